"""Fresh training tasks of a given slice (family, level, wording) for adversarial task generation during RL.

:meth:`pipeline.envs.sql.SqlAnalyst.generate_tasks` calls :func:`weak_spot_tasks` when the `train` phase asks for
more tasks where the policy is weak (:mod:`pipeline.train.extensions.task_generation`). The draw reuses the build's pieces
(:func:`pipeline.envs.sql.tasks._draw` for the slots, :func:`~pipeline.envs.sql.tasks.ground_truth` for the answer
and its rules: no empty, zero or NULL answers, no ties among the top k + 1), so a generated task is a built one with
another id.

Decisions:

- **Training values only.** Cities, categories and months come from the partition's ``train`` part, so no generated
  task filters on a value of validation or test; the caller checks it again with
  :meth:`~pipeline.envs.sql.SqlAnalyst.leaks_heldout`.
- **Never the held-out wording** (index 4): a slice naming it is refused with ValueError; a slice naming a fixed
  training wording or a grammar frame (:mod:`pipeline.envs.sql.wordings`) draws that one; without a wording, the
  task draws from the first `train_wordings` and the grammar, as the build does.
- **Entity kind** (city, category, month) is a function of the family, so a family slice already targets it.
- Ids are the build's (``sql-train-<i>``, which the 'sql_tasks' suite requires), numbered from 0 in each call;
  the caller renames them into its own namespace.
"""

from __future__ import annotations

import sqlite3

import numpy as np

from pipeline.envs.contract import Task
from pipeline.envs.sql.tasks import BY_NAME, FAMILIES, HELDOUT_TEMPLATE, TRAIN_TEMPLATES, _draw, ground_truth
from pipeline.envs.sql.wordings import FRAMES, GRAMMAR_BASE, draw


def slice_choices(weakness: dict, train_wordings: int = 4) -> tuple[list[str], list[int] | None]:
    """(family names, the one wording id, or the first `train_wordings` fixed ones) a weakness slice allows;
    ValueError for an unknown family or wording, a family of another level, or the held-out wording.

    >>> slice_choices({"template_id": "top_products/1"})
    (['top_products'], [1])
    >>> slice_choices({"level": 3})[0]
    ['orders_city_status', 'revenue_city_month', 'units_category_month']
    """
    family, level, template_id = weakness.get("family"), weakness.get("level"), weakness.get("template_id")
    wordings = list(TRAIN_TEMPLATES[:train_wordings])
    if template_id is not None:
        fam, _, idx = str(template_id).partition("/")
        if fam not in BY_NAME or not idx.isdigit() or int(idx) >= GRAMMAR_BASE + len(FRAMES[fam]):
            raise ValueError(f"unknown wording {template_id!r}: wordings are <family>/<index>")
        if family is not None and family != fam:
            raise ValueError(f"wording {template_id!r} is not one of family {family!r}")
        family, wordings = fam, [int(idx)]
        if int(idx) == HELDOUT_TEMPLATE or (int(idx) < GRAMMAR_BASE and int(idx) not in TRAIN_TEMPLATES):
            raise ValueError(f"wording {template_id!r} is held out of training (test only); no task is generated in it")
    if family is not None and family not in BY_NAME:
        raise ValueError(f"unknown family {family!r}; families are {list(BY_NAME)}")
    families = [family] if family is not None else [f.name for f in FAMILIES if level is None or f.level == level]
    if level is not None and any(BY_NAME[f].level != level for f in families):
        raise ValueError(f"family {family!r} is of level {BY_NAME[family].level}, not {level}")
    if not families:
        raise ValueError(f"no family of level {level}")
    return families, wordings


def weak_spot_tasks(conn: sqlite3.Connection, partition: dict, weakness: dict, n: int, seed: int,
                    train_wordings: int = 4) -> list[Task]:
    """Up to `n` distinct training tasks of the slice `weakness` ({"family", "level", "template_id"}, any subset) on
    the database `conn`, drawn with `seed` from the `partition`'s training values; fewer when the slice has no more
    distinct usable questions (after 50·n + 200 draws)."""
    families, wordings = slice_choices(weakness, train_wordings)
    values = {dim: part["train"] for dim, part in partition.items()}
    rng = np.random.default_rng([seed, 12, 17])
    tasks: list[Task] = []
    seen: set[str] = set()
    for _ in range(50 * n + 200):
        if len(tasks) >= n:
            break
        family = BY_NAME[families[int(rng.integers(len(families)))]]
        slots, heldout = _draw(family, values, rng)
        if len(wordings) == 1 and wordings[0] >= GRAMMAR_BASE:  # one grammar frame
            question, template = draw(family.name, slots, [], family.wordings, rng, frame=wordings[0] - GRAMMAR_BASE)
        else:
            question, template = draw(family.name, slots, wordings, family.wordings, rng)
        if question in seen:
            continue
        seen.add(question)
        answer = ground_truth(family, slots, conn)
        if answer is None:
            continue
        tasks.append(Task(
            task_id=f"sql-train-{len(tasks):06d}", split="train", level=family.level, question=question,
            answer=answer, family=family.name, min_calls=len(family.tables) + 2, template_seen=True,
            data={"sql": family.sql.format(**slots), "tables": list(family.tables), "kind": family.kind,
                  "heldout": heldout, "template_id": f"{family.name}/{template}"}))
    return tasks
