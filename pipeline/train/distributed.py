"""Everything distributed lives here: rank discovery, DeepSpeed config resolution and engine creation, collectives.

The training loop never reads ``LOCAL_RANK``/``RANK``; it asks a :class:`Dist`. Launched by the ``deepspeed`` launcher
(``deepspeed --num_gpus N --module pipeline.train.worker``), each process is one rank: on this machine DeepSpeed picks
its CPU accelerator by itself (gloo; its shared-memory inference all-reduce is skipped, see SHM_OP); on GPUs the same code
runs with NCCL, and with a hostfile (``deepspeed --hostfile hosts ...``) across nodes.

Precision: where the accelerator is a GPU with bf16, the engine runs in bf16 (``"bf16": {"enabled": "auto"}`` in the
config files resolves to that). On the CPU the engine keeps fp32 master weights and the forward runs under
``torch.autocast("cpu", bfloat16)`` when the CPU supports it (about 2× faster on the CPUs measured), which the config's
"auto" resolves to: DeepSpeed's bf16 optimizer is not used on CPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.core.errors import AgentRLError


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj):
        """Every rank's `obj`, in rank order (a list of length world_size)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """End of a multi-rank run: every rank waits here until all have written what they write. The group itself
        is not torn down: its C++ teardown aborted a rank now and then (SIGABRT, "terminate called without an
        active exception") after the work was done, so a launched rank leaves with `os._exit` instead (the worker's
        `__main__`). A group of one (tests that call the worker in-process) is left as it is, so a later call in
        the same process reuses it."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(extra: dict | None = None) -> dict:
    """The environment for a new training process: this process's, without its own rank variables (a child that
    inherited them would try to join this process's group and bind its port)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(extra or {})
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DeepSpeed's CPU backend builds a C++ op at its first initialisation on a machine (a compile of 20 s to a minute,
# cached in ~/.cache/torch_extensions) and maps one 66 MB shared-memory buffer per rank in /dev/shm, which it never
# removes, for one collective: `inference_all_reduce`, the all-reduce of its tensor-parallel inference layers. Training
# reduces its gradients through torch.distributed (gloo on CPU) with or without that op, and nothing here runs
# DeepSpeed inference, so the ranks mark the op unavailable before they initialise: no compiler is needed, nothing is
# left in /dev/shm (a machine that ran the test suite a few dozen times had 16 GB of RAM in those buffers and swapped),
# and `inference_all_reduce`, if anything called it, falls back to torch.distributed's all-reduce.
SHM_OP = "deepspeed_shm_comm"  # deepspeed/ops/op_builder/cpu/comm.py: ShareMemCommBuilder.NAME


def skip_shared_memory_op() -> None:
    """Make DeepSpeed's CPU backend skip its shared-memory inference all-reduce (see SHM_OP)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False  # the dict its backend reads when it initialises


def init_dist() -> Dist:
    """Initialise the process group: the launcher's ranks, or a group of one when run without the launcher."""
    import deepspeed
    import torch.distributed as dist

    alone = "WORLD_SIZE" not in os.environ
    if alone:  # one process started directly (tests, `--num-ranks 1`)
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_port())})
    skip_shared_memory_op()
    for attempt in range(5):
        if dist.is_initialized():
            break
        try:
            deepspeed.init_distributed(dist_backend=None)
        except RuntimeError as exc:  # DistNetworkError: the free port was taken between choosing and binding it
            if not alone or "EADDRINUSE" not in str(exc) or attempt == 4:
                raise
            os.environ["MASTER_PORT"] = str(free_port())
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = "cpu"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    if not torch.cuda.is_available() and local_world > 1:
        # CPU ranks on one machine share its cores: without this each rank would start one thread per core and the
        # ranks would fight over them (2 ranks × 2 threads on 2 cores ran slower than 1 rank here).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if torch.cuda.is_available():
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    return Dist(rank=rank, world_size=world, local_rank=local, device=device)


def resolve_ds_config(path: str | Path, *, micro_batch: int, grad_accum: int, world_size: int, max_grad_norm: float,
                      device: str) -> dict:
    """Read a DeepSpeed config and fill what the params decide; a file that contradicts the params is refused."""
    path = Path(path)
    if not path.is_file():
        raise AgentRLError(f"DeepSpeed config {path} not found (train.deepspeed_config)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AgentRLError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise AgentRLError(f"{path}: ZeRO stage {stage} is not supported here (stages 1 and 2; stage 3 partitions the "
                           f"parameters the rollout engine reads)")
    wanted = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "gradient_clipping": max_grad_norm,
    }
    clashes = [f"{k}={cfg[k]!r} (params give {v!r})" for k, v in wanted.items() if k in cfg and cfg[k] != v]
    if clashes:
        raise AgentRLError(f"{path} contradicts params.yaml train section: {', '.join(clashes)}; remove these keys "
                           f"from the file or change the params")
    if "optimizer" in cfg or "scheduler" in cfg:
        raise AgentRLError(f"{path}: the optimizer is set by params.yaml (train.lr, train.weight_decay); remove "
                           f"'optimizer'/'scheduler' from the DeepSpeed config")
    cfg.update(wanted)
    bf16 = cfg.get("bf16", {}).get("enabled", False)
    if bf16 == "auto":
        bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    if bf16 and not device.startswith("cuda"):
        raise AgentRLError(f"{path}: bf16 engine requested on {device}; on CPU use \"auto\" (fp32 master weights "
                           f"with bf16 autocast)")
    cfg["bf16"] = {"enabled": bool(bf16)}
    return cfg


def make_engine(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict, dist: Dist,
                warmup_steps: int = 0):
    """A DeepSpeed engine around `module` with a client optimizer (DeepSpeed's own fused Adam would JIT-compile).

    `warmup_steps` > 0 adds a linear warm-up scheduler, lr·min(1, (step+1)/(warmup_steps+1)); the engine steps it with
    the optimizer and saves it in its checkpoints, so a resumed run continues the schedule where it stopped."""
    import deepspeed

    scheduler = None
    if warmup_steps > 0:
        def scheduler(opt):
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config,
                                           lr_scheduler=scheduler)
    return engine
