"""Fresh training tasks of a given slice (family, level, wording) for adversarial task generation during RL.

:meth:`pipeline.envs.calendar.CalendarWorld.generate_tasks` calls :func:`weak_spot_tasks` when the `train` phase asks
for more tasks where the policy is weak (:mod:`pipeline.train.extensions.task_generation`). The draw reuses the build's
(:func:`pipeline.envs.calendar.tasks.draw` and :func:`~pipeline.envs.calendar.tasks.make_task`), so a generated task
is a built one with another id.

Decisions:

- **Training people only**: requesters and swap partners come from the partition's ``train`` part; the caller checks
  it again with :meth:`~pipeline.envs.calendar.CalendarWorld.leaks_heldout`.
- **Never the held-out wording** (index 3): a slice naming it is refused with ValueError; without a wording, the
  task draws from the first `train_wordings`, as the build does.
- Ids are the build's (``cal-train-<i>``, which the 'calendar_tasks' suite requires), numbered from 0 in each call;
  the caller renames them into its own namespace.
"""

from __future__ import annotations

import numpy as np

from pipeline.envs.contract import Task
from pipeline.envs.calendar.tasks import BY_NAME, FAMILIES, HELDOUT_TEMPLATE, TRAIN_TEMPLATES, Schedule, draw, make_task


def slice_choices(weakness: dict, train_wordings: int = 3) -> tuple[list[str], list[int]]:
    """(family names, wording indexes) a weakness slice allows; ValueError for an unknown family or wording, a family
    of another level, or the held-out wording.

    >>> slice_choices({"template_id": "swap_times/1"})
    (['swap_times'], [1])
    >>> slice_choices({"level": 2})[0]
    ['replace', 'book_next_free']
    """
    family, level, template_id = weakness.get("family"), weakness.get("level"), weakness.get("template_id")
    wordings = list(TRAIN_TEMPLATES[:train_wordings])
    if template_id is not None:
        fam, _, idx = str(template_id).partition("/")
        if fam not in BY_NAME or not idx.isdigit() or int(idx) >= len(BY_NAME[fam].wordings):
            raise ValueError(f"unknown wording {template_id!r}: wordings are <family>/<index>")
        if family is not None and family != fam:
            raise ValueError(f"wording {template_id!r} is not one of family {family!r}")
        if int(idx) == HELDOUT_TEMPLATE:
            raise ValueError(f"wording {template_id!r} is held out of training (test only); no task is generated in it")
        family, wordings = fam, [int(idx)]
    if family is not None and family not in BY_NAME:
        raise ValueError(f"unknown family {family!r}; families are {list(BY_NAME)}")
    families = [family] if family is not None else [f.name for f in FAMILIES if level is None or f.level == level]
    if level is not None and any(BY_NAME[f].level != level for f in families):
        raise ValueError(f"family {family!r} is of level {BY_NAME[family].level}, not {level}")
    if not families:
        raise ValueError(f"no family of level {level}")
    return families, wordings


def weak_spot_tasks(schedule: Schedule, partition: dict, weakness: dict, n: int, seed: int,
                    train_wordings: int = 3) -> list[Task]:
    """Up to `n` distinct training tasks of the slice `weakness` ({"family", "level", "template_id"}, any subset),
    drawn with `seed` among the training people; fewer when the slice has no more (after 100·n + 500 draws)."""
    families, wordings = slice_choices(weakness, train_wordings)
    people = list(partition["person"]["train"])
    rng = np.random.default_rng([seed, 22, 17])
    tasks: list[Task] = []
    seen: set[str] = set()
    for _ in range(100 * n + 500):
        if len(tasks) >= n:
            break
        family = BY_NAME[families[int(rng.integers(len(families)))]]
        template = wordings[int(rng.integers(len(wordings)))]
        drawn = draw(family.name, schedule, people, rng)
        if drawn is None:
            continue
        task = make_task(family, template, drawn, "train", len(tasks))
        if task.question not in seen:
            seen.add(task.question)
            tasks.append(task)
    return tasks
