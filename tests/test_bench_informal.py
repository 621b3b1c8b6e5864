"""bench/informal_wording.py: the informal questions carry each task's values, come in both quotings, are never a
question the training grammar can write, and are the same on every machine (known answers); bad input is one error
line and the project is only read."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.tasks import FAMILIES, FIELD_WORDS, TEMPLATES, TRAIN_TEMPLATES, UNIT_WORDS, generate_tasks
from pipeline.envs.shop.wordings import surface_forms

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_informal", ROOT / "bench" / "informal_wording.py")
informal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(informal)


@pytest.fixture(scope="module")
def test_tasks():
    runtime = ShopWorld.default()
    try:
        yield [t.to_dict() for t in generate_tasks(runtime.world, "test", 120, {1: 1, 2: 1, 3: 1, 4: 1}, seed=0,
                                                   solver=lambda p, w: runtime.solve(p, w))]
    finally:
        runtime.close()


def test_every_family_has_frames_and_every_question_carries_its_task_values(test_tasks):
    assert set(informal.FRAMES) == set(FAMILIES) and {t["family"] for t in test_tasks} == set(FAMILIES)
    for task in test_tasks:
        quoted, bare = informal.informal(task), informal.informal(task, quoted=False)
        slots = informal.slots(task)
        for name in slots["names"] + ([slots["supplier"]] if "supplier" in slots else []):
            assert f'"{name}"' in quoted and name in bare and f'"{name}"' not in bare
        if "n" in slots:
            assert slots["n"] in bare
        assert '"' not in bare and quoted.replace('"', "") == bare


def test_no_informal_question_is_one_the_training_grammar_writes(test_tasks):
    for task in test_tasks[:40]:
        s = informal.slots(task)  # the grammar's slots of the task, from its plan
        slots = {"p": s["names"][0] if s["names"] else "", "q": s["names"][1] if len(s["names"]) > 1 else "",
                 "s": s.get("supplier", ""), "n": s.get("n", ""), "field": s.get("field", ""),
                 "f": FIELD_WORDS.get(s.get("field"), ""), "unit": s.get("unit", ""),
                 "u": UNIT_WORDS.get(s.get("unit"), "")}
        forms = {q.lower() for q in surface_forms(task["family"], slots, TEMPLATES[task["family"]],
                                                  list(TRAIN_TEMPLATES[:4]))}
        assert len(forms) >= 200
        for q in (informal.informal(task), informal.informal(task, quoted=False)):
            assert q.lower() not in forms


def test_known_answers_for_one_task_in_both_quotings():
    task = {"task_id": "test-000003", "family": "lookup_convert",
            "plan": [{"tool": "lookup", "params": {"name": "Bright Compass", "field": "weight_kg"}},
                     {"tool": "convert", "params": {"value": "{0}", "from": "kg", "to": "g"}},
                     {"tool": "answer", "params": {"value": "{1}"}}]}
    assert informal.informal(task) == 'whats "Bright Compass" weigh in g'
    assert informal.informal(task, quoted=False) == "whats Bright Compass weigh in g"


def _project(root: Path, env: str = "shop") -> Path:
    (root / "data" / "env").mkdir(parents=True)
    (root / "data" / "tasks").mkdir()
    (root / "data" / "tasks" / "test.jsonl").write_text("")
    (root / "models" / "policy").mkdir(parents=True)
    (root / "models" / "policy" / "policy.json").write_text("{}")
    (root / "params.yaml").write_text(f"env:\n  name: {env}\n  max_steps: 8\n  max_policy_chars: 2048\n"
                                      f"  max_action_chars: 256\nrollout:\n  max_new_tokens: 48\n")
    return root


@pytest.mark.parametrize("case, args, expected", [
    ("no project", ["--project", "{root}/nowhere"], "error: {root}/nowhere: no params.yaml (run the pipeline's "
                                                     "build_env there first)"),
    ("negative limit", ["--project", "{root}", "--limit", "-1"], "error: --limit -1: expected 0 (all test tasks) or "
                                                                  "a positive number"),
    ("no such policy", ["--project", "{root}", "--policies", "models/adapted"],
     "error: --policies: {root}/models/adapted is not a saved policy (no policy.json)"),
])
def test_bad_input_is_one_error_line_before_anything_loads(tmp_path, capsys, case, args, expected):
    root = _project(tmp_path / "p")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert informal.main([a.format(root=root) for a in args]) == 2, case
    assert capsys.readouterr().err.strip().splitlines() == [expected.format(root=root)]
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # it only reads


def test_a_project_of_another_world_is_one_error_line(tmp_path, capsys):
    root = _project(tmp_path / "p", env="calendar")
    assert informal.main(["--project", str(root), "--policies", "models/policy"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {root}: params.yaml: env.name is 'calendar'; the informal questions are the default world's (shop)"]
