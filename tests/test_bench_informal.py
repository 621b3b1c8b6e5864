"""bench/informal_wording.py: the informal questions carry each task's values, come in both quotings, and are never
a question the training grammar can write."""

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
        assert quoted == informal.informal(task)  # the same question every run
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
                 "f": FIELD_WORDS.get(s.get("field"), ""), "unit": s.get("unit", ""), "u": UNIT_WORDS.get(s.get("unit"), "")}
        forms = {q.lower() for q in surface_forms(task["family"], slots, TEMPLATES[task["family"]],
                                                  list(TRAIN_TEMPLATES[:4]))}
        assert len(forms) >= 200
        for q in (informal.informal(task), informal.informal(task, quoted=False)):
            assert q.lower() not in forms
