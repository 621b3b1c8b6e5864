"""Phase 1, `build_env`: generate the world, the task splits and the demonstrations; validate; publish atomically.

Outputs (JSON Lines schemas in the README):

- ``data/env/``: the environment's world files (the default world: ``world.sqlite``, ``corpus.jsonl``, ``entities.json``);
- ``data/tasks/{train,validation,test}.jsonl``;
- ``data/demos/train.jsonl``: imperfect expert demonstrations of training tasks;
- ``data/recipe.json``: the limits `env.max_action_chars`, `env.max_steps`, `env.max_policy_chars` derived from the
  demonstrations where params.yaml says ``auto`` (:mod:`pipeline.core.recipe`), with their evidence (also under
  ``recipe`` in the metrics);
- ``metrics/build_env.json``: counts, level mix, checksums, validation summary, expert and random baselines per split,
  and the reward-hacking probes' scores (``reward_hacking_probes``).

The environment is checked before it is trusted (:mod:`pipeline.envs.checks`: its class, tools, tasks, and its
expert replayed to the top return), right after its world is loaded from the staging folder: a broken environment
stops the phase before demonstrations are made or anything is published. So does a reward that a degenerate policy
can hack (:mod:`pipeline.envs.probes`, `build_env.probes`): the probes play right after the checks, with the run's
reward, and one that earns more than `floor` × the expert's mean return stops the phase with one error line naming it.

Everything is written into a staging folder first and checked with Great Expectations (every dataset, plus the
cross-split rules). Only when every check passes are the old outputs replaced, one rename per folder; data that fails
validation stops the phase with the failing expectations and rows, and the previous good outputs stay as they were.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import shutil
import sqlite3
import time
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.build_env.config import BuildEnvConfig, option_owners
from pipeline.core.atomic import disk_errors, write_json
from pipeline.core.config import load_section
from pipeline.core.errors import AgentRLError
from pipeline.core import recipe as recipes
from pipeline.envs.config import SPLITS, EnvConfig
from pipeline.envs.contract import BuildRequest, Environment
from pipeline.envs.checks import check_environment, sample
from pipeline.envs.probes import run_probes
from pipeline.envs.registry import EnvironmentError_, environment_class
from pipeline.envs.runner import AgentEnv
from pipeline.envs.taskfile import as_read_back, write_tasks
from pipeline.policy.episodes import evaluate, run_episode

OUTPUT_DIRS = ("env", "tasks", "demos")


def draw_flaw(cfg, flaws: tuple[str, ...], rng: np.random.Generator) -> str:
    """One flaw per demonstration, by the configured probabilities (checked in order, at most one); a flaw the
    environment's expert cannot inject counts as none (the draw is made all the same, so the sequence of draws does not
    depend on which flaws an environment supports)."""
    u = rng.random()
    for flaw, p in (("wrong_value", cfg.wrong_value_prob), ("wrong_order", cfg.wrong_order_prob),
                    ("redundant_call", cfg.redundant_call_prob)):
        if u < p:
            return flaw if flaw in flaws else "none"
        u -= p
    return "none"


def demo_record(demo_id: str, task, flaw: str, steps: list[dict], success: bool, ret: float) -> dict:
    return {"demo_id": demo_id, "task_id": task.task_id, "level": task.level, "family": task.family, "flaw": flaw,
            "steps": steps, "success": bool(success), "return": round(float(ret), 6), "n_calls": len(steps)}


def build_demos(train: list, world: Environment, cfg: BuildEnvConfig, env_cfg: EnvConfig) -> list[dict]:
    """Demonstrations of the training tasks chosen by `family_coverage` (where it names the task's family) or else
    `level_coverage`, then of more tasks of any family left below ``min_per_family`` (a family that
    `family_coverage` names gets its share and no more), one flaw drawn per demonstration; none when the environment
    has no expert.

    The top-up draws from its own generator, after the coverage pass, and the demonstrations are then put in the
    order of their tasks (and numbered in it): data whose families all reach the floor are byte for byte what
    coverage alone gives, and the first demonstrations of topped-up data are still a sample of every family, not the
    scarce families' extra ones (a replay of them as traffic would look like drift)."""
    if world.expert() is None:
        return []
    rng = np.random.default_rng([cfg.seed, 3])
    env = AgentEnv(world=world, tasks=train,
                   config=env_cfg.model_copy(update={"tool_latency_s": 0.0, "tool_latency_spike_rate": 0.0}))
    demos: list[tuple[int, dict]] = []  # (the task's index in `train`, its demonstration)

    def demonstrate(i: int, rng: np.random.Generator) -> None:
        task = train[i]
        flaw = draw_flaw(cfg.demos, type(world).flaws, rng)
        rec = run_episode(env, world.expert(flaw, rng), task, seed=int(rng.integers(2**31)))
        demos.append((i, demo_record("", task, flaw, rec["steps"], rec["success"], rec["return"])))

    try:
        for i, task in enumerate(train):
            share = cfg.demos.family_coverage.get(task.family, cfg.demos.level_coverage.get(task.level, 0.0))
            if rng.random() < share:
                demonstrate(i, rng)
        top_up = np.random.default_rng([cfg.seed, 5])
        chosen = {i for i, _ in demos}
        have = Counter(d["family"] for _, d in demos)
        for family in sorted({t.family for t in train} - set(cfg.demos.family_coverage)):
            left = [i for i, t in enumerate(train) if t.family == family and i not in chosen]
            missing = min(cfg.demos.min_per_family - have[family], len(left))
            if missing > 0:
                for j in sorted(top_up.choice(len(left), size=missing, replace=False)):
                    demonstrate(left[j], top_up)
    finally:
        env.close()
    ordered = [d for _, d in sorted(demos, key=lambda x: x[0])]
    return [{**d, "demo_id": f"demo-{k:06d}"} for k, d in enumerate(ordered)]


def probe_rewards(world: Environment, train: list, cfg: BuildEnvConfig, env_cfg: EnvConfig) -> dict:
    """The reward-hacking probes (:mod:`pipeline.envs.probes`) on a sample of the training tasks: their metrics
    (``reward_hacking_probes`` of metrics/build_env.json; the time they took goes under ``seconds.probes``), or an
    AgentRLError naming the first probe that earns more than the rule allows (the caller publishes nothing then)."""
    pc = cfg.probes
    if not pc.enabled:
        return {"enabled": False}
    chosen = sample(train, pc.tasks)
    out = run_probes(world, train, env_cfg, chosen, pc.floor, seed=cfg.seed)
    if not out:
        return {"enabled": True, "skipped": f"environment {world.name!r} has no expert to compare with"}
    expert, results = out["expert"], out["probes"]
    for r in results.values():
        if not r.passed:
            ratio = f"{r.ratio:.2f} of it" if r.ratio is not None else "the expert's is not positive"
            raise AgentRLError(
                f"build_env: reward hacking: probe {r.name!r} earns mean return {r.mean_return:.3f} (success "
                f"{r.success_rate:.2f}) on {r.n} training tasks against the expert's {r.expert_return:.3f} "
                f"({ratio}; build_env.probes.floor {pc.floor:g}): the reward of env.reward pays a degenerate policy; "
                f"change its weights or shaping; nothing was published")
    wp = out["write_probe"]
    if wp["undeclared"]:
        print(f"build_env: warning: tools {wp['undeclared']} change an episode's state but their ToolSpec does not "
              f"say writes=True; the write probe called them; declare them as write tools", flush=True)
    if not wp["ran"]:
        print(f"build_env: warning: reward-hacking probe 'attempt_writes' did not run: environment {world.name!r} "
              f"declares no write tool and none was found changing an episode's state", flush=True)
    return {"enabled": True, "tasks": len(chosen), "floor": pc.floor, "expert": expert,
            "probes": {name: r.as_dict() for name, r in results.items()}, "write_probe": wp}


def validate_outputs(stage: Path, world: Environment) -> list:
    """Every check of the environment on what was written to `stage` (read back from disk), one report per dataset."""
    from pipeline.core.jsonl import read_jsonl

    read = lambda p: read_jsonl(p, allow_empty=True)  # noqa: E731  (an empty file is the suite's failure to report)
    records = {s: read(stage / "tasks" / f"{s}.jsonl") for s in SPLITS}
    demos_path = stage / "demos" / "train.jsonl"
    return world.validate(stage / "env", records, read(demos_path) if world.expert() is not None else None)


def _first_error(exc: Exception, model, given: dict | None = None) -> str:
    """The first problem of an options model's validation error; an unknown key gets a 'did you mean' hint, and the
    keys of `given` that belong to another built-in environment are named with it (params written for that one)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        e = errors()[0]
        where = '.'.join(str(p) for p in e['loc']) or 'options'
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            valid = list(model.model_fields)
            close = difflib.get_close_matches(str(e["loc"][0]), valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            owners = option_owners([k for k in (given or {}) if k not in valid])
            other = "".join(f"; {', '.join(ks)}: options of environment {name!r}" for name, ks in owners.items())
            return f"{where}: unknown key{hint}; valid keys: {', '.join(valid) or '(none)'}{other}"
        return f"{where}: {e['msg']}"
    return str(exc)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def publish(stage: Path, data_dir: Path) -> None:
    """Replace each output folder by its staged version: old folder aside, new one in, old one removed."""
    for name in OUTPUT_DIRS:
        target, new, old = data_dir / name, stage / name, data_dir / f".{name}.old"
        if old.exists():
            shutil.rmtree(old)
        if target.exists():
            target.rename(old)
        new.rename(target)
        if old.exists():
            shutil.rmtree(old)


def resolve_request(cfg: BuildEnvConfig, env_cfg: EnvConfig) -> tuple[type[Environment], BuildRequest]:
    """The environment class and what to ask it to build: `build_env.options` checked by its Options model
    (AgentRLError naming the key, and the environment an unknown key belongs to, otherwise) and `level_mix` restricted
    to its levels (:func:`levels_for`)."""
    cls = environment_class(env_cfg.name)
    try:
        options = cls.Options.model_validate(cfg.options)
    except ValueError as exc:
        raise AgentRLError(f"build_env.options for environment {cls.name!r}: "
                           f"{_first_error(exc, cls.Options, cfg.options)}") from None
    levels_for(cfg.demos.level_coverage, cls, "demos.level_coverage")  # only the note: other levels go unused
    uncovered = [lv for lv in cls.levels if lv not in cfg.demos.level_coverage]
    if uncovered and cfg.demos.level_coverage:
        print(f"build_env: note: levels {uncovered} of environment {cls.name!r} have no build_env.demos."
              f"level_coverage: their tasks get no demonstrations unless family_coverage names their family",
              flush=True)
    return cls, BuildRequest(cfg.seed, dict(cfg.tasks_per_split), levels_for(cfg.level_mix, cls, "level_mix"), options)


def levels_for(mix: dict[int, float], cls: type[Environment], key: str) -> dict[int, float]:
    """`mix` ({level: weight}, `build_env.<key>`) without the levels environment `cls` does not have, with one printed
    note naming them (params written for another environment's levels are not an error, and not silent); every level
    of the environment evenly when none is left."""
    have = set(cls.levels)
    dropped = sorted(set(mix) - have)
    kept = {lv: w for lv, w in mix.items() if lv in have}
    if dropped:
        fallback = "" if any(kept.values()) else "; none left, so every level of it evenly"
        print(f"build_env: note: build_env.{key} names levels {dropped} that environment {cls.name!r} does not have "
              f"(its levels: {list(cls.levels)}); they are left out{fallback}", flush=True)
    if key == "level_mix" and not any(kept.values()):
        kept = {lv: 1.0 for lv in cls.levels}
    return kept


def build(cfg: BuildEnvConfig, env_cfg: EnvConfig, data_dir: Path, metrics_path: Path, run=None,
          validator=validate_outputs) -> dict:
    """Generate, validate (with `validator(stage, world) -> reports`) and publish; returns the metrics written to
    `metrics_path`. Everything is generated in a staging folder and published by renames, so a failure (a full disk
    included: :class:`~pipeline.core.atomic.DiskFullError` naming `data_dir`) leaves the previous outputs as they
    were."""
    with disk_errors(data_dir):
        return _build(cfg, env_cfg, data_dir, metrics_path, run, validator)


def _build(cfg: BuildEnvConfig, env_cfg: EnvConfig, data_dir: Path, metrics_path: Path, run, validator) -> dict:
    t0 = time.perf_counter()
    cls, request = resolve_request(cfg, env_cfg)
    stage = _fresh_stage(data_dir)
    world = None
    try:
        try:
            result = cls.build(stage / "env", request)
        except ValueError as exc:
            raise AgentRLError(f"build_env: environment {cls.name!r}: {exc}") from None
        tasks = result.tasks
        world = cls.load(stage / "env")
        demos, env_cfg, recipe, over = _checked_demos(cls, world, tasks, cfg, env_cfg)
        t_probe = time.perf_counter()
        probes = probe_rewards(world, tasks["train"], cfg, env_cfg)  # a winning probe stops the phase here
        t_probe = time.perf_counter() - t_probe
        t_gen = time.perf_counter() - t0 - t_probe
        _write_stage(stage, tasks, demos)
        t1 = time.perf_counter()
        reports = validator(stage, world)
        t_val = time.perf_counter() - t1
        failed = [r for r in reports if not r.success]
        if failed:
            raise AgentRLError("build_env: generated data failed validation; the previous outputs are left untouched.\n"
                               + "\n".join(r.describe() for r in failed))
        baselines = _baselines(world, tasks, cfg, env_cfg)
        files = {str(Path("data") / p.relative_to(stage)): p for p in
                 [*sorted(Path(f) for f in result.files), *sorted((stage / "tasks").glob("*.jsonl")),
                  stage / "demos" / "train.jsonl"]}
        metrics = _metrics(cls.name, recipe, over, result.counts, tasks, demos, baselines, reports, probes, files)
        metrics["seconds"] = {"generate": round(t_gen, 3), "validate": round(t_val, 3), "probes": round(t_probe, 3),
                              "total": round(time.perf_counter() - t0, 3)}
        world.close()
        world = None
        publish(stage, data_dir)
        write_json(data_dir / recipes.RECIPE_FILE.name, recipe)  # what every later phase's `auto` keys resolve to
    finally:
        if world is not None:
            world.close()
        if stage.exists():
            shutil.rmtree(stage)
    write_json(metrics_path, metrics)
    if run is not None:
        _log_run(run, metrics, probes, recipe, metrics_path)
    return metrics


def _fresh_stage(data_dir: Path) -> Path:
    """The empty staging folder (with its `env/`) the phase generates into; one a failed run left is removed."""
    data_dir.mkdir(parents=True, exist_ok=True)
    stage = data_dir / ".staging-build_env"
    if stage.exists():
        shutil.rmtree(stage)
    (stage / "env").mkdir(parents=True)
    return stage


def _checked_demos(cls: type[Environment], world: Environment, tasks: dict, cfg: BuildEnvConfig,
                   env_cfg: EnvConfig) -> tuple[list[dict], EnvConfig, dict, int]:
    """Check the environment, make the demonstrations and derive the `auto` limits from them; returns the
    demonstrations, the env config with its limits derived, the recipe, and the number of tasks over the step budget.
    A broken environment or a family_coverage naming a family the environment does not build stops the phase."""
    min_calls = [t.min_calls for ts in tasks.values() for t in ts]
    first_cfg = recipes.provisional(env_cfg, min_calls)  # `auto` characters at their bounds until derived
    try:  # the class, tools, tasks and expert (pipeline.envs.checks); nothing is written or published otherwise
        check_environment(world, tasks, first_cfg)
    except EnvironmentError_ as exc:
        raise EnvironmentError_(f"build_env: {exc}; nothing was published") from None
    demos = build_demos(as_read_back(tasks["train"], world), world, cfg, first_cfg)  # the file's key order; the same
    # demonstrations under the limits derived from them
    env_cfg, recipe = recipes.data_recipe(env_cfg, demos, min_calls)
    over = sum(t.min_calls > env_cfg.max_steps for ts in tasks.values() for t in ts)
    if over:  # the expert check runs with the budget raised; the run's own budget would truncate these
        print(f"build_env: warning: {over} tasks need more calls than env.max_steps={env_cfg.max_steps} allows; "
              f"no policy can solve them in this run's episodes", flush=True)
    families = {t.family for ts in tasks.values() for t in ts}
    unknown = sorted(set(cfg.demos.family_coverage) - families)
    if unknown:
        raise AgentRLError(f"build_env.demos.family_coverage names task families {unknown} that environment "
                           f"{cls.name!r} does not build; its families: {sorted(families)}")
    return demos, env_cfg, recipe, over


def _write_stage(stage: Path, tasks: dict, demos: list[dict]) -> None:
    """The task splits and the demonstrations, into the staging folder."""
    for split, ts in tasks.items():
        write_tasks(ts, stage / "tasks" / f"{split}.jsonl")
    (stage / "demos").mkdir(parents=True)
    (stage / "demos" / "train.jsonl").write_text("".join(json.dumps(d, sort_keys=True) + "\n" for d in demos))


def _baselines(world: Environment, tasks: dict, cfg: BuildEnvConfig, env_cfg: EnvConfig) -> dict:
    """The expert's and the random policy's (each where the environment has one) evaluation summary per split,
    keyed "split/policy", without simulated tool latency."""
    baselines = {}
    eval_cfg = env_cfg.model_copy(update={"tool_latency_s": 0.0, "tool_latency_spike_rate": 0.0})
    policies = [p for p, make in (("expert", world.expert), ("random", lambda: world.random_policy(None)))
                if make() is not None]
    for split, ts in tasks.items():
        for policy in policies:
            summary, _ = evaluate(policy, ts, world, eval_cfg, seed=cfg.seed)
            baselines[f"{split}/{policy}"] = summary
    return baselines


def _metrics(environment: str, recipe: dict, over: int, counts: dict, tasks: dict, demos: list[dict], baselines: dict,
             reports: list, probes: dict, files: dict[str, Path]) -> dict:
    """metrics/build_env.json but its `seconds`: counts, mixes, demonstrations, baselines, validation, probes and the
    checksums of every file the phase publishes."""
    return {
        "environment": environment,
        "recipe": recipe,
        "tasks_over_step_budget": over,
        "counts": {**counts, **{f"tasks_{s}": len(ts) for s, ts in tasks.items()}, "demos": len(demos)},
        "level_mix": {s: dict(sorted(Counter(str(t.level) for t in ts).items())) for s, ts in tasks.items()},
        "family_mix": {s: dict(sorted(Counter(t.family for t in ts).items())) for s, ts in tasks.items()},
        "test_unseen_template_share": sum(not t.template_seen for t in tasks["test"]) / len(tasks["test"]),
        "demos": {
            "per_level": dict(sorted(Counter(str(d["level"]) for d in demos).items())),
            "per_flaw": dict(sorted(Counter(d["flaw"] for d in demos).items())),
            "success_rate": sum(d["success"] for d in demos) / max(1, len(demos)),
        },
        "baselines": {k: {"success_rate": v["overall"]["success_rate"], "mean_return": v["overall"]["mean_return"],
                          "mean_tool_calls": v["overall"]["mean_tool_calls"],
                          "safety_violations": v["overall"]["safety_violations"],
                          "per_level_success": {lv: s["success_rate"] for lv, s in v["per_level"].items()}}
                      for k, v in baselines.items()},
        "validation": {
            "datasets": len(reports), "rows": sum(r.n_rows for r in reports),
            "expectations_evaluated": sum(len(r.results) for r in reports),
            "expectations_failed": sum(len(r.failures) for r in reports),
        },
        "reward_hacking_probes": probes,
        "checksums": {name: sha256(p) for name, p in files.items()},
    }


def _log_run(run, metrics: dict, probes: dict, recipe: dict, metrics_path: Path) -> None:
    flat = {f"data/{k}": v for k, v in metrics["counts"].items()}
    for k, v in metrics["baselines"].items():
        flat[f"env/{k.replace('/', '_')}_success"] = v["success_rate"]
    flat["data/demo_success_rate"] = metrics["demos"]["success_rate"]
    flat.update({f"sys/{k}_seconds": v for k, v in metrics["seconds"].items()})
    flat.update({f"data/validation_{k}": v for k, v in metrics["validation"].items()})
    for name, r in probes.get("probes", {}).items():  # a skipped probe (no write tool) has no numbers
        flat.update({f"env/probe_{name}_{k}": r[k] for k in ("mean_return", "ratio") if r.get(k) is not None})
    run.log_metrics(flat)
    run.log_params(recipes.mlflow_params(recipe))
    run.log_dict(metrics["checksums"], "checksums.json")
    run.log_artifact(str(metrics_path))


def main(params_path: str = "params.yaml", data_dir: str = "data", metrics_path: str = "metrics/build_env.json") -> dict:
    """Entry point of `agentrl build-env` and of the DVC stage `build_env`."""
    from pipeline.core.tracking import Tracker

    env_cfg = load_section(EnvConfig, "env", params_path, resolve=False)  # its `auto` limits are derived here
    cfg = load_section(BuildEnvConfig, "build_env", params_path)
    resolve_request(cfg, env_cfg)  # a bad option or level fails here, before an MLflow run is opened
    with Tracker().run("build_env", params={"env": env_cfg.model_dump(), "build_env": cfg.model_dump()}) as run:
        metrics = build(cfg, env_cfg, Path(data_dir), Path(metrics_path), run)
    c, b = metrics["counts"], metrics["baselines"]
    world = ", ".join(f"{v} {k}" for k, v in c.items() if not k.startswith("tasks_") and k != "demos")
    baselines = "; ".join(f"{p} success {b[f'test/{p}']['success_rate']:.3f}" for p in ("expert", "random")
                          if f"test/{p}" in b)
    print(f"build_env: environment {metrics['environment']}: {world}, tasks {c['tasks_train']}/{c['tasks_validation']}/"
          f"{c['tasks_test']} (train/validation/test), {c['demos']} demos; {baselines or 'no baselines'} on test; "
          f"{metrics['seconds']['total']:.1f}s")
    print(f"build_env: recipe: {recipes.describe(metrics['recipe'])}")
    return metrics
