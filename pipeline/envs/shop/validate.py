"""The shop's data checks at `build_env`: every Great Expectations suite over what was written, read back from disk."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def _table(db: Path, table: str) -> list[dict]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(f"SELECT * FROM {table}")]
    finally:
        conn.close()


def validate_data(world_dir: Path, tasks: dict[str, list[dict]], demos: list[dict] | None) -> list:
    """One report per dataset: the world's tables and corpus, each task split, the demonstrations, the split rules."""
    from pipeline.core.jsonl import read_jsonl
    from pipeline.core.validation import validate_records
    from pipeline.envs.shop.suites import check_splits, register_suites

    register_suites()
    db = world_dir / "world.sqlite"
    products, suppliers = _table(db, "products"), _table(db, "suppliers")
    reports = [
        validate_records(products, "products", "data/env/world.sqlite:products",
                         supplier_names=[s["name"] for s in suppliers]),
        validate_records(suppliers, "suppliers", "data/env/world.sqlite:suppliers",
                         product_names=[p["name"] for p in products]),
        validate_records(read_jsonl(world_dir / "corpus.jsonl", allow_empty=True), "corpus", "data/env/corpus.jsonl"),
        *[validate_records(records, "tasks", f"data/tasks/{s}.jsonl", split=s) for s, records in tasks.items()],
    ]
    if demos is not None:
        reports.append(validate_records(demos, "demos", "data/demos/train.jsonl",
                                        task_ids=[t["task_id"] for t in tasks["train"]]))
    reports.append(check_splits(tasks))
    return reports
