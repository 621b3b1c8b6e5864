"""Incoming production tasks for the `train` stage: read, checked and filtered before they join the RL task pool.

New production tasks arrive as JSON Lines files in the task schema of the run's environment in a
folder, ``train.incoming_tasks`` (default ``data/incoming``, the folder the `check_drift` stage and the retraining flow
read too). RL needs no demonstrations, only each task's ground truth, so the incoming tasks join the training tasks in
the RL task pool, with these exceptions. Each one is counted under the first reason that applies, in this order:

- ``dropped_heldout_entities``: the task names what the environment holds out of training for the validation and
  test splits (:meth:`Environment.leaks_heldout`; the shop: an entity of ``data/env/entities.json``'s other splits).
  Those splits measure generalisation to entities no training task names, so training on such a task would make that
  measurement dishonest;
- ``dropped_heldout_templates``: the task's ``template_id`` is one the test split holds out (``template_seen`` false),
  for the same reason: the test split also measures generalisation to unseen phrasings;
- ``dropped_duplicates``: the same task (every field but its id and split) as a training task or an earlier
  incoming one (files in name order). A second copy would only double that task's sampling weight;
- ``dropped_unverifiable``: the environment, asked to recompute the task's ground truth in the training world
  (:meth:`Environment.verify_task`), does not get its answer (the shop: its plan names an entity the world lacks,
  or the values have changed since). Its reward would punish a policy that reads its tools correctly.

Ids: every task that is used is renamed ``incoming/<file stem>/<task_id>``. Production ids come from another namespace
and may equal the generator's (``train-000001``) while naming another task. The prefix keeps them apart in the
goal sampler's per-task sampling counts, and shows which file a task came from. So no task is dropped for its id alone.

Tasks made from served traffic (``train.production_tasks``, default ``data/production/snapshot/tasks``, written by
`agentrl snapshot`: :mod:`pipeline.deploy.snapshot`) are read from that folder the same way, after the incoming
folder's files, and go through the same checks and filter; the counts cover both folders.

Boundary: each file must pass the task-file checks (:func:`pipeline.envs.taskfile.load_task_file`, as for every other
task file). A file that breaks it raises :class:`AgentRLError` naming the file and the failed expectations,
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

from pipeline.core.errors import AgentRLError
from pipeline.envs.contract import TaskFields as Task

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


def _folders(folder: str | Path | Sequence[str | Path | None] | None) -> list[Path]:
    """`folder` as a list of folders (a single one, or several: ``train.incoming_tasks`` and
    ``train.production_tasks``), None entries left out."""
    if folder is None:
        return []
    if isinstance(folder, (str, Path)):
        return [Path(folder)]
    return [Path(f) for f in folder if f is not None]


def read_incoming(folder: str | Path | Sequence[str | Path | None] | None, world) -> list[tuple[Path, list[Task]]]:
    """(file, tasks) for every ``*.jsonl`` in `folder` (or in each of several folders, in the order given), in name
    order, each file checked with the "tasks" suite.

    [] when `folder` is None or does not exist. A file that cannot be read or breaks the suite raises AgentRLError.
    """
    from pipeline.envs.taskfile import load_task_file

    files = []
    for one in _folders(folder):
        if one.exists() and not one.is_dir():
            raise AgentRLError(f"train.incoming_tasks: {one} is not a folder (set the folder whose *.jsonl files hold "
                               f"the incoming tasks, or null)")
        files += sorted(one.glob("*.jsonl")) if one.is_dir() else []
    batches = []
    for path in files:
        try:
            batches.append((path, load_task_file(path, world)))
        except AgentRLError as exc:
            raise AgentRLError(f"incoming task file {path} breaks the task schema (fix or remove it; nothing was "
                               f"trained): {exc}") from None
    return batches


def _content(task: Task) -> str:
    """What makes two tasks the same task for RL: every field but the id, the split and the wording's bookkeeping."""
    skip = {"task_id", "split", "template_id", "template_seen", "family", "level", "min_calls", "entities", "env"}
    return json.dumps({k: v for k, v in task.to_dict().items() if k not in skip}, sort_keys=True)


def select_incoming(batches: Sequence[tuple[str | Path, Sequence[Task]]], train_tasks: Sequence[Task],
                    leaks_heldout: Callable[[Task], bool], heldout_templates: Collection[str] = (),
                    verify: Callable[[Task], bool] | None = None) -> tuple[list[Task], dict[str, int]]:
    """The incoming tasks that may join the training pool, renamed, and the count per drop reason (module docstring).

    `batches`: (file, its tasks) in reading order; `leaks_heldout(task)`: whether it names what validation and test
    hold out; `heldout_templates`: template ids only the test split uses; `verify(task)`: whether the training world
    gives the task's answer; None skips that check.

    >>> from pipeline.envs.contract import Task as T
    >>> t = T("t1", "train", 1, 'Height of "A"?', "3", data={"entities": ["A"]})
    >>> leaks = lambda task: "H" in task.data["entities"]
    >>> used, counts = select_incoming([("b.jsonl", [t, replace(t, task_id="t2", data={"entities": ["H"]})])], [], leaks)
    >>> [u.task_id for u in used], counts["dropped_heldout_entities"]
    (['incoming/b/t1'], 1)
    """
    heldout_templates = set(heldout_templates)
    seen = {_content(t) for t in train_tasks}
    counts = dict.fromkeys(DROP_REASONS, 0)
    used: list[Task] = []
    for path, tasks in batches:
        stem = Path(path).stem
        for task in tasks:
            if leaks_heldout(task):
                counts["dropped_heldout_entities"] += 1
                continue
            if getattr(task, "template_id", None) in heldout_templates:
                counts["dropped_heldout_templates"] += 1
                continue
            key = _content(task)
            if key in seen:
                counts["dropped_duplicates"] += 1
                continue
            seen.add(key)
            if verify is not None and not verify(task):
                counts["dropped_unverifiable"] += 1
                continue
            used.append(replace(task, task_id=f"{PREFIX}/{stem}/{task.task_id}"))
    return used, counts


def load_incoming(folder: str | Path | Sequence[str | Path | None] | None, *, train_tasks: Sequence[Task],
                  test_tasks: Sequence[Task], runtime) -> IncomingTasks:
    """Read, check and filter the incoming tasks in `folder` against the training data and the world `runtime` (an
    :class:`~pipeline.envs.contract.Environment`); see the module docstring."""
    batches = read_incoming(folder, runtime)
    templates = {getattr(t, "template_id", None) for t in test_tasks if not t.template_seen} - {None}
    used, counts = select_incoming(batches, train_tasks, runtime.leaks_heldout, templates, verify=runtime.verify_task)
    # the first folder (train.incoming_tasks) is always named; a later one (the traffic snapshot's tasks) only when
    # it exists, so a project that never took a snapshot reports its incoming folder alone
    folders = [f for i, f in enumerate(_folders(folder)) if i == 0 or f.exists()]
    summary = {"dir": ", ".join(map(str, folders)) or None, "files": len(batches),
               "read": sum(len(tasks) for _, tasks in batches), "tasks": len(used), **counts}
    return IncomingTasks(used, summary)
