"""Phase 3, `train`: DeepSpeed-distributed RL from the adapted policy (see :mod:`pipeline.train.loop`).

`main` launches ``train.num_ranks`` processes with the ``deepspeed`` launcher (each one
:mod:`pipeline.train.worker`), or runs the single rank in this process when `num_ranks` is 1. Outputs:
``models/policy`` (the best policy by validation success), ``metrics/train.json``, ``metrics/train_curve.csv``;
checkpoints in ``checkpoints/train`` (a rerun resumes from the last one; delete the folder to start over).

Incoming production tasks (``train.incoming_tasks``, default ``data/incoming/*.jsonl``) join the RL task pool; a file
that breaks the task schema stops the phase before anything trains (:mod:`pipeline.train.incoming`; with several ranks
it is checked here, before the launcher starts them, so the error is reported once).

Several machines: with ``AGENTRL_HOSTFILE`` (and, to start each node without ssh, ``AGENTRL_NODE_RANK`` and
``AGENTRL_MASTER_ADDR``) the launcher starts the ranks of the hostfile's nodes instead (:mod:`pipeline.train.nodes`);
the worker is the same.
"""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.core.config import load_section
from pipeline.core.errors import AgentRLError
from pipeline.train.config import TrainConfig


def launcher_command(params_path: str, num_ranks: int, port: int, extra: list[str] | None = None,
                     nodes=None) -> list[str]:
    """The DeepSpeed launcher's command: `num_ranks` ranks on this machine, or the ranks of `nodes`
    (:class:`pipeline.train.nodes.Nodes`, from AGENTRL_HOSTFILE) with their own port."""
    deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    where = nodes.launcher_args() if nodes is not None else ["--num_gpus", str(num_ranks), "--master_port", str(port)]
    return [deepspeed, *where, "--module", "pipeline.train.worker", "--params", params_path, *(extra or [])]


def main(params_path: str = "params.yaml", stop_after: int | None = None) -> None:
    cfg = load_section(TrainConfig, "train", params_path)
    if not Path("models/adapted").is_dir():
        raise AgentRLError("train: models/adapted not found; run the adapt stage first (`agentrl adapt`)")
    import torch

    from pipeline.policy.model import dtype_notice

    # the learner's autocast is 'auto' (pipeline.train.learner), on the ranks' device
    # (pipeline.train.distributed.init_dist)
    if (notice := dtype_notice("auto", "cuda" if torch.cuda.is_available() else "cpu")) is not None:
        print(f"train: {notice}", flush=True)
    extra = ["--stop-after", str(stop_after)] if stop_after is not None else []
    from pipeline.train.nodes import nodes_from_env

    nodes = nodes_from_env(cfg.num_ranks)  # AGENTRL_HOSTFILE: ranks on several machines
    if cfg.num_ranks == 1 and nodes is None:
        from pipeline.train.worker import run_worker

        run_worker(params_path, stop_after=stop_after)
        return
    from pipeline.train.distributed import free_port, child_env
    from pipeline.train.incoming import read_incoming

    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment

    world = open_environment(load_section(EnvConfig, "env", params_path).name, Path("data") / "env")
    try:
        # AgentRLError naming the file, before any rank starts
        read_incoming([cfg.incoming_tasks, cfg.production_tasks], world)
    finally:
        world.close()
    cmd = launcher_command(params_path, cfg.num_ranks, free_port(), extra, nodes)
    # stream the ranks' progress lines as they come (the launcher's own "[...]" log lines are dropped from the
    # display); keep the last lines of everything for the error message
    tail: collections.deque[str] = collections.deque(maxlen=25)
    rank_errors: list[str] = []  # a rank's own `error:` line (what it was refused for), said once by this process
    with subprocess.Popen(cmd, env=child_env({"PYTHONUNBUFFERED": "1"}), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if line.startswith("error: "):
                rank_errors.append(line.rstrip("\n")[len("error: "):])
            elif not line.startswith("["):
                sys.stdout.write(line)
                sys.stdout.flush()
    if proc.returncode != 0:
        if rank_errors:  # every rank that failed said why; the same reason once
            raise AgentRLError("; ".join(dict.fromkeys(rank_errors)))
        raise AgentRLError(f"train: the DeepSpeed launcher exited with {proc.returncode}; last lines:\n"
                           + "\n".join(tail))
