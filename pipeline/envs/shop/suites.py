"""The Great Expectations suites of the shop world's data, registered with the generic registry of
:mod:`pipeline.core.validation`.

- "tasks": task records (``data/tasks/{split}.jsonl``), and :func:`check_splits`, the rules across the three splits
  (unique ids, held-out entities and templates) that a single-file suite cannot see;
- "demos": the demonstrations (``data/demos/train.jsonl``);
- "products", "suppliers": rows of the world's SQLite tables; "corpus": the documents of ``data/env/corpus.jsonl``;
- "trajectories", "evaluation": episode records (:mod:`pipeline.envs.shop.episode_suites`).

Importing this module registers them all (:func:`register_suites`, which is idempotent, does it); a phase that
validates the shop world's data calls :func:`register_suites` before it names a suite, so the order of imports never
matters. Each suite derives the structural columns it checks from the records (`plan_len`, `is_update`, ...), so a
row-level rule is an ordinary GX expectation whose failure names its row.

Deliberately left out: the GX machinery itself (pipeline.core.validation) and drift statistics (pipeline.check_drift).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import pandas as pd

from pipeline.core import validation as V
from pipeline.envs.demo_suite import derive_demo_columns
from pipeline.envs.config import LEVELS, SPLITS
from pipeline.envs.shop.expert import FLAWS
from pipeline.envs.shop.tasks import ALL_FAMILIES, LONG_FAMILY
from pipeline.envs.shop.tools import TOOL_NAMES as TOOLS

# ------------------------------------------------------------------------------------------------------- tasks

_TOOL_LIST = re.compile(rf"^(?:{'|'.join(TOOLS)})(?:,(?:{'|'.join(TOOLS)}))*$").pattern  # comma-joined known tools


def _derive_tasks(df: pd.DataFrame) -> dict[str, list]:
    entities, plan, writes, family = (V.column_values(df, c) for c in ("entities", "plan", "allowed_writes", "family"))

    def tool(step: Any) -> str:
        return step["tool"] if isinstance(step, dict) and isinstance(step.get("tool"), str) else "?"

    return {
        "n_entities": [V.list_len(e) for e in entities],
        "entities_are_names": [isinstance(e, list) and all(V.is_text(x) for x in e) for e in entities],
        "plan_len": [V.list_len(p) for p in plan],
        "plan_tools": [",".join(tool(s) for s in p) if isinstance(p, list) else "" for p in plan],
        "plan_last_tool": [tool(p[-1]) if isinstance(p, list) and p else "" for p in plan],
        "plan_steps_have_params": [
            isinstance(p, list) and all(isinstance(step, dict) and isinstance(step.get("params"), dict) for step in p)
            for p in plan
        ],
        "n_allowed_writes": [V.list_len(w) for w in writes],
        "allowed_writes_well_formed": [
            isinstance(w, list)
            and all(isinstance(x, dict) and all(V.is_text(x.get(k)) for k in ("table", "name", "field")) for x in w)
            for w in writes
        ],
        "is_update": [f == "update" for f in family],
        "has_allowed_writes": [isinstance(w, list) and len(w) > 0 for w in writes],
    }


def tasks_suite(split: str | None = None) -> list:
    """Task records (data/tasks/{split}.jsonl); `split` pins the `split` column to the file's split."""
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits are {list(SPLITS)}")
    return [
        *V.non_empty_table(gxe),
        *V.text(gxe, "task_id", unique=True),
        *V.one_of(gxe, "split", [split] if split else SPLITS),
        *V.one_of(gxe, "family", ALL_FAMILIES),  # the long family only in builds with long_task_share > 0
        *V.one_of(gxe, "level", LEVELS, V.INT_TYPES),
        *V.text(gxe, "template_id"),
        *V.present(gxe, "template_seen", V.BOOL_TYPES),
        *V.text(gxe, "question", max_len=400),
        *V.present(gxe, "entities", V.STR_TYPES),  # a JSON string after flattening
        gxe.ExpectColumnValuesToBeBetween(column="n_entities", min_value=1),
        *V.all_true(gxe, "entities_are_names"),
        *V.present(gxe, "plan", V.STR_TYPES),
        gxe.ExpectColumnValuesToMatchRegex(column="plan_tools", regex=_TOOL_LIST),
        gxe.ExpectColumnValuesToBeInSet(column="plan_last_tool", value_set=["answer"]),
        *V.all_true(gxe, "plan_steps_have_params"),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="plan_len", column_B="min_calls"),
        *V.text(gxe, "answer"),
        *V.present(gxe, "min_calls", V.INT_TYPES),  # long tasks (build option long_task_share) are bounded by their plan
        gxe.ExpectColumnValuesToBeBetween(column="min_calls", min_value=2, max_value=8,
                                          row_condition=Column("family") != LONG_FAMILY),
        *V.present(gxe, "allowed_writes", V.STR_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="n_allowed_writes", min_value=0),
        *V.all_true(gxe, "allowed_writes_well_formed"),
        # allowed_writes is non-empty exactly for update tasks
        gxe.ExpectColumnPairValuesToBeEqual(column_A="is_update", column_B="has_allowed_writes"),
    ]


# ------------------------------------------------------------------------------------------------------- demos


# the columns derived from a demonstration's steps are the generic suite's (pipeline.envs.demo_suite); the shop's
# suite adds its own families, levels and step bound on top
_derive_demos = derive_demo_columns


def demos_suite(task_ids: Collection[str] | None = None) -> list:
    """Demonstrations (data/demos/train.jsonl); `task_ids`, when given, are the tasks a demo may refer to."""
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    return [
        *V.non_empty_table(gxe),
        *V.text(gxe, "demo_id", unique=True),
        *V.text(gxe, "task_id"),
        *V.in_known(gxe, "task_id", task_ids),
        *V.one_of(gxe, "level", LEVELS, V.INT_TYPES),
        *V.one_of(gxe, "family", ALL_FAMILIES),
        *V.one_of(gxe, "flaw", FLAWS),
        *V.present(gxe, "steps", V.STR_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="n_steps", min_value=1, max_value=16,  # long tasks: up to ~30
                                          row_condition=Column("family") != LONG_FAMILY),
        *V.all_true(gxe, "steps_well_formed"),
        *V.present(gxe, "success", V.BOOL_TYPES),
        *V.number(gxe, "return", -5, 5, types=V.FLOAT_TYPES),
        *V.number(gxe, "n_calls", 1, None),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="n_calls", column_B="n_steps"),
    ]


# ------------------------------------------------------------------------------------------------- environment


def products_suite(categories: Collection[str] | None = None, supplier_names: Collection[str] | None = None) -> list:
    """Rows of the `products` table; `categories` and `supplier_names`, when given, are the allowed values."""
    import great_expectations.expectations as gxe

    category = V.one_of(gxe, "category", categories) if categories is not None else V.text(gxe, "category")
    return [
        *V.non_empty_table(gxe),
        *V.number(gxe, "product_id", None, None, unique=True),
        *V.text(gxe, "name", unique=True),
        *category,
        *V.text(gxe, "supplier"),
        *V.in_known(gxe, "supplier", supplier_names),
        *V.number(gxe, "price", 1, 999),
        *V.number(gxe, "stock", 0, 500),
        *V.number(gxe, "weight_kg", 0.1, 50, types=V.FLOAT_TYPES),
    ]


def suppliers_suite(product_names: Collection[str] | None = None) -> list:
    """Rows of the `suppliers` table; `product_names`, when given, are the names a flagship may take."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.number(gxe, "supplier_id", None, None, unique=True),
        *V.text(gxe, "name", unique=True),
        *V.text(gxe, "city"),
        *V.text(gxe, "flagship"),
        *V.in_known(gxe, "flagship", product_names),
    ]


def corpus_suite() -> list:
    """Documents of data/env/corpus.jsonl."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.text(gxe, "doc_id", unique=True),
        *V.text(gxe, "title"),
        *V.text(gxe, "text", max_len=1000),
    ]


# ------------------------------------------------------------------------------------------------- across splits


def check_splits(splits: Mapping[str, list[dict]]) -> V.ValidationReport:
    """Cross-split rules of the task splits (each split's own suite is "tasks").

    - `task_id` is unique across all splits;
    - every entity of a validation/test task is absent from the training tasks' entities (held-out entities);
    - every test task with `template_seen == False` has a `template_id` that no training task has;
    - every train/validation task has `template_seen == True`.
    The held-out rules are GX `expect_column_values_to_not_be_in_set` with the training values as `value_set`.
    Malformed fields (non-list entities and the like) are skipped here: the per-split suite reports them.
    """
    unknown = sorted(set(splits) - set(SPLITS))
    if unknown or "train" not in splits:
        raise ValueError(f"splits must include 'train' and only name {list(SPLITS)}; got {sorted(splits)}")
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    task_rows, entity_rows = [], []
    for split, records in splits.items():
        for i, r in enumerate(records):
            tid = r.get("task_id")
            task_rows.append((split, i, tid, r.get("template_id"), r.get("template_seen")))
            ents = r.get("entities")
            if split != "train" and isinstance(ents, list):
                entity_rows += [(split, i, tid, e) for e in ents if isinstance(e, str)]
    tasks = pd.DataFrame(task_rows, columns=[V.SPLIT, V.ROW, "task_id", "template_id", "template_seen"], dtype=object)
    entities = pd.DataFrame(entity_rows, columns=[V.SPLIT, V.ROW, "task_id", "entity"], dtype=object)

    train = splits["train"]
    train_entities = sorted(
        {e for r in train if isinstance(r.get("entities"), list) for e in r["entities"] if isinstance(e, str)}
    )
    train_templates = sorted({r["template_id"] for r in train if isinstance(r.get("template_id"), str)})

    index_columns = [V.SPLIT, V.ROW, "task_id"]
    task_checks = [
        gxe.ExpectColumnValuesToBeUnique(column="task_id"),
        gxe.ExpectColumnValuesToBeInSet(
            column="template_seen", value_set=[True], row_condition=Column(V.SPLIT) != "test"
        ),
    ]
    if "test" in splits:
        task_checks.append(
            gxe.ExpectColumnValuesToNotBeInSet(
                column="template_id",
                value_set=train_templates,
                # a GX condition object, not a Python comparison: `is False` would not build one
                row_condition=(Column(V.SPLIT) == "test") & (Column("template_seen") == False),  # noqa: E712
            )
        )
    results = V.run_expectations(tasks, task_checks, index_columns, name="splits")
    if len(entities):
        entity_checks = [gxe.ExpectColumnValuesToNotBeInSet(column="entity", value_set=train_entities)]
        results += V.run_expectations(entities, entity_checks, index_columns, name="split_entities")
    return V.ValidationReport("splits", "splits", len(tasks), results)


# ------------------------------------------------------------------------------------------------------ registration


def _suites() -> list[tuple[str, str, Any, Any]]:
    """(name, id column, builder, derive) of every suite of the shop world, in registration order."""
    from pipeline.envs.shop import episode_suites as E

    return [
        ("tasks", "task_id", tasks_suite, _derive_tasks),
        ("demos", "demo_id", demos_suite, _derive_demos),
        ("products", "product_id", products_suite, None),
        ("suppliers", "supplier_id", suppliers_suite, None),
        ("corpus", "doc_id", corpus_suite, None),
        ("trajectories", "task_id", E.trajectories_suite, E.derive_episodes),
        ("evaluation", "task_id", E.evaluation_suite, E.derive_episodes),
    ]


def register_suites() -> list[str]:
    """Register every suite of the shop world that the registry lacks (calling it again does nothing); their names."""
    names = []
    for name, id_column, build, derive in _suites():
        if name not in V.SUITES:
            V.register_suite(name, id_column=id_column, derive=derive)(build)
        names.append(name)
    return names


register_suites()

__all__ = ["check_splits", "register_suites"]
