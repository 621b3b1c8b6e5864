"""Task files: the one writer and the one reader of the JSON Lines files that hold tasks (one task per line).

Every phase reads its tasks through :func:`load_task_file`: the pipeline checks that each line is a JSON object with
the keys of :class:`~pipeline.envs.contract.TaskFields` of the right JSON types, and (with `validate`, at a phase's
boundary) the environment's own Great Expectations check of its records; only then does the environment turn each
record into a task (:meth:`Environment.task_from_dict`).

Key order: a record is written with its keys sorted at every depth (:func:`record_json`), so a task's free `data`
comes back from the file with sorted keys. The pipeline never hands an expert a task that has not made that trip:
`build_env` writes its demonstrations from the tasks as they read back (:func:`as_read_back`), so demonstrations, RL
guidance, evaluation and serving all show the expert the same order. (Sorted keys keep the files of every earlier
build byte for byte as they were; an expert that needs an order of its own should take it from the tool's schema, as
the built-in experts do.)
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import iter_numbered_jsonl

# The keys every task record has, with the JSON types the pipeline reads them as (bool is not an int here).
TASK_KEYS = {"task_id": str, "split": str, "level": int, "family": str, "question": str, "answer": str,
             "min_calls": int, "template_seen": bool}


def record_json(record: dict) -> str:
    """One task record as a line of a task file (keys sorted at every depth; see the module docstring)."""
    return json.dumps(record, sort_keys=True)


def write_tasks(tasks: list, path: Path, env: str | None = None) -> None:
    """One task per line (:func:`record_json`); `env` (a mixed run's) is written into every record. Atomic
    (:mod:`pipeline.core.atomic`): `path` holds the old file or the whole new one."""
    from pipeline.core.atomic import atomic_open

    extra = {"env": env} if env else {}
    with atomic_open(path) as fh:
        for t in tasks:
            fh.write(record_json({**t.to_dict(), **extra}) + "\n")


def as_read_back(tasks: list, world) -> list:
    """`tasks` as :func:`load_task_file` will give them back from the file :func:`write_tasks` writes (same key
    order everywhere), for whatever uses a task before it is read from its file (the demonstrations)."""
    return [world.task_from_dict(json.loads(record_json(t.to_dict()))) for t in tasks]


class TaskFileError(AgentRLError, ValueError):
    """A task file that cannot be used; the message names the file, the line (or the rows) and what is wrong."""


def record_problem(rec: dict) -> str | None:
    """What is wrong with the pipeline's keys of one task record, or None."""
    missing = [k for k in TASK_KEYS if k not in rec]
    if missing:
        return f"missing keys {missing}"
    for key, typ in TASK_KEYS.items():
        value = rec[key]
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if not ok:
            return f"{key} must be a JSON {typ.__name__.replace('str', 'string').replace('int', 'integer')}, " \
                   f"got {type(value).__name__}"
    return None


def read_task_records(path: str | Path) -> list[tuple[int, dict]]:
    """(line, record) of every task of `path`, checked for what any environment's task needs (the task keys and
    their JSON types); :class:`TaskFileError` naming the file and the line otherwise. No environment is needed, so an
    entry point can refuse a bad file before it opens a world."""
    path = Path(path)
    records = []
    try:
        for i, rec in iter_numbered_jsonl(path, "task file"):
            problem = record_problem(rec)
            if problem:
                raise TaskFileError(f"{path}:{i}: {problem}")
            records.append((i, rec))
    except TaskFileError:
        raise
    except AgentRLError as exc:
        raise TaskFileError(str(exc)) from None
    if not records:
        raise TaskFileError(f"{path}: no tasks in file")
    return records


def load_task_file(path: str | Path, world, *, validate: bool = True) -> list:
    """The tasks of `path` for the environment `world` (see the module docstring).

    A missing or empty file, a line that is not a JSON object, a record without the task keys or with a key of the
    wrong type, and a record the environment cannot read raise :class:`TaskFileError` naming the file and the line.
    """
    path = Path(path)
    records = read_task_records(path)
    if validate:
        from pipeline.core.validation import DataValidationError

        report = world.check_task_records([r for _, r in records], str(path))
        if report is not None:
            try:
                report.raise_if_failed()
            except DataValidationError as exc:
                raise TaskFileError(str(exc)) from None
    tasks = []
    for i, rec in records:
        try:
            tasks.append(world.task_from_dict(rec))
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskFileError(f"{path}:{i}: environment {world.name!r} cannot read this task "
                                f"({type(exc).__name__}: {str(exc)[:160]})") from None
    return tasks
