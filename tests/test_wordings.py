"""The compositional grammar of shop questions (`pipeline/envs/shop/wordings.py`, ``build_env.options.wordings``):
hundreds of wordings per family for train and validation, and never the held-out test wording or its construction."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.tasks import (FAMILIES, HELDOUT_TEMPLATE, TEMPLATES, TRAIN_TEMPLATES, _slots,
                                      generate_tasks)
from pipeline.envs.shop.wordings import GRAMMAR_BASE, draw, surface_forms

# the construction of each family's held-out wording (template 4), which no grammar frame may use
HELDOUT_CONSTRUCTIONS = {
    "lookup": "for the product", "lookup_calc": "what do i pay", "lookup_convert": "the mass of one",
    "search_lookup": "has a flagship product;", "two_lookup": "taken together",
    "update": "book an incoming shipment", "search_lookup_calc": "has a flagship product;",
}


@pytest.fixture(scope="module")
def runtime():
    rt = ShopWorld.default()
    yield rt
    rt.close()


def _slot_draws(world, family, n=4):
    rng = np.random.default_rng(0)
    return [_slots(family, "train", world, rng)[0] for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_has_hundreds_of_wordings_and_never_the_heldout_one(family, runtime):
    seen = list(TRAIN_TEMPLATES[:4])
    for slots in _slot_draws(runtime.world, family):
        forms = surface_forms(family, slots, TEMPLATES[family], seen)
        assert len(forms) >= 200, (family, len(forms))
        heldout = TEMPLATES[family][HELDOUT_TEMPLATE].format(**slots)
        assert not any(heldout in q for q in forms)
        marker = HELDOUT_CONSTRUCTIONS[family]
        assert not any(marker in q.lower() for q in forms), marker
        # every fixed training wording is still among them, as written
        assert all(TEMPLATES[family][t].format(**slots) in forms for t in seen)


def test_draw_is_reproducible_and_its_template_ids_count_sentence_patterns(runtime):
    slots = _slot_draws(runtime.world, "lookup", 1)[0]
    same = {draw("lookup", slots, [0, 1, 2, 3], TEMPLATES["lookup"], np.random.default_rng(7)) for _ in range(3)}
    assert len(same) == 1
    rng = np.random.default_rng(0)
    ids = {draw("lookup", slots, [0, 1, 2, 3], TEMPLATES["lookup"], rng)[1] for _ in range(400)}
    assert {0, 1, 2, 3} <= ids and max(ids) >= GRAMMAR_BASE and HELDOUT_TEMPLATE not in ids
    # a fixed frame is drawn alone when asked for
    q, tid = draw("lookup", slots, [0, 1, 2, 3], TEMPLATES["lookup"], rng, frame=0)
    assert tid == GRAMMAR_BASE and slots["p"] in q


def test_grammar_widens_train_and_validation_and_leaves_test_byte_for_byte(runtime):
    def gen(split, grammar, n=400):
        return generate_tasks(runtime.world, split, n, {1: 1, 2: 1, 3: 1, 4: 1}, seed=0,
                              solver=lambda p, w: runtime.solve(p, w), grammar=grammar)

    for split in ("train", "validation"):
        tasks = gen(split, True)
        ids = {t.template_id for t in tasks}
        assert all(t.template_seen for t in tasks)
        assert not any(tid.endswith(f"/{HELDOUT_TEMPLATE}") for tid in ids)
        assert len(ids) > 4 * len(FAMILIES)  # more sentence patterns than the four fixed wordings
        for t in tasks:
            assert HELDOUT_CONSTRUCTIONS[t.family] not in t.question.lower(), t.question
    assert [t.to_dict() for t in gen("test", True)] == [t.to_dict() for t in gen("test", False)]
