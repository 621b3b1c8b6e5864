"""One rank of the `train` phase. Started by the DeepSpeed launcher (``deepspeed --num_gpus N --module
pipeline.train.worker --params params.yaml``), or in-process for a single rank by :mod:`pipeline.train.main`.

Reads the `env`, `rollout` and `train` sections, trains from ``models/adapted`` on the training split plus the incoming
production tasks in ``train.incoming_tasks`` and ``train.production_tasks`` (checked and filtered by
:mod:`pipeline.train.incoming` before anything trains), keeps the best policy (by the validation metric ``train.early_stopping_metric``; training stops early after
``early_stopping_patience`` evaluations without improvement) in ``models/policy``, and on rank 0 writes
``metrics/train.json`` (SFT against RL on the test split, per level, the seen-wording headroom that bounds RL's
gain (:func:`seen_wording_headroom`), the early-stopping decision with its reason, ``incoming``: the incoming
tasks used and dropped, ``health``: tool faults, stale batches dropped, collapse alarms, and ``learnability``: the
report of :mod:`pipeline.policy.learnability` on the RL policy's test episodes, also printed last) and
``metrics/train_curve.csv`` (the learning curve for ``dvc plots show``; the columns an extension declares
(:attr:`pipeline.train.extensions.base.Extension.curve_keys`) when it reported them, a health column when its figure
is nonzero somewhere).

An extension may train the stage otherwise than as one run (:meth:`pipeline.train.extensions.base.Extension.train_stage`):
with ``train.population.size`` > 1 the members are trained one after the other
(:mod:`pipeline.train.extensions.population`), the best on validation becomes ``models/policy`` and
``metrics/train.json`` gets ``population``: every member's validation figures and the pairwise behaviour diversity.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.atomic import atomic_open, write_json
from pipeline.core.config import load_section
from pipeline.envs.config import EnvConfig
from pipeline.envs.registry import open_environment
from pipeline.envs.taskfile import load_task_file
from pipeline.core.errors import AgentRLError
from pipeline.train.config import TrainConfig
from pipeline.train.diagnostics import run_health
from pipeline.train.incoming import DROP_REASONS, load_incoming
from pipeline.policy.learnability_render import flat_metrics, render
from pipeline.train.extensions import Stage, curve_keys, train_stage

CURVE_KEYS = ("update", "rollout/success", "rollout/return", "policy/entropy", "losses/total", "losses/approx_kl",
              "rollout/zero_variance_group_share", "sys/rollout_s", "sys/learn_s", "sys/idle_s", "sys/update_s",
              "train/batch_tokens")
# columns of the environment's context actions when it reports them; an extension declares its own
# (pipeline.train.extensions.base.Extension.curve_keys)
OPTIONAL_CURVE_KEYS = ("context/episodes_with_actions_share", "context/plan_completion", "context/memory_notes",
                       "context/memory_utility")  # env.context_actions
# run health (pipeline.train.diagnostics): columns only when some update has a nonzero value (always logged to MLflow)
HEALTH_CURVE_KEYS = ("faults/failure_rate", "faults/latency_spikes", "faults/tool_exceptions",
                     "offpolicy/dropped_stale_batch", "alarms/entropy_collapse", "alarms/reward_spread_collapse",
                     "alarms/advantage_var_collapse")


def compare(policy_dirs: dict[str, Path], tasks, runtime, env_cfg, rollout_cfg, dist,
            records: dict[str, list] | None = None) -> dict:
    """Greedy test-split metrics of each policy (same tasks, same seeds), per level; the episode records of the
    policies that `records` names are appended to its lists."""
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.train.validation import evaluate_greedy

    out = {}
    for name, path in policy_dirs.items():
        model, tok, _ = load_policy(path)
        out[name] = evaluate_greedy(RolloutEngine(model, tok, runtime, env_cfg, rollout_cfg), tasks, dist, seed=20_000,
                                    records_out=(records or {}).get(name))
    return out


def learnability(runtime, records: list[dict], tasks, train_tasks, env_cfg, rollout_cfg, data: Path) -> dict:
    """The learnability report (:mod:`pipeline.policy.learnability`) of the RL policy's test episodes."""
    from pipeline.core.jsonl import read_jsonl
    from pipeline.policy.learnability import report_for

    path = data / "demos" / "train.jsonl"
    demos = read_jsonl(path, "demonstrations", allow_empty=True) if path.is_file() else []
    return report_for(runtime, records, tasks, demos, train_tasks, env_cfg, rollout_cfg)


def deltas(sft: dict, rl: dict) -> dict:
    d = {"overall_success": rl["overall"]["success_rate"] - sft["overall"]["success_rate"]}
    for lv in sft["per_level"]:
        d[f"level_{lv}_success"] = rl["per_level"][lv]["success_rate"] - sft["per_level"][lv]["success_rate"]
    # tool calls per solved task, in two readings: the mean over the solved episodes (`mean_tool_calls_solved`) and
    # every call, failed episodes' included, per task solved (`tool_calls_per_success`, what a success costs). Per
    # level too: the overall figure mixes levels (a policy that solves more level-4 tasks, 4 calls each, raises the
    # first reading even when every level's solved tasks take fewer calls). None where a policy solved nothing or
    # an older summary lacks the statistic.
    for stat, name in (("mean_tool_calls_solved", "tool_calls_per_solved_task"),
                       ("tool_calls_per_success", "tool_calls_per_success")):
        for key, scope in [(name, None)] + [(f"level_{lv}_{name}", lv) for lv in sft["per_level"]]:
            a, b = [(p["overall"] if scope is None else p["per_level"][scope]).get(stat) for p in (sft, rl)]
            d[key] = None if a is None or b is None else b - a
    d["safety_violations"] = rl["overall"]["safety_violations"] - sft["overall"]["safety_violations"]
    # test tasks in the held-out fifth wording of their family (about 18 % of them) stay near 0 for both policies:
    # RL trains on the four seen wordings, so the seen-template figure is where its effect shows undiluted
    for split in ("template_seen", "template_unseen"):
        if split in sft and split in rl:
            d[f"{split}_success"] = rl[split]["success_rate"] - sft[split]["success_rate"]
    return d


def seen_wording_headroom(sft: dict) -> dict | None:
    """The most RL can add to the SFT policy's test success by solving the seen-wording tasks that SFT fails, per
    level (``level_<lv>``) and overall: the share of each level's test tasks that are in a training wording and not
    solved by SFT. RL trains on the training wordings only, so a gain above this needs the policy to carry what it
    learns over to the held-out wording (about 18 % of the test split: each task family's fifth wording is held out
    of training), which no training signal reaches. Read it beside ``delta_rl_minus_sft``: a target gain above the
    headroom is out of reach from that start. None for a split without held-out wordings (no
    ``per_level_template_seen``, see :func:`pipeline.train.validation.evaluate_greedy`)."""
    seen = sft.get("per_level_template_seen")
    if seen is None:
        return None
    out, gap_total, n_total = {}, 0.0, 0
    for lv, stats in sft["per_level"].items():
        s = seen.get(lv)
        gap = 0.0 if s is None else s["n"] * (1.0 - s["success_rate"])
        out[f"level_{lv}"] = gap / stats["n"] if stats["n"] else 0.0
        gap_total, n_total = gap_total + gap, n_total + stats["n"]
    out["overall"] = gap_total / n_total if n_total else 0.0
    return out


@dataclass
class Inputs:
    """What a rank reads before it trains: the environment, the task splits, the incoming tasks and the
    behaviour-cloning demonstrations."""

    runtime: Any
    train_tasks: list
    val_tasks: list
    test_tasks: list
    incoming: Any  # pipeline.train.incoming.IncomingTasks
    demos: list | None


def read_inputs(cfg: TrainConfig, env_cfg: EnvConfig, data: Path, adapted: str, dist) -> Inputs:
    """The environment, splits, incoming tasks (a schema-breaking incoming file stops the stage here, before the
    tracker, checkpoints or model) and, with `bc_coef` > 0, the successful demonstrations as examples."""
    try:
        runtime = open_environment(env_cfg.name, data / "env")
        train_tasks, val_tasks, test_tasks = (load_task_file(data / "tasks" / f"{s}.jsonl", runtime, validate=False)
                                              for s in ("train", "validation", "test"))
    except (FileNotFoundError, ValueError) as exc:
        raise AgentRLError(f"train: {exc}") from None
    incoming = load_incoming([cfg.incoming_tasks, cfg.production_tasks], train_tasks=train_tasks,
                             test_tasks=test_tasks, runtime=runtime)
    if dist.is_main:
        print(incoming.describe(), flush=True)
    demos = None
    if cfg.bc_coef > 0:
        from pipeline.policy.model import load_policy
        from pipeline.policy.demos import demo_examples, load_demos, prompt_signatures

        _, tok, _ = load_policy(adapted)
        questions = {t.task_id: t.question for t in train_tasks}
        demos = demo_examples(tok, [d for d in load_demos(data / "demos" / "train.jsonl") if d["success"]],
                              questions, env_cfg.history_window,
                              signatures=prompt_signatures(runtime, train_tasks, env_cfg.context_actions))
    return Inputs(runtime, train_tasks, val_tasks, test_tasks, incoming, demos)


def run_worker(params_path: str = "params.yaml", adapted: str = "models/adapted", out: str = "models/policy",
               ckpt: str = "checkpoints/train", metrics_path: str = "metrics/train.json",
               curve_path: str = "metrics/train_curve.csv", data_dir: str = "data", stop_after: int | None = None,
               before_learn=None) -> dict:
    """Train one rank (see the module docstring); `stop_after` and `before_learn` are passed to
    :func:`pipeline.train.loop.train` as :class:`pipeline.train.loop.Hooks` (tests stop or kill a run midway with
    them). Returns the loop's result."""
    from pipeline.policy.config import RolloutConfig
    from pipeline.train.distributed import init_dist
    from pipeline.train.loop import Hooks
    from pipeline.core.tracking import NullTracker, Tracker

    env_cfg = load_section(EnvConfig, "env", params_path)
    rollout_cfg = load_section(RolloutConfig, "rollout", params_path)
    cfg = load_section(TrainConfig, "train", params_path)
    dist = init_dist()
    data = Path(data_dir)
    inputs = read_inputs(cfg, env_cfg, data, adapted, dist)
    # a tracking server lost mid-run is said once and training goes on untracked (pipeline.core.tracking)
    tracker = Tracker(on_outage="continue") if dist.is_main else NullTracker()
    t0 = time.perf_counter()
    params = {"env": env_cfg.model_dump(), "rollout": rollout_cfg.model_dump(), "train": cfg.model_dump(),
              "world_size": dist.world_size}
    with tracker.run("train", params=params) as run:
        incoming = inputs.incoming
        run.log_metrics({f"incoming/{k}": incoming.summary[k] for k in ("files", "read", "tasks", *DROP_REASONS)})
        run.set_tags({"incoming.dir": incoming.summary["dir"] or "null"})
        hooks = Hooks(stop_after=stop_after, before_learn=before_learn)
        result = train_runs(cfg, env_cfg, rollout_cfg, inputs, adapted=adapted, out=out, ckpt=ckpt, dist=dist,
                            run=run, hooks=hooks)
        result["incoming"] = incoming.summary
        if not result["completed"]:
            dist.close()
            return result
        test_records: dict[str, list] = {"rl": []}
        tests = inputs.test_tasks[:cfg.test_tasks]
        comparison = compare({"sft": Path(adapted), "rl": Path(out)}, tests, inputs.runtime, env_cfg, rollout_cfg,
                             dist, test_records)
        if dist.is_main:
            learn = learnability(inputs.runtime, test_records["rl"], tests, inputs.train_tasks, env_cfg, rollout_cfg,
                                 data)
            metrics = train_summary(cfg, result, comparison, learn, dist.world_size, time.perf_counter() - t0)
            write_json(metrics_path, metrics)
            write_curve(curve_path, result["history"], curve_keys(cfg) + OPTIONAL_CURVE_KEYS)
            report(metrics, comparison, learn, metrics_path, run)
    dist.close()
    return result


def train_runs(cfg: TrainConfig, env_cfg: EnvConfig, rollout_cfg, inputs: Inputs, *, adapted: str, out: str,
               ckpt: str, dist, run, hooks) -> dict:
    """The stage: one run, unless an extension trains it otherwise (:func:`pipeline.train.extensions.train_stage`;
    a population trains its members one after the other, each in its own checkpoint folder); the loop's result."""
    from pipeline.train.loop import train

    rl_rollout_cfg = (rollout_cfg if cfg.rollout_temperature is None
                      else rollout_cfg.model_copy(update={"temperature": cfg.rollout_temperature}))
    runtime, val_tasks = inputs.runtime, inputs.val_tasks
    ckpt_dir_of = lambda c: Path(ckpt) / run_key(adapted, env_cfg, rollout_cfg, c, dist.world_size,  # noqa: E731
                                                 inputs.incoming.digest)

    def train_one(c: TrainConfig, out_dir: Path, ckpt_dir: Path, run) -> dict:
        return train(c, env_cfg, rl_rollout_cfg, policy_dir=Path(adapted),
                     train_tasks=inputs.train_tasks + inputs.incoming.tasks, val_tasks=val_tasks, runtime=runtime,
                     out_dir=out_dir, ckpt_dir=ckpt_dir, dist=dist, run=run, demo_examples=inputs.demos, hooks=hooks)

    return train_stage(cfg, Stage(train_one, ckpt_dir_of, Path(out), run, dist, runtime, val_tasks, env_cfg,
                                  rollout_cfg))


def train_summary(cfg: TrainConfig, result: dict, comparison: dict, learn: dict, world_size: int,
                  seconds: float) -> dict:
    """What ``metrics/train.json`` holds (see the module docstring)."""
    metrics = {
        "algorithm": cfg.algorithm, "world_size": world_size, "updates": cfg.updates,
        "best_update": result["best"]["update"], "best_val_success": result["best"]["success"],
        "test": comparison, "delta_rl_minus_sft": deltas(comparison["sft"], comparison["rl"]),
        "seen_wording_headroom": seen_wording_headroom(comparison["sft"]),
        "seconds": round(seconds, 1),
        "mean_rollout_share": _share(result["history"]),
        "evals": result["evals"],
        "early_stopping": result["early_stopping"],
        "incoming": result["incoming"],
        "health": run_health(result["history"]),  # tool faults, stale batches dropped, collapse alarms
        "learnability": learn,  # why the RL policy's test episodes fail (docs/environments.md)
    }
    metrics.update(result.get("extension_summary", {}))  # e.g. a population's members and their diversity
    return metrics


def write_curve(curve_path: str, history: list[dict], optional: tuple[str, ...] = OPTIONAL_CURVE_KEYS) -> None:
    """``metrics/train_curve.csv``: the fixed columns, the `optional` ones (the extensions' and the context
    actions') some update reported, the health ones some update has nonzero."""
    with atomic_open(curve_path, newline="") as fh:
        w = csv.writer(fh)
        keys = CURVE_KEYS + tuple(k for k in optional if any(k in h for h in history))
        keys += tuple(k for k in HEALTH_CURVE_KEYS if any(h.get(k) for h in history))
        w.writerow([k.replace("/", "_") for k in keys])
        for h in history:
            w.writerow([h.get(k, "") for k in keys])


def report(metrics: dict, comparison: dict, learn: dict, metrics_path: str, run) -> None:
    """Rank 0: the headline figures, tags and files to the tracker run, and the summary lines to stdout."""
    flat = {f"test/{name}_success": c["overall"]["success_rate"] for name, c in comparison.items()}
    flat.update({f"test/delta_{k}": v for k, v in metrics["delta_rl_minus_sft"].items() if v is not None})
    es = metrics["early_stopping"]
    flat.update({"early_stopping/stopped": es["stopped"], "early_stopping/stop_update": es["stop_update"] or 0,
                 "early_stopping/best_update": es["best_update"] or 0})
    run.log_metrics({**flat, **flat_metrics(learn)})
    run.log_dict(learn, "learnability.json")
    run.set_tags({"early_stopping.stopped": es["stopped"], "early_stopping.reason": es["reason"],
                  "early_stopping.best_update": es["best_update"]})
    run.log_artifact(metrics_path)
    d = metrics["delta_rl_minus_sft"]
    print(f"train: test success SFT {comparison['sft']['overall']['success_rate']:.3f} -> RL "
          f"{comparison['rl']['overall']['success_rate']:.3f} ({d['overall_success']:+.3f}); per level "
          + ", ".join(f"L{lv} {d[f'level_{lv}_success']:+.3f}" for lv in comparison["sft"]["per_level"]))
    head = metrics["seen_wording_headroom"]
    if head is not None:
        print("train: seen-wording headroom (the most RL adds without the held-out wording) overall "
              f"+{head['overall']:.3f}; per level "
              + ", ".join(f"L{lv} +{head[f'level_{lv}']:.3f}" for lv in comparison["sft"]["per_level"]))
    print(render(learn, "train: learnability of the RL policy on the test split (greedy)"), flush=True)


def run_key(adapted: str, env_cfg, rollout_cfg, cfg, world_size: int, incoming_digest: str | None = None) -> str:
    """Checkpoints live in a folder named after everything the run depends on: a killed run resumes from its own
    checkpoints, and a run with other params, another adapted model, other incoming tasks (`incoming_digest`,
    :attr:`pipeline.train.incoming.IncomingTasks.digest`), another DeepSpeed config file or other code
    (:func:`source_digest`) starts fresh instead of resuming a stranger. Without the code in the key, a `dvc repro`
    after a change to the training code would resume the finished run of the old code and train nothing."""
    import hashlib

    meta = Path(adapted) / "policy.json"
    ds = Path(cfg.deepspeed_config)
    parts = [env_cfg.model_dump_json(), rollout_cfg.model_dump_json(), cfg.model_dump_json(), str(world_size),
             meta.read_text() if meta.is_file() else "", ds.read_text() if ds.is_file() else "", source_digest()]
    if incoming_digest is not None:  # None when no incoming task is used (a README, an all-dropped file)
        parts.append(incoming_digest)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


# The train stage's code, as `dvc.yaml` lists it in the stage's deps (a test keeps the two lists equal).
TRAIN_SOURCES = ("pipeline/train", "pipeline/policy", "pipeline/envs", "pipeline/core",
                 "pipeline/reward_model")  # train.learned_reward scores episodes with it


def source_digest() -> str:
    """SHA-256 over the Python sources of the train stage (:data:`TRAIN_SOURCES`: relative path and content, in path
    order). Only the stage's own code counts, as for DVC: an edit to serving or drift code does not make a killed
    training run start over."""
    import hashlib

    repo = Path(__file__).resolve().parents[2]
    files: list[Path] = []
    for src in TRAIN_SOURCES:
        p = repo / src
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.relative_to(repo).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _share(history: list[dict]) -> float | None:
    r = sum(h.get("sys/rollout_s", 0) for h in history)
    t = sum(h.get("sys/update_s", 0) for h in history)
    return round(r / t, 3) if t else None


def _kill_at(target: int, update: int) -> None:
    if update == target:
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipeline.train.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--local_rank", type=int, default=None, help="set by the DeepSpeed launcher; read from the env")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many updates (resume tests)")
    ap.add_argument("--adapted", default="models/adapted", help="the policy to start from")
    ap.add_argument("--out", default="models/policy", help="where the best policy goes")
    ap.add_argument("--ckpt", default="checkpoints/train", help="checkpoint folder (resumed from when present)")
    ap.add_argument("--metrics", default="metrics/train.json")
    ap.add_argument("--curve", default="metrics/train_curve.csv")
    ap.add_argument("--kill-at-update", type=int, default=None,
                    help="fault injection for tests: SIGKILL every rank in this update, after its rollouts")
    args = ap.parse_args(argv)
    kill = None if args.kill_at_update is None else functools.partial(_kill_at, args.kill_at_update)
    try:
        run_worker(args.params, adapted=args.adapted, out=args.out, ckpt=args.ckpt, metrics_path=args.metrics,
                   curve_path=args.curve, stop_after=args.stop_after, before_learn=kill)
    except AgentRLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # A launched rank leaves without the interpreter's teardown: after `dist.close()` every rank has passed the final
    # barrier and written what it writes, and the C++ teardown of the process group and of DeepSpeed's shared-memory
    # communication threads still aborted a rank now and then ("terminate called without an active exception",
    # exit -6, seen in clean-clone CI runs of the two-node resume test) after its work was done.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
