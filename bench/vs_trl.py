"""This project's RL phase against TRL's ``GRPOTrainer``, side by side on this machine, in one run.

    python bench/vs_trl.py [--budget 540] [--evals 6] [--eval-tasks 200] [--project .] [--json OUT]
                           [--plot docs/img/vs_trl.png] [--arms project,trl] [--trl-lr LR] [--reuse-json EARLIER]

Needs TRL (``pip install -e '.[bench]'``: trl and datasets, an optional extra; the product does not import them),
and a project folder holding ``params.yaml``, ``models/adapted`` and ``data/`` (run ``dvc repro adapt`` first).
Prints validation success against training wall time for both arms, the time each arm takes to reach TRL's final
validation success, their ratio against the goal (this project in at most 1/3 of TRL's time), episodes/s, peak
memory and final success; writes the plot and, with ``--json``, every figure. Writes nothing else outside a
temporary folder.

``--trl-lr`` sets the TRL arm's learning rate (default: the shared ``train.lr``; TRL's own default is 1e-6), so a
reader can see whether the shared rate handicaps TRL. ``--arms trl`` runs the TRL arm alone; ``--reuse-json`` (any
number of times) adds the arms of earlier ``--json`` results to the table and the plot, each marked as reused and
named by where it came from, so variants run one at a time end on one plot. A TRL arm is named by its learning rate
(``trl lr=2e-05``); an arm both run and reused, or reused from two files, or an earlier result with another budget or
evaluation schedule, is an error, not a silent choice. Reused arms were measured at another time, under the load
their own run printed; the table says which rows they are. Without a project arm (run or reused) there are no
time-to-reach figures, only the curves.

What both arms share:

- **Start**: the committed adapted model ``models/adapted`` (a Llama causal LM with the built-in byte-level BPE
  tokenizer, no chat template), loaded by :func:`pipeline.policy.model.load_policy`, in fp32 weights with bf16
  autocast where the CPU supports bf16 (our learner's "auto" on CPU; TRL's ``bf16=True`` is the same autocast).
- **Tasks and world**: the shop environment of the project folder, training split ``data/tasks/train.jsonl``.
  (The project arm leaves out ``train.incoming_tasks``: TRL gets the training split alone.)
- **Reward**: the environment's verifier reward the train stage learns from (each episode's return under
  ``env.reward``).
- **Group and batch**: ``train.group_size`` (8) rollouts per task = TRL's ``num_generations``; 8 tasks x 8 rollouts
  = 64 episodes per optimizer step in both (TRL: ``per_device_train_batch_size`` 8, ``gradient_accumulation_steps``
  8, so one generation round of 64 feeds one optimizer step); learning rate ``train.lr``; at most
  ``rollout.max_new_tokens`` (48) tokens per action (TRL's ``max_completion_length``, applied per turn).
- **Budget and clock**: ``--budget`` seconds of training wall clock per arm, each arm in its own child process
  (peak RSS is that process's own), one after the other, one process each (the project arm with
  ``train.num_ranks`` 1: both arms on the same threads). The clock starts before each arm builds its trainer
  (DeepSpeed engine, TRL's Trainer) and stops while an evaluation runs: evaluation time is excluded from both arms.
- **Evaluator**: the train stage's validation, :func:`pipeline.train.validation.evaluate_greedy` with the project's
  rollout engine, greedy, on the first ``--eval-tasks`` validation tasks with the validation seeds, at the adapted
  model (t = 0, the same point for both) and at the first optimizer step after each of ``--evals`` equal marks of
  the budget (the last mark is the budget, the arm's final point). The project arm's scored policy is what its
  validation scores and keeps (the WiSE-FT ensemble, ``train.merge_alpha``); TRL's is its trained model.

The project arm is the train stage as ``params.yaml`` configures it (RLOO, behaviour-cloning anchor and expert-guided
groups on demonstrations, rollout temperature 0.7, WiSE-FT), driven through :func:`pipeline.train.loop.train` with
updates unbounded, early stopping and periodic checkpoints off, and a validation hook that evaluates on the
schedule above.

The TRL arm is TRL 1.16's GRPO with its defaults (loss ``dapo``, ``beta`` 0, ``epsilon`` 0.2, rewards scaled by the
group's std, temperature 1.0, gradient checkpointing, linear learning-rate decay) except the shared values above;
``max_steps`` 10000 only bounds its schedule (the budget stops it, so the decay is negligible).
**Multi-turn route: ``rollout_func``, not ``environment_factory``.** ``environment_factory`` cannot play this
environment faithfully with TRL 1.16 on this model: (1) TRL's tool loop (``GRPOTrainer._tool_call_loop``,
``trl/trainer/grpo_trainer.py`` line 1957, ``while idxs_with_tool and iteration_num <
self.max_tool_calling_iterations``) ends an episode only when the model writes no tool call, while here the
environment ends it (the ``answer`` tool, ``env.max_steps``) and pays its verifier reward then; (2) it renders and
parses tool calls through a chat template with tools and a response parser (``supports_tool_calling``, line 650;
``parse_response``), which the built-in tokenizer does not have, and the adapted model was trained on the
protocol's text (``<call>tool {json}</call>`` / ``<obs>...</obs>``), not on any template's tool-call syntax: a
template written for the bench would have to reproduce that text and a parser for it, i.e. re-implement the
protocol inside Jinja, and any difference from the trained format would handicap TRL; (3) the environment folds
turns older than ``env.history_window`` into a ``State:`` line, a rewrite of the context that an append-only
conversation cannot express. So TRL's documented custom-rollout hook plays the project's own environment
(:class:`pipeline.policy.episode_drivers.EnvEpisode`, the engine's episode driver): each turn generates with TRL's
own generation path (``unwrap_model_for_generation`` and ``model.generate`` under the trainer's generation config,
batched over the running episodes, stopping at ``</call>`` or eos), the prompt is the environment's context encoded
as the project encodes it (TRL's "standard" text format), observations go into the completion with ``env_mask`` 0
(out of the loss, as TRL masks tool results) and the reward function returns the environment's return. One
difference remains: TRL's completion keeps the whole history verbatim where the environment would fold it after
``env.history_window`` (6) turns, which an episode of at most ``env.max_steps`` (8) actions rarely reaches.
``completions/clipped_ratio`` in TRL's log reads 1 because a completion ends with an action's ``</call>``, not eos;
``mask_truncated_completions`` is off by default, so nothing is masked for it.

What limits the comparison: the machine's load (printed at start and end; other jobs share the cores); one seed
per arm; validation on ``--eval-tasks`` tasks (the standard error of a success rate near 0.9 on 200 tasks is about
0.02, so curves that differ by less are ties); the arms differ in algorithm and recipe (the project's arm uses
demonstrations, TRL's does not), so this compares the two trainers as each is meant to be used, not one
algorithm implemented twice.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = Path(__file__).resolve().with_name("vs_trl_arms.py")
GOAL_RATIO = 1 / 3  # goal: this project reaches TRL's final validation success in at most 1/3 of TRL's time
TRL_MAX_STEPS = 10_000  # bounds TRL's learning-rate schedule only; the budget stops training
PEAK_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
                "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
                "sys.exit(rc)")
ARM_NAMES = ("project", "trl")
NEEDED = ("params.yaml", "models/adapted/config.json", "data/tasks/train.jsonl", "data/tasks/validation.jsonl",
          "data/env")


class BenchError(Exception):
    """Bad input: printed as one ``error:`` line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise BenchError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=540.0, help="training seconds per arm (evaluation excluded)")
    ap.add_argument("--evals", type=int, default=6, help="evaluations per arm after t = 0, at equal marks")
    ap.add_argument("--eval-tasks", type=int, default=200, help="validation tasks per evaluation")
    ap.add_argument("--project", type=Path, default=REPO, help="folder with params.yaml, models/adapted, data/")
    ap.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "vs_trl.png")
    ap.add_argument("--arms", default="project,trl", help="comma-separated arms to run: project, trl")
    ap.add_argument("--trl-lr", type=float, default=None,
                    help="the TRL arm's learning rate (default: the shared train.lr; TRL's own default is 1e-6)")
    ap.add_argument("--reuse-json", type=Path, action="append", default=[],
                    help="an earlier --json result whose arms join this one's table and plot (repeatable)")
    args = ap.parse_args(argv)
    args.arms = parse_arms(args.arms)
    if args.trl_lr is not None and not (args.trl_lr > 0 and math.isfinite(args.trl_lr)):
        raise BenchError(f"--trl-lr must be a positive learning rate, got {args.trl_lr:g}")
    if args.trl_lr is not None and "trl" not in args.arms:
        raise BenchError("--trl-lr sets the trl arm's learning rate, but --arms leaves that arm out")
    if not args.budget > 0:
        raise BenchError(f"--budget must be a positive number of seconds, got {args.budget:g}")
    if args.evals < 1:
        raise BenchError(f"--evals must be at least 1, got {args.evals}")
    if args.eval_tasks < 1:
        raise BenchError(f"--eval-tasks must be at least 1, got {args.eval_tasks}")
    for name in NEEDED:
        if not (args.project / name).exists():
            raise BenchError(f"--project {args.project}: {name} not found (the bench needs params.yaml, "
                             f"models/adapted and data/; run `dvc repro adapt` there first)")
    return args


def parse_arms(text: str) -> list[str]:
    """``--arms``: a comma-separated, non-empty subset of the arms, run in the order ``project``, ``trl``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ARM_NAMES]
    if bad or not names:
        raise BenchError(f"--arms: {'unknown arm ' + repr(bad[0]) if bad else 'no arm named'} "
                         f"(a comma-separated list of {', '.join(ARM_NAMES)})")
    return [n for n in ARM_NAMES if n in names]


def shared_lr(project: Path) -> float:
    """The project's ``train.lr``, the learning rate both arms share unless ``--trl-lr`` says otherwise."""
    from pipeline.core.config import ConfigError, load_section
    from pipeline.core.errors import AgentRLError
    from pipeline.train.config import TrainConfig

    try:
        return load_section(TrainConfig, "train", project / "params.yaml").lr
    except (AgentRLError, ConfigError) as exc:
        raise BenchError(f"--project {project}: {exc}") from None


def make_spec(args: argparse.Namespace, trl_lr: float) -> dict:
    """What each arm's child process reads: the project, the evaluation schedule, and the TRL arm's settings."""
    return {"project": str(args.project.resolve()), "marks": marks(args.budget, args.evals),
            "eval_tasks": args.eval_tasks, "max_steps": TRL_MAX_STEPS, "trl_lr": trl_lr}


def arm_order(key: str) -> tuple:
    """The project first, then the TRL arms from the highest learning rate down."""
    return (0, 0.0) if key == "project" else (1, -float(key.split("=", 1)[1]))


def require_trl() -> str:
    """TRL's version; without TRL (or datasets) one BenchError that names the extra to install."""
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as exc:
        raise BenchError(f"TRL is not installed ({exc}): pip install -e '.[bench]'") from None
    return trl.__version__


def marks(budget: float, evals: int) -> list[float]:
    """Evaluation marks in training seconds; the last is the budget."""
    return [budget * (k + 1) / evals for k in range(evals)]


def time_to_reach(points: list[dict], target: float) -> float | None:
    """The training time of the first point whose validation success is at least `target` (points in time order);
    None when no point reaches it."""
    for p in points:
        if p["success"] >= target - 1e-12:
            return p["t"]
    return None


def compare(project: dict, trl: dict) -> dict:
    """The figures of the two arms' results (``points`` each, in time order): TRL's final success as the target,
    each arm's time to reach it, their ratio and whether the goal is met (None when it cannot be judged)."""
    target = trl["points"][-1]["success"]
    start = trl["points"][0]["success"]
    reach = {"project": time_to_reach(project["points"], target), "trl": time_to_reach(trl["points"], target)}
    best = max(p["success"] for p in trl["points"])  # a second reading, less exposed to one noisy final point
    reach_best = {"project": time_to_reach(project["points"], best), "trl": time_to_reach(trl["points"], best)}
    out = {"target": target, "start": start, "time_to_target_s": reach, "ratio": None, "goal_met": None,
           "goal": f"project time to TRL's final validation success <= {GOAL_RATIO:.2f} x TRL's",
           "trl_best": best, "time_to_trl_best_s": reach_best}
    if target <= start:
        low = {k: min((p["success"] for p in a["points"][1:]), default=start)
               for k, a in (("project", project), ("trl", trl))}
        out["verdict"] = (f"not measurable: TRL's final validation success {target:.3f} is not above the start "
                          f"{start:.3f} (both arms hold it at t = 0); lowest point after the start: project "
                          f"{low['project']:.3f}, TRL {low['trl']:.3f}")
    elif reach["project"] is None:
        out.update(goal_met=False, verdict=f"goal not met: the project did not reach {target:.3f} within the budget")
    else:
        ratio = reach["project"] / reach["trl"]
        met = ratio <= GOAL_RATIO
        out.update(ratio=ratio, goal_met=met,
                   verdict=f"project / TRL time to {target:.3f}: {ratio:.2f}x (goal <= {GOAL_RATIO:.2f}x: "
                           f"{'met' if met else 'not met'})")
    return out


def table(result: dict) -> list[str]:
    """One row per arm (an arm reused from an earlier run is marked ``*``), then each TRL arm's comparison with the
    project arm: time to reach TRL's final success, the ratio against the goal, episodes/s and memory."""
    arms, comp = result["arms"], result["comparison"]
    lines = [f"{'arm':16s} {'start':>6s} {'final':>6s} {'lowest':>6s} {'best':>6s} {'updates':>8s} {'episodes':>9s} "
             f"{'episodes/s':>11s} {'peak MiB':>9s}"]
    for name, a in arms.items():
        s, mark = [p["success"] for p in a["points"]], "*" if "reused_from" in a else ""
        lines.append(f"{name + mark:16s} {s[0]:6.3f} {s[-1]:6.3f} {min(s[1:] or s):6.3f} {max(s):6.3f} "
                     f"{a['points'][-1]['update']:8d} {a['episodes']:9d} "
                     f"{a['episodes'] / max(1e-9, a['train_s']):11.2f} {a['peak_mib']:9.0f}")
    if any("reused_from" in a for a in arms.values()):
        lines.append("* reused from an earlier run (" + ", ".join(sorted({a["reused_from"] for a in arms.values()
                                                                          if "reused_from" in a})) + ")")
    if not comp:
        lines.append("no project arm (run it, or --reuse-json a result that has one): no time-to-reach figures")
    p = arms.get("project")
    for name, c in comp.items():
        t, reach, rb = arms[name], c["time_to_target_s"], c["time_to_trl_best_s"]
        speed = (p["episodes"] / p["train_s"]) / (t["episodes"] / t["train_s"])
        lines.append(f"project vs {name}: episodes/s {speed:.2f}x, peak memory {p['peak_mib'] / t['peak_mib']:.2f}x; "
                     f"time to TRL's final {c['target']:.3f}: project {fmt_s(reach['project'])}, TRL "
                     f"{fmt_s(reach['trl'])}; to TRL's best {c['trl_best']:.3f}: project {fmt_s(rb['project'])}, "
                     f"TRL {fmt_s(rb['trl'])}")
        lines.append(f"  {c['verdict']}")
    if comp:
        lines.append(f"goal: {next(iter(comp.values()))['goal']}")
    return lines


def fmt_s(t: float | None) -> str:
    return "never" if t is None else f"{t:.0f} s"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for name, a in result["arms"].items():
        label = ("this project (train stage)" if name == "project" else
                 f"TRL GRPOTrainer, lr {a['config']['learning_rate']:g}")
        pts = a["points"]
        ax.plot([p["t"] for p in pts], [p["success"] for p in pts], marker="o", label=label)
    start = next(iter(result["arms"].values()))["points"][0]["success"]
    ax.axhline(start, color="grey", linestyle="--", linewidth=0.8, label="adapted model (t = 0)")
    ax.set_xlabel("training wall clock, s (evaluation excluded)")
    ax.set_ylabel(f"validation success ({result['eval_tasks']} tasks)")
    ax.set_title(f"Validation success vs training time ({result['budget_s']:.0f} s budget per arm)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run_arm(name: str, spec: dict, tmp: Path) -> dict:
    """One arm in a child process (under a wrapper that reads the child's peak RSS)."""
    (tmp / name).mkdir()
    spec_path, out = tmp / f"{name}.spec.json", tmp / f"{name}.json"
    spec_path.write_text(json.dumps({**spec, "tmp": str(tmp / name)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRL_EXPERIMENTAL_SILENCE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-c", PEAK_WRAPPER, sys.executable, str(ARMS), name, str(spec_path), str(out)]
    proc = subprocess.run(cmd, cwd=spec["project"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    progress = [line for line in proc.stderr.splitlines() if line.startswith(f"{name}: ")]
    for line in progress:
        print("  " + line)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"arm {name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(out.read_text())
    result["peak_mib"] = int(proc.stderr.rsplit("PEAK_KB ", 1)[1].split()[0]) / 1024
    return result


def trl_key(lr: float) -> str:
    """A TRL arm's name in a result: its learning rate tells the variants apart."""
    return f"trl lr={lr:g}"


def arm_keys(result: dict) -> dict:
    """A result's arms by name (``project``, ``trl lr=...``). A result written before ``--trl-lr`` existed names its
    TRL arm ``trl``; its learning rate is in its configuration."""
    return {(trl_key(a["config"]["learning_rate"]) if k == "trl" else k): a for k, a in result["arms"].items()}


def load_reused(paths: list[Path], args: argparse.Namespace, running: list[str]) -> dict:
    """The arms of earlier results (``--reuse-json``), each marked with the file it came from. An earlier result
    with another budget, evaluation count or evaluation size, or two sources of one arm, is an error: their curves
    would not be comparable, or one would silently win."""
    reused: dict = {}
    for path in paths:
        try:
            old = json.loads(path.read_text())
            same = (old["budget_s"], old["evals"], old["eval_tasks"]) == (args.budget, args.evals, args.eval_tasks)
            arms = arm_keys(old)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BenchError(f"--reuse-json {path}: not a result of this bench ({type(exc).__name__}: {exc})") from None
        if not same:
            raise BenchError(f"--reuse-json {path}: budget {old['budget_s']:g} s, {old['evals']} evaluations on "
                             f"{old['eval_tasks']} tasks, this run {args.budget:g} s, {args.evals} on "
                             f"{args.eval_tasks}: the curves would not be comparable")
        for key, arm in arms.items():
            if key in reused or key in running:
                raise BenchError(f"--reuse-json {path}: arm {key!r} is also "
                                 f"{'run here' if key in running else 'in ' + reused[key]['reused_from']}")
            reused[key] = {**arm, "reused_from": arm.get("reused_from", str(path))}
    return reused


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        require_trl()
        trl_lr = args.trl_lr if args.trl_lr is not None else shared_lr(args.project)
        names = {"project": "project", "trl": trl_key(trl_lr)}
        reused = load_reused(args.reuse_json, args, [names[a] for a in args.arms])
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import trl

    load0 = os.getloadavg()
    print(f"this project vs TRL {trl.__version__} GRPOTrainer: arms {', '.join(names[a] for a in args.arms)}, "
          f"{args.budget:.0f} s of training per arm, {args.evals} evaluations on {args.eval_tasks} validation tasks; "
          f"{os.cpu_count()} CPUs, load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    if reused:
        print("reused from earlier runs: " + ", ".join(f"{k} ({a['reused_from']})" for k, a in reused.items()))
    spec = make_spec(args, trl_lr)
    arms = dict(reused)
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as t:
        for name in args.arms:
            print(f"arm {names[name]}:", flush=True)
            arms[names[name]] = run_arm(name, spec, Path(t))
    arms = dict(sorted(arms.items(), key=lambda kv: arm_order(kv[0])))
    load1 = os.getloadavg()
    result = {"budget_s": args.budget, "evals": args.evals, "eval_tasks": args.eval_tasks, "trl": trl.__version__,
              "load_start": load0, "load_end": load1, "arms": arms}
    result["comparison"] = ({k: compare(arms["project"], a) for k, a in arms.items() if k != "project"}
                            if "project" in arms else {})
    if args.json:  # first: the figures survive whatever goes wrong below
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print("configuration (why: bench/vs_trl.py docstring):")
    for name, a in arms.items():
        print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in a["config"].items()))
    for name, a in arms.items():
        print(f"  {name} curve: " + ", ".join(f"{p['t']:.0f}s {p['success']:.3f}" for p in a["points"]))
    for line in table(result):
        print(line)
    print(f"load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    plot(result, args.plot)
    print(f"plot: {args.plot}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
