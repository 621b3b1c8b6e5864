"""Serving requests for the shop: a bare question (with optional task id, allowed writes and ground truth) or a complete
task record, type-checked field by field before an episode starts (ValueError naming the field; the server answers
422 with it)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipeline.envs.shop.tasks import ALL_FAMILIES, FAMILY_LEVEL, Task
from pipeline.envs.shop.tools import TOOL_NAMES

REQUEST_KEYS = ("question", "task_id", "allowed_writes", "answer")


def request_task(obj: dict) -> Task:
    """A :class:`~pipeline.envs.shop.tasks.Task` from one request (a dict); ValueError names what is wrong."""
    full = set(Task.__dataclass_fields__)
    if full <= set(obj):  # a complete task record (e.g. a line of data/tasks/test.jsonl)
        extra = set(obj) - full - {"seed"}
        if extra:
            raise ValueError(f"unknown task fields {sorted(extra)}")
        _check_record(obj)
        try:
            task = Task.from_dict(obj)
        except TypeError as exc:
            raise ValueError(f"malformed task record: {exc}") from None
    else:
        unknown = sorted(set(obj) - set(REQUEST_KEYS) - {"seed"})
        if unknown:
            raise ValueError(f"unknown fields {unknown}; a task has {list(REQUEST_KEYS)} (only 'question' is "
                               f"required) or every field of a task record")
        question = obj.get("question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError("'question' must be a non-empty string")
        answer = obj.get("answer")
        if answer is not None and not isinstance(answer, (str, int, float)):
            raise ValueError("'answer' (ground truth) must be a string or a number")
        writes = _check_writes(obj.get("allowed_writes", []))
        task_id = obj.get("task_id")
        if task_id is not None and not isinstance(task_id, (str, int)):
            raise ValueError("'task_id' must be a string or an integer")
        if task_id is None:
            task_id = "req-" + hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]
        task = Task(task_id=str(task_id), split="serve", family="unknown", level=0, template_id="",
                    template_seen=True, question=question, entities=[], plan=[],
                    answer="" if answer is None else str(answer), min_calls=2, allowed_writes=writes)
    return task


_STR, _INT = (str,), (int,)
RECORD_TYPES = {"task_id": (str, int), "split": _STR, "family": _STR, "level": _INT, "template_id": _STR,
                "template_seen": (bool,), "question": _STR, "entities": (list,), "plan": (list,),
                "answer": (str, int, float), "min_calls": _INT, "allowed_writes": (list,)}


def _check_record(obj: dict) -> None:
    """Type-check every field of a complete task record before an episode starts (the README's task schema, without
    the dataset-level Great Expectations suite, which is too slow per request): a wrong type is a ValueError naming
    the field, never an exception inside the episode (a `plan` of 5 or a `min_calls` of "x" used to fail there).
    The vocabularies are checked too: `family` is one of the environment's families, `level` is that family's level,
    and every `plan` step names one of its tools."""
    for key, types in RECORD_TYPES.items():
        v = obj[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise ValueError(f"task field {key!r} must be {' or '.join(t.__name__ for t in types)}, "
                               f"got {type(v).__name__}")
    if not obj["question"].strip():
        raise ValueError("'question' must be a non-empty string")
    if not all(isinstance(e, str) for e in obj["entities"]):
        raise ValueError("task field 'entities' must be a list of strings")
    if obj["min_calls"] < 1:
        raise ValueError("task field 'min_calls' must be at least 1")
    if not all(isinstance(st, dict) and isinstance(st.get("tool"), str) and isinstance(st.get("params"), dict)
               for st in obj["plan"]):
        raise ValueError("task field 'plan' must be a list of {tool, params} steps")
    _check_writes(obj["allowed_writes"])
    if obj["family"] not in ALL_FAMILIES:
        raise ValueError(f"task field 'family' must be one of {list(ALL_FAMILIES)}, got {obj['family'][:40]!r}")
    if obj["level"] != FAMILY_LEVEL[obj["family"]]:
        raise ValueError(f"task field 'level' is {obj['level']}, but family {obj['family']!r} is level "
                           f"{FAMILY_LEVEL[obj['family']]}")
    unknown = sorted({st["tool"][:40] for st in obj["plan"]} - set(TOOL_NAMES))
    if unknown:
        raise ValueError(f"task field 'plan' names unknown tools {unknown}; the tools are {list(TOOL_NAMES)}")


def _check_writes(writes: Any) -> list:
    """`writes` itself when it is a list of {table, name, field} string objects (a task's ``allowed_writes``), else a
    ValueError: checked before an episode starts, in a bare request and in a complete task record alike."""
    if not isinstance(writes, list) or not all(
            isinstance(w, dict) and set(w) == {"table", "name", "field"} and all(isinstance(v, str) for v in w.values())
            for w in writes):
        raise ValueError("'allowed_writes' must be a list of {table, name, field} string objects")
    return writes


