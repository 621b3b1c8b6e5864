"""Incoming production tasks for the `train` stage: read, checked and filtered before they join the RL task pool.

New production tasks arrive as JSON Lines files in the task schema (:meth:`pipeline.env.tasks.Task.to_dict`) in a
folder, ``train.incoming_tasks`` (default ``data/incoming``, the folder the `check_drift` stage and the retraining flow
read too). RL needs no demonstrations, only each task's ground truth, so the incoming tasks join the training tasks in
the RL task pool, with these exceptions. Each one is counted under the first reason that applies, in this order:

- ``dropped_heldout_entities``: the task names an entity of the validation or test split (``data/env/entities.json``).
  Those splits measure generalisation to entities no training task names, so training on such a task would make that
  measurement dishonest;
- ``dropped_heldout_templates``: the task's ``template_id`` is one the test split holds out (``template_seen`` false),
  for the same reason: the test split also measures generalisation to unseen phrasings;
- ``dropped_duplicates``: the same task (question, plan, answer and allowed writes) as a training task or an earlier
  incoming one (files in name order). A second copy would only double that task's sampling weight;
- ``dropped_unverifiable``: the task's plan, run in the training world, does not give its answer (the world lacks an
  entity it names, or its values have changed since). Its reward would punish a policy that reads its tools correctly.

Ids: every task that is used is renamed ``incoming/<file stem>/<task_id>``. Production ids come from another namespace
and may equal the generator's (``train-000001``) while naming another task. The prefix keeps them apart in the
goal sampler's per-task sampling counts, and shows which file a task came from. So no task is dropped for its id alone.

Boundary: each file must pass the Great Expectations suite "tasks" (:func:`pipeline.env.taskfile.load_task_file`, as for
every other task file). A file that breaks it raises :class:`AgentRLError` naming the file and the failed expectations,
before anything trains. A missing folder or one without ``*.jsonl`` files (a ``README.md`` is ignored) adds nothing.

Deliberately left out: writing incoming tasks into ``data/tasks`` (the `build_env` stage still generates the splits from
params alone; the incoming tasks are added at train time), demonstrations for them (the behaviour-cloning term uses the
training demonstrations only), and rebuilding the world when incoming tasks disagree with it (they are counted as
unverifiable; rebuild ``data/env``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.env.tasks import Task, answers_match
from pipeline.core.errors import AgentRLError

PREFIX = "incoming"
DROP_REASONS = ("dropped_heldout_entities", "dropped_heldout_templates", "dropped_duplicates", "dropped_unverifiable")


@dataclass(frozen=True)
class IncomingTasks:
    """The incoming tasks that join the training pool, and what happened to the others (``metrics/train.json``)."""

    tasks: list[Task]
    summary: dict

    @property
    def digest(self) -> str | None:
        """SHA-256 of the tasks used (None when none are): part of the checkpoint key, so a run on other incoming
        tasks starts fresh instead of resuming (or finding complete) a run on the old ones."""
        if not self.tasks:
            return None
        blob = json.dumps([t.to_dict() for t in self.tasks], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def describe(self) -> str:
        s = self.summary
        if not s["files"]:
            return f"incoming tasks: none ({s['dir'] or 'train.incoming_tasks is null'})"
        dropped = ", ".join(f"{k.removeprefix('dropped_')} {s[k]}" for k in DROP_REASONS if s[k])
        return (f"incoming tasks: {s['tasks']} of {s['read']} from {s['files']} file(s) in {s['dir']} join the "
                f"training pool" + (f" (dropped: {dropped})" if dropped else ""))


def read_incoming(folder: str | Path | None) -> list[tuple[Path, list[Task]]]:
    """(file, tasks) for every ``*.jsonl`` in `folder`, in name order, each file checked with the "tasks" suite.

    [] when `folder` is None or does not exist. A file that cannot be read or breaks the suite raises AgentRLError.
    """
    from pipeline.env.taskfile import load_task_file

    if folder is None:
        return []
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise AgentRLError(f"train.incoming_tasks: {folder} is not a folder (set the folder whose *.jsonl files hold "
                           f"the incoming tasks, or null)")
    batches = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        try:
            batches.append((path, load_task_file(path)))
        except AgentRLError as exc:
            raise AgentRLError(f"incoming task file {path} breaks the task schema (fix or remove it; nothing was "
                               f"trained): {exc}") from None
    return batches


def _content(task: Task) -> str:
    """What makes two tasks the same task for RL: what the policy is asked, the plan, the answer, the writes allowed."""
    return json.dumps([task.question, task.plan, task.answer, task.allowed_writes], sort_keys=True)


def select_incoming(batches: Sequence[tuple[str | Path, Sequence[Task]]], train_tasks: Sequence[Task],
                    heldout_entities: Collection[str], heldout_templates: Collection[str] = (),
                    solve: Callable[[Task], str] | None = None) -> tuple[list[Task], dict[str, int]]:
    """The incoming tasks that may join the training pool, renamed, and the count per drop reason (module docstring).

    `batches`: (file, its tasks) in reading order; `heldout_entities`: names whose split is validation or test;
    `heldout_templates`: template ids only the test split uses; `solve`: the task's answer in the training world (it may
    raise for a plan the world cannot run); None skips that check.

    >>> t = Task("t1", "train", "lookup", 1, "lookup/0", True, 'Price of "A"?', ["A"],
    ...          [{"tool": "lookup", "params": {"name": "A", "field": "price"}}, {"tool": "answer", "params": {}}], "3",
    ...          2, [])
    >>> used, counts = select_incoming([("b.jsonl", [t, replace(t, task_id="t2", entities=["H"])])], [], {"H"})
    >>> [u.task_id for u in used], counts["dropped_heldout_entities"]
    (['incoming/b/t1'], 1)
    """
    heldout_entities, heldout_templates = set(heldout_entities), set(heldout_templates)
    seen = {_content(t) for t in train_tasks}
    counts = dict.fromkeys(DROP_REASONS, 0)
    used: list[Task] = []
    for path, tasks in batches:
        stem = Path(path).stem
        for task in tasks:
            if heldout_entities.intersection(task.entities):
                counts["dropped_heldout_entities"] += 1
                continue
            if task.template_id in heldout_templates:
                counts["dropped_heldout_templates"] += 1
                continue
            key = _content(task)
            if key in seen:
                counts["dropped_duplicates"] += 1
                continue
            seen.add(key)
            if solve is not None and not _verifiable(task, solve):
                counts["dropped_unverifiable"] += 1
                continue
            used.append(replace(task, task_id=f"{PREFIX}/{stem}/{task.task_id}"))
    return used, counts


def _verifiable(task: Task, solve: Callable[[Task], str]) -> bool:
    from pipeline.env.tools import ToolError

    try:
        truth = solve(task)
    except (ToolError, KeyError, IndexError, ValueError):  # an entity the world lacks, a reference past the plan
        return False
    return answers_match(truth, task.answer)


def heldout_entities(world) -> set[str]:
    """Names of the products and suppliers of the validation and test splits (``entities.json``)."""
    return {name for split in (world.product_split, world.supplier_split) for name, s in split.items() if s != "train"}


def load_incoming(folder: str | Path | None, *, train_tasks: Sequence[Task], test_tasks: Sequence[Task],
                  runtime) -> IncomingTasks:
    """Read, check and filter the incoming tasks in `folder` against the training data and world of `runtime`
    (a :class:`pipeline.env.core.WorldRuntime`); see the module docstring."""
    batches = read_incoming(folder)
    templates = {t.template_id for t in test_tasks if not t.template_seen}
    used, counts = select_incoming(batches, train_tasks, heldout_entities(runtime.world), templates,
                                   solve=lambda t: runtime.solve(t.plan, t.allowed_writes))
    summary = {"dir": None if folder is None else str(folder), "files": len(batches),
               "read": sum(len(tasks) for _, tasks in batches), "tasks": len(used), **counts}
    return IncomingTasks(used, summary)
