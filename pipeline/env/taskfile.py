"""Task files: the one writer and the one reader of the JSON Lines files that hold tasks (one task per line).

Every phase reads its tasks through :func:`load_task_file`, which checks them at the phase's boundary with the Great
Expectations suite "tasks" (:mod:`pipeline.env.suites`) before any :class:`~pipeline.env.tasks.Task` is built.
Kept apart from :mod:`pipeline.env.tasks` (generation, plans, ground truth) because the suites themselves import that
module's task families: reading a file is a boundary above both.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import iter_numbered_jsonl
from pipeline.env.tasks import Task


def write_tasks(tasks: list[Task], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t.to_dict(), sort_keys=True) + "\n" for t in tasks))


class TaskFileError(AgentRLError, ValueError):
    """A task file that cannot be used; the message names the file, the line (or the rows) and what is wrong.

    A user-facing error (:class:`AgentRLError`) and a ValueError, as a malformed world or config is.
    """


def load_task_file(path: str | Path, *, validate: bool = True) -> list[Task]:
    """The one reader of task files (JSON Lines, one task per line): every phase reads its tasks through it.

    A missing or empty file, a line that is not a JSON object and a record without every :class:`Task` key raise
    :class:`TaskFileError` naming the file and the line. With `validate` (the default, at every phase's boundary) the
    records must also pass the Great Expectations suite "tasks" before any :class:`Task` is built; without it (the
    environment handed a file a phase already checked) nothing but the JSON and the keys is checked, and Great
    Expectations is not imported.
    """
    path = Path(path)
    records = []
    try:
        for i, rec in iter_numbered_jsonl(path, "task file"):
            missing = [k for k in Task.__dataclass_fields__ if k not in rec]
            if missing:
                raise TaskFileError(f"{path}:{i}: missing keys {missing}")
            records.append(rec)
    except TaskFileError:
        raise
    except AgentRLError as exc:
        raise TaskFileError(str(exc)) from None
    if not records:
        raise TaskFileError(f"{path}: no tasks in file")
    if validate:
        from pipeline.core.validation import DataValidationError, validate_records
        from pipeline.env.suites import register_suites

        register_suites()
        try:
            validate_records(records, suite="tasks", dataset=str(path)).raise_if_failed()
        except DataValidationError as exc:
            raise TaskFileError(str(exc)) from None
    return [Task.from_dict(r) for r in records]
