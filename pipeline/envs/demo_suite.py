"""The Great Expectations suite "demonstrations": the pipeline's own check of any environment's demonstration file
(``data/demos/train.jsonl``, written by `build_env` from the environment's expert), read at every phase that trains on
it. An environment may check its demonstrations further in :meth:`Environment.validate` (the shop's suite "demos"
also knows its task families)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pandas as pd

from pipeline.core import validation as V

FLAWS = ("none", "redundant_call", "wrong_order", "wrong_value")


def derive_demo_columns(df: pd.DataFrame) -> dict[str, list]:
    """`n_steps` and `steps_well_formed` of each demonstration (shared with the environments' own demo suites)."""
    steps = V.column_values(df, "steps")

    def well_formed(step: Any) -> bool:
        return isinstance(step, dict) and all(isinstance(step.get(k), str) for k in ("action", "observation"))

    return {
        "n_steps": [V.list_len(s) for s in steps],
        "steps_well_formed": [isinstance(s, list) and all(well_formed(x) for x in s) for s in steps],
    }


def demonstrations_suite(task_ids: Collection[str] | None = None) -> list:
    """Demonstrations; `task_ids`, when given, are the tasks a demonstration may refer to."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.text(gxe, "demo_id", unique=True),
        *V.text(gxe, "task_id"),
        *V.in_known(gxe, "task_id", task_ids),
        *V.number(gxe, "level", 1, None, types=V.INT_TYPES),
        *V.present(gxe, "family", V.STR_TYPES),
        *V.one_of(gxe, "flaw", FLAWS),
        *V.present(gxe, "steps", V.STR_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="n_steps", min_value=1, max_value=64),
        *V.all_true(gxe, "steps_well_formed"),
        *V.present(gxe, "success", V.BOOL_TYPES),
        *V.number(gxe, "return", -5, 5, types=V.FLOAT_TYPES),
        *V.number(gxe, "n_calls", 1, None),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="n_calls", column_B="n_steps"),
    ]


def register() -> str:
    """Register the suite once (idempotent); its name."""
    if "demonstrations" not in V.SUITES:
        V.register_suite("demonstrations", id_column="demo_id", derive=derive_demo_columns)(demonstrations_suite)
    return "demonstrations"
