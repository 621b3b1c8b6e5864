"""Benchmark of the RL phase, in one run on the same adapted model and tasks:

- the time split between rollout and learning per update;
- learning throughput as FLOP/s against the machine's matrix-multiply peak measured here, in the learner's dtype;
- 1 rank against 2 DeepSpeed ranks (episodes/s);
- synchronous against asynchronous rollouts under a tool latency of 20 ms (episodes/s; goal: async ≥ 2×), each with
  the tool calls that end in one decode step run side by side (`rollout.tool_threads`, the default) and one after
  another (`tool_threads: 0`, the plain Gymnasium loop); what hiding every wait
  could give while generation and learning stay one after the other: the synchronous update at 20 ms over the
  generation and learning time of the run without latency; and the async run at 20 ms against that run without
  latency, which is above 1 only where generation and learning side by side use the cores better than each alone
  (0.99x measured on an Intel Xeon, 1.16x and 1.21x on an AMD EPYC; README, RL section);
- the learner's gradient accumulation over length chunks (`train.micro_batches`, default) against one forward of
  the whole batch (`micro_batches: 1`): learning time and peak memory;
- peak memory of each run (the largest process of that run alone: each run is measured in its own wrapper process).

    python bench/train.py [--updates 4] [--tasks 8] [--group 8]

Needs `models/adapted` and `data/` (run `dvc repro adapt` first). Runs write only under a temporary folder.
FLOPs are counted as 2·N·T for the no-grad forward (π_old, V_old; skipped by a one-step on-policy update) plus 6·N·T
for each training forward+backward, with N the parameter count and T the tokens of the padded rows the learner
forwards (attention's extra FLOPs are ignored: sequences are short). The behaviour-cloning forward on
demonstrations (`train.bc_coef`, on by default: `bc_batch` demonstrations per step and rank) is not
counted either, so the learning FLOP/s figure is a lower bound when it is on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def matmul_peak(dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t)


PEAK_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
                "sys.exit(rc)")


def run(name: str, tmp: Path, updates: int, tasks: int, group: int, ranks: int, overrides: dict, env_over: dict,
        rollout_over: dict | None = None) -> dict:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update({"updates": updates, "tasks_per_update": tasks, "group_size": group, "num_ranks": ranks,
                            "eval_every": 10_000, "checkpoint_every": 10_000, "eval_tasks": 16, "test_tasks": 16,
                            "deepspeed_config": str(REPO / params["train"]["deepspeed_config"]), **overrides})
    params["env"].update(env_over)
    params["rollout"].update(rollout_over or {})
    d = tmp / name
    d.mkdir()
    (d / "params.yaml").write_text(yaml.safe_dump(params))
    args = ["--params", str(d / "params.yaml"), "--out", str(d / "policy"), "--ckpt", str(d / "ckpt"),
            "--metrics", str(d / "train.json"), "--curve", str(d / "curve.csv")]
    if ranks > 1:
        from pipeline.train.main import launcher_command
        from pipeline.train.distributed import free_port

        cmd = launcher_command(str(d / "params.yaml"), ranks, free_port(), args[2:])
    else:
        cmd = [sys.executable, "-m", "pipeline.train.worker", *args]
    from pipeline.train.distributed import child_env

    env = child_env({"MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"})
    # ru_maxrss of RUSAGE_CHILDREN only ever grows over a process's children, so each run gets its own wrapper
    proc = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, *cmd], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    peak = int(proc.stderr.rsplit("PEAK_KB ", 1)[1].split()[0]) / 1024
    rows = [line.split(",") for line in (d / "curve.csv").read_text().splitlines()]
    head, rows = rows[0], [dict(zip(rows[0], r)) for r in rows[1:]][1:]  # the first update warms up
    roll = sum(float(r["sys_rollout_s"]) for r in rows)
    learn = sum(float(r["sys_learn_s"]) for r in rows)
    metrics = json.loads((d / "train.json").read_text())
    return {"name": name, "rollout_s": roll, "learn_s": learn, "updates": len(rows),
            # wall time per update: in async mode the rollout overlaps learning, so rollout_s + learn_s would count
            # the overlap twice; update_s is the learner's wall clock (idle wait for the batch + learning)
            "episodes_per_s": len(rows) * tasks * group / max(1e-9, sum(float(r["sys_update_s"]) for r in rows)),
            "idle_s": sum(float(r["sys_idle_s"] or 0) for r in rows),
            "peak_mib": peak, "world_size": metrics["world_size"],
            "tokens": sum(int(r["train_batch_tokens"]) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    args = ap.parse_args()
    if not (REPO / "models/adapted").is_dir():
        raise SystemExit("models/adapted not found: run `dvc repro adapt` first")
    from pipeline.policy.model import load_policy, n_parameters, supports_bf16

    model, _, _ = load_policy(REPO / "models/adapted")
    n_params = n_parameters(model)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        base = run("sync-1rank", tmp, args.updates, args.tasks, args.group, 1, {}, {})
        one_chunk = run("sync-1rank-1chunk", tmp, args.updates, args.tasks, args.group, 1, {"micro_batches": 1}, {})
        two = run("sync-2ranks", tmp, args.updates, args.tasks, args.group, 2, {}, {})
        lat = {"tool_latency_s": 0.02}
        asy = {"async_rollouts": True, "max_staleness": 1}
        serial = {"tool_threads": 0}
        lat_sync_serial = run("sync-20ms-serial", tmp, args.updates, args.tasks, args.group, 1, {}, lat, serial)
        lat_async_serial = run("async-20ms-serial", tmp, args.updates, args.tasks, args.group, 1, asy, lat, serial)
        lat_sync = run("sync-20ms", tmp, args.updates, args.tasks, args.group, 1, {}, lat)
        lat_async = run("async-20ms", tmp, args.updates, args.tasks, args.group, 1, asy, lat)
    dtype = torch.bfloat16 if supports_bf16() else torch.float32
    peak = matmul_peak(dtype)
    from pipeline.core.config import load_section
    from pipeline.policy.config import RolloutConfig
    from pipeline.train.config import TrainConfig
    from pipeline.train.learner import one_forward

    tcfg_chunks = load_section(TrainConfig, "train", REPO / "params.yaml").micro_batches  # params.yaml, validated
    print(f"RL benchmark: {n_params / 1e6:.2f}M-parameter policy, {args.tasks} tasks x {args.group} rollouts per "
          f"update, {args.updates} updates (first one excluded as warm-up)")
    print("rollout s: generating the batch (async: in the background, overlapping learning); idle s: the learner "
          "waiting for a batch (async only); episodes/s: over the learner's wall clock")
    print(f"{'run':20s} {'rollout s':>10s} {'learn s':>8s} {'idle s':>7s} {'rollout %':>10s} {'episodes/s':>11s} "
          f"{'peak MiB':>9s}")
    for r in (base, one_chunk, two, lat_sync_serial, lat_async_serial, lat_sync, lat_async):
        share = 100 * r["rollout_s"] / max(1e-9, r["rollout_s"] + r["learn_s"])
        print(f"{r['name']:20s} {r['rollout_s']:10.1f} {r['learn_s']:8.1f} {r['idle_s']:7.1f} {share:9.1f}% "
              f"{r['episodes_per_s']:11.2f} {r['peak_mib']:9.0f}")
    print(f"learner in {tcfg_chunks} length chunks / one forward: learn time "
          f"{base['learn_s'] / one_chunk['learn_s']:.2f}x, peak memory {base['peak_mib'] / one_chunk['peak_mib']:.2f}x")
    print(f"2 ranks / 1 rank episodes/s: {two['episodes_per_s'] / base['episodes_per_s']:.2f}x")
    eps = {r["name"]: r["episodes_per_s"] for r in (base, lat_sync_serial, lat_async_serial, lat_sync, lat_async)}
    threads = load_section(RolloutConfig, "rollout", REPO / "params.yaml").tool_threads
    print(f"at 20 ms tool latency, tool calls of a decode step side by side (rollout.tool_threads {threads}, the "
          f"default): async / sync episodes/s {eps['async-20ms'] / eps['sync-20ms']:.2f}x (goal: >= 2x)")
    print(f"  tool calls one after another (tool_threads 0): async / sync "
          f"{eps['async-20ms-serial'] / eps['sync-20ms-serial']:.2f}x; async (default) / that sync "
          f"{eps['async-20ms'] / eps['sync-20ms-serial']:.2f}x; sync side by side / one after another "
          f"{eps['sync-20ms'] / eps['sync-20ms-serial']:.2f}x")
    # what hiding the waits alone could give: the sync update at 20 ms against generation + learning without any
    # waiting, one after the other. An async mode beats it only where generation and learning, run side by side,
    # use the cores better than each does alone (measured on a 2-core AMD EPYC).
    compute = (base["rollout_s"] + base["learn_s"]) / base["updates"]
    for r in (lat_sync, lat_sync_serial):
        per_update = (r["rollout_s"] + r["learn_s"]) / r["updates"]
        print(f"  hiding every wait, generation and learning still one after the other, against {r['name']}: "
              f"{per_update:.2f} s per update / {compute:.2f} s of generation + learning without latency = "
              f"{per_update / compute:.2f}x")
    print(f"  async at 20 ms / sync without any latency ({base['name']}): "
          f"{eps['async-20ms'] / eps[base['name']]:.2f}x (above 1: generation and learning side by side gained "
          f"more than the waits cost)")
    tcfg = load_section(TrainConfig, "train", REPO / "params.yaml")
    epochs = tcfg.epochs
    # a no-grad forward (π_old), then forward+backward per epoch; a one-step on-policy update (group baseline, one
    # epoch, one minibatch) skips the no-grad forward (pipeline.train.learner.one_forward)
    single_pass = one_forward(tcfg)
    flops = ((0 if single_pass else 2) + 6 * epochs) * n_params * base["tokens"]
    print(f"learning: {flops / base['learn_s'] / 1e9:.1f} GFLOP/s vs {dtype} matmul peak {peak / 1e9:.0f} GFLOP/s "
          f"({100 * flops / base['learn_s'] / peak:.1f}% of peak)")


if __name__ == "__main__":
    main()
