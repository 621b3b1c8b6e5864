"""The wording grammar of the SQL analyst's questions (`pipeline/envs/sql/wordings.py`): many wordings per family for
train and validation, never the held-out test wording or its construction, and grammar frames as generation slices."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.envs.sql.generate import slice_choices
from pipeline.envs.sql.tasks import BY_NAME, FAMILIES, HELDOUT_TEMPLATE, TRAIN_TEMPLATES
from pipeline.envs.sql.wordings import FRAMES, GRAMMAR_BASE, draw, surface_forms

SLOTS = {"city": "Lyon", "segment": "retail", "status": "shipped", "d1": "2023-04-03", "d2": "2023-04-12",
         "category": "books", "threshold": 50, "month": "2023-04", "channel": "web", "k": 3, "k1": 4,
         "metric": "units", "m": "SUM(quantity)", "mw": "units ordered"}

# the construction of each family's held-out wording (index 4), which no grammar frame may use
HELDOUT_CONSTRUCTIONS = {
    "count_customers": ("in 'lyon', how many",), "count_orders_range": ("give the count",),
    "count_products": ("of the 'books' products,", "more expensive than"),
    "revenue_month": ("for '2023-04',", "combined", "whose status is"),
    "avg_order_month": ("across ", "what is the mean total"),
    "stock_category": ("taking ", "more expensive than", "hold together"),
    "orders_city_status": ("placed orders;", "of those orders"),
    "revenue_city_month": ("in '2023-04', what", "combined"),
    "units_category_month": ("included", "altogether", "products;"),
    "top_products": ("and give the first",), "top_customers": ("and give the first",),
    "top_products_month": ("and give the first",),
    "max_spend": ("summing ", "the maximum"),
}


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_each_family_has_hundreds_of_wordings_and_never_the_heldout_one(family):
    fixed = BY_NAME[family].wordings
    forms = surface_forms(family, SLOTS, fixed, list(TRAIN_TEMPLATES))
    assert len(forms) >= 300, (family, len(forms))
    heldout = fixed[HELDOUT_TEMPLATE].format(**SLOTS)
    assert not any(heldout.rstrip("?.") in q for q in forms)
    for marker in HELDOUT_CONSTRUCTIONS[family]:
        assert not any(marker in q.lower() for q in forms), marker
    # every fixed training wording is among them as written, and every value stays quoted as the SQL writes it
    assert all(fixed[t].format(**SLOTS) in forms for t in TRAIN_TEMPLATES)
    for q in forms:
        for slot in ("city", "segment", "status", "category", "month", "channel", "d1", "d2"):
            if "{" + slot + "}" in fixed[0]:
                assert f"'{SLOTS[slot]}'" in q, (slot, q)
        assert q[0].isupper() and q.rstrip()[-1] in ".?!", q


def test_draw_is_reproducible_and_its_template_ids_count_sentence_patterns():
    fixed = BY_NAME["max_spend"].wordings
    same = {draw("max_spend", SLOTS, [0, 1, 2, 3], fixed, np.random.default_rng(7)) for _ in range(3)}
    assert len(same) == 1
    rng = np.random.default_rng(0)
    ids = {draw("max_spend", SLOTS, [0, 1, 2, 3], fixed, rng)[1] for _ in range(400)}
    assert ids == {0, 1, 2, 3} | set(range(GRAMMAR_BASE, GRAMMAR_BASE + len(FRAMES["max_spend"])))
    q, tid = draw("max_spend", SLOTS, [], fixed, rng, frame=2)  # one grammar frame, asked for
    assert tid == GRAMMAR_BASE + 2 and "'Lyon'" in q
    q, tid = draw("max_spend", SLOTS, [1], fixed, rng)  # one fixed wording, asked for
    assert tid == 1 and q.startswith(fixed[1].format(**SLOTS))


def test_a_generation_slice_may_name_a_grammar_frame_but_never_the_heldout_wording():
    assert slice_choices({"template_id": f"top_products/{GRAMMAR_BASE + 1}"}) == (
        ["top_products"], [GRAMMAR_BASE + 1])
    assert slice_choices({"family": "top_products"}) == (["top_products"], list(TRAIN_TEMPLATES))
    with pytest.raises(ValueError, match="held out of training"):
        slice_choices({"template_id": f"top_products/{HELDOUT_TEMPLATE}"})
    with pytest.raises(ValueError, match="unknown wording"):
        slice_choices({"template_id": f"top_products/{GRAMMAR_BASE + len(FRAMES['top_products'])}"})
