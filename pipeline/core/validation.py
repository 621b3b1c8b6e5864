"""Data validation with Great Expectations: a registry of named suites, a generic `validate`, and expectation kits.

Every dataset a phase writes is checked before the next phase reads it. A *suite* is a named function that returns a
list of GX expectations (see :data:`SUITES` and :func:`register_suite`); :func:`validate` runs one against a DataFrame
and returns a :class:`ValidationReport`; :func:`validate_records` first flattens JSON-like records into a frame (nested
lists and dicts become JSON strings, and each suite derives the structural columns it checks, such as `plan_len` or
`is_update`, so that row-level rules like "len(plan) == min_calls" are ordinary GX expectations whose failures name
their rows). :func:`run_expectations` runs expectations on a frame the caller built itself (cross-dataset rules).

Failures name their rows: every frame carries `_row` (the record's position in its source) and the suite's id column,
passed to GX as `unexpected_index_column_names`, so a report reads "row 3 (task_id='train-000003')".

This module knows no dataset: the suites of the shop world's data (tasks, demonstrations, world tables, corpus,
episodes) live with that data in :mod:`pipeline.envs.shop.suites`, which registers them here.

Cost (measured on a quiet 2-core machine): `import great_expectations` takes about 2 s, so it is imported inside the
functions that run GX, never at module import. Each call builds its own ephemeral context (about 3 ms + 20 ms for the
data source and suite), because a context keeps every validation result in memory: a shared one would grow without
bound and carry suites from one call into the next. GX then spends about 7 ms per expectation whatever the row count
(0.3 s for the 44 expectations of "tasks"); 100k task rows take about 1.5 s to flatten and 1 s to validate.

Deliberately left out: persisted GX stores, data docs and checkpoints (DVC versions the data and MLflow records the
summary); statistical drift checks (a later phase's job); checks of the SQLite file itself (callers export tables to
frames).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipeline.core import validation_memo as memo

ROW = "_row"  # the record's position in its source (file line, table row); added to every validated frame
SPLIT = "_split"  # the split a record was read from, in cross-split frames
MAX_SHOWN = 10  # offending rows (and values) kept per failed expectation

# GX type names: a typed column is checked by dtype name, an object column value by value (`type(v).__name__`).
STR_TYPES = ["str"]
INT_TYPES = ["int", "int8", "int16", "int32", "int64", "Int64"]
BOOL_TYPES = ["bool", "bool_", "boolean"]
# A float column whose values are all whole numbers may arrive as int64 (SQLite REAL exported by some writers as 2).
FLOAT_TYPES = ["float", "float32", "float64", "Float64", *INT_TYPES]

NON_BLANK = r"\S"  # at least one non-space character


class DataValidationError(ValueError):
    """A dataset failed its suite; the message names the dataset, each failed expectation and its offending rows."""

    def __init__(self, message: str, report: ValidationReport | None = None):
        super().__init__(message, report)
        self.report = report

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class ValidationReport:
    """The outcome of validating one dataset.

    `results` has one dict per expectation: `expectation` (GX type), `kwargs` (column, bounds, value set...),
    `success`, `unexpected_count`, `unexpected_rows` (at most :data:`MAX_SHOWN` dicts holding `row`, the id
    column and the offending values), `observed_value` (column-level expectations) and `exception` (a message when GX
    could not evaluate the expectation, e.g. a range check on a column of mixed types). A column an expectation names
    but the frame lacks is reported once, as a failed `expect_column_to_exist`.
    """

    dataset: str
    suite: str
    n_rows: int
    results: list[dict] = field(default_factory=list)

    @property
    def success(self) -> bool:
        return all(r["success"] for r in self.results)

    @property
    def failures(self) -> list[dict]:
        return [r for r in self.results if not r["success"]]

    def summary(self, prefix: str = "") -> dict[str, float]:
        """Numbers to log (e.g. to MLflow as metrics); `prefix` namespaces the keys, e.g. "data/train/"."""
        n_ok = sum(r["success"] for r in self.results)
        return {
            f"{prefix}rows": self.n_rows,
            f"{prefix}expectations_evaluated": len(self.results),
            f"{prefix}expectations_successful": n_ok,
            f"{prefix}expectations_failed": len(self.results) - n_ok,
            f"{prefix}success": float(self.success),
        }

    def describe(self) -> str:
        """A human-readable account of the failures ("... passed" when there are none)."""
        head = f"dataset {self.dataset!r} (suite {self.suite!r}, {self.n_rows} rows)"
        fails = self.failures
        if not fails:
            return f"{head} passed all {len(self.results)} expectations"
        lines = [f"{head} failed {len(fails)} of {len(self.results)} expectations:"]
        lines += [f"  - {_describe_result(r)}" for r in fails]
        return "\n".join(lines)

    def raise_if_failed(self) -> ValidationReport:
        """Raise :class:`DataValidationError` if any expectation failed; return the report otherwise."""
        if not self.success:
            raise DataValidationError(self.describe(), self)
        return self


# --------------------------------------------------------------------------------------------------------- registry

Derive = Callable[[pd.DataFrame], dict[str, list]]


@dataclass(frozen=True)
class SuiteSpec:
    """A named suite: `build(**params)` returns GX expectations; `derive(raw_frame)` returns the derived columns they
    check (computed from the records before nested values are JSON-encoded)."""

    name: str
    id_column: str
    build: Callable[..., list]
    derive: Derive | None
    description: str


SUITES: dict[str, SuiteSpec] = {}


def register_suite(name: str, *, id_column: str, derive: Derive | None = None):
    """Decorator registering `build(**params) -> list[Expectation]` as suite `name` (a repeated name is an error)."""

    def decorator(build: Callable[..., list]) -> Callable[..., list]:
        if name in SUITES:
            raise ValueError(f"suite {name!r} is already registered (by {SUITES[name].build.__module__})")
        doc = (build.__doc__ or "").strip().splitlines()
        SUITES[name] = SuiteSpec(name, id_column, build, derive, doc[0] if doc else "")
        return build

    return decorator


def get_suite(name: str) -> SuiteSpec:
    try:
        return SUITES[name]
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; registered suites are {sorted(SUITES)}") from None


# ------------------------------------------------------------------------------------------------------ public API


def validate(df: pd.DataFrame, suite_name: str, *, dataset: str | None = None, **params: Any) -> ValidationReport:
    """Validate a frame (already flattened: see :func:`flatten_records`) against suite `suite_name`.

    A pass of the same frame under the same suite and parameters is looked up in the memo of passed validations
    first (:mod:`pipeline.core.validation_memo`), which spares the import of GX and the run.
    `params` go to the suite's builder (e.g. `split="train"` for "tasks", `categories=[...]` for an entity table's suite); an
    unknown parameter is a TypeError. A frame without `_row` gets its positional row numbers.
    """
    spec = get_suite(suite_name)
    if ROW not in df.columns:
        df = df.assign(**{ROW: np.arange(len(df))})
    df = _with_object_strings(df)
    memo_key = memo.key(spec, params, df) if memo.folder() is not None else None
    results = memo.load(memo_key)
    if results is None:
        expectations = spec.build(**params)
        index_columns = [c for c in (ROW, spec.id_column) if c in df.columns]
        results = _run_gx(df, expectations, index_columns, name=suite_name)
        if all(r["success"] for r in results):
            memo.store(memo_key, results)
    return ValidationReport(dataset or suite_name, suite_name, len(df), results)


def validate_records(records: list[dict], suite: str, dataset: str, **params: Any) -> ValidationReport:
    """Flatten `records` (e.g. the lines of a JSONL file) and validate them against `suite`."""
    return validate(flatten_records(records, suite), suite, dataset=dataset, **params)


def flatten_records(records: Iterable[Mapping], suite: str) -> pd.DataFrame:
    """A frame of `records` with the suite's derived columns, nested lists/dicts as JSON strings and `_row`."""
    spec = get_suite(suite)
    records = list(records)
    bad = [i for i, r in enumerate(records) if not isinstance(r, Mapping)]
    if bad:
        raise TypeError(f"records must be mappings; rows {bad[:MAX_SHOWN]} are not ({len(bad)} in all)")
    raw = pd.DataFrame.from_records(records) if records else pd.DataFrame()
    derived = spec.derive(raw) if spec.derive else {}
    out = {}
    for col in raw.columns:
        s = raw[col]
        if s.dtype == object and any(isinstance(v, (list, dict)) for v in s):
            s = s.map(_json_if_nested)
        out[col] = s
    for col, values in derived.items():
        if col in out:
            raise ValueError(f"suite {suite!r} derives column {col!r}, which the records already have")
        out[col] = pd.Series(values, index=raw.index)
    out[ROW] = pd.Series(np.arange(len(raw)), index=raw.index)
    return pd.DataFrame(out, index=raw.index)


def run_expectations(df: pd.DataFrame, expectations: list, index_columns: list[str], *, name: str) -> list[dict]:
    """Run `expectations` on a frame the caller built (e.g. rows of several datasets, for rules across them).

    One result dict per expectation, in order (see :class:`ValidationReport`); `index_columns` name the offending
    rows in the results.
    """
    return _run_gx(df, expectations, index_columns, name=name)


# ---------------------------------------------------------------------------------------------------- GX plumbing


def _run_gx(df: pd.DataFrame, expectations: list, index_columns: list[str], *, name: str) -> list[dict]:
    """Run `expectations` on `df` in a fresh ephemeral context; one result dict per expectation, in suite order."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    result_format = {
        "result_format": "SUMMARY",
        "partial_unexpected_count": MAX_SHOWN,
        "unexpected_index_column_names": index_columns,
        "return_unexpected_index_query": False,
    }
    expectations = _guard_missing_columns(df, expectations)
    # GX 1.24 resolves a validation definition's suite and data through the context that owns them (not the
    # process-wide "current" one), so concurrent calls in threads do not see each other (tested).
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    batch = context.data_sources.add_pandas(name).add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
    suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
    definition = gx.ValidationDefinition(data=batch, suite=suite, name=name)
    outcome = definition.run(batch_parameters={"dataframe": df}, result_format=result_format)
    # GX returns results grouped by metric, not in suite order; the ids it gives each expectation restore the order.
    order = {e.id: i for i, e in enumerate(suite.expectations)}
    ranked = sorted(outcome.results, key=lambda r: order.get(r.expectation_config.id, len(order)))
    return [_result_entry(r.to_json_dict(), index_columns) for r in ranked]


def _with_object_strings(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with pandas string-dtype columns as object columns.

    pandas 3 infers a `str` dtype (and `read_sql` returns one), which GX 1.24's type check rejects even for
    `type_list=["str"]`; in an object column GX checks each Python value instead.
    """
    strings = [c for c in df.columns if pd.api.types.is_string_dtype(df[c].dtype) and df[c].dtype != object]
    return df.astype({c: object for c in strings}) if strings else df


def _guard_missing_columns(df: pd.DataFrame, expectations: list) -> list:
    """Replace the expectations on columns `df` lacks by one `expect_column_to_exist` per missing column.

    GX would otherwise report each of them as an evaluation error, burying the one fact that matters.
    """
    import great_expectations.expectations as gxe

    present = set(df.columns)
    kept, missing = [], []
    for e in expectations:
        cols = [getattr(e, a, None) for a in ("column", "column_A", "column_B")]
        absent = [c for c in cols if c is not None and c not in present]
        if not absent:
            kept.append(e)
        missing += [c for c in absent if c not in missing]
    return kept + [gxe.ExpectColumnToExist(column=c) for c in missing]


def _plain_kwargs(kwargs: dict) -> dict:
    """The kwargs with a serialised row condition shown as text, e.g. "_split == 'test' and template_seen == False"."""
    out = dict(kwargs)
    if isinstance(out.get("row_condition"), dict):
        out["row_condition"] = _condition_text(out["row_condition"])
    return out


def _condition_text(cond: dict) -> str:
    kind = cond.get("type")
    if kind in ("and", "or"):
        return f" {kind} ".join(_condition_text(c) for c in cond.get("conditions", []))
    if kind == "comparison":
        return f"{cond['column']['name']} {cond['operator']} {cond['parameter']!r}"
    if kind == "pass_through":
        return str(cond.get("pass_through_filter"))
    return json.dumps(cond, sort_keys=True, default=str)


def _result_entry(r: dict, index_columns: list[str]) -> dict:
    cfg = r["expectation_config"]
    kwargs = _plain_kwargs({k: v for k, v in cfg["kwargs"].items() if k != "batch_id"})
    res = r.get("result") or {}
    names = {ROW: "row", SPLIT: "split"}
    rows = []
    for d in (res.get("partial_unexpected_index_list") or [])[:MAX_SHOWN]:
        # index columns first (split, row, id), then the offending values
        keys = [c for c in index_columns if c in d] + [c for c in d if c not in index_columns]
        rows.append({names.get(k, k): d[k] for k in keys})
    return {
        "expectation": cfg["type"],
        "kwargs": kwargs,
        "success": bool(r["success"]),
        "unexpected_count": res.get("unexpected_count"),
        "unexpected_rows": rows,
        "observed_value": res.get("observed_value"),
        "exception": _exception_message(r.get("exception_info")),
    }


def _exception_message(info: Any) -> str | None:
    """GX reports errors flat ({"raised_exception": ..., "exception_message": ...}) or keyed by metric id."""
    if not isinstance(info, dict):
        return None
    if "raised_exception" in info:
        return info.get("exception_message") if info.get("raised_exception") else None
    messages = {v.get("exception_message") for v in info.values() if isinstance(v, dict) and v.get("raised_exception")}
    return "; ".join(sorted(m for m in messages if m)) or None


def _short(value: Any, limit: int = 8) -> str:
    if isinstance(value, (list, tuple)) and len(value) > limit:
        head = ", ".join(repr(v) for v in value[:limit])
        return f"[{head}, ... ({len(value)} values)]"
    return repr(value)


def _describe_result(r: dict) -> str:
    kwargs = ", ".join(f"{k}={_short(v)}" for k, v in r["kwargs"].items())
    text = f"{r['expectation']}({kwargs})"
    if r["exception"]:
        return f"{text}: could not be evaluated: {r['exception']}"
    if r["expectation"] == "expect_column_to_exist":
        return f"{text}: the column is missing"
    if r["unexpected_count"] is None:
        return f"{text}: observed {r['observed_value']!r}"
    count = r["unexpected_count"]
    shown = "; ".join(_describe_row(row) for row in r["unexpected_rows"])
    more = f" (first {len(r['unexpected_rows'])} shown)" if count > len(r["unexpected_rows"]) else ""
    return f"{text}: {count} unexpected row{'s' if count != 1 else ''}{more}: {shown}"


def _describe_row(row: dict) -> str:
    where = " ".join(f"{k}={row[k]!r}" if k != "row" else f"row {row[k]}" for k in ("split", "row") if k in row)
    rest = ", ".join(f"{k}={v!r}" for k, v in row.items() if k not in ("split", "row"))
    return f"{where} ({rest})" if rest else where


# ------------------------------------------------------------------------------- helpers for derived columns


# One encoder for all calls: `json.dumps` with non-default options builds a new encoder per value (a third of the
# flattening time at 100k rows).
_encode_json = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str).encode


def _json_if_nested(v: Any) -> Any:
    return _encode_json(v) if isinstance(v, (list, dict)) else v


def column_values(df: pd.DataFrame, col: str) -> list:
    """The column's values as Python objects (missing column or value -> None)."""
    if col not in df.columns:
        return [None] * len(df)
    return [None if (v is None or (isinstance(v, float) and np.isnan(v))) else v for v in df[col].tolist()]


def is_text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def list_len(v: Any) -> int:
    """Length of a list, -1 for anything else (so `>= 1` rejects a missing or non-list field too)."""
    return len(v) if isinstance(v, list) else -1


# ------------------------------------------------------------------------------------------------ expectation kits


# Building blocks of suites (each returns a list of GX expectations; `gxe` is `great_expectations.expectations`,
# passed in so that GX is imported only when a suite is built). They leave out `expect_column_to_exist`: `_run_gx`
# adds one for each column an expectation names and the frame lacks (instead of running that column's expectations),
# so a missing column is one clear failure.
# GX spends about 7 ms per expectation whatever the row count, so the kits avoid redundant ones.


def present(gxe, col: str, types: list[str]) -> list:
    return [
        gxe.ExpectColumnValuesToNotBeNull(column=col),
        gxe.ExpectColumnValuesToBeInTypeList(column=col, type_list=types),
    ]


def text(gxe, col: str, *, max_len: int | None = None, unique: bool = False) -> list:
    """A non-blank string (the regex also rejects ""), at most `max_len` characters."""
    out = present(gxe, col, STR_TYPES) + [gxe.ExpectColumnValuesToMatchRegex(column=col, regex=NON_BLANK)]
    if max_len is not None:
        out.append(gxe.ExpectColumnValueLengthsToBeBetween(column=col, min_value=1, max_value=max_len))
    return out + ([gxe.ExpectColumnValuesToBeUnique(column=col)] if unique else [])


def number(gxe, col: str, lo: float | None, hi: float | None, *, types=INT_TYPES, unique: bool = False) -> list:
    out = present(gxe, col, types)
    if lo is not None or hi is not None:
        out.append(gxe.ExpectColumnValuesToBeBetween(column=col, min_value=lo, max_value=hi))
    return out + ([gxe.ExpectColumnValuesToBeUnique(column=col)] if unique else [])


def one_of(gxe, col: str, values: Collection, types: list[str] = STR_TYPES) -> list:
    return present(gxe, col, types) + [gxe.ExpectColumnValuesToBeInSet(column=col, value_set=list(values))]


def all_true(gxe, col: str) -> list:
    """A derived boolean column that must be True on every row."""
    return [gxe.ExpectColumnValuesToBeInSet(column=col, value_set=[True])]


def non_empty_table(gxe) -> list:
    return [gxe.ExpectTableRowCountToBeBetween(min_value=1)]


def in_known(gxe, col: str, known: Collection[str] | None) -> list:
    return [] if known is None else [gxe.ExpectColumnValuesToBeInSet(column=col, value_set=sorted(known))]
