"""Tasks: a seeded generator of families × difficulty levels, each task with its plan and ground-truth answer.

A task carries a *plan*: the minimal sequence of tool calls that solves it, whose parameters may refer to earlier
results (``"{0}"`` is the result of step 0; ``"{0:quoted}"`` the last double-quoted name inside it). Running the plan against
the world (:func:`run_plan`) gives the ground truth; the scripted expert runs the same plan inside the environment,
reading each result from its observation. `min_calls` is the plan's length, the final `answer` included.

Families and levels:

=====  ====================  ===========================================  =========
level  family                plan                                          min_calls
=====  ====================  ===========================================  =========
1      lookup                lookup → answer                                2
2      lookup_calc           lookup → calc → answer                         3
2      lookup_convert        lookup → convert → answer                      3
2      search_lookup         search → lookup → answer                       3
3      two_lookup            lookup → lookup → calc → answer                4
3      update                lookup → calc → update → answer (safety)       4
4      search_lookup_calc    search → lookup → calc → answer                4
=====  ====================  ===========================================  =========

Long tasks (optional, build option ``long_task_share``, 0 by default): the family ``long_sum`` (level 4) asks for the
total price or stock of K products (``long_task_lookups``, at most the split's products): K lookups → calc → answer,
min_calls K + 2. With K above ``env.history_window`` the early lookups leave the verbatim window, and with K well above
it (20 against the default window of 6) they overflow the summary line too, so a policy that does not keep them in a
``note`` (:mod:`pipeline.envs.context_actions`) no longer sees them when it must add them up. They are drawn after the
regular tasks from their own random stream, so the regular tasks of a build with long tasks are those of a build
without them (the first ones), and with a share of 0 nothing changes.

Generalisation: every family has nine fixed question templates (wordings), and with the build option
``wordings: grammar`` (the default) train and validation draw from a compositional grammar around the training ones
(:mod:`pipeline.envs.shop.wordings`, hundreds of wordings per family). Index 4 is *held out*: it never appears in train
or validation and is used only in test (`template_seen` = False), next to the seen ones. Train and validation draw from
the first `train_wordings` of the training wordings :data:`TRAIN_TEMPLATES` (0-3, then 5-8); test always draws from
the original five (0-4), so the test split is the same whatever `train_wordings` is, and results stay comparable.

Entity names are written in double quotes everywhere a policy reads them (questions, documents), exactly as they
appear inside a JSON call: the token before a name is then the same in the question and in the call, which is what
lets a small model learn to copy names it never saw in training. Entities are partitioned by `pipeline.envs.shop.world`,
so validation and test tasks name only products and suppliers that no training task names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.envs.shop.wordings import draw as draw_wording
from pipeline.envs.shop.world import World

FAMILIES = ("lookup", "lookup_calc", "lookup_convert", "search_lookup", "two_lookup", "update", "search_lookup_calc")
FAMILY_LEVEL = {"lookup": 1, "lookup_calc": 2, "lookup_convert": 2, "search_lookup": 2, "two_lookup": 3, "update": 3,
                "search_lookup_calc": 4}
LONG_FAMILY = "long_sum"  # not in FAMILIES: the regular draw must not change when long tasks exist
ALL_FAMILIES = FAMILIES + (LONG_FAMILY,)
FAMILY_LEVEL[LONG_FAMILY] = 4
MAX_QUESTION_CHARS = 400
LONG_TEMPLATES = ("What is the total {f} of {items}?", "Add up the {f} of {items}.")
HELDOUT_TEMPLATE = 4  # index of the test-only template in every family
TEST_TEMPLATES = HELDOUT_TEMPLATE + 1  # test draws from templates 0..4: four training wordings and the held-out one
TRAIN_TEMPLATES = (0, 1, 2, 3, 5, 6, 7, 8)  # train/validation draw from the first `train_wordings` of these
FIELD_WORDS = {"price": "price", "stock": "stock", "supplier": "supplier", "category": "category"}
UNIT_WORDS = {"lb": "pounds", "g": "grams", "oz": "ounces"}

TEMPLATES: dict[str, tuple[str, ...]] = {
    "lookup": (
        "What is the {f} of \"{p}\"?",
        "Look up the {f} of \"{p}\".",
        "Find the {f} for \"{p}\".",
        "I need the {f} of \"{p}\".",
        "For the product \"{p}\", what is its {f}?",
        "Tell me the {f} of \"{p}\".",
        "\"{p}\": what {f} does it have?",
        "Could you check the {f} of \"{p}\"?",
        "Please report the {f} listed for \"{p}\".",
    ),
    "lookup_calc": (
        "How much do {n} units of \"{p}\" cost?",
        "What is the total price of {n} \"{p}\"?",
        "What would {n} of \"{p}\" cost in total?",
        "Compute the cost of buying {n} units of \"{p}\".",
        "If I order {n} pieces of \"{p}\", what do I pay?",
        "Tell me the price of {n} \"{p}\" together.",
        "What is the cost of {n} units of \"{p}\"?",
        "I want {n} of \"{p}\"; how much is that?",
        "Price out an order of {n} \"{p}\".",
    ),
    "lookup_convert": (
        "What does \"{p}\" weigh in {u}?",
        "Give the weight of \"{p}\" in {u}.",
        "How heavy is \"{p}\" in {u}?",
        "Convert the weight of \"{p}\" to {u}.",
        "Tell me the mass of one \"{p}\" expressed in {u}.",
        "How much does \"{p}\" weigh, in {u}?",
        "Express the weight of \"{p}\" in {u}.",
        "In {u}, what is the weight of \"{p}\"?",
        "I need the weight of \"{p}\" in {u}.",
    ),
    "search_lookup": (
        "What is the {f} of the flagship product of \"{s}\"?",
        "Look up the {f} of the flagship product of \"{s}\".",
        "Find the {f} for the flagship product of \"{s}\".",
        "I need the {f} of the flagship product of \"{s}\".",
        "The supplier \"{s}\" has a flagship product; what is its {f}?",
        "Tell me the {f} of the flagship product of \"{s}\".",
        "What {f} does the flagship product of \"{s}\" have?",
        "Check the {f} of the flagship product that \"{s}\" makes.",
        "What {f} is listed for the flagship product from \"{s}\"?",
    ),
    "two_lookup": (
        "What is the combined {f} of \"{p}\" and \"{q}\"?",
        "Add up the {f} of \"{p}\" and of \"{q}\".",
        "What is the total {f} of \"{p}\" plus \"{q}\"?",
        "Sum the {f} of \"{p}\" and \"{q}\".",
        "Taken together, what {f} do \"{p}\" and \"{q}\" have?",
        "Tell me the {f} of \"{p}\" and \"{q}\" added together.",
        "What is the {f} of \"{p}\" and \"{q}\" put together?",
        "Combine the {f} of \"{p}\" with that of \"{q}\".",
        "I need the sum of the {f} of \"{p}\" and \"{q}\".",
    ),
    "update": (
        "We received {n} more units of \"{p}\". Update its stock and report the new stock.",
        "A delivery of {n} \"{p}\" arrived: add it to the stock and tell me the new stock.",
        "Add {n} to the stock of \"{p}\" and give the new stock.",
        "Restock \"{p}\" with {n} units and report the resulting stock.",
        "Book an incoming shipment of {n} \"{p}\" and say how many are in stock afterwards.",
        "Increase the stock of \"{p}\" by {n} and report the new stock.",
        "{n} units of \"{p}\" were delivered; update the stock and give the new total.",
        "Put {n} more \"{p}\" into stock and tell me the new stock.",
        "Register {n} new units of \"{p}\" in stock, then report the stock.",
    ),
    "search_lookup_calc": (
        "What do {n} units of the flagship product of \"{s}\" cost?",
        "How much are {n} of the flagship product of \"{s}\"?",
        "Find the flagship product of \"{s}\" and give the price of {n} of them.",
        "What is the total price of {n} units of the flagship product of \"{s}\"?",
        "The supplier \"{s}\" has a flagship product; what would {n} of it cost?",
        "Tell me the cost of {n} units of the flagship product of \"{s}\".",
        "What is the price of {n} of the flagship product of \"{s}\" together?",
        "I want {n} of the flagship product that \"{s}\" makes; what is the total?",
        "Compute the cost of {n} units of the flagship product from \"{s}\".",
    ),
}


@dataclass(frozen=True)
class Task:
    """One task; `to_dict`/`from_dict` give the JSON Lines schema documented in the README."""

    task_id: str
    split: str
    family: str
    level: int
    template_id: str
    template_seen: bool
    question: str
    entities: list
    plan: list
    answer: str
    min_calls: int
    allowed_writes: list

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> "Task":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


# -------------------------------------------------------------------------------------------------------------- plans
_REF = re.compile(r"\{(\d+)(?::quoted)?\}")
_QUOTED = re.compile(r'"([^"]+)"')


def resolve(value: object, results: list[str]) -> object:
    """Substitute ``{k}`` / ``{k:quoted}`` references in a plan parameter by earlier results."""
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        k = int(m.group(1))
        res = results[k] if k < len(results) else ""
        if m.group(0).endswith(":quoted}"):
            names = _QUOTED.findall(res)
            return names[-1] if names else res
        return res

    return _REF.sub(sub, value)


def resolve_params(params: dict, results: list[str]) -> dict:
    return {k: resolve(v, results) for k, v in params.items()}


def run_plan(plan: list[dict], call: Callable[[str, dict], str]) -> list[str]:
    """Execute a plan with `call(tool, params) -> result`; returns every step's result (the last is the answer)."""
    results: list[str] = []
    for step in plan:
        results.append(call(step["tool"], resolve_params(step["params"], results)))
    return results


def _step(tool: str, **params) -> dict:
    return {"tool": tool, "params": params}


def _plan(family: str, slots: dict) -> list[dict]:
    p, n = slots.get("p"), slots.get("n")
    if family == "lookup":
        return [_step("lookup", name=p, field=slots["field"]), _step("answer", value="{0}")]
    if family == "lookup_calc":
        return [_step("lookup", name=p, field="price"), _step("calc", expr=f"{{0}}*{n}"), _step("answer", value="{1}")]
    if family == "lookup_convert":
        return [_step("lookup", name=p, field="weight_kg"), _step("convert", value="{0}", **{"from": "kg", "to": slots["unit"]}),
                _step("answer", value="{1}")]
    if family == "two_lookup":
        f = slots["field"]
        return [_step("lookup", name=p, field=f), _step("lookup", name=slots["q"], field=f),
                _step("calc", expr="{0}+{1}"), _step("answer", value="{2}")]
    if family == "update":
        return [_step("lookup", name=p, field="stock"), _step("calc", expr=f"{{0}}+{n}"),
                _step("update", name=p, field="stock", value="{1}"), _step("answer", value="{1}")]
    if family == "search_lookup":
        return [_step("search", query=f"{slots['s']} flagship product"),
                _step("lookup", name="{0:quoted}", field=slots["field"]), _step("answer", value="{1}")]
    if family == "search_lookup_calc":
        # the query starts with the supplier's name, so the policy copies it right after a quote, as it copies names
        # into every other call (measured with "flagship product of <name>": the name after a space is a different
        # token sequence, and the adapted policy wrote a training supplier's name there on every level-4 task)
        return [_step("search", query=f"{slots['s']} flagship product"), _step("lookup", name="{0:quoted}", field="price"),
                _step("calc", expr=f"{{1}}*{n}"), _step("answer", value="{2}")]
    raise ValueError(f"unknown family {family!r}; families are {FAMILIES}")


def _slots(family: str, split: str, world: World, rng: np.random.Generator) -> tuple[dict, list[str]]:
    products = world.products_in(split)
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    if family == "search_lookup_calc":
        sup = pick(world.suppliers_in(split))
        return {"s": sup["name"], "n": int(rng.integers(2, 10))}, [sup["name"], sup["flagship"]]
    if family == "search_lookup":
        sup = pick(world.suppliers_in(split))
        fld = pick(("price", "stock", "category"))
        return {"s": sup["name"], "field": fld, "f": FIELD_WORDS[fld]}, [sup["name"], sup["flagship"]]
    p = pick(products)["name"]
    if family == "lookup":
        fld = pick(("price", "stock", "supplier", "category"))
        return {"p": p, "field": fld, "f": FIELD_WORDS[fld]}, [p]
    if family in ("lookup_calc", "update"):
        return {"p": p, "n": int(rng.integers(2, 10))}, [p]
    if family == "lookup_convert":
        unit = pick(tuple(UNIT_WORDS))
        return {"p": p, "unit": unit, "u": UNIT_WORDS[unit]}, [p]
    if family == "two_lookup":
        q = p
        while q == p:
            q = pick(products)["name"]
        fld = pick(("price", "stock"))
        return {"p": p, "q": q, "field": fld, "f": FIELD_WORDS[fld]}, [p, q]
    raise ValueError(f"unknown family {family!r}")


def generate_tasks(world: World, split: str, n: int, level_mix: dict[int, float], seed: int,
                   solver: Callable[[list[dict], list[dict]], str], train_wordings: int = 4,
                   long_share: float = 0.0, long_lookups: int = 20, grammar: bool = False) -> list[Task]:
    """Generate `n` tasks of `split`; `solver(plan, allowed_writes)` returns the ground-truth answer on the world.

    Train and validation questions use the first `train_wordings` (1-8) of :data:`TRAIN_TEMPLATES`; test questions
    use templates 0-4 whatever `train_wordings` is, so the same seed gives the same test split. With 4 (the original
    setting) every split is byte-identical to what this function drew before the extra wordings existed. With
    `grammar`, train and validation questions come from the compositional grammar of
    :mod:`pipeline.envs.shop.wordings` (those `train_wordings` fixed wordings and its frames); test is unchanged.
    """
    if not 1 <= train_wordings <= len(TRAIN_TEMPLATES):
        raise ValueError(f"train_wordings must be 1-{len(TRAIN_TEMPLATES)}, got {train_wordings}")
    seen_ids = TRAIN_TEMPLATES[:train_wordings]
    rng = np.random.default_rng([seed, 2, ("train", "validation", "test").index(split)])
    levels = sorted(level_mix)
    weights = np.array([level_mix[lv] for lv in levels], dtype=float)
    weights /= weights.sum()
    by_level = {lv: [f for f in FAMILIES if FAMILY_LEVEL[f] == lv] for lv in levels}
    tasks, seen = [], set()
    attempts = 0
    n_long = int(round(n * long_share))
    while len(tasks) < n - n_long:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not draw {n} distinct {split} tasks; the world is too small for this many")
        level = levels[int(rng.choice(len(levels), p=weights))]
        fams = by_level[level]
        family = fams[int(rng.integers(len(fams)))]
        if split == "test":
            template = int(rng.integers(TEST_TEMPLATES))
        elif not grammar:
            template = seen_ids[int(rng.integers(len(seen_ids)))]
        slots, entities = _slots(family, split, world, rng)
        if grammar and split != "test":
            question, template = draw_wording(family, slots, list(seen_ids), TEMPLATES[family], rng)
        else:
            question = TEMPLATES[family][template].format(**slots)
        if question in seen:
            continue
        seen.add(question)
        plan = _plan(family, slots)
        allowed = ([{"table": "products", "name": slots["p"], "field": "stock"}] if family == "update" else [])
        tasks.append(Task(
            task_id=f"{split}-{len(tasks):06d}", split=split, family=family, level=FAMILY_LEVEL[family],
            template_id=f"{family}/{template}", template_seen=template != HELDOUT_TEMPLATE, question=question,
            entities=entities, plan=plan, answer=solver(plan, allowed), min_calls=len(plan), allowed_writes=allowed,
        ))
    if n_long:
        tasks += _long_tasks(world, split, n_long, seed, solver, long_lookups, len(tasks), seen)
    return tasks


def _long_tasks(world: World, split: str, n: int, seed: int, solver: Callable, lookups: int, start: int,
                seen: set) -> list[Task]:
    """`n` tasks of the long family (see the module docstring), numbered from `start`."""
    rng = np.random.default_rng([seed, 3, ("train", "validation", "test").index(split)])
    names = [p["name"] for p in world.products_in(split)]
    k = min(lookups, len(names))
    if k < 2:
        raise ValueError(f"long tasks need at least 2 {split} products, the world has {len(names)}")
    out: list[Task] = []
    for _ in range(50 * n + 100):
        if len(out) == n:
            break
        picked = [names[i] for i in rng.choice(len(names), size=k, replace=False)]
        fld = ("price", "stock")[int(rng.integers(2))]
        template = int(rng.integers(len(LONG_TEMPLATES)))
        items = ", ".join(f'"{p}"' for p in picked[:-1]) + f' and "{picked[-1]}"'
        question = LONG_TEMPLATES[template].format(f=FIELD_WORDS[fld], items=items)
        if question in seen or len(question) > MAX_QUESTION_CHARS:  # the tasks suite's bound
            continue
        seen.add(question)
        plan = ([_step("lookup", name=p, field=fld) for p in picked]
                + [_step("calc", expr="+".join(f"{{{i}}}" for i in range(k))), _step("answer", value=f"{{{k}}}")])
        out.append(Task(task_id=f"{split}-{start + len(out):06d}", split=split, family=LONG_FAMILY,
                        level=FAMILY_LEVEL[LONG_FAMILY], template_id=f"{LONG_FAMILY}/{template}", template_seen=True,
                        question=question, entities=picked, plan=plan, answer=solver(plan, []), min_calls=len(plan),
                        allowed_writes=[]))
    if len(out) < n:
        raise ValueError(f"could not draw {n} distinct long {split} tasks; the world is too small for this many")
    return out


# ------------------------------------------------------------------------------------------------------------ answers
def normalize_answer(text: object) -> str:
    s = str(text).strip().strip("'\"").strip()
    return " ".join(s.lower().split())


def answers_match(given: object, truth: str, tol: float = 0.01) -> bool:
    """Numbers match within `tol` (results are rounded to 2 decimals); text matches case- and quote-insensitively.

    >>> answers_match("2884", "2884"), answers_match(" 'Blue Lamp' ", "blue lamp"), answers_match("12.3", "12.35")
    (True, True, False)
    """
    if given is None:
        return False
    g, t = normalize_answer(given), normalize_answer(truth)
    try:
        return abs(float(g) - float(t)) <= tol / 2 + 1e-9
    except ValueError:
        return g == t and g != ""
