"""Fresh training tasks of a given slice (family, level, wording) for adversarial task generation during RL.

:meth:`pipeline.envs.shop.ShopWorld.generate_tasks` calls :func:`weak_spot_tasks` when the `train` phase asks for more
tasks where the policy is weak (:mod:`pipeline.train.extensions.task_generation`). The draw reuses the build's own pieces
(:func:`pipeline.envs.shop.tasks._slots`, :func:`~pipeline.envs.shop.tasks._plan`, the wordings of
:data:`~pipeline.envs.shop.tasks.TEMPLATES`), so a generated task is indistinguishable from a built one except for its
id and the seed it came from.

Decisions:

- **Training split only.** Entities come from ``world.products_in("train")`` / ``suppliers_in("train")``, so no
  generated task names a product or supplier of validation or test; the caller checks it again with
  :meth:`~pipeline.envs.shop.ShopWorld.leaks_heldout`.
- **Never the held-out wording.** A slice naming wording 4 (test-only) is refused with ValueError; without a wording,
  the task draws from the first `train_wordings` training wordings (and, with `grammar`, the grammar's frames), as the
  build does. A slice naming a grammar frame (id 9 on) draws that frame with fresh synonyms, opener and closer.
- **Entity kind** is a function of the family here (the two ``search_*`` families name a supplier, the others
  products), so a family slice already targets it.
- Ids are ``gen-<seed>-<i>``; the caller renames them into its own namespace.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from pipeline.envs.shop.tasks import (FAMILIES, FAMILY_LEVEL, HELDOUT_TEMPLATE, TEMPLATES, TRAIN_TEMPLATES, Task,
                                      _plan, _slots)
from pipeline.envs.shop.wordings import FRAMES, GRAMMAR_BASE, draw
from pipeline.envs.shop.world import World


def slice_choices(weakness: dict, train_wordings: int = 4, grammar: bool = False
                  ) -> tuple[list[str], dict[str, list[int]]]:
    """(families, {family: wording indices}) that a weakness slice allows; ValueError for a slice that names an
    unknown family, a level without families, a wording of another family or the held-out wording.

    >>> slice_choices({"template_id": "update/2"})
    (['update'], {'update': [2]})
    >>> slice_choices({"level": 2}, train_wordings=1)[0]
    ['lookup_calc', 'lookup_convert', 'search_lookup']
    """
    family, level, template_id = weakness.get("family"), weakness.get("level"), weakness.get("template_id")
    wording = None
    if template_id is not None:
        fam, _, idx = str(template_id).partition("/")
        n_ids = GRAMMAR_BASE + len(FRAMES[fam]) if grammar and fam in FAMILIES else len(TEMPLATES.get(fam, ()))
        if fam not in FAMILIES or not idx.isdigit() or int(idx) >= n_ids:
            raise ValueError(f"unknown wording {template_id!r}: wordings are <family>/<index>")
        if family is not None and family != fam:
            raise ValueError(f"wording {template_id!r} is not one of family {family!r}")
        family, wording = fam, int(idx)
        if wording == HELDOUT_TEMPLATE or (wording < GRAMMAR_BASE and wording not in TRAIN_TEMPLATES):
            raise ValueError(f"wording {template_id!r} is held out of training (test only); no task is generated in it")
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; families are {FAMILIES}")
    families = [family] if family is not None else [f for f in FAMILIES if level is None or FAMILY_LEVEL[f] == level]
    if level is not None and any(FAMILY_LEVEL[f] != level for f in families):
        raise ValueError(f"family {family!r} is of level {FAMILY_LEVEL[family]}, not {level}")
    if not families:
        raise ValueError(f"no family of level {level}; levels are {sorted(set(FAMILY_LEVEL.values()))}")
    if wording is not None:
        return families, {f: [wording] for f in families}
    fixed = list(TRAIN_TEMPLATES[:train_wordings])
    return families, {f: fixed + ([GRAMMAR_BASE + k for k in range(len(FRAMES[f]))] if grammar else [])
                      for f in families}


def weak_spot_tasks(world: World, weakness: dict, n: int, seed: int, solver: Callable[[list[dict], list[dict]], str],
                    train_wordings: int = 4, grammar: bool = False) -> list[Task]:
    """Up to `n` distinct training tasks of the slice `weakness` ({"family", "level", "template_id"}, any subset),
    drawn with `seed`; `solver(plan, allowed_writes)` gives each answer. Fewer than `n` come back when the slice has
    no more distinct questions (after 50·n + 200 draws)."""
    families, wordings = slice_choices(weakness, train_wordings, grammar)
    rng = np.random.default_rng([seed, 2, 17])
    tasks: list[Task] = []
    seen: set[str] = set()
    for _ in range(50 * n + 200):
        if len(tasks) >= n:
            break
        family = families[int(rng.integers(len(families)))]
        template = wordings[family][int(rng.integers(len(wordings[family])))]
        slots, entities = _slots(family, "train", world, rng)
        if grammar:  # that wording (fixed or a frame) with its own draw of synonyms, opener and closer
            question, template = draw(family, slots, [template] if template < GRAMMAR_BASE else [], TEMPLATES[family],
                                      rng, frame=template - GRAMMAR_BASE if template >= GRAMMAR_BASE else None)
        else:
            question = TEMPLATES[family][template].format(**slots)
        if question in seen:
            continue
        seen.add(question)
        plan = _plan(family, slots)
        allowed = [{"table": "products", "name": slots["p"], "field": "stock"}] if family == "update" else []
        tasks.append(Task(
            task_id=f"gen-{seed}-{len(tasks):06d}", split="train", family=family, level=FAMILY_LEVEL[family],
            template_id=f"{family}/{template}", template_seen=True, question=question, entities=entities, plan=plan,
            answer=solver(plan, allowed), min_calls=len(plan), allowed_writes=allowed))
    return tasks
