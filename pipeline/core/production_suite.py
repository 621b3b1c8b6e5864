"""The Great Expectations suite "production": the episodes of a snapshot of captured traffic
(``data/production/snapshot/episodes.jsonl``, written by `agentrl snapshot`, :mod:`pipeline.deploy.snapshot`).

One row per answered request: its id, the question, the trajectory (``steps``, each ``{"action", "observation"}``),
the call count, the environment's verdict (``success``, null without ground truth), the latency, and the feedback a
person gave on it (``rating`` 1-5 and ``label``, null when none). It knows no environment: the tasks derived from the
same traffic are checked by the environment's own task suite when they are read back."""

from __future__ import annotations

import pandas as pd

from pipeline.core import validation as V

LABELS = ("success", "failure")


def derive_columns(df: pd.DataFrame) -> dict[str, list]:
    """`n_steps` and `steps_well_formed`: every step a dict of string `action` and `observation`."""
    steps = V.column_values(df, "steps")

    def well_formed(step) -> bool:
        return isinstance(step, dict) and all(isinstance(step.get(k), str) for k in ("action", "observation"))

    return {"n_steps": [V.list_len(s) for s in steps],
            "steps_well_formed": [isinstance(s, list) and all(well_formed(x) for x in s) for s in steps]}


def production_suite() -> list:
    """Episodes of captured traffic with people's feedback."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.text(gxe, "request_id", unique=True),
        *V.text(gxe, "question"),
        *V.present(gxe, "steps", V.STR_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="n_steps", min_value=0),
        *V.all_true(gxe, "steps_well_formed"),
        *V.number(gxe, "n_calls", 0, None),
        *V.number(gxe, "latency_ms", 0, None, types=V.FLOAT_TYPES),
        gxe.ExpectColumnValuesToBeInSet(column="success", value_set=[True, False]),  # nulls (no ground truth) pass
        gxe.ExpectColumnValuesToBeBetween(column="rating", min_value=1, max_value=5),  # nulls (no feedback) pass
        gxe.ExpectColumnValuesToBeInSet(column="label", value_set=list(LABELS)),
    ]


def register() -> str:
    """Register the suite once (idempotent); its name."""
    if "production" not in V.SUITES:
        V.register_suite("production", id_column="request_id", derive=derive_columns)(production_suite)
    return "production"
