"""Device check of the `train` path on a GPU (or, for the side-by-side figures, on this CPU): the README's claim that
the same DeepSpeed launch command and config files run on GPUs unchanged.

Every run starts the worker the way the `train` stage does, through the DeepSpeed launcher (``python -m
deepspeed.launcher.runner --num_gpus 1 --module scripts.probes.gpu_worker``: the worker with tracking off,
``AGENTRL_TRACKING=off``, see that module), from ``models/adapted`` and ``data/`` with params.yaml's train section and these
overrides (one rank: the device machine has one GPU):

0. ``profile``: one batch of 64 rollouts in this process under torch.profiler (:func:`profile_rollout`; session
   31 onward: where the GPU's rollout time goes);
1. ``sync``: ``--updates`` updates (default 6), an evaluation and a checkpoint every 4, validation on 32 tasks and the
   SFT-against-RL test comparison on 64; per update the rollout and learning seconds; the engine's precision; the saved
   policy's dtype; peak GPU memory;
2. ``resume``: 4 updates with a checkpoint after each, killed (SIGKILL) in update 3, then started again: it must say
   it resumed and finish;
3. ``sync-20ms`` and ``async-20ms``: 4 updates each with a 20 ms tool latency, synchronous and asynchronous rollouts
   (episodes/s over the learner's wall clock, the first update left out as warm-up, as bench/train.py counts);
4. ``zero1``: 2 updates with configs/deepspeed_zero1.json (the default is ZeRO-2).

The time limits are sized from session 30's H200 run (about 35 s to start and stop a launch, 10-15 s per update: the
rollouts are slower there than on the 2-core CPU, see scripts/probes/README.md): all four steps take about 13 minutes,
more than one device call's 10, so run them as two calls, ``--only profile sync zero1`` (about 6 minutes) and
``--only resume latency`` (about 8).

Plus the bf16 matrix-multiply rate of the device (8192³ on a GPU, 1024³ on a CPU) for scale. Writes a log per run and
``summary.json`` to ``--out`` (the run folders go to a temporary folder); prints a summary. Each run has its own
time limit, so a hang loses one run, not all.

    python scripts/probes/gpu_train.py --out /tmp/gpu [--updates 6]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
WORK = Path(tempfile.mkdtemp(prefix="gpu_train_"))


def matmul_rate(device: str) -> float:
    n, reps = (8192, 10) if device == "cuda" else (1024, 10)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


def launch(name: str, out: Path, train: dict, env: dict | None = None, extra: list[str] | None = None,
           timeout: int = 300, log_name: str | None = None) -> dict:
    from pipeline.train.distributed import _free_port, child_env

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update({"num_ranks": 1, **train})
    params["train"]["deepspeed_config"] = str(REPO / params["train"]["deepspeed_config"])  # runs start elsewhere
    params["env"].update(env or {})
    d = WORK / name  # run folders (checkpoints, policies) stay out of --out, which the device machine sends back
    d.mkdir(parents=True, exist_ok=True)
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(_free_port()),
           "--module", "scripts.probes.gpu_worker", "--params", str(d / "params.yaml"), "--out", str(d / "policy"),
           "--ckpt", str(d / "ckpt"), "--metrics", str(d / "train.json"), "--curve", str(d / "curve.csv"),
           *(extra or [])]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=child_env({"PYTHONUNBUFFERED": "1"}), capture_output=True, text=True,
                              timeout=timeout)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = "timeout", ((exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""))
    wall = time.perf_counter() - t
    log_name = log_name or name
    (out / f"{log_name}.log").write_text(log)
    res: dict = {"rc": rc, "wall_s": round(wall, 1)}
    if m := re.search(r"ENGINE (.*)", log):
        res["engine"] = m.group(1).strip()
    if peaks := re.findall(r"GPU_PEAK_MIB (\d+)", log):
        res["gpu_peak_mib"] = int(peaks[-1])
    res["resumed"] = "resumed from" in log
    if (d / "curve.csv").is_file():
        rows = [line.split(",") for line in (d / "curve.csv").read_text().splitlines()]
        rows = [dict(zip(rows[0], r)) for r in rows[1:]]
        res["per_update"] = [{k: round(float(r[k]), 2) for k in ("sys_rollout_s", "sys_learn_s", "sys_update_s")}
                             | {"tokens": int(r["train_batch_tokens"])} for r in rows]
        warm = rows[1:] or rows
        tp = params["train"]
        res["episodes_per_s"] = round(len(warm) * tp["tasks_per_update"] * tp["group_size"]
                                      / max(1e-9, sum(float(r["sys_update_s"]) for r in warm)), 2)
    elif lines := re.findall(r"update (\d+)/\d+: .*? rollout ([\d.]+)s learn ([\d.]+)s", log):
        # a run stopped by its time limit leaves no curve: its progress lines still give the updates it finished
        res["per_update"] = [{"sys_rollout_s": float(r), "sys_learn_s": float(lr)} for _, r, lr in lines]
    if res.get("per_update"):  # means without the first update (CUDA and allocator warm-up)
        warm_rows = res["per_update"][1:] or res["per_update"]
        for key in ("sys_rollout_s", "sys_learn_s"):
            res[f"mean_{key[4:]}"] = round(sum(u[key] for u in warm_rows) / len(warm_rows), 2)
    if (d / "train.json").is_file():
        m = json.loads((d / "train.json").read_text())
        res["test"] = {k: round(m["test"][k]["overall"]["success_rate"], 3) for k in ("sft", "rl")}
        res["test_delta_per_level"] = {k: round(v, 3) for k, v in m["delta_rl_minus_sft"].items()
                                       if v is not None and k.endswith("_success")
                                       and "tool_calls" not in k}
        res["train_seconds"] = m["seconds"]
    if (d / "policy" / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(d / "policy" / "model.safetensors"), "pt") as f:
            res["saved_dtypes"] = sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})
    if rc != 0 and rc != "timeout" and log_name != "resume-killed":
        res["log_tail"] = log[-2500:]
    print(f"[{log_name}] " + json.dumps({k: v for k, v in res.items() if k not in ("per_update", "log_tail")}),
          flush=True)
    if "log_tail" in res:
        print(res["log_tail"], flush=True)
    return res


def profile_rollout(out: Path, device: str, n_tasks: int = 8, group: int = 8) -> dict:
    """One RL batch of rollouts (the train split's first `n_tasks` tasks × `group`, sampled at the RL temperature),
    in this process on `device`, under torch.profiler after one unprofiled warm-up batch: the time per main decode
    forward, and the ops that took the most host time (``rollout_profile.txt`` in `out`; on a GPU also the most GPU
    time, and the host-device copies and synchronisations per forward). On a GPU the policy is cast to bf16, as the
    bf16 engine holds it. What a GPU session needs to see where the rollouts' time goes (session 30's H200 run took
    10-14 s per such batch against 3 s on the 2-core CPU)."""
    from pipeline.core.config import load_section
    from pipeline.env.config import EnvConfig
    from pipeline.env.core import WorldRuntime, load_tasks
    from pipeline.env.world import load_world
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.train.config import TrainConfig

    params = REPO / "params.yaml"
    model, tok, _ = load_policy(REPO / "models" / "adapted")
    model = model.to(device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    rollout_cfg = load_section(RolloutConfig, "rollout", params)
    temperature = load_section(TrainConfig, "train", params).rollout_temperature
    if temperature is not None:
        rollout_cfg = rollout_cfg.model_copy(update={"temperature": temperature})
    engine = RolloutEngine(model, tok, WorldRuntime(load_world(REPO / "data" / "env")),
                           load_section(EnvConfig, "env", params), rollout_cfg)
    tasks = [t for t in load_tasks(REPO / "data" / "tasks" / "train.jsonl")[:n_tasks] for _ in range(group)]
    engine.run(tasks, list(range(len(tasks))), greedy=False)  # warm-up: allocator, kernels, caches
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        records = engine.run(tasks, list(range(len(tasks))), greedy=False)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    averages = prof.key_averages()
    st = engine.stats
    res = {"wall_s": round(wall, 2), "episodes": len(records), "forwards": st["forwards"],
           "chunk_forwards": st["chunk_forwards"], "sampled_tokens": st["sampled_tokens"],
           "ms_per_forward": round(1000 * wall / max(1, st["forwards"] + st["chunk_forwards"]), 2)}
    counts = {e.key: e.count for e in averages}
    for key in ("aten::copy_", "aten::_to_copy", "aten::item", "aten::_local_scalar_dense", "cudaMemcpyAsync",
                "cudaStreamSynchronize", "cudaLaunchKernel", "cudaLaunchKernelExC"):
        if key in counts:
            res[f"per_forward/{key}"] = round(counts[key] / max(1, st["forwards"] + st["chunk_forwards"]), 1)
    text = [json.dumps(res), "", averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device == "cuda":
        text += ["", averages.table(sort_by="self_cuda_time_total", row_limit=20)]
    (out / "rollout_profile.txt").write_text("\n".join(text) + "\n")
    print("[profile] " + json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only these steps (profile sync resume latency zero1)")
    args = ap.parse_args()
    needed = ("models/adapted/config.json", "data/tasks/train.jsonl", "data/env")
    missing = [p for p in needed if not (REPO / p).exists()]
    if missing:
        raise SystemExit(f"gpu_train: {', '.join(missing)} not found under {REPO}: run `dvc pull` or `dvc repro adapt` "
                         f"first (on the device machine, carry data and models/adapted)")
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import deepspeed
    import transformers

    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
            "python": sys.version.split()[0], "bf16_matmul_tflops": round(matmul_rate(device) / 1e12, 2)}
    print("[info] " + json.dumps(info), flush=True)
    summary = {"info": info}
    steps = set(args.only or ("profile", "sync", "resume", "latency", "zero1"))
    if "profile" in steps:
        summary["profile"] = profile_rollout(args.out, device)
    base = {"eval_every": 4, "checkpoint_every": 4, "eval_tasks": 32, "test_tasks": 64}
    if "sync" in steps:
        summary["sync"] = launch("sync", args.out, {**base, "updates": args.updates}, timeout=210)
    if "resume" in steps:
        short = {**base, "updates": 4, "checkpoint_every": 1, "eval_every": 2, "test_tasks": 16}
        summary["resume_killed"] = launch("resume", args.out, short, extra=["--kill-at-update", "3"], timeout=110,
                                         log_name="resume-killed")
        summary["resume"] = launch("resume", args.out, short, timeout=100)
    if "latency" in steps:
        lat = {**base, "updates": 4, "eval_every": 10_000, "checkpoint_every": 10_000, "test_tasks": 16}
        summary["sync_20ms"] = launch("sync-20ms", args.out, lat, env={"tool_latency_s": 0.02}, timeout=130)
        summary["async_20ms"] = launch("async-20ms", args.out, {**lat, "async_rollouts": True, "max_staleness": 1},
                                       env={"tool_latency_s": 0.02}, timeout=130)
        a, s = summary["async_20ms"].get("episodes_per_s"), summary["sync_20ms"].get("episodes_per_s")
        if a and s:
            print(f"[latency] async / sync episodes/s at 20 ms: {a / s:.2f}x", flush=True)
    if "zero1" in steps:
        summary["zero1"] = launch("zero1", args.out, {**base, "updates": 2, "test_tasks": 16,
                                                      "deepspeed_config": "configs/deepspeed_zero1.json"}, timeout=100)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
