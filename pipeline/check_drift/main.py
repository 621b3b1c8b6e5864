"""Phase `check_drift`: is the current data still the data the policy was trained for, and does serving see what
training saw? Writes ``metrics/drift.json`` with a pass/fail verdict per check and overall.

Inputs (the `check_drift` section of params.yaml, :class:`pipeline.check_drift.config.DriftConfig`):

- reference tasks: the training tasks (``data/tasks/train.jsonl``), entity values from the world ``data/env``;
- current tasks: ``data/incoming/*.jsonl`` when that folder holds any, else the validation split (a stand-in until
  production data arrives: it shares the level mix and templates, and names held-out entities);
- reference episodes: the policy's greedy rollouts on a sample of the reference tasks when a policy exists; before
  the first policy, the demonstrations ``data/demos/train.jsonl`` (the behaviour SFT imitates);
- current episodes: a configured file (e.g. logged by the deployed policy), else the policy's rollouts on a sample of
  the current tasks; with neither, the behaviour check is skipped.

Checks, each ``pass``, ``fail`` or ``skipped`` (with the reason) in the verdict:

- ``consistency``: the prompt contract on probe observations: the training rendering against the serving code's
  rendering ``serving_preprocess`` (prompts always, token ids when a policy exists). With the default
  ``serving_preprocess`` (the training function itself) it only shows that the probes render; it earns its keep when
  a serving stack brings its own preprocess. Hidden states are not compared here any more: both sides were this
  fp32 policy, equal by construction. The model that is actually served (the registered int8 pyfunc behind `agentrl
  serve`) is checked against the training path by the deploy phase (:mod:`pipeline.deploy.served_check`);
- ``task_drift``: per-feature tests on task features (pipeline.check_drift.checks);
- ``calibration``: the task check's alarms on repeated fresh samples of the reference generator against the
  reference tasks, tested against its level (binomial); it fails when the task check fires more often on drift-free
  data than its level allows (the task verdict would not be trustworthy);
- ``trajectory_drift``: per-feature tests on episode features (behaviour drift); the outcome features (success,
  return, correctness) are reported under ``outcomes`` but gate only with ``trajectory_outcomes: test``
  (pipeline.check_drift.checks says why);
- ``state_drift``: the MMD test on the policy's hidden states of reference and current observations;
- ``trajectory_suite``: the Great Expectations suite "trajectories" on the rollouts this phase produced.

The statistical checks (task, per-environment, calibration, behaviour and hidden-state drift) are judged together
by Holm's rule at the family level ``alpha`` (:mod:`pipeline.check_drift.verdict`), so the verdict's false-alarm
rate on drift-free data is at most ``alpha``; consistency and the trajectory suite are exact checks. The overall
verdict passes when no check failed. Bad input (a missing or empty file, a task file that breaks the
"tasks" suite, episodes that break the "trajectories" suite) is refused with an :class:`AgentRLError`; the verdict
file is then overwritten with ``"verdict": "error"`` and ``"passed": false`` first, so a stale pass never survives.

Deliberately left out: acting on the verdict (the promotion gate and the retraining flow read the file), and
collecting production trajectories (they arrive as a file).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.core.config import load_section
from pipeline.check_drift.config import DriftConfig
from pipeline.envs.config import EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.core.errors import AgentRLError

INCOMING_DIR = Path("data/incoming")
VALIDATION_TASKS = Path("data/tasks/validation.jsonl")
DEMOS = Path("data/demos/train.jsonl")


# ---------------------------------------------------------------------------------------------------------- inputs
def load_tasks(path: str | Path, world) -> tuple[list[dict], list[str]]:
    """Task records from a JSONL file or from every *.jsonl in a folder, each file checked as every task file is
    (:func:`pipeline.envs.taskfile.load_task_file`); returns (records, files read). Missing, empty or schema-breaking
    files raise AgentRLError naming the file."""
    from pipeline.envs.taskfile import load_task_file

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise AgentRLError(f"{path}: the folder holds no *.jsonl task files")
    elif path.is_file():
        files = [path]
    else:
        raise AgentRLError(f"{path}: task data not found")
    records = []
    for f in files:
        records += [t.to_dict() for t in load_task_file(f, world)]  # AgentRLError on an empty or bad file
    return records, [str(f) for f in files]


def current_source(cfg: DriftConfig) -> Path:
    """The current task data `cfg.current` names ('auto': data/incoming/ if it holds *.jsonl, else validation)."""
    if cfg.current != "auto":
        return Path(cfg.current)
    if INCOMING_DIR.is_dir() and any(INCOMING_DIR.glob("*.jsonl")):
        return INCOMING_DIR
    return VALIDATION_TASKS


def load_episodes(path: str | Path, what: str, env_cfg: EnvConfig, world, suite: str | None = "trajectories",
                  chunk_size: int | None = None):
    """Episode records from a JSONL file, checked with the environment's `suite` check (None: not checked, e.g.
    demonstrations), streamed in chunks so that memory does not grow with the file
    (:mod:`pipeline.check_drift.episodes`); returns an :class:`~pipeline.check_drift.episodes.EpisodeFile`, which
    the checks take where they take a list of records."""
    from pipeline.check_drift.episodes import CHUNK, load_episode_file

    return load_episode_file(path, what, env_cfg, world, suite, chunk_size or CHUNK)


def _world(env_cfg: EnvConfig, path: str | Path):
    from pipeline.envs.registry import open_environment

    return open_environment(env_cfg.name, path)


@dataclass
class Policy:
    model: object
    tokenizer: object
    path: str


def load_policy_if_any(cfg: DriftConfig) -> Policy | None:
    if not Path(cfg.policy).exists():
        return None
    from pipeline.policy.model import load_policy

    model, tokenizer, _ = load_policy(cfg.policy)
    return Policy(model, tokenizer, cfg.policy)


# ---------------------------------------------------------------------------------------------------------- checks
def _skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def _sample(records: list, k: int, rng: np.random.Generator) -> list:
    if len(records) <= k:
        return list(records)
    return [records[i] for i in np.sort(rng.choice(len(records), size=k, replace=False))]


def rollouts(policy: Policy, tasks: list[dict], world, env_cfg: EnvConfig, rollout_cfg, seed: int) -> list[dict]:
    """Greedy episodes of the policy on `tasks` in `world`, with token ids, log-probabilities and masks."""
    from pipeline.policy.rollout import RolloutEngine

    engine = RolloutEngine(policy.model, policy.tokenizer, world, env_cfg, rollout_cfg)
    return engine.run([world.task_from_dict(t) for t in tasks], [seed + i for i in range(len(tasks))], greedy=True)


@dataclass
class Episodes:
    """The episodes the behaviour and hidden-state checks compare, where they came from, and those this phase made."""

    reference: list[dict] | None
    reference_source: str
    current: list[dict] | None
    current_source: str
    made: dict[str, list[dict]] = field(default_factory=dict)


def _roll_out_missing(cfg: DriftConfig, env_cfg: EnvConfig, policy: Policy | None, rollout_cfg, ref_tasks, cur_tasks,
                      ref_world, cur_world, eps: Episodes) -> Episodes:
    """Roll the policy out where it must provide the episodes (no file given for that side)."""
    if policy is None:
        return eps
    rng = np.random.default_rng([cfg.seed, 10])
    source = f"policy rollouts ({policy.path})"
    if eps.reference is None:
        eps.reference = eps.made["reference"] = rollouts(policy, _sample(ref_tasks, cfg.max_rollout_episodes, rng),
                                                         ref_world, env_cfg, rollout_cfg, cfg.seed * 1_000_000)
        eps.reference_source = source
    if eps.current is None:
        eps.current = eps.made["current"] = rollouts(policy, _sample(cur_tasks, cfg.max_rollout_episodes, rng),
                                                     cur_world, env_cfg, rollout_cfg, cfg.seed * 1_000_000 + 500_000)
        eps.current_source = source
    return eps


def _consistency(cfg: DriftConfig, env_cfg: EnvConfig, ref_tasks, eps: Episodes, sigs, policy: Policy | None) -> dict:
    from pipeline.check_drift.consistency import check_consistency, probes_from_episodes, resolve_callable

    probes = probes_from_episodes(ref_tasks, eps.reference or [], env_cfg.history_window, cfg.consistency_probes,
                                  cfg.seed, signatures=sigs)
    serve = resolve_callable(cfg.serving_preprocess)
    report = check_consistency(probes, None, serve, None, policy.tokenizer if policy else None)
    out = {**report.to_dict(), "serving_preprocess": cfg.serving_preprocess,
           "served_model": "checked by the deploy phase (metrics/deploy.json served_consistency)"}
    if policy is None:
        out["skipped"].append(f"no policy at {cfg.policy}")
    return out


def _task_checks(cfg: DriftConfig, ref_tasks, cur_tasks, ref_world, cur_world) -> dict[str, object]:
    """The task check, and in a run over several environments each environment's task check on its own."""
    from pipeline.check_drift.checks import task_drift
    from pipeline.check_drift.verdict import PerEnvironment

    out: dict[str, object] = {"task_drift": task_drift(ref_tasks, cur_tasks, ref_world, cur_world, cfg)}
    envs = sorted({t.get("env", "") for t in ref_tasks} | {t.get("env", "") for t in cur_tasks})
    if len(envs) > 1:
        reports, skipped = {}, {}
        for env in envs:
            r, c = [t for t in ref_tasks if t.get("env") == env], [t for t in cur_tasks if t.get("env") == env]
            if r and c:
                reports[env] = task_drift(r, c, ref_world, cur_world, cfg)
            else:
                skipped[env] = f"no {'reference' if not r else 'current'} tasks of {env}"
        out["task_drift_per_env"] = PerEnvironment(reports, skipped)
    return out


def _calibration(cfg: DriftConfig, level_mix: dict, options, ref_tasks, cur_tasks, ref_world):
    """The task check's alarms at level alpha on fresh drift-free samples against the reference tasks (each a
    subsample of a draw as large as the reference split: see make_reference_sample's `drawn_as`)."""
    from pipeline.check_drift.checks import false_alarm_rate, make_reference_sample, task_drift

    n = min(cfg.false_alarm_sample_size, len(cur_tasks))
    base = 1_000_000 + 1000 * cfg.seed
    pairs = ((ref_tasks, make_reference_sample(ref_world, n, base + k, level_mix, options=options,
                                               drawn_as=len(ref_tasks)).tasks)
             for k in range(cfg.false_alarm_repeats))
    try:
        fa = false_alarm_rate(pairs, lambda a, b: task_drift(a, b, ref_world, ref_world, cfg), nominal=cfg.alpha)
    except ValueError as exc:  # the generator cannot draw a split of this size (e.g. too few distinct tasks)
        raise AgentRLError(f"the calibration cannot draw {len(ref_tasks)} fresh tasks as the reference split "
                           f"{cfg.reference_tasks} was drawn ({exc}); set check_drift.false_alarm_repeats: 0 to skip "
                           f"it") from None
    return fa, {"sample_size": n, "drawn_as": len(ref_tasks),
                "what": "task check at level alpha on the reference tasks against fresh samples of the reference "
                        "generator; p_value: binomial test of the alarms against alpha"}


def _state_check(cfg: DriftConfig, env_cfg: EnvConfig, policy: Policy, ref_tasks, cur_tasks, eps: Episodes, sigs):
    """The MMD test on hidden states: one observation per episode (a random step) when both sides have episodes,
    else each task's reset observation."""
    from pipeline.check_drift.checks import state_drift
    from pipeline.check_drift.features import observation_contexts

    both = bool(eps.reference and eps.current)
    rng = np.random.default_rng([cfg.seed, 11])
    ref_ctx = observation_contexts(ref_tasks, eps.reference if both else None, env_cfg.history_window, sigs, rng)
    cur_ctx = observation_contexts(cur_tasks, eps.current if both else None, env_cfg.history_window, sigs, rng)
    result = state_drift(policy.model, policy.tokenizer, ref_ctx, cur_ctx, cfg)
    return result, {"observations": "one random step per episode" if both else "reset contexts of the tasks"}


def _trajectory_suite(made: dict[str, list[dict]], ref_world, env_cfg: EnvConfig) -> dict:
    """The rollouts this phase made must satisfy the trajectories suite."""
    if not made:
        return _skipped("no rollouts made by this phase (episodes given as files are checked on load)")
    reports = [r for r in (ref_world.check_episodes(v, "trajectories", f"{k} rollouts", env_cfg, require_tokens=True)
                           for k, v in made.items()) if r is not None]
    if not reports:
        return _skipped(f"environment {ref_world.name!r} has no trajectory check")
    return {"status": "pass" if all(r.success for r in reports) else "fail",
            "message": "\n".join(r.describe() for r in reports)}


CHECK_ORDER = ("consistency", "task_drift", "task_drift_per_env", "calibration", "trajectory_drift", "state_drift",
               "trajectory_suite")


def _judge(statistical: dict[str, object], extras: dict[str, dict], other: dict[str, dict], alpha: float) -> dict:
    """Every check's entry of the verdict: the statistical ones judged together by the family rule
    (:mod:`pipeline.check_drift.verdict`), the skipped and exact ones as they are, in :data:`CHECK_ORDER`."""
    from pipeline.check_drift.verdict import combine

    tested = {k: v for k, v in statistical.items() if getattr(v, "status", "pass") != "skipped"}
    entries = dict(other)
    entries.update({k: _skipped("no feature could be tested") for k in statistical if k not in tested})
    for name, (judged, decision) in combine(tested, alpha).items():
        entries[name] = {**judged.to_dict(), **extras.get(name, {}), "status": "fail" if decision.rejected else "pass",
                         "family": decision.to_dict()}
    return {k: entries[k] for k in CHECK_ORDER if k in entries}


def run_checks(cfg: DriftConfig, env_cfg: EnvConfig, level_mix: dict, options, ref_tasks: list[dict],
               cur_tasks: list[dict],
               ref_world, cur_world, policy: Policy | None = None, rollout_cfg=None,
               ref_episodes: list[dict] | None = None, ref_episodes_source: str = "none",
               cur_episodes: list[dict] | None = None, cur_episodes_source: str = "none") -> dict:
    """Every check on loaded inputs; returns the verdict (without file I/O). Rollouts are made here when a policy
    is given and the corresponding episodes are not. The statistical checks are judged together at the family
    level ``cfg.alpha`` (:mod:`pipeline.check_drift.verdict`)."""
    from pipeline.check_drift.checks import trajectory_drift
    from pipeline.check_drift.features import tool_signatures, unknown_entities
    from pipeline.check_drift.verdict import overall

    sigs = tool_signatures(ref_world)
    seconds: dict[str, float] = {}
    statistical: dict[str, object] = {}
    extras: dict[str, dict] = {}
    other: dict[str, dict] = {}
    t0 = last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        seconds[name], last = now - last, now

    eps = _roll_out_missing(cfg, env_cfg, policy, rollout_cfg, ref_tasks, cur_tasks, ref_world, cur_world,
                            Episodes(ref_episodes, ref_episodes_source, cur_episodes, cur_episodes_source))
    lap("rollouts")
    other["consistency"] = _consistency(cfg, env_cfg, ref_tasks, eps, sigs, policy)
    lap("consistency")
    statistical.update(_task_checks(cfg, ref_tasks, cur_tasks, ref_world, cur_world))
    lap("task_drift")
    if cfg.false_alarm_repeats:
        statistical["calibration"], extras["calibration"] = _calibration(cfg, level_mix, options, ref_tasks,
                                                                         cur_tasks, ref_world)
    else:
        other["calibration"] = _skipped("false_alarm_repeats is 0")
    lap("calibration")
    if eps.reference and eps.current:
        statistical["trajectory_drift"] = trajectory_drift(eps.reference, eps.current, cfg)
        extras["trajectory_drift"] = {"reference": eps.reference_source, "current": eps.current_source}
    else:
        missing = "reference" if not eps.reference else "current"
        other["trajectory_drift"] = _skipped(f"no {missing} episodes (set check_drift.current_trajectories, or "
                                             f"train a policy at {cfg.policy})")
    lap("trajectory_drift")
    if policy is None:
        other["state_drift"] = _skipped(f"no policy at {cfg.policy}")
    else:
        statistical["state_drift"], extras["state_drift"] = _state_check(cfg, env_cfg, policy, ref_tasks, cur_tasks,
                                                                         eps, sigs)
    lap("state_drift")
    other["trajectory_suite"] = _trajectory_suite(eps.made, ref_world, env_cfg)
    checks = _judge(statistical, extras, other, cfg.alpha)
    passed, failed = overall(checks)
    unknown = unknown_entities(cur_tasks, cur_world)
    seconds["total"] = time.perf_counter() - t0
    return {
        "passed": passed, "verdict": "pass" if passed else "fail", "failed_checks": failed,
        "family_rule": {"alpha": cfg.alpha, "rule": "holm", "checks": sorted(statistical)},
        "checks": checks,
        "inputs": {"n_reference_tasks": len(ref_tasks), "n_current_tasks": len(cur_tasks),
                   "reference_episodes": eps.reference_source, "n_reference_episodes": len(eps.reference or []),
                   "current_episodes": eps.current_source, "n_current_episodes": len(eps.current or []),
                   "policy": policy.path if policy else None,
                   "unknown_current_entities": len(unknown), "unknown_current_entity_examples": unknown[:10]},
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }


def verdict_metrics(verdict: dict) -> dict[str, float]:
    """Flat, namespaced numbers of a verdict for MLflow."""
    c = verdict["checks"]
    out = {"drift/passed": float(verdict["passed"])}
    for name, check in c.items():
        out[f"drift/{name}/status"] = {"pass": 1.0, "fail": 0.0}.get(check["status"], -1.0)  # -1: skipped
        if "family" in check:  # the statistical checks: their p-value, Holm-adjusted p-value and level
            out[f"drift/{name}/p_value"] = check["family"]["p_value"]
            out[f"drift/{name}/p_holm"] = check["family"]["p_holm"]
            out[f"drift/{name}/level"] = check["family"]["level"]
    for name in ("task_drift", "trajectory_drift"):
        for feat, r in c[name].get("features", {}).items():
            if r["test"] != "skipped":
                out[f"drift/{name}/{feat}/p_adjusted"] = r["p_adjusted"]
                out[f"drift/{name}/{feat}/effect"] = r["effect"]
    if "rate" in c["calibration"]:
        out["drift/calibration/false_alarm_rate"] = c["calibration"]["rate"]
    if "statistic" in c["state_drift"]:
        out["drift/state_drift/mmd2"] = c["state_drift"]["statistic"]
    out.update({f"sys/check_drift_{k}_seconds": v for k, v in verdict["seconds"].items()})
    return out


def _write(path: Path, obj: dict) -> None:
    from pipeline.core.atomic import write_json

    write_json(path, obj, default=str)


def check(cfg: DriftConfig, env_cfg: EnvConfig, build_cfg: BuildEnvConfig, metrics_path: Path, run=None,
          rollout_cfg=None) -> dict:
    """Load the inputs `cfg` names, run every check, write the verdict to `metrics_path`; bad input writes an error
    verdict and raises AgentRLError."""
    try:
        ref_world = _world(env_cfg, cfg.world_dir)
        cur_world = _world(env_cfg, cfg.current_world_dir) if cfg.current_world_dir else ref_world
        try:
            options = type(ref_world).Options.model_validate(build_cfg.options)
        except ValueError as exc:
            raise AgentRLError(f"build_env.options for environment {ref_world.name!r}: {exc}") from None
        ref_tasks, _ = load_tasks(cfg.reference_tasks, ref_world)
        cur_path = current_source(cfg)
        cur_tasks, cur_files = load_tasks(cur_path, ref_world)
        if len(cur_tasks) < cfg.min_samples:
            raise AgentRLError(f"{cur_path}: {len(cur_tasks)} current tasks, fewer than check_drift.min_samples="
                               f"{cfg.min_samples}: too few to test for drift")
        policy = load_policy_if_any(cfg)
        ref_eps, ref_src = None, "none"
        if cfg.reference_trajectories != "auto":
            ref_src = cfg.reference_trajectories
            ref_eps = load_episodes(ref_src, "reference episodes", env_cfg, ref_world)
        elif policy is None and DEMOS.is_file():
            ref_eps, ref_src = load_episodes(DEMOS, "demonstrations", env_cfg, ref_world, suite=None), str(DEMOS)
        cur_eps, cur_src = None, "none"
        if cfg.current_trajectories:
            cur_src = cfg.current_trajectories
            cur_eps = load_episodes(cur_src, "current episodes", env_cfg, ref_world)
        if policy is not None and rollout_cfg is None:
            from pipeline.policy.config import RolloutConfig

            rollout_cfg = RolloutConfig()
        verdict = run_checks(cfg, env_cfg, dict(build_cfg.level_mix), options, ref_tasks, cur_tasks,
                             ref_world, cur_world,
                             policy, rollout_cfg, ref_eps, ref_src, cur_eps, cur_src)
    except AgentRLError as exc:
        _write(metrics_path, {"passed": False, "verdict": "error", "error": str(exc)})
        raise AgentRLError(f"check_drift: {exc}") from None
    verdict["inputs"].update({"reference_tasks": cfg.reference_tasks, "current": cur_files})
    _write(metrics_path, verdict)
    if run is not None:
        run.log_metrics(verdict_metrics(verdict))
        run.log_artifact(str(metrics_path))
    return verdict


def main(params_path: str = "params.yaml", metrics_path: str = "metrics/drift.json") -> dict:
    """Entry point of `agentrl check-drift` and of the DVC stage `check_drift`."""
    from pipeline.core.tracking import Tracker

    env_cfg = load_section(EnvConfig, "env", params_path)
    build_cfg = load_section(BuildEnvConfig, "build_env", params_path)
    cfg = load_section(DriftConfig, "check_drift", params_path)
    rollout_cfg = None
    if Path(cfg.policy).exists():
        from pipeline.policy.config import RolloutConfig

        rollout_cfg = load_section(RolloutConfig, "rollout", params_path)
    with Tracker().run("check_drift", params={"check_drift": cfg.model_dump(), "env": env_cfg.model_dump()}) as run:
        verdict = check(cfg, env_cfg, build_cfg, Path(metrics_path), run, rollout_cfg)
    c = verdict["checks"]
    summary = ", ".join(f"{k} {v['status']}" for k, v in c.items())
    fa = c["calibration"].get("rate")
    family = verdict["family_rule"]
    print(f"check_drift: {verdict['verdict'].upper()} ({summary}; Holm over {len(family['checks'])} statistical "
          f"checks at alpha {family['alpha']})"
          + (f"; false-alarm rate {fa:.2f} over {c['calibration']['repeats']} fresh samples" if fa is not None else "")
          + f"; {verdict['seconds']['total']:.1f}s -> {metrics_path}")
    if cfg.fail_on_drift and not verdict["passed"]:
        raise AgentRLError(f"check_drift: checks failed: {', '.join(verdict['failed_checks'])} (see {metrics_path})")
    return verdict
