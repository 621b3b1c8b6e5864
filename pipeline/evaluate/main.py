"""Phase `evaluate`: the SFT policy (``models/adapted``) and the RL policy (``models/policy``) on the train (a subset),
validation and test splits, with the overfitting checks of docs/design.md §5.2.1 (see :mod:`pipeline.evaluate.report`).

Reads the `evaluate`, `env` and `rollout` sections. Steps:

1. check every input before any episode runs: both policy folders load, the three task files pass the "tasks" suite,
   the world loads (anything missing or broken is an :class:`AgentRLError` naming it);
2. play greedy episodes of both policies on the same tasks with the same seeds (so results pair up), and the sampled
   episodes of the rigid-behaviour check (``diversity_tasks`` tasks × ``diversity_seeds`` seeds, rollout temperature);
3. validate every episode record with the Great Expectations suite "evaluation" (reward in range, masks consistent
   with tokens, tool-call JSON valid, no empty answers);
4. build the report and write ``metrics/evaluate.json`` (metrics with bootstrap intervals per policy, split and level;
   the flags; per-task test successes of each policy keyed by task id, for the promotion gate's paired test) and
   ``metrics/evaluate_success.csv`` (success per policy, split and level, for ``dvc plots show``);
5. log the metrics, the flags (tags), both files and a Markdown report to MLflow (run ``evaluate``).

Outputs from an earlier run are deleted first, and new ones are written only once everything succeeded: after bad
input or a failure there is no metrics file, never a stale one that a promotion gate could mistake for this run's.

Deliberately left out: deciding anything from the flags (the promotion gate reads the file), and evaluating the expert
or random baselines (``build_env`` records those).
"""

from __future__ import annotations

import csv
import io
import json
import tempfile
import time
from pathlib import Path

from pipeline.core.config import load_section
from pipeline.envs.config import EnvConfig
from pipeline.core.errors import AgentRLError
from pipeline.evaluate.config import POLICIES, SPLITS, EvaluateConfig

METRICS_PATH = Path("metrics/evaluate.json")
PLOT_PATH = Path("metrics/evaluate_success.csv")
PLOT_COLUMNS = ("series", "policy", "split", "level", "success", "ci_low", "ci_high", "n")
STAGE_BEFORE = {"sft": "adapt", "rl": "train"}


def _write_atomic(path: Path, text: str) -> None:
    from pipeline.core.atomic import atomic_open

    with atomic_open(path, newline="") as fh:
        fh.write(text)


def load_inputs(cfg: EvaluateConfig, env_cfg: EnvConfig) -> tuple[dict, dict, object]:
    """(policies {name: (model, tokenizer)}, tasks {split: [Task]}, world); every problem is an AgentRLError."""
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.model import load_policy

    policies = {}
    for name, path in (("sft", cfg.sft_policy), ("rl", cfg.rl_policy)):
        if not Path(path).is_dir():
            raise AgentRLError(f"evaluate: the {name.upper()} policy folder {path} does not exist; run the "
                               f"`{STAGE_BEFORE[name]}` stage first (evaluate.{name}_policy)")
        model, tokenizer, _ = load_policy(path)
        policies[name] = (model, tokenizer)
    world = open_environment(env_cfg.name, cfg.world_dir)
    tasks = {}
    for split in SPLITS:
        path = Path(cfg.tasks_dir) / f"{split}.jsonl"
        if not path.is_file():
            raise AgentRLError(f"evaluate: task file {path} not found; run the `build_env` stage first "
                               f"(evaluate.tasks_dir)")
        tasks[split] = load_task_file(path, world)  # AgentRLError when it breaks the task checks
        if not tasks[split]:
            raise AgentRLError(f"evaluate: task file {path} holds no tasks")
    return policies, tasks, world


def chosen_tasks(cfg: EvaluateConfig, tasks: dict) -> tuple[dict, list]:
    """The tasks each split is evaluated on, and the diversity check's tasks (first N of each split)."""
    limits = {"train": cfg.train_tasks, "validation": cfg.max_tasks, "test": cfg.max_tasks}
    chosen = {split: tasks[split][:limits[split]] for split in SPLITS}
    return chosen, tasks[cfg.diversity_split][:cfg.diversity_tasks]


def play(policies: dict, chosen: dict, diversity_tasks: list, runtime, env_cfg: EnvConfig, rollout_cfg,
         cfg: EvaluateConfig) -> tuple[dict, dict]:
    """Greedy episodes of each policy on each split (episode i gets seed cfg.seed + i, for both policies), and the
    sampled diversity episodes (every task `diversity_seeds` times, each episode with its own seed)."""
    from pipeline.policy.rollout import RolloutEngine

    k = cfg.diversity_seeds
    div_tasks = [t for t in diversity_tasks for _ in range(k)]
    div_seeds = [1_000_000 + cfg.seed * 100_003 + j for j in range(len(div_tasks))]
    greedy, sampled = {}, {}
    for name, (model, tokenizer) in policies.items():
        engine = RolloutEngine(model, tokenizer, runtime, env_cfg, rollout_cfg)
        greedy[name] = {split: engine.run(ts, [cfg.seed + i for i in range(len(ts))], greedy=True)
                        for split, ts in chosen.items()}
        sampled[name] = engine.run(div_tasks, div_seeds, greedy=False)
    return greedy, sampled


def validate_episodes(greedy: dict, sampled: dict, env_cfg: EnvConfig, world) -> dict:
    """Every record set through the environment's "evaluation" check; the first failure is an AgentRLError (nothing
    is written)."""
    from pipeline.core.validation import DataValidationError

    summary = {}
    sets = [(f"{p}/{s}", recs) for p, splits in greedy.items() for s, recs in splits.items()]
    sets += [(f"{p}/sampled", recs) for p, recs in sampled.items()]
    for name, records in sets:
        try:
            report = world.check_episodes(records, "evaluation", f"evaluate:{name}", env_cfg)
            if report is None:
                continue
            report.raise_if_failed()
        except DataValidationError as exc:
            raise AgentRLError(f"evaluate: the {name} episodes fail the 'evaluation' suite: {exc}") from None
        summary[name] = report.summary()
    return summary


def label_slices(greedy: dict, chosen: dict, world) -> None:
    """Add to every greedy record the held-out slices its task exercises (:meth:`Environment.heldout_slices`), which
    the report groups success by (`per_slice`); records of an environment that names none are left as they are."""
    slices = {t.task_id: list(world.heldout_slices(t)) for ts in chosen.values() for t in ts}
    if not any(slices.values()):
        return
    for splits in greedy.values():
        for records in splits.values():
            for r in records:
                r["slices"] = slices.get(r["task_id"], [])


def evaluate(cfg: EvaluateConfig, env_cfg: EnvConfig, rollout_cfg, *, metrics_path: Path = METRICS_PATH,
             plot_path: Path = PLOT_PATH, tracker=None) -> dict:
    """Run the phase (see the module docstring); returns what it wrote to `metrics_path`."""
    from pipeline.evaluate.report import build_report, flat_metrics, markdown_report, success_rows
    from pipeline.core.tracking import NullTracker

    metrics_path, plot_path = Path(metrics_path), Path(plot_path)
    for stale in (metrics_path, plot_path):
        stale.unlink(missing_ok=True)
    t0 = time.perf_counter()
    policies, tasks, world = load_inputs(cfg, env_cfg)
    chosen, diversity_tasks = chosen_tasks(cfg, tasks)
    tracker = tracker or NullTracker()
    params = {"evaluate": cfg.model_dump(), "env": env_cfg.model_dump(), "rollout": rollout_cfg.model_dump()}
    with tracker.run("evaluate", params=params) as run:
        try:
            greedy, sampled = play(policies, chosen, diversity_tasks, world, env_cfg, rollout_cfg, cfg)
        finally:
            world.close()
        validation = validate_episodes(greedy, sampled, env_cfg, world)
        label_slices(greedy, chosen, world)
        report = build_report(greedy, sampled, cfg)
        result = {
            "policy_paths": {"sft": cfg.sft_policy, "rl": cfg.rl_policy},
            "tasks": {split: len(ts) for split, ts in chosen.items()},
            "diversity": {"split": cfg.diversity_split, "tasks": len(diversity_tasks), "seeds": cfg.diversity_seeds,
                          "temperature": rollout_cfg.temperature},
            "confidence": cfg.confidence, "bootstrap_samples": cfg.bootstrap_samples,
            **report,
            "validation": validation,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=PLOT_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(success_rows(report["policies"]))
        run.log_metrics(flat_metrics(report))
        run.set_tags({"evaluate.flagged": "; ".join(report["flagged"]) or "none"})
        with tempfile.TemporaryDirectory() as tmp:
            md = Path(tmp) / "evaluation_report.md"
            md.write_text(markdown_report(result))
            run.log_artifact(md)
        _write_atomic(plot_path, table.getvalue())
        _write_atomic(metrics_path, json.dumps(result, indent=2, sort_keys=True) + "\n")
        run.log_artifact(metrics_path)
        run.log_artifact(plot_path)
    return result


def main(params_path: str = "params.yaml") -> dict:
    from pipeline.policy.config import RolloutConfig
    from pipeline.core.tracking import Tracker

    cfg = load_section(EvaluateConfig, "evaluate", params_path)
    env_cfg = load_section(EnvConfig, "env", params_path)
    rollout_cfg = load_section(RolloutConfig, "rollout", params_path)
    result = evaluate(cfg, env_cfg, rollout_cfg, tracker=Tracker())
    for policy in POLICIES:
        parts = [f"{split} {result['policies'][policy][split]['overall']['success']['mean']:.3f}" for split in SPLITS]
        print(f"evaluate: {policy} success " + ", ".join(parts))
    tc = result.get("tool_calls_both_solved")
    if tc:
        parts = [f"L{lv} {g['sft']:.2f} -> {g['rl']:.2f} (n {g['n']})" for lv, g in tc["per_level"].items() if g["n"]]
        print("evaluate: tool calls on the test tasks both solve, SFT -> RL: " + ", ".join(parts))
    print("evaluate: flags: " + ("; ".join(result["flagged"]) or "none") + f" -> {METRICS_PATH}, {PLOT_PATH}")
    return result
