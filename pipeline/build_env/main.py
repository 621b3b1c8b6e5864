"""Phase 1, `build_env`: generate the world, the task splits and the demonstrations; validate; publish atomically.

Outputs (JSON Lines schemas in the README):

- ``data/env/``: ``world.sqlite`` (tables `products`, `suppliers`), ``corpus.jsonl``, ``entities.json`` (entity split);
- ``data/tasks/{train,validation,test}.jsonl``;
- ``data/demos/train.jsonl``: imperfect expert demonstrations of training tasks;
- ``metrics/build_env.json``: counts, level mix, checksums, validation summary, expert and random baselines per split.

Everything is written into a staging folder first and checked with Great Expectations (every dataset, plus the
cross-split rules). Only when every check passes are the old outputs replaced, one rename per folder; data that fails
validation stops the phase with the failing expectations and rows, and the previous good outputs stay as they were.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import time
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.core.config import load_section
from pipeline.env.config import SPLITS, EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.env.core import ToolTasksEnv, WorldRuntime
from pipeline.env.expert import ExpertPolicy, demo_record, draw_flaw, dumps_demo
from pipeline.env.tasks import Task, generate_tasks
from pipeline.env.taskfile import write_tasks
from pipeline.env.world import World, generate_world, write_world
from pipeline.core.errors import AgentRLError
from pipeline.policy.episodes import evaluate, run_episode

OUTPUT_DIRS = ("env", "tasks", "demos")


def build_tasks(world: World, runtime: WorldRuntime, cfg: BuildEnvConfig) -> dict[str, list[Task]]:
    return {
        split: generate_tasks(world, split, cfg.tasks_per_split[split], cfg.level_mix, cfg.seed,
                              solver=lambda plan, allowed: runtime.solve(plan, allowed),
                              train_wordings=cfg.train_wordings)
        for split in SPLITS
    }


def build_demos(train: list[Task], runtime: WorldRuntime, cfg: BuildEnvConfig, env_cfg: EnvConfig) -> list[dict]:
    """Demonstrations of the training tasks chosen by `family_coverage` (where it names the task's family) or else
    `level_coverage`, one flaw drawn per demonstration."""
    rng = np.random.default_rng([cfg.seed, 3])
    env = ToolTasksEnv(world=runtime, tasks=train, config=env_cfg.model_copy(update={"tool_latency_s": 0.0}))
    demos = []
    try:
        for task in train:
            share = cfg.demos.family_coverage.get(task.family, cfg.demos.level_coverage.get(task.level, 0.0))
            if rng.random() >= share:
                continue
            flaw = draw_flaw(task.level, cfg.demos, rng)
            rec = run_episode(env, ExpertPolicy(flaw, rng), task, seed=int(rng.integers(2**31)))
            demos.append(demo_record(f"demo-{len(demos):06d}", task, flaw, rec["steps"], rec["success"], rec["return"]))
    finally:
        env.close()
    return demos


def _table(db: Path, table: str) -> list[dict]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(f"SELECT * FROM {table}")]
    finally:
        conn.close()


def validate_outputs(stage: Path) -> list:
    """Run every suite on what was written to `stage` (read back from disk); returns one report per dataset."""
    from pipeline.core.jsonl import read_jsonl
    from pipeline.core.validation import validate_records
    from pipeline.env.suites import check_splits, register_suites

    register_suites()

    db = stage / "env" / "world.sqlite"
    products, suppliers = _table(db, "products"), _table(db, "suppliers")
    read = lambda p: read_jsonl(p, allow_empty=True)  # noqa: E731  (an empty file is the suite's failure to report)
    records = {s: read(stage / "tasks" / f"{s}.jsonl") for s in SPLITS}
    return [
        validate_records(products, "products", "data/env/world.sqlite:products",
                         supplier_names=[s["name"] for s in suppliers]),
        validate_records(suppliers, "suppliers", "data/env/world.sqlite:suppliers",
                         product_names=[p["name"] for p in products]),
        validate_records(read(stage / "env" / "corpus.jsonl"), "corpus", "data/env/corpus.jsonl"),
        *[validate_records(records[s], "tasks", f"data/tasks/{s}.jsonl", split=s) for s in SPLITS],
        validate_records(read(stage / "demos" / "train.jsonl"), "demos", "data/demos/train.jsonl",
                         task_ids=[t["task_id"] for t in records["train"]]),
        check_splits(records),
    ]


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


def build(cfg: BuildEnvConfig, env_cfg: EnvConfig, data_dir: Path, metrics_path: Path, run=None,
          validator=validate_outputs) -> dict:
    """Generate, validate (with `validator(stage) -> reports`) and publish; returns the metrics written to `metrics_path`."""
    t0 = time.perf_counter()
    try:
        world = generate_world(cfg.seed, cfg.n_products, cfg.n_suppliers, cfg.heldout_entity_fraction)
    except ValueError as exc:
        raise AgentRLError(f"build_env: {exc}") from None
    runtime = WorldRuntime(world)
    data_dir.mkdir(parents=True, exist_ok=True)
    stage = data_dir / ".staging-build_env"
    if stage.exists():
        shutil.rmtree(stage)
    try:
        tasks = build_tasks(world, runtime, cfg)
        demos = build_demos(tasks["train"], runtime, cfg, env_cfg)
        t_gen = time.perf_counter() - t0
        paths = write_world(world, stage / "env")
        for split, ts in tasks.items():
            write_tasks(ts, stage / "tasks" / f"{split}.jsonl")
        (stage / "demos").mkdir(parents=True)
        (stage / "demos" / "train.jsonl").write_text("".join(dumps_demo(d) + "\n" for d in demos))
        t1 = time.perf_counter()
        reports = validator(stage)
        t_val = time.perf_counter() - t1
        failed = [r for r in reports if not r.success]
        if failed:
            raise AgentRLError("build_env: generated data failed validation; the previous outputs are left untouched.\n"
                               + "\n".join(r.describe() for r in failed))

        baselines = {}
        eval_cfg = env_cfg.model_copy(update={"tool_latency_s": 0.0})
        for split, ts in tasks.items():
            for policy in ("expert", "random"):
                summary, _ = evaluate(policy, ts, runtime, eval_cfg, seed=cfg.seed)
                baselines[f"{split}/{policy}"] = summary
        files = {str(Path("data") / p.relative_to(stage)): p for p in
                 [paths["db"], paths["corpus"], paths["entities"], *sorted((stage / "tasks").glob("*.jsonl")),
                  stage / "demos" / "train.jsonl"]}
        metrics = {
            "counts": {
                "products": len(world.products), "suppliers": len(world.suppliers), "documents": len(world.corpus),
                **{f"tasks_{s}": len(ts) for s, ts in tasks.items()}, "demos": len(demos),
            },
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
            "checksums": {name: sha256(p) for name, p in files.items()},
            "seconds": {"generate": round(t_gen, 3), "validate": round(t_val, 3),
                        "total": round(time.perf_counter() - t0, 3)},
        }
        publish(stage, data_dir)
    finally:
        runtime.close()
        if stage.exists():
            shutil.rmtree(stage)
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    metrics_path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if run is not None:
        flat = {f"data/{k}": v for k, v in metrics["counts"].items()}
        for k, v in metrics["baselines"].items():
            flat[f"env/{k.replace('/', '_')}_success"] = v["success_rate"]
        flat["data/demo_success_rate"] = metrics["demos"]["success_rate"]
        flat.update({f"sys/{k}_seconds": v for k, v in metrics["seconds"].items()})
        flat.update({f"data/validation_{k}": v for k, v in metrics["validation"].items()})
        run.log_metrics(flat)
        run.log_dict(metrics["checksums"], "checksums.json")
        run.log_artifact(str(metrics_path))
    return metrics


def main(params_path: str = "params.yaml", data_dir: str = "data", metrics_path: str = "metrics/build_env.json") -> dict:
    """Entry point of `agentrl build-env` and of the DVC stage `build_env`."""
    from pipeline.core.tracking import Tracker

    env_cfg = load_section(EnvConfig, "env", params_path)
    cfg = load_section(BuildEnvConfig, "build_env", params_path)
    with Tracker().run("build_env", params={"env": env_cfg.model_dump(), "build_env": cfg.model_dump()}) as run:
        metrics = build(cfg, env_cfg, Path(data_dir), Path(metrics_path), run)
    c = metrics["counts"]
    print(f"build_env: {c['products']} products, {c['documents']} documents, tasks "
          f"{c['tasks_train']}/{c['tasks_validation']}/{c['tasks_test']} (train/validation/test), {c['demos']} demos; "
          f"expert success {metrics['baselines']['test/expert']['success_rate']:.3f}, random "
          f"{metrics['baselines']['test/random']['success_rate']:.3f} on test; {metrics['seconds']['total']:.1f}s")
    return metrics
