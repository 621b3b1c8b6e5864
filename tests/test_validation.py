"""Tests of `pipeline.core.validation` and the shop world's suites (`pipeline.envs.shop.suites`): valid data passes; each
kind of defect fails naming the expectation and the row.

Records are built by hand (small, valid by construction); each defect test changes one field of one record and checks
that the error message names the GX expectation and the offending id, and that the report's structured results agree.
"""

from __future__ import annotations

import copy
import pickle
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest

from pipeline.core import validation
from pipeline.core.validation import (
    DataValidationError,
    ValidationReport,
    flatten_records,
    register_suite,
    validate,
    validate_records,
)
from pipeline.envs.shop.suites import check_splits, register_suites

register_suites()

# GX expectation types, as reports name them
UNIQUE = "expect_column_values_to_be_unique"
IN_SET = "expect_column_values_to_be_in_set"
NOT_IN_SET = "expect_column_values_to_not_be_in_set"
BETWEEN = "expect_column_values_to_be_between"
LENGTHS = "expect_column_value_lengths_to_be_between"
REGEX = "expect_column_values_to_match_regex"
TYPES = "expect_column_values_to_be_in_type_list"
NOT_NULL = "expect_column_values_to_not_be_null"
PAIR_EQUAL = "expect_column_pair_values_to_be_equal"

# ---------------------------------------------------------------------------------------------------- builders


def make_task(i: int, split: str = "train", **overrides) -> dict:
    """A valid lookup_calc task about product `P{split}{i}` (train and held-out entities never overlap)."""
    name = f"Widget-{split}-{i}"
    task = {
        "task_id": f"{split}-{i:06d}",
        "split": split,
        "family": "lookup_calc",
        "level": 2,
        "template_id": "lookup_calc/2",
        "template_seen": True,
        "question": f"What do 3 units of '{name}' cost?",
        "entities": [name],
        "plan": [
            {"tool": "lookup", "params": {"table": "products", "name": name, "field": "price"}},
            {"tool": "calc", "params": {"expr": "3*12"}},
            {"tool": "answer", "params": {"text": "36"}},
        ],
        "answer": "36",
        "min_calls": 3,
        "allowed_writes": [],
    }
    task.update(overrides)
    return task


def make_update_task(i: int, split: str = "train") -> dict:
    name = f"Widget-{split}-{i}"
    return make_task(
        i,
        split,
        family="update",
        level=3,
        template_id="update/1",
        question=f"Set the stock of '{name}' to 7.",
        plan=[
            {"tool": "update", "params": {"table": "products", "name": name, "field": "stock", "value": 7}},
            {"tool": "answer", "params": {"text": "done"}},
        ],
        answer="done",
        min_calls=2,
        allowed_writes=[{"table": "products", "name": name, "field": "stock"}],
    )


def make_splits() -> dict[str, list[dict]]:
    train = [make_task(i) for i in range(4)] + [make_update_task(4)]
    validation_ = [make_task(i, "validation") for i in range(3)]
    test = [make_task(i, "test") for i in range(2)] + [
        make_task(2, "test", family="two_lookup", template_id="two_lookup/9", template_seen=False)
    ]
    return {"train": train, "validation": validation_, "test": test}


def make_demo(i: int, **overrides) -> dict:
    demo = {
        "demo_id": f"demo-{i:05d}",
        "task_id": f"train-{i:06d}",
        "level": 2,
        "family": "lookup_calc",
        "flaw": "none",
        "steps": [
            {"action": "lookup(products, 'Widget', price)", "observation": "12"},
            {"action": "calc(3*12)", "observation": "36"},
            {"action": "answer(36)", "observation": "correct"},
        ],
        "success": True,
        "return": 1.0,
        "n_calls": 3,
    }
    demo.update(overrides)
    return demo


def make_products() -> list[dict]:
    return [
        {"product_id": i, "name": f"Widget-{i}", "category": "tools", "supplier": f"Acme-{i % 2}",
         "price": 10 + i, "stock": 5 * i, "weight_kg": 0.5 + i}
        for i in range(4)
    ]


def make_suppliers() -> list[dict]:
    return [{"supplier_id": i, "name": f"Acme-{i}", "city": "Lyon", "flagship": f"Widget-{i}"} for i in range(2)]


def make_corpus() -> list[dict]:
    return [{"doc_id": f"doc-{i}", "title": f"About Acme-{i}", "text": "Acme makes widgets. " * 5} for i in range(3)]


def failing(report: ValidationReport) -> dict[tuple[str, str], dict]:
    """Failed results keyed by (expectation type, the column(s) it checks)."""
    out = {}
    for r in report.failures:
        kw = r["kwargs"]
        col = kw.get("column") or f"{kw.get('column_A')},{kw.get('column_B')}"
        out[(r["expectation"], col)] = r
    return out


def assert_fails(report: ValidationReport, expectation: str, column: str, offending_id: str, id_key: str = "task_id"):
    """The report fails `expectation` on `column`, names `offending_id` in its rows and in the raised message."""
    assert not report.success
    found = failing(report)
    assert (expectation, column) in found, f"{expectation} on {column} did not fail; failures: {sorted(found)}"
    rows = found[(expectation, column)]["unexpected_rows"]
    assert offending_id in {row.get(id_key) for row in rows}, rows
    with pytest.raises(DataValidationError) as info:
        report.raise_if_failed()
    message = str(info.value)
    assert expectation in message and f"column='{column.split(',')[0]}" in message.replace("column_A=", "column=")
    assert repr(offending_id) in message
    assert report.dataset in message


# ---------------------------------------------------------------------------------------------------- tasks


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_valid_task_splits_pass(split):
    report = validate_records(make_splits()[split], "tasks", split, split=split)
    assert report.success, report.describe()
    assert report.raise_if_failed() is report
    summary = report.summary(prefix="data/tasks/")
    assert summary["data/tasks/rows"] == len(make_splits()[split])
    assert summary["data/tasks/expectations_evaluated"] == summary["data/tasks/expectations_successful"] > 20
    assert summary["data/tasks/expectations_failed"] == 0


def test_valid_splits_pass_cross_split_checks():
    report = check_splits(make_splits())
    assert report.success, report.describe()
    assert {r["expectation"] for r in report.results} == {
        "expect_column_values_to_be_unique",
        "expect_column_values_to_be_in_set",
        "expect_column_values_to_not_be_in_set",
    }


def _set(i, key, value):
    def mutate(records):
        records[i][key] = value

    return mutate


def _duplicate_id(records):
    records[2]["task_id"] = records[1]["task_id"]


def _plan_without_answer(records):
    records[3]["plan"][-1] = {"tool": "calc", "params": {"expr": "1+1"}}


def _update_without_writes(records):
    records[4]["allowed_writes"] = []


def _writes_on_lookup(records):
    records[0]["allowed_writes"] = [{"table": "products", "name": "Widget-train-0", "field": "price"}]


def _unknown_tool(records):
    records[1]["plan"][0]["tool"] = "delete_all"


def _plan_longer_than_min_calls(records):
    records[2]["min_calls"] = 4


WRITES_IFF_UPDATE = "is_update,has_allowed_writes"
TASK_DEFECTS = {
    # name: (mutation, expectation, column(s), offending task_id)
    "duplicate task_id": (_duplicate_id, UNIQUE, "task_id", "train-000001"),
    "level 7": (_set(1, "level", 7), IN_SET, "level", "train-000001"),
    "unknown family": (_set(2, "family", "lookup_teleport"), IN_SET, "family", "train-000002"),
    "empty answer": (_set(3, "answer", ""), REGEX, "answer", "train-000003"),
    "blank answer": (_set(3, "answer", "  "), REGEX, "answer", "train-000003"),
    "answer not a string": (_set(0, "answer", 36), TYPES, "answer", "train-000000"),
    "plan not ending in answer": (_plan_without_answer, IN_SET, "plan_last_tool", "train-000003"),
    "unknown tool": (_unknown_tool, REGEX, "plan_tools", "train-000001"),
    "len(plan) != min_calls": (_plan_longer_than_min_calls, PAIR_EQUAL, "plan_len,min_calls", "train-000002"),
    "update without allowed_writes": (_update_without_writes, PAIR_EQUAL, WRITES_IFF_UPDATE, "train-000004"),
    "allowed_writes on a lookup": (_writes_on_lookup, PAIR_EQUAL, WRITES_IFF_UPDATE, "train-000000"),
    "split differs from the file": (_set(0, "split", "test"), IN_SET, "split", "train-000000"),
    "question too long": (_set(1, "question", "x" * 401), LENGTHS, "question", "train-000001"),
    "no entities": (_set(2, "entities", []), BETWEEN, "n_entities", "train-000002"),
    "min_calls 9": (_set(0, "min_calls", 9), BETWEEN, "min_calls", "train-000000"),
    "template_seen missing": (_set(1, "template_seen", None), NOT_NULL, "template_seen", "train-000001"),
}


@pytest.mark.parametrize("defect", list(TASK_DEFECTS))
def test_task_defect_fails_naming_expectation_and_task(defect):
    mutate, expectation, column, task_id = TASK_DEFECTS[defect]
    records = copy.deepcopy(make_splits()["train"])
    mutate(records)
    report = validate_records(records, "tasks", "train", split="train")
    assert_fails(report, expectation, column, task_id)


def test_missing_column_is_one_failure_not_a_cascade():
    records = [{k: v for k, v in r.items() if k != "answer"} for r in make_splits()["train"]]
    report = validate_records(records, "tasks", "train", split="train")
    failed = [(r["expectation"], r["kwargs"]) for r in report.failures]
    assert failed == [("expect_column_to_exist", {"column": "answer"})]
    assert "the column is missing" in report.describe()


def test_empty_dataset_fails():
    report = validate_records([], "tasks", "train", split="train")
    assert ("expect_table_row_count_to_be_between", "None,None") in failing(report)


def test_message_shows_at_most_ten_rows_with_the_count():
    records = [make_task(i, answer="") for i in range(25)]
    report = validate_records(records, "tasks", "train", split="train")
    result = failing(report)[("expect_column_values_to_match_regex", "answer")]
    assert result["unexpected_count"] == 25
    assert len(result["unexpected_rows"]) == validation.MAX_SHOWN
    assert result["unexpected_rows"][0] == {"row": 0, "task_id": "train-000000", "answer": ""}
    message = report.describe()
    assert "25 unexpected rows (first 10 shown)" in message
    assert "train-000009" in message and "train-000010" not in message


def test_error_carries_the_report_and_pickles():
    records = make_splits()["train"]
    records[1]["level"] = 7
    with pytest.raises(DataValidationError) as info:
        validate_records(records, "tasks", "train").raise_if_failed()
    assert isinstance(info.value, ValueError)
    assert info.value.report.failures[0]["kwargs"]["column"] == "level"
    clone = pickle.loads(pickle.dumps(info.value))  # Prefect moves exceptions between processes
    assert str(clone) == str(info.value) and clone.report == info.value.report


# ---------------------------------------------------------------------------------------------------- splits


def test_heldout_template_appearing_in_train_fails():
    splits = make_splits()
    splits["train"][0]["template_id"] = "two_lookup/9"  # the test split's unseen template
    report = check_splits(splits)
    assert_fails(report, NOT_IN_SET, "template_id", "test-000002")
    assert failing(report)[(NOT_IN_SET, "template_id")]["unexpected_rows"][0]["split"] == "test"


def test_entity_shared_between_train_and_test_fails():
    splits = make_splits()
    splits["test"][1]["entities"] = ["Widget-test-1", "Widget-train-3"]
    report = check_splits(splits)
    assert_fails(report, "expect_column_values_to_not_be_in_set", "entity", "test-000001")
    row = failing(report)[("expect_column_values_to_not_be_in_set", "entity")]["unexpected_rows"][0]
    assert row == {"split": "test", "row": 1, "task_id": "test-000001", "entity": "Widget-train-3"}


def test_entity_shared_between_train_and_validation_fails():
    splits = make_splits()
    splits["validation"][0]["entities"] = ["Widget-train-0"]
    assert_fails(check_splits(splits), "expect_column_values_to_not_be_in_set", "entity", "validation-000000")


def test_task_id_repeated_across_splits_fails():
    splits = make_splits()
    splits["test"][0]["task_id"] = "train-000002"
    report = check_splits(splits)
    assert_fails(report, "expect_column_values_to_be_unique", "task_id", "train-000002")
    rows = failing(report)[("expect_column_values_to_be_unique", "task_id")]["unexpected_rows"]
    assert {(r["split"], r["row"]) for r in rows} == {("train", 2), ("test", 0)}


@pytest.mark.parametrize("split", ["train", "validation"])
def test_unseen_template_outside_test_fails(split):
    splits = make_splits()
    splits[split][1]["template_seen"] = False
    assert_fails(check_splits(splits), "expect_column_values_to_be_in_set", "template_seen", f"{split}-000001")


def test_seen_test_template_may_appear_in_train():
    splits = make_splits()
    splits["train"][0]["template_id"] = "two_lookup/9"
    splits["test"][2]["template_seen"] = True
    assert check_splits(splits).success


def test_check_splits_requires_train_and_known_names():
    with pytest.raises(ValueError, match="must include 'train'"):
        check_splits({"validation": [], "test": []})
    with pytest.raises(ValueError, match="holdout"):
        check_splits({"train": [], "holdout": []})


# ---------------------------------------------------------------------------------------------------- demos & env


def test_valid_demos_pass():
    demos = [make_demo(i) for i in range(3)] + [make_demo(3, flaw="redundant_call", success=False, **{"return": -0.5})]
    report = validate_records(demos, "demos", "demos/train", task_ids=[f"train-{i:06d}" for i in range(4)])
    assert report.success, report.describe()


DEMO_DEFECTS = {
    "n_calls mismatch": (_set(1, "n_calls", 4), PAIR_EQUAL, "n_calls,n_steps", "demo-00001"),
    "unknown flaw": (_set(0, "flaw", "typo"), IN_SET, "flaw", "demo-00000"),
    "return out of range": (_set(2, "return", 7.5), BETWEEN, "return", "demo-00002"),
    "no steps": (_set(2, "steps", []), BETWEEN, "n_steps", "demo-00002"),
    "unknown task": (_set(0, "task_id", "train-999999"), IN_SET, "task_id", "demo-00000"),
    "step without observation": (_set(1, "steps", [{"action": "a"}]), IN_SET, "steps_well_formed", "demo-00001"),
}


@pytest.mark.parametrize("defect", list(DEMO_DEFECTS))
def test_demo_defect_fails(defect):
    mutate, expectation, column, demo_id = DEMO_DEFECTS[defect]
    demos = [make_demo(i) for i in range(3)]
    mutate(demos)
    report = validate_records(demos, "demos", "demos/train", task_ids=[f"train-{i:06d}" for i in range(3)])
    assert_fails(report, expectation, column, demo_id, id_key="demo_id")


def test_products_suppliers_corpus_pass():
    products, suppliers = make_products(), make_suppliers()
    assert validate_records(
        products, "products", "products", categories=["tools", "food"], supplier_names=[s["name"] for s in suppliers]
    ).success
    assert validate_records(suppliers, "suppliers", "suppliers", product_names=[p["name"] for p in products]).success
    assert validate_records(make_corpus(), "corpus", "corpus").success


def test_products_from_a_frame():
    """An exported table validates as a DataFrame directly (string columns in pandas' `str` dtype, as `read_sql`
    returns them); rows are numbered by position."""
    df = pd.DataFrame(make_products())
    assert df["name"].dtype != object  # pandas 3 infers `str`
    assert validate(df, "products", dataset="world.sqlite:products").success
    df.loc[2, "price"] = 0
    report = validate(df, "products", dataset="world.sqlite:products")
    assert_fails(report, "expect_column_values_to_be_between", "price", 2, id_key="product_id")
    assert failing(report)[("expect_column_values_to_be_between", "price")]["unexpected_rows"][0]["row"] == 2


@pytest.mark.parametrize(
    "suite, records, mutate, expectation, column, offending_id, kwargs",
    [
        ("products", make_products, _set(1, "category", "toys"), IN_SET, "category", 1, {"categories": ["tools"]}),
        ("products", make_products, _set(3, "weight_kg", 80.0), BETWEEN, "weight_kg", 3, {}),
        ("products", make_products, _set(0, "name", "Widget-1"), UNIQUE, "name", 0, {}),
        ("suppliers", make_suppliers, _set(1, "name", "Acme-0"), UNIQUE, "name", 1, {}),
        ("suppliers", make_suppliers, _set(0, "flagship", "Gizmo"), IN_SET, "flagship", 0, {"product_names": ["W"]}),
        ("corpus", make_corpus, _set(2, "text", "y" * 1001), LENGTHS, "text", "doc-2", {}),
        ("corpus", make_corpus, _set(1, "title", ""), REGEX, "title", "doc-1", {}),
    ],
)
def test_environment_defects_fail(suite, records, mutate, expectation, column, offending_id, kwargs):
    data = records()
    mutate(data)
    report = validate_records(data, suite, suite, **kwargs)
    id_key = validation.SUITES[suite].id_column
    assert_fails(report, expectation, column, offending_id, id_key=id_key)


# ---------------------------------------------------------------------------------------------------- registry


def test_unknown_suite_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown suite 'taks'.*'tasks'"):
        validate_records([], "taks", "x")


def test_unknown_suite_parameter_is_an_error():
    with pytest.raises(TypeError):
        validate_records(make_corpus(), "corpus", "corpus", max_len=5)
    with pytest.raises(ValueError, match="unknown split"):
        validate_records(make_splits()["train"], "tasks", "train", split="dev")


def test_the_shop_suites_register_once_and_the_machinery_knows_none(monkeypatch):
    import subprocess
    import sys

    expected = {"tasks": "task_id", "demos": "demo_id", "products": "product_id", "suppliers": "supplier_id",
                "corpus": "doc_id", "trajectories": "task_id", "evaluation": "task_id"}
    monkeypatch.setattr(validation, "SUITES", {})
    assert register_suites() == list(expected) == register_suites()  # a second call registers nothing twice
    assert {name: spec.id_column for name, spec in validation.SUITES.items()} == expected
    # the generic machinery, imported alone, registers nothing and imports nothing of the environment
    code = ("import sys, pipeline.core.validation as v; "
            "print(sorted(v.SUITES), any(m.startswith('pipeline.env') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "False"]


def test_a_new_suite_registers_and_flattens(monkeypatch):
    """How a later phase adds a suite: a builder, an id column, and (optionally) derived columns."""
    monkeypatch.setattr(validation, "SUITES", dict(validation.SUITES))  # keep the registration local to this test

    def derive(df):
        return {"n_tokens": [len(t) for t in df["tokens"]]}

    @register_suite("example_rollouts", id_column="episode_id", derive=derive)
    def trajectories_suite(max_tokens: int = 4):
        """Rollout trajectories."""
        import great_expectations.expectations as gxe

        return [gxe.ExpectColumnValuesToBeBetween(column="n_tokens", min_value=1, max_value=max_tokens)]

    records = [{"episode_id": "e0", "tokens": [1, 2]}, {"episode_id": "e1", "tokens": [1, 2, 3, 4, 5]}]
    frame = flatten_records(records, "example_rollouts")
    assert frame["tokens"].tolist() == ["[1, 2]", "[1, 2, 3, 4, 5]"]  # nested lists become JSON strings
    assert frame["_row"].tolist() == [0, 1]
    report = validate_records(records, "example_rollouts", "rollouts")
    assert_fails(report, "expect_column_values_to_be_between", "n_tokens", "e1", id_key="episode_id")
    assert validation.SUITES["example_rollouts"].description == "Rollout trajectories."
    with pytest.raises(ValueError, match="already registered"):
        register_suite("example_rollouts", id_column="episode_id")(trajectories_suite)


@pytest.mark.slow
def test_concurrent_validations_do_not_interfere():
    """Prefect may run tasks in threads: each call has its own context, so results stay separate."""
    good = make_splits()["train"]
    bad = copy.deepcopy(good)
    bad[0]["level"] = 9

    def run(i):
        return validate_records(bad if i % 2 else good, "tasks", f"d{i}", split="train")

    with ThreadPoolExecutor(4) as pool:
        reports = list(pool.map(run, range(8)))
    assert [r.success for r in reports] == [i % 2 == 0 for i in range(8)]
    assert all(r.dataset == f"d{i}" for i, r in enumerate(reports))


# ---------------------------------------------------------------------------------------------------- scale


@pytest.mark.slow  # about 4 s on a quiet 2-core machine, 8-12 s under load (generation + flattening + GX)
def test_validates_100k_task_rows():
    """100k rows: the whole suite runs, valid rows pass, and the one bad row deep in the file is named."""
    records = [make_task(i) for i in range(100_000)]
    records[98_765]["level"] = 0
    report = validate_records(records, "tasks", "train", split="train")
    assert report.n_rows == 100_000
    assert [(r["expectation"], r["kwargs"]["column"]) for r in report.failures] == [
        ("expect_column_values_to_be_in_set", "level")
    ]
    assert report.failures[0]["unexpected_rows"] == [{"row": 98_765, "task_id": "train-098765", "level": 0}]
