"""Throughput of the trainers alone: this project's RL learner against TRL's ``GRPOTrainer``, equal work per step.

    python bench/vs_trl_throughput.py --project DIR [--reps 3] [--steps 3] [--warmup 1]
                                      [--arms project,trl-naive,trl-engine] [--profile] [--json OUT]

Needs TRL (``pip install -e '.[bench]'``) and a project folder holding ``params.yaml``, ``models/adapted`` and
``data/`` (``dvc repro adapt`` there). Writes nothing outside a temporary folder except ``--json``.

The arms (bench/vs_trl_throughput_arms.py, each repetition of each arm in a child process of its own):

- ``project``: this project's learner, :func:`pipeline.train.loop.setup` and the loop's own steps (the rollout
  engine's ``run``, ``observe``, ``learn_or_drop``: RLOO, DeepSpeed on one rank), as ``params.yaml`` configures
  them except the recipe's aids, which are work TRL does not do: no behaviour cloning, no expert-guided groups, no
  KL reference. Groups whose returns are all equal are left out of the loss as the project does by default
  (``train.skip_zero_variance_groups``; TRL forwards them with advantage 0).
- ``project-all``: the same, learning every group as TRL does (not in the default arms; the table's "rows learned"
  says how much the skip saves).
- ``trl-naive``: TRL 1.16's ``GRPOTrainer`` with bench/vs_trl_shared.py's naive ``rollout_func`` (TRL's generation path,
  ``model.generate`` re-encoding each running episode at every turn): what a TRL user who writes the obvious
  multi-turn loop gets.
- ``trl-engine``: the same trainer with a ``rollout_func`` that calls this project's rollout engine on the model TRL
  trains. Generation is then the same code as ``project``'s, so ``project`` against ``trl-engine`` compares the
  trainers apart from generation (the goal: at least 1.5x TRL's episodes per second).

Equal work per step, in every arm: the same plan (the same ``train.tasks_per_update`` training tasks at each step,
each played ``train.group_size`` times with the same episode seeds), sampling at ``train.rollout_temperature`` (the
learner's log-probabilities at the same temperature), at most ``rollout.max_new_tokens`` tokens per action, fp32
weights with bf16 autocast where the CPU has bf16 (TRL's ``bf16=True``; our learner's ``auto``), one optimizer step
per generation round of ``tasks_per_update x group_size`` episodes, accumulated over ``train.micro_batches`` micro-
batches in both (TRL: ``per_device_train_batch_size`` = episodes / micro-batches, ``gradient_accumulation_steps`` =
micro-batches), the same learning rate and warm-up, gradient clipping at ``train.max_grad_norm``, TRL's gradient
checkpointing off, ``beta`` 0 (no reference model, as ours with ``kl_coef`` 0). The policies drift apart as they
learn, so the sampled tokens per episode differ a little between arms; the table prints them.

Equal work, not equal time: every repetition of an arm runs ``--warmup`` steps (left out: first-call costs) and then
``--steps`` timed ones. The arms alternate (a, b, c, a, b, c, ...) ``--reps`` times in one invocation, so a change of
the machine's load falls on all of them. Per arm: episodes/s and sampled tokens/s over the timed steps of each
repetition (min / median / max over repetitions), the same per CPU second of the child process (all its threads:
less exposed to other jobs on a shared machine than the wall clock; the goal is judged on the wall clock), and the
split of a step between rollout (the engine's ``run``;
TRL: the ``rollout_func`` call) and learning (the rest of the step: advantages, padding, forward, backward,
optimizer step, TRL's logging). ``--profile`` runs each arm once more under cProfile after the timed repetitions
(not counted) and prints the functions with the most time of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import BenchError, Parser, require_trl  # noqa: E402  (the learning bench's input handling, shared)
from vs_trl_shared import REPO, run_child  # noqa: E402

CHILD = Path(__file__).resolve().with_name("vs_trl_throughput_arms.py")
ARM_NAMES = ("project", "project-all", "trl-naive", "trl-engine")
GOAL = 1.5  # the project's episodes/s at least 1.5x TRL's with generation held equal (trl-engine)
NEEDED = ("params.yaml", "models/adapted/config.json", "data/tasks/train.jsonl", "data/env")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", type=Path, default=REPO, help="folder with params.yaml, models/adapted, data/")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every arm, alternated")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per repetition")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--arms", default="project,trl-naive,trl-engine", help=f"comma-separated: {', '.join(ARM_NAMES)}")
    ap.add_argument("--profile", action="store_true", help="then each arm once more under cProfile")
    ap.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.arms.split(",") if n.strip()]
    bad = [n for n in names if n not in ARM_NAMES]
    if bad or not names or len(set(names)) != len(names):
        why = f"unknown arm {bad[0]!r}" if bad else "no arm named" if not names else "an arm named twice"
        raise BenchError(f"--arms: {why} (a comma-separated list of {', '.join(ARM_NAMES)})")
    args.arms = names
    for flag, low in (("reps", 1), ("steps", 1), ("warmup", 0)):
        if getattr(args, flag) < low:
            raise BenchError(f"--{flag} must be at least {low}, got {getattr(args, flag)}")
    for name in NEEDED:
        if not (args.project / name).exists():
            raise BenchError(f"--project {args.project}: {name} not found (the bench needs params.yaml, "
                             f"models/adapted and data/; run `dvc repro adapt` there first)")
    return args


def rep_figures(steps: list[dict]) -> dict:
    """One repetition's figures over its timed steps."""
    total = sum(s["step_s"] for s in steps)
    rollout = sum(s["rollout_s"] for s in steps)
    eps, toks = sum(s["episodes"] for s in steps), sum(s["sampled_tokens"] for s in steps)
    trl = {}
    if "gen_score_s" in steps[0]:  # TRL's learning split: scoring the round, the optimizer step, the rest
        trl = {"prepare_s": sum(s["gen_score_s"] - s["rollout_s"] for s in steps) / len(steps),
               "optimizer_s": sum(s["optimizer_s"] for s in steps) / len(steps)}
    return trl | {"episodes_per_s": eps / total, "tokens_per_s": toks / total, "step_s": total / len(steps),
            "rollout_s": rollout / len(steps), "learn_s": (total - rollout) / len(steps),
            "learn_tokens_per_s": sum(s["sampled_tokens"] * s["rows_learned"] / s["episodes"] for s in steps)
            / max(1e-9, total - rollout),
            "episodes_per_cpu_s": eps / sum(s["step_cpu_s"] for s in steps),
            "learn_cpu_s": sum(s["step_cpu_s"] - s["rollout_cpu_s"] for s in steps) / len(steps),
            "rollout_cpu_s": sum(s["rollout_cpu_s"] for s in steps) / len(steps),
            "tokens_per_episode": toks / eps, "rows_learned": sum(s["rows_learned"] for s in steps) / len(steps),
            "success": sum(s["success"] for s in steps) / len(steps)}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(arm_reps: dict[str, list[dict]]) -> dict:
    """Per arm: min / median / max over repetitions of every repetition figure."""
    out = {}
    for arm, reps in arm_reps.items():
        figs = [rep_figures(r["steps"]) for r in reps]
        out[arm] = {k: spread([f[k] for f in figs]) for k in figs[0]}
        out[arm]["peak_mib"] = max(r["peak_mib"] for r in reps)
    return out


def ratios(summary: dict) -> dict:
    """Median against median: each project arm against each TRL arm (episodes/s, and learning time per step)."""
    out = {}
    for p in (a for a in summary if a.startswith("project")):
        for t in (a for a in summary if a.startswith("trl")):
            sp, st = summary[p], summary[t]
            out[f"{p} / {t}"] = {
                "episodes_per_s": sp["episodes_per_s"]["median"] / st["episodes_per_s"]["median"],
                "tokens_per_s": sp["tokens_per_s"]["median"] / st["tokens_per_s"]["median"],
                "learn_speed": st["learn_s"]["median"] / sp["learn_s"]["median"],
                "episodes_per_cpu_s": sp["episodes_per_cpu_s"]["median"] / st["episodes_per_cpu_s"]["median"],
                "learn_cpu_speed": st["learn_cpu_s"]["median"] / sp["learn_cpu_s"]["median"],
                "rollout_speed": st["rollout_s"]["median"] / sp["rollout_s"]["median"]}
    return out


def goal(rat: dict) -> str | None:
    """The goal's verdict: the project's learner (``project``, else ``project-all``) against ``trl-engine``."""
    key = next((k for k in ("project / trl-engine", "project-all / trl-engine") if k in rat), None)
    if key is None:
        return None
    r = rat[key]["episodes_per_s"]
    return (f"goal: {key} episodes/s >= {GOAL:.1f}x: {r:.2f}x, " + ("met" if r >= GOAL else
            f"not met (short by {GOAL / r:.2f}x)"))


def table(summary: dict, rat: dict) -> list[str]:
    fmt = lambda s, f: "/".join(format(s[k], f) for k in ("min", "median", "max"))  # noqa: E731
    lines = [f"{'arm':12s} {'episodes/s min/med/max':>24s} {'tokens/s min/med/max':>22s} {'rollout s':>9s} "
             f"{'learn s':>8s} {'rollout %':>9s} {'tok/ep':>7s} {'rows learned':>12s} {'learn tok/s':>11s} "
             f"{'success':>7s} {'peak MiB':>8s} {'ep/cpu-s':>8s} {'learn cpu s':>11s}"]
    for arm, s in summary.items():
        med = {k: v["median"] for k, v in s.items() if isinstance(v, dict)}
        lines.append(f"{arm:12s} {fmt(s['episodes_per_s'], '.2f'):>24s} {fmt(s['tokens_per_s'], '.0f'):>22s} "
                     f"{med['rollout_s']:9.2f} {med['learn_s']:8.2f} {100 * med['rollout_s'] / med['step_s']:8.0f}% "
                     f"{med['tokens_per_episode']:7.1f} {med['rows_learned']:12.1f} {med['learn_tokens_per_s']:11.0f} "
                     f"{med['success']:7.3f} {s['peak_mib']:8.0f} {med['episodes_per_cpu_s']:8.2f} "
                     f"{med['learn_cpu_s']:11.2f}")
    lines.append("(rollout s, learn s: per step, medians; learn tok/s: sampled tokens in the rows the learner "
                 "forwarded per second of learning; ep/cpu-s and learn cpu s: per CPU second of the process, all its "
                 "threads, which a loaded machine disturbs less than the wall clock)")
    for arm, s in summary.items():
        if "prepare_s" in s:
            prep, opt, learn = (s[k]["median"] for k in ("prepare_s", "optimizer_s", "learn_s"))
            lines.append(f"{arm} learning per step: {prep:.2f} s scoring and padding the round (outside rollout_func), "
                         f"{opt:.2f} s optimizer step, {learn - prep - opt:.2f} s forward, backward and the rest")
    for key, r in rat.items():
        lines.append(f"{key}: episodes/s {r['episodes_per_s']:.2f}x, tokens/s {r['tokens_per_s']:.2f}x; learning "
                     f"{r['learn_speed']:.2f}x as fast, rollout {r['rollout_speed']:.2f}x; per CPU second: episodes "
                     f"{r['episodes_per_cpu_s']:.2f}x, learning {r['learn_cpu_speed']:.2f}x")
    g = goal(rat)
    if g:
        lines.append(g)
    return lines


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        version = require_trl()
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    print(f"this project's learner vs TRL {version} GRPOTrainer, equal work: arms {', '.join(args.arms)}, "
          f"{args.reps} repetitions x ({args.warmup} warm-up + {args.steps} timed steps), alternated; "
          f"{os.cpu_count()} CPUs, load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    spec = {"project": str(args.project.resolve()), "steps": args.steps, "warmup": args.warmup}
    arm_reps: dict[str, list[dict]] = {a: [] for a in args.arms}
    profiles = {}
    with tempfile.TemporaryDirectory(prefix="vs_trl_tp_") as t:
        for rep in range(args.reps):
            for arm in args.arms:
                r = run_child(CHILD, arm, spec, Path(t) / f"{arm}-r{rep}", f"arm {arm}")
                arm_reps[arm].append(r)
                f = rep_figures(r["steps"])
                print(f"  rep {rep + 1} {arm}: {f['episodes_per_s']:.2f} episodes/s, {f['tokens_per_s']:.0f} "
                      f"tokens/s, rollout {f['rollout_s']:.2f} s + learn {f['learn_s']:.2f} s per step "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
        if args.profile:
            for arm in args.arms:
                profiles[arm] = run_child(CHILD, arm, {**spec, "profile": True}, Path(t) / f"{arm}-profile",
                                           f"arm {arm}")["profile"]
    load1 = os.getloadavg()
    summary = summarize(arm_reps)
    rat = ratios(summary)
    result = {"trl": version, "reps": args.reps, "steps": args.steps, "warmup": args.warmup, "load_start": load0,
              "load_end": load1, "summary": summary, "ratios": rat, "goal": goal(rat),
              "config": {a: arm_reps[a][0]["config"] for a in args.arms},
              "runs": {a: [r["steps"] for r in reps] for a, reps in arm_reps.items()}, "profiles": profiles}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print("configuration (why: bench/vs_trl_throughput.py docstring):")
    for arm in args.arms:
        print(f"  {arm}: " + ", ".join(f"{k}={v}" for k, v in result["config"][arm].items()))
    for line in table(summary, rat):
        print(line)
    for arm, lines in profiles.items():
        print(f"profile of {arm} (cProfile, the timed steps of one extra repetition; tottime = own time):")
        for line in lines:
            print("  " + line)
    print(f"load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
