"""The memo of passed validations (pipeline.core.validation_memo): a hit gives GX's own results, a miss runs GX,
and nothing that could change the answer shares a key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from pipeline.core import validation, validation_memo
from pipeline.core.validation import register_suite, validate_records


@pytest.fixture
def memo_dir(tmp_path, monkeypatch):
    folder = tmp_path / "memo"
    monkeypatch.setenv("AGENTRL_VALIDATION_MEMO", str(folder))
    monkeypatch.setattr(validation, "SUITES", dict(validation.SUITES))
    return folder


@pytest.fixture
def gx_runs(monkeypatch):
    """Count the calls that reach GX."""
    calls = []
    real = validation._run_gx

    def counting(*args, **kwargs):
        calls.append(kwargs.get("name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(validation, "_run_gx", counting)
    return calls


def _register(max_value: int = 9):
    @register_suite("memo_example", id_column="item_id")
    def suite(limit: int = max_value):
        """Items with a bounded count."""
        import great_expectations.expectations as gxe

        return [gxe.ExpectColumnValuesToBeBetween(column="count", min_value=0, max_value=limit),
                gxe.ExpectColumnValuesToBeOfType(column="count", type_="int")]


RECORDS = [{"item_id": "a", "count": 1}, {"item_id": "b", "count": 3}]


def files(folder):
    return sorted(folder.rglob("*.json")) if folder.exists() else []


def test_a_pass_is_kept_and_a_second_call_returns_it_without_gx(memo_dir, gx_runs):
    _register()
    first = validate_records(RECORDS, "memo_example", "one.jsonl")
    assert first.success and gx_runs == ["memo_example"] and len(files(memo_dir)) == 1
    second = validate_records(RECORDS, "memo_example", "two.jsonl")
    assert gx_runs == ["memo_example"]  # no second GX run
    assert second.results == first.results and second.summary() == first.summary()
    assert second.dataset == "two.jsonl" and second.n_rows == 2


def test_a_failure_is_never_kept(memo_dir, gx_runs):
    _register()
    bad = [{"item_id": "a", "count": 1}, {"item_id": "b", "count": 30}]
    for _ in range(2):
        report = validate_records(bad, "memo_example", "bad.jsonl")
        assert not report.success and report.failures[0]["unexpected_rows"][0]["item_id"] == "b"
    assert gx_runs == ["memo_example"] * 2 and files(memo_dir) == []


@pytest.mark.parametrize("change", ["value", "type", "params", "column", "suite"])
def test_anything_that_changes_the_answer_changes_the_key(memo_dir, gx_runs, change):
    _register()
    assert validate_records(RECORDS, "memo_example", "d").success
    records, params = [dict(r) for r in RECORDS], {}
    if change == "value":
        records[1]["count"] = 4
    elif change == "type":
        records[1]["count"] = "3"  # the same text, another type: GX fails it
    elif change == "params":
        params = {"limit": 2}  # 3 > 2 fails
    elif change == "column":
        records = [{**r, "note": "x"} for r in records]
    else:  # the same name, another builder: a different suite
        validation.SUITES.pop("memo_example")
        _register(max_value=2)
    report = validate_records(records, "memo_example", "d", **params)
    assert len(gx_runs) == 2
    assert report.success is (change in ("value", "column"))


def test_sets_in_parameters_give_one_key_whatever_the_hash_seed():
    code = ("import pandas as pd; from pipeline.core import validation_memo as m, validation as v; "
            "spec = v.SuiteSpec('s', 'id', print, None, ''); "
            "print(m.key(spec, {'known': {'alpha', 'beta', 'gamma', 'delta'}}, pd.DataFrame({'id': ['x']})))")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in "123"}
    assert len(keys) == 1


def test_off_runs_gx_every_time(tmp_path, monkeypatch, gx_runs):
    monkeypatch.setenv("AGENTRL_VALIDATION_MEMO", "off")
    monkeypatch.setattr(validation, "SUITES", dict(validation.SUITES))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _register()
    for _ in range(2):
        assert validate_records(RECORDS, "memo_example", "d").success
    assert len(gx_runs) == 2 and not (tmp_path / "cache").exists()


def test_a_damaged_entry_is_a_miss_and_is_replaced(memo_dir, gx_runs):
    _register()
    validate_records(RECORDS, "memo_example", "d")
    (entry,) = files(memo_dir)
    entry.write_text("{not json")
    assert validate_records(RECORDS, "memo_example", "d").success
    assert len(gx_runs) == 2 and json.loads(entry.read_text())["format"] == validation_memo.FORMAT


@pytest.mark.slow
def test_a_hit_in_a_new_process_does_not_import_great_expectations(memo_dir):
    """What the memo is for: a phase that re-reads validated data pays neither GX's import nor its run."""
    script = "\n".join([
        "import sys",
        "import pandas as pd",
        "from pipeline.core.validation import register_suite, validate",
        "@register_suite('probe', id_column='name')",
        "def probe():",
        "    import great_expectations.expectations as gxe",
        "    return [gxe.ExpectColumnValuesToNotBeNull(column='n')]",
        "report = validate(pd.DataFrame({'name': ['a', 'b'], 'n': [1, 2]}), 'probe')",
        "print(report.success, 'great_expectations' in sys.modules)",
    ])
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert runs == [["True", "True"], ["True", "False"]]


def test_the_frame_is_hashed_with_its_dtypes():
    spec = validation.SuiteSpec("s", "id", print, None, "")
    ints = pd.DataFrame({"id": ["x", "y"], "n": [1, 2]})
    floats = ints.astype({"n": float})
    assert validation_memo.key(spec, {}, ints) != validation_memo.key(spec, {}, floats)
    assert validation_memo.key(spec, {}, ints) == validation_memo.key(spec, {}, ints.copy())
