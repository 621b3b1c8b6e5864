"""Helpers of the built-in environments' own tests (tests/test_env_sql.py, tests/test_env_calendar.py): drive a
scripted policy through an environment's episodes directly, below the pipeline's runner."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from pipeline.envs.contract import SafetyViolation, Task, ToolError

ACTION = re.compile(r"\A<call>([a-z_]+) (\{.*\})</call>\Z", re.DOTALL)
MAX_ACTION_CHARS = 256  # the pipeline's default longest action text


def all_tasks(result) -> list[Task]:
    return [t for split in ("train", "validation", "test") for t in result.tasks[split]]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse(text: str) -> tuple[str, dict]:
    m = ACTION.match(text)
    assert m, f"not an action: {text!r}"
    return m.group(1), json.loads(m.group(2))


def drive(env, task: Task, policy, max_steps: int = 12):
    """Run `policy` on `task` through an episode of `env`; (calls as (tool, outcome), correct, actions)."""
    episode = env.open_episode(task, np.random.default_rng(0))
    policy.reset(task)
    obs, info, calls, actions = {"context": task.question}, {}, [], []
    try:
        for _ in range(max_steps):
            text = policy.act(obs, info)
            actions.append(text)
            tool, params = parse(text)
            if tool == "answer":
                calls.append((tool, "answer"))
                return calls, episode.correct(str(params["value"])), actions
            try:
                result, outcome = episode.call(tool, params), "ok"
            except SafetyViolation as exc:
                result, outcome = str(exc), "safety_violation"
            except ToolError as exc:
                result, outcome = str(exc), "tool_error"
            calls.append((tool, outcome))
            info = {"tool_result": result, "outcome": outcome}
        return calls, False, actions
    finally:
        episode.close()
