"""Learning, like for like: this project's RL against TRL's ``GRPOTrainer``, pure RL against pure RL, over a
learning-rate sweep with seeds, with the project's default recipe as a third arm.

    python bench/vs_trl.py --project DIR [--steps 30] [--evals 3] [--eval-tasks 400] [--lrs 2e-5,5e-5,1e-4,2e-4]
                           [--seeds 0,1,2] [--arms project-rl,trl,project-default] [--json OUT] [--plot PNG]
                           [--report]

Needs TRL (``pip install -e '.[bench]'``: trl and datasets, an optional extra; the product does not import them)
and a project folder holding ``params.yaml``, ``models/adapted`` and ``data/`` (``dvc repro adapt`` there). Prints
each run's curve as it ends, then per arm and learning rate the final test success of the raw weights and of the
WiSE-FT average with a 95 % interval, the curves against training wall time, and the goal's verdict; writes, with
``--json``, every figure and the plot beside it (``--plot`` names another file). ``--json`` is also the bench's
memory: runs already in it are kept and not run again, so an interrupted sweep goes on where it stopped, if they share
this invocation's settings and inputs (a digest of the adapted weights and the task files: a project re-adapted
since is an error, not a mix); ``--report`` runs nothing and prints the figures of the named runs it holds (no TRL
needed). Writes nothing else outside a temporary folder.

The arms (bench/vs_trl_arms.py; every run a child process of its own, one after the other, one rank):

- ``project-rl``: this project's learner (:func:`pipeline.train.loop.setup` and the loop's own steps: RLOO,
  DeepSpeed), pure RL: no behaviour cloning, no expert-guided groups, no KL reference, and zero-variance groups kept
  in the loss as TRL keeps them (their advantage is 0, their tokens count in the token mean).
- ``trl``: TRL 1.16's ``GRPOTrainer``, with ``scale_rewards="none"`` (advantage: return minus the group's mean) and
  ``loss_type="dapo"`` (the loss averaged over every action token of the step's batch, the project's
  ``train.loss_agg`` token-mean). Its ``rollout_func`` plays the episodes with this project's rollout engine on the
  model TRL trains (bench/vs_trl_shared.py), the fastest multi-turn generation TRL can be given here.
- ``project-default``: the train stage's recipe as ``params.yaml`` sets it (behaviour cloning on demonstrations,
  expert-guided groups, zero-variance groups left out, failure-weighted levels and goal sampling, its own
  ``train.lr``), labelled as such: it is not pure RL, and it does not play the plan.

Like for like between ``project-rl`` and ``trl``, run by run: the same start (``models/adapted``), the same plan
(``train.tasks_per_update`` training tasks per step drawn from the run's seed, each played ``train.group_size``
times with the same episode seeds: both arms' first batch is the same episodes), the same rollout engine sampling at
``train.rollout_temperature`` (the learner's log-probabilities at that temperature in both), fp32 weights with bf16
autocast, ``train.micro_batches`` accumulation steps per optimizer step, the learning rate with
``train.lr_warmup_steps`` linear warm-up and then constant, clipping at ``train.max_grad_norm``, AdamW without weight
decay, one on-policy step per batch (the PPO ratio is 1 in both), no reference model. What differs is the trainer
(advantages, loss, backward, optimizer step) and one constant: RLOO's leave-one-out baseline makes the project's
advantages G/(G-1) = 8/7 of TRL's, as a learning rate 8/7 higher would; the sweep covers it.

Equal work: every run plays ``--steps`` optimizer steps. After each of ``--evals`` equal marks of them the run's
clock stops and the policy is scored greedy on the first ``--eval-tasks`` test tasks with the evaluate stage's seeds,
twice: its raw weights, and the WiSE-FT average ``adapted + train.merge_alpha x (trained - adapted)`` that the train
stage keeps (scoring the same for every arm). The clock counts training wall time: trainer construction, rollouts
and learning, not evaluations. The adapted model is scored once (``start``) and begins every curve.

Figures: per arm and learning rate, the final success averaged over seeds with a 95 % interval (bootstrap over the
test tasks, the same resampled tasks for every seed: the interval of the task sample; the seeds' spread is printed
beside it as min-max), mean training seconds and episodes/s; curves (mean over seeds against mean training seconds).
The goal, for each scoring: the best TRL run's final success (over learning rates) is the target; TRL's time is the
first mark at which that TRL curve reaches it, the project's is the earliest such mark over its learning rates; goal
met when project / TRL <= 1/3. A target inside the start's 95 % interval is "not measurable": no TRL rate learned
measurably, and timing who first reaches a point within noise of the start would time the noise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl_shared import REPO, run_child  # noqa: E402

CHILD = Path(__file__).resolve().with_name("vs_trl_arms.py")
GOAL_RATIO = 1 / 3  # the project's pure-RL arm reaches the best TRL arm's final success in <= 1/3 of TRL's time
ARM_NAMES = ("project-rl", "trl", "project-default")
SCORINGS = ("raw", "wise")
NEEDED = ("params.yaml", "models/adapted/config.json", "data/tasks/train.jsonl", "data/tasks/test.jsonl",
          "data/env")
SETTINGS = ("steps", "evals", "eval_tasks", "project", "inputs")  # what a kept run must share with this invocation
INPUTS = ("models/adapted/*.safetensors", "data/tasks/train.jsonl", "data/tasks/test.jsonl")  # their digest: "inputs"


class BenchError(Exception):
    """Bad input: printed as one ``error:`` line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BenchError(message)


def number_list(flag: str, text: str, kind) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"{flag}: {text!r} is not a comma-separated list of {kind.__name__}s") from None
    if not values or len(set(values)) != len(values):
        raise BenchError(f"{flag}: {'nothing named' if not values else 'a value named twice'} in {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", type=Path, default=REPO, help="folder with params.yaml, models/adapted, data/")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (equal work)")
    ap.add_argument("--evals", type=int, default=3, help="evaluations per run, at equal marks of the steps")
    ap.add_argument("--eval-tasks", type=int, default=400, help="test tasks per evaluation")
    ap.add_argument("--lrs", default="2e-5,5e-5,1e-4,2e-4", help="learning rates of the pure-RL arms")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of every arm")
    ap.add_argument("--arms", default=",".join(ARM_NAMES), help=f"comma-separated: {', '.join(ARM_NAMES)}")
    ap.add_argument("--json", type=Path, default=None, help="every figure; runs already in it are kept")
    ap.add_argument("--plot", type=Path, default=None, help="the curves' plot (default: beside --json, as .png)")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: the figures of the named runs already in --json (the rest listed as not run)")
    args = ap.parse_args(argv)
    if args.report and (args.json is None or not args.json.is_file()):
        raise BenchError(f"--report reads the runs of --json, and {args.json or 'no --json'} is not a file")
    args.arms = number_list("--arms", args.arms, str)
    bad = [a for a in args.arms if a not in ARM_NAMES]
    if bad:
        raise BenchError(f"--arms: unknown arm {bad[0]!r} (a comma-separated list of {', '.join(ARM_NAMES)})")
    args.lrs, args.seeds = number_list("--lrs", args.lrs, float), number_list("--seeds", args.seeds, int)
    if not all(lr > 0 and math.isfinite(lr) for lr in args.lrs):
        raise BenchError(f"--lrs: every learning rate must be positive, got {args.lrs}")
    if any(s < 0 for s in args.seeds):
        raise BenchError(f"--seeds: seeds are non-negative, got {args.seeds}")
    if args.steps < 1:
        raise BenchError(f"--steps must be at least 1, got {args.steps}")
    if not 1 <= args.evals <= args.steps:
        raise BenchError(f"--evals must be between 1 and --steps ({args.steps}), got {args.evals}")
    if args.eval_tasks < 1:
        raise BenchError(f"--eval-tasks must be at least 1, got {args.eval_tasks}")
    for name in NEEDED:
        if not (args.project / name).exists():
            raise BenchError(f"--project {args.project}: {name} not found (the bench needs params.yaml, "
                             f"models/adapted and data/; run `dvc repro adapt` there first)")
    return args


def require_trl() -> str:
    """TRL's version; without TRL (or datasets) one BenchError that names the extra to install."""
    try:
        import datasets  # noqa: F401  (TRL's GRPOTrainer takes a datasets.Dataset)
        import trl
    except ImportError as exc:
        raise BenchError(f"TRL is not installed ({exc}): pip install -e '.[bench]'") from None
    return trl.__version__


def default_lr(project: Path) -> float:
    """The project's ``train.lr``: the default recipe's learning rate."""
    from pipeline.core.config import ConfigError, load_section
    from pipeline.core.errors import AgentRLError
    from pipeline.train.config import TrainConfig

    try:
        return load_section(TrainConfig, "train", project / "params.yaml").lr
    except (AgentRLError, ConfigError) as exc:
        raise BenchError(f"--project {project}: {exc}") from None


def marks(steps: int, evals: int) -> list[int]:
    """The steps after which a run is scored: `evals` equal marks, the last at `steps`."""
    return sorted({round(steps * (k + 1) / evals) for k in range(evals)})


def inputs_digest(project: Path) -> str:
    """A digest of what a run starts from and is scored on (the adapted weights, the training and test tasks): kept
    runs of a project whose model or tasks have since changed are not mixed with new ones."""
    h = hashlib.sha256()
    for pattern in INPUTS:
        for f in sorted(project.glob(pattern)):
            h.update(f"{f.relative_to(project)}\0".encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def run_key(arm: str, lr: float, seed: int) -> str:
    return f"{arm} lr={lr:g} seed={seed}"


def schedule(arms: list[str], lrs: list[float], seeds: list[int], recipe_lr: float) -> list[tuple[str, float, int]]:
    """Every run, in the order they run: seed by seed, each learning rate's pure-RL arms side by side (a change of
    the machine's load falls on both), then the default recipe at its own rate."""
    runs = []
    for seed in seeds:
        for lr in lrs:
            runs += [(a, lr, seed) for a in ("project-rl", "trl") if a in arms]
        if "project-default" in arms:
            runs.append(("project-default", recipe_lr, seed))
    return runs


def load_kept(path: Path | None, settings: dict) -> dict:
    """The runs of an earlier invocation with the same settings (``--json``); another setting is an error, not a
    silent mix of curves that are not comparable."""
    if path is None or not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())
        kept = {k: old["settings"].get(k) for k in SETTINGS}
        runs = old["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"--json {path}: exists and is not a result of this bench ({type(exc).__name__}: {exc})"
                         ) from None
    if kept != {k: settings[k] for k in SETTINGS}:
        raise BenchError(f"--json {path}: holds runs with other settings ("
                         + ", ".join(f"{k} {kept[k]} here {settings[k]}" for k in SETTINGS if kept[k] != settings[k])
                         + "); name another file")
    return runs


def bootstrap_interval(outcomes: list[list[int]], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean success over seeds and tasks, resampling the tasks (the same resample for every
    seed: the runs share their test tasks)."""
    import numpy as np

    m = np.asarray(outcomes, dtype=float)  # seeds x tasks
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, m.shape[1], size=(n_boot, m.shape[1]))
    means = m[:, idx].mean(axis=(0, 2))
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def summarize(runs: dict, start: dict) -> dict:
    """Per arm and learning rate (``"trl lr=2e-05"``): for each scoring, the final success over seeds with its
    interval and the seeds' finals; the mean curve (start first); mean training seconds and episodes/s."""
    groups: dict[str, list[dict]] = {}
    for r in runs.values():
        groups.setdefault(f"{r['arm']} lr={r['lr']:g}", []).append(r)
    out = {}
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        g = {"arm": rs[0]["arm"], "lr": rs[0]["lr"], "seeds": [r["seed"] for r in rs],
             "train_s": sum(r["points"][-1]["t"] for r in rs) / len(rs),
             "episodes_per_s": sum(r["points"][-1]["episodes"] / r["points"][-1]["t"] for r in rs) / len(rs)}
        steps = [p["step"] for p in rs[0]["points"]]
        g["curve"] = [{"step": 0, "t": 0.0, **{s: start["points"][0][s] for s in SCORINGS}}] + [
            {"step": st, "t": sum(r["points"][i]["t"] for r in rs) / len(rs),
             **{s: sum(r["points"][i][s] for r in rs) / len(rs) for s in SCORINGS}} for i, st in enumerate(steps)]
        for s in SCORINGS:
            finals = [sum(r["final"][s]) / len(r["final"][s]) for r in rs]
            g[s] = {"final": sum(finals) / len(finals), "seeds": finals,
                    "interval": bootstrap_interval([r["final"][s] for r in rs])}
        out[name] = g
    return dict(sorted(out.items(), key=lambda kv: (ARM_NAMES.index(kv[1]["arm"]), kv[1]["lr"])))


def time_to_reach(curve: list[dict], scoring: str, target: float) -> float | None:
    """Training seconds of the first point of a mean curve at or above `target`; None if none is."""
    return next((p["t"] for p in curve if p[scoring] >= target - 1e-12), None)


def goal(summary: dict, scoring: str, start_interval: tuple[float, float]) -> dict | None:
    """The goal's figures for one scoring: the best TRL group's final success as the target, TRL's and the
    project's (earliest over its learning rates) time to reach it, their ratio and the verdict. A target inside the
    start's 95 % interval is no target: reaching it first would time noise, so the verdict is "not measurable"."""
    trl = {k: g for k, g in summary.items() if g["arm"] == "trl"}
    proj = {k: g for k, g in summary.items() if g["arm"] == "project-rl"}
    if not trl or not proj:
        return None
    best = max(trl, key=lambda k: trl[k][scoring]["final"])
    target = trl[best][scoring]["final"]
    t_trl = time_to_reach(trl[best]["curve"], scoring, target)
    reach = {k: time_to_reach(g["curve"], scoring, target) for k, g in proj.items()}
    hits = {k: t for k, t in reach.items() if t is not None}
    first = min(hits, key=hits.get) if hits else None
    out = {"scoring": scoring, "target": target, "best_trl": best, "trl_s": t_trl, "project_group": first,
           "project_s": hits.get(first), "ratio": None, "met": None}
    lo, hi = start_interval
    if target <= hi:
        out["verdict"] = (f"not measurable: TRL's best final {target:.3f} is inside the start's 95 % interval "
                          f"[{lo:.3f}, {hi:.3f}]: no TRL rate learned measurably")
    elif first is None:
        out.update(met=False, verdict=f"not met: no project-rl learning rate reached {target:.3f} within the steps")
    else:
        ratio = hits[first] / t_trl
        out.update(ratio=ratio, met=ratio <= GOAL_RATIO,
                   verdict=f"{'met' if ratio <= GOAL_RATIO else 'not met'}: {ratio:.2f}x (goal <= {GOAL_RATIO:.2f}x)")
    return out


def table(summary: dict, goals: list[dict]) -> list[str]:
    lines = [f"{'arm':24s} {'seeds':>5s} {'raw final [95% CI] (seeds min-max)':>38s} "
             f"{'wise final [95% CI] (seeds min-max)':>38s} {'train s':>8s} {'ep/s':>6s}"]
    for name, g in summary.items():
        cells = [f"{g[s]['final']:.3f} [{g[s]['interval'][0]:.3f}, {g[s]['interval'][1]:.3f}] "
                 f"({min(g[s]['seeds']):.3f}-{max(g[s]['seeds']):.3f})" for s in SCORINGS]
        lines.append(f"{name:24s} {len(g['seeds']):5d} {cells[0]:>38s} {cells[1]:>38s} {g['train_s']:8.0f} "
                     f"{g['episodes_per_s']:6.2f}")
    for name, g in summary.items():
        lines.append(f"  {name} curve (mean over seeds): " + ", ".join(
            f"step {p['step']} {p['t']:.0f}s {p['raw']:.3f}/{p['wise']:.3f}" for p in g["curve"]))
    for gl in goals:
        fmt = lambda t: "never" if t is None else f"{t:.0f} s"  # noqa: E731
        lines.append(f"goal ({gl['scoring']}): target {gl['target']:.3f} ({gl['best_trl']}'s final); TRL reaches it "
                     f"at {fmt(gl['trl_s'])}, project-rl at {fmt(gl['project_s'])}"
                     + (f" ({gl['project_group']})" if gl["project_group"] else "") + f": {gl['verdict']}")
    return lines


def plot(summary: dict, path: Path, eval_tasks: int, start_interval: tuple[float, float]) -> None:
    """Mean curves, one panel per scoring: a learning rate's colour is the same in both pure-RL arms (the project
    solid, TRL dashed), the default recipe dotted black; the grey band is the start's 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100, sharey=True)
    rates = sorted({g["lr"] for g in summary.values() if g["arm"] != "project-default"})
    colour = {lr: plt.get_cmap("viridis")(i / max(1, len(rates) - 1) * 0.9) for i, lr in enumerate(rates)}
    styles = {"project-rl": "-", "trl": "--", "project-default": ":"}
    for ax, s in zip(axes, SCORINGS):
        ax.axhspan(*start_interval, color="grey", alpha=0.15, label="start, 95 % interval")
        for name, g in summary.items():
            c = g["curve"]
            ax.plot([p["t"] for p in c], [p[s] for p in c], styles[g["arm"]], marker="o", markersize=3,
                    color="black" if g["arm"] == "project-default" else colour[g["lr"]],
                    label=f"{name} ({len(g['seeds'])} seed{'s' if len(g['seeds']) > 1 else ''})")
        ax.set_title(f"{'raw weights' if s == 'raw' else 'WiSE-FT average'}: test success ({eval_tasks} tasks)",
                     fontsize=10)
        ax.set_xlabel("training wall clock, s (mean over seeds; evaluation excluded)")
    axes[0].set_ylabel("success, mean over seeds")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        version = None if args.report else require_trl()  # a report needs no TRL: its runs are in --json
        recipe_lr = default_lr(args.project)
        settings = {"steps": args.steps, "evals": args.evals, "eval_tasks": args.eval_tasks,
                    "project": str(args.project.resolve()), "inputs": inputs_digest(args.project)}
        runs = load_kept(args.json, settings)
        version = version or json.loads(args.json.read_text()).get("trl")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    todo = schedule(args.arms, args.lrs, args.seeds, recipe_lr)
    print(f"this project vs TRL {version} GRPOTrainer, learning: {len(todo)} runs of {args.steps} steps "
          f"({len([k for k in runs if k in {run_key(*r) for r in todo}])} kept from {args.json}), scored after steps "
          f"{marks(args.steps, args.evals)} on {args.eval_tasks} test tasks; {os.cpu_count()} CPUs, load average "
          f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    spec = {**settings, "marks": marks(args.steps, args.evals)}

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"settings": settings, "trl": version, "runs": runs}, indent=1))

    missing = [run_key(*r) for r in todo if run_key(*r) not in runs]
    if args.report:
        if missing:
            print(f"not run yet ({len(missing)}): " + ", ".join(missing))
        todo = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as t:
        if "start" not in runs and todo:
            runs["start"] = {**run_child(CHILD, "start", {**spec, "name": "start", "seed": 0, "lr": 0.0},
                                         Path(t) / "start", "run start"),
                             "seed": 0, "lr": 0.0}
            save()
        if "start" in runs:
            print(f"start (models/adapted): {runs['start']['points'][0]['raw']:.3f}", flush=True)
        for arm, lr, seed in todo:
            key = run_key(arm, lr, seed)
            if key in runs:
                continue
            r = run_child(CHILD, arm, {**spec, "name": key, "lr": lr, "seed": seed},
                          Path(t) / key.replace(" ", "_"), f"run {key}")
            runs[key] = {**r, "lr": lr, "seed": seed, "load": os.getloadavg()[0]}
            save()
            print(f"{key}: " + ", ".join(f"step {p['step']} {p['t']:.0f}s {p['raw']:.3f}/{p['wise']:.3f}"
                                         for p in r["points"]) + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    wanted = {run_key(*r) for r in schedule(args.arms, args.lrs, args.seeds, recipe_lr)} & set(runs)
    if not wanted or "start" not in runs:
        print("no run to report")
        return 0
    summary = summarize({k: r for k, r in runs.items() if k in wanted}, runs["start"])
    start_interval = bootstrap_interval([runs["start"]["final"]["raw"]])
    goals = [g for g in (goal(summary, s, start_interval) for s in SCORINGS) if g is not None]
    if args.json:
        result = json.loads(args.json.read_text()) if args.json.exists() else {}
        args.json.write_text(json.dumps({**result, "settings": settings, "trl": version, "runs": runs,
                                         "summary": summary, "goals": goals}, indent=1))
    print("configuration (why: bench/vs_trl.py docstring):")
    for arm in args.arms:
        r = next((r for k, r in runs.items() if k in wanted and r.get("arm") == arm), None)
        if r is not None:
            print(f"  {arm}: " + ", ".join(f"{k}={v}" for k, v in r["config"].items() if k not in ("lr", "seed",
                                                                                                 "learning_rate")))
    for line in table(summary, goals):
        print(line)
    load1 = os.getloadavg()
    print(f"load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    png = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if png is None:
        print("plot: none (name --plot or --json)")
    else:
        plot(summary, png, args.eval_tasks, start_interval)
        print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
