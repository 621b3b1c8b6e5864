"""Incoming production tasks for RL (:mod:`pipeline.train.incoming`): tasks naming held-out entities or test-only
templates, copies and unverifiable tasks dropped and counted, colliding ids renamed, a schema-breaking file refused
with its name; and the folder's place in the graph (a dep of `train` and `check_drift`, a README that no reader
mistakes for tasks).

Everything runs on the generator's small default world; no test trains a model (tests/test_train.py runs the worker).
"""

from __future__ import annotations

import doctest
import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.tasks import generate_tasks
from pipeline.envs.taskfile import write_tasks
from pipeline.core.errors import AgentRLError
from pipeline.train.incoming import DROP_REASONS, load_incoming, read_incoming, select_incoming

ROOT = Path(__file__).resolve().parents[1]
MIX = {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}


@pytest.fixture(scope="module")
def runtime():
    rt = ShopWorld.default()  # the generator's small world, seed 0
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def splits(runtime):
    """Training, validation and test tasks of the default world, and fresh training-entity tasks none of them has."""
    solve = lambda plan, allowed: runtime.solve(plan, allowed)  # noqa: E731
    made = {split: generate_tasks(runtime.world, split, n, MIX, seed=0, solver=solve)
            for split, n in (("train", 40), ("validation", 10), ("test", 40))}
    questions = {t.question for t in made["train"]}
    made["fresh"] = [t for t in generate_tasks(runtime.world, "train", 40, MIX, seed=1, solver=solve)
                     if t.question not in questions][:6]
    assert len(made["fresh"]) == 6 and any(not t.template_seen for t in made["test"])
    return made


def test_doctests():
    import pipeline.train.incoming as mod

    result = doctest.testmod(mod)
    assert result.attempted > 0 and result.failed == 0


def test_held_out_entities_templates_copies_and_unverifiable_tasks_are_dropped_and_counted(runtime, splits):
    train, fresh = splits["train"], splits["fresh"]
    heldout = next(t for t in splits["test"] if not t.template_seen)
    a = [
        fresh[0],                                                         # used
        splits["validation"][0],                                          # names a validation entity
        splits["test"][0],                                                # names a test entity
        replace(fresh[1], template_id=heldout.template_id, template_seen=False),  # a test-only template
        replace(train[3], task_id="prod-17"),                             # a training task under another id
        replace(fresh[2], task_id=train[0].task_id),                      # a new task whose id a training task has
        replace(fresh[3], answer="123456789"),                            # the world gives another answer
        replace(fresh[4], plan=[{"tool": "lookup", "params": {"name": "No Such Thing", "field": "price"}},
                                *fresh[4].plan[1:]]),                     # names a product the world lacks
    ]
    b = [replace(fresh[0], task_id="again"), fresh[5]]                   # a copy of a.jsonl's first task; used
    used, counts = select_incoming([("in/a.jsonl", a), ("in/b.jsonl", b)], train, runtime.leaks_heldout,
                                   {heldout.template_id}, verify=runtime.verify_task)
    assert counts == {"dropped_heldout_entities": 2, "dropped_heldout_templates": 1, "dropped_duplicates": 2,
                      "dropped_unverifiable": 2}
    assert [t.task_id for t in used] == [f"incoming/a/{fresh[0].task_id}", f"incoming/a/{train[0].task_id}",
                                         f"incoming/b/{fresh[5].task_id}"]
    assert [t.question for t in used] == [fresh[0].question, fresh[2].question, fresh[5].question]
    assert not {t.task_id for t in used} & {t.task_id for t in train}  # the trainer picks tasks by id
    # each task counts once, under the first reason: a validation task is a held-out-entity drop, whatever else holds
    assert sum(counts.values()) + len(used) == len(a) + len(b)


def test_held_out_entities_are_the_validation_and_test_partition(runtime, splits):
    def held_out(name):  # one entity on its own
        return runtime.leaks_heldout(replace(splits["train"][0], entities=[name]))

    assert all(held_out(e) for t in splits["validation"] + splits["test"] for e in t.entities)
    assert not any(held_out(e) for t in splits["train"] for e in t.entities)
    assert all(runtime.leaks_heldout(t) for t in splits["validation"] + splits["test"])
    assert not any(runtime.leaks_heldout(t) for t in splits["train"])


def test_load_incoming_reads_only_jsonl_files_and_summarises(tmp_path, runtime, splits):
    folder = tmp_path / "incoming"
    folder.mkdir()
    (folder / "README.md").write_text("# not tasks\n")
    args = {"train_tasks": splits["train"], "test_tasks": splits["test"], "runtime": runtime}
    empty = load_incoming(folder, **args)
    assert empty.tasks == [] and empty.digest is None and empty.summary["files"] == 0
    write_tasks([*splits["fresh"][:2], splits["validation"][1]], folder / "batch-1.jsonl")
    got = load_incoming(folder, **args)
    assert got.summary == {"dir": str(folder), "files": 1, "read": 3, "tasks": 2, "dropped_heldout_entities": 1,
                           "dropped_heldout_templates": 0, "dropped_duplicates": 0, "dropped_unverifiable": 0}
    assert got.digest and got.digest == load_incoming(folder, **args).digest
    assert "2 of 3 from 1 file(s)" in got.describe() and "heldout_entities 1" in got.describe()
    for missing in (None, tmp_path / "absent"):  # disabled, or nothing has arrived yet
        s = load_incoming(missing, **args).summary
        assert s["files"] == s["tasks"] == 0 and set(DROP_REASONS) <= set(s)


@pytest.mark.parametrize("line, message", [
    ('{"task_id": "x", "question": "truncated...', r"bad\.jsonl:2: not valid JSON"),
    (None, "expect_column_values_to_be_in_set"),  # level 9: parses, but breaks the "tasks" suite
])
def test_a_file_that_breaks_the_schema_is_refused_naming_the_file(tmp_path, runtime, splits, line, message):
    (tmp_path / "good.jsonl").write_text(json.dumps(splits["fresh"][0].to_dict()) + "\n")
    rows = [splits["fresh"][1].to_dict(), {**splits["fresh"][2].to_dict(), "level": 9}]
    text = json.dumps(rows[0]) + "\n" + (line if line is not None else json.dumps(rows[1])) + "\n"
    (tmp_path / "bad.jsonl").write_text(text)
    with pytest.raises(AgentRLError, match="incoming task file .*bad.jsonl breaks the task schema") as err:
        read_incoming(tmp_path, runtime)
    assert re.search(message, str(err.value))
    (tmp_path / "bad.jsonl").unlink()
    assert [len(tasks) for _, tasks in read_incoming(tmp_path, runtime)] == [1]
    (tmp_path / "not-a-folder.txt").write_text("")
    with pytest.raises(AgentRLError, match="is not a folder"):
        read_incoming(tmp_path / "not-a-folder.txt", runtime)


def test_train_and_check_drift_depend_on_the_folder_that_train_reads():
    from pipeline.core.graph import load_stages
    from pipeline.train.config import TrainConfig

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stages = {s.name: s for s in load_stages(ROOT / "dvc.yaml")}
    assert params["train"]["incoming_tasks"] == TrainConfig().incoming_tasks == "data/incoming"
    assert "data/incoming" in stages["train"].deps and "data/incoming" in stages["check_drift"].deps
    # a DVC dep must exist in a fresh clone: the folder's README is tracked by git, not ignored
    readme = ROOT / "data" / "incoming" / "README.md"
    assert readme.is_file() and "held-out" in readme.read_text()
    ignored = subprocess.run(["git", "check-ignore", "-q", str(readme)], cwd=ROOT)
    assert ignored.returncode == 1


def test_check_drift_ignores_a_readme_in_the_folder(tmp_path, monkeypatch, splits):
    from pipeline.check_drift.config import DriftConfig
    from pipeline.check_drift.main import INCOMING_DIR, VALIDATION_TASKS, current_source

    monkeypatch.chdir(tmp_path)
    INCOMING_DIR.mkdir(parents=True)
    (INCOMING_DIR / "README.md").write_text("# not tasks\n")
    assert current_source(DriftConfig()) == VALIDATION_TASKS  # no *.jsonl: the validation split stands in
    write_tasks(splits["fresh"][:1], INCOMING_DIR / "batch.jsonl")
    assert current_source(DriftConfig()) == INCOMING_DIR

