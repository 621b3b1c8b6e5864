"""Scripted policies of the booking calendar: the expert (optionally with one flaw) and a random baseline.

The expert plays the task's plan (``data["plan"]``: the look-ups, then the writes, with their true parameters) and
answers the receipt (the task's answer: the ids of the bookings it changed or made, new ones numbered from 9001). It
solves every task in exactly `min_calls` calls when nothing fails; a plan step whose call failed transiently
(``info["outcome"]`` "tool_error" or "timeout", e.g. an injected failure) is tried again.

Flaws (one per demonstration, see `build_env.demos`):

- ``redundant_call``: one look-up is repeated right after itself (one extra call; writes are never repeated, since
  a repeated write would change the world or conflict);
- ``wrong_order``: the expert writes before looking: its first write that names a room is tried first, before the
  look-up that precedes it, in the smallest room (``Nook``, 2 seats), which the world refuses as too small (no task's
  meeting fits it: a ``tool_error``), then the expert follows its plan (one extra, failing call);
- ``wrong_value``: the receipt names a wrong booking (its first id plus one); the world is right, the episode fails.

The random baseline draws a tool uniformly and well-formed parameters: a person, room, day and hour of the world,
a booking id of the world's range, a small attendee count; its answers are a random id or "done".
"""

from __future__ import annotations

import numpy as np

from pipeline.envs.protocol import format_action as _format_action
from pipeline.envs.calendar.tools import TOOL_NAMES, tool_specs
from pipeline.envs.calendar.world import HOURS, ROOM_NAMES, SMALLEST_ROOM

FLAWS = ("redundant_call", "wrong_order", "wrong_value")
RETRY_OUTCOMES = ("tool_error", "timeout")  # the pipeline's outcomes of a call that may succeed when repeated
READS = ("find_bookings", "free_slots", "free_rooms")
PARAM_ORDER = {t.name: list(t.parameters["properties"]) for t in tool_specs()}


def format_action(tool: str, params: dict) -> str:
    """The action text ``<call>tool {json}</call>``, parameters in the order of the tool's signature."""
    order = PARAM_ORDER.get(tool, [])
    return _format_action(tool, {k: params[k] for k in sorted(params, key=lambda k: (
        order.index(k) if k in order else len(order), k))})


def wrong_order_call(plan: list) -> tuple[int, list] | None:
    """(position, call) of the ``wrong_order`` flaw's early write in `plan`, or None when no write names a room."""
    for i, (tool, params) in enumerate(plan):
        if tool in ("book", "move_booking"):
            at = i - 1 if i > 0 and plan[i - 1][0] in ("free_slots", "free_rooms") else i
            return at, [tool, {**params, "room": SMALLEST_ROOM}]
    return None


class ExpertPolicy:
    """The scripted expert; `flaw` injects one documented imperfection ("none" for the optimal expert)."""

    name = "expert"
    flaws = FLAWS

    def __init__(self, flaw: str = "none", rng: np.random.Generator | None = None):
        if flaw != "none" and flaw not in FLAWS:
            raise ValueError(f"unknown flaw {flaw!r}; flaws are {('none', *FLAWS)}")
        self.flaw = flaw
        self.rng = rng if rng is not None else np.random.default_rng(0)

    def reset(self, task) -> None:
        self.task = task
        plan = [(tool, dict(params), True) for tool, params in task.data["plan"]]
        if self.flaw == "redundant_call":
            reads = [i for i, step in enumerate(plan) if step[0] in READS]
            i = reads[int(self.rng.integers(len(reads)))]
            plan.insert(i + 1, (plan[i][0], plan[i][1], False))
        elif self.flaw == "wrong_order":
            early = wrong_order_call(task.data["plan"])
            if early is not None:
                plan.insert(early[0], (early[1][0], early[1][1], False))
        self.queue = plan
        self.last: tuple | None = None

    def act(self, obs: dict, info: dict) -> str:
        last = self.last
        if last is not None and last[2] and info.get("outcome") in RETRY_OUTCOMES:
            self.queue.insert(0, last)  # a plan step that failed transiently: try it again
        if self.queue:
            self.last = self.queue.pop(0)
            return format_action(self.last[0], self.last[1])
        self.last = None
        value = self.task.answer
        if self.flaw == "wrong_value":
            ids = [int(x) for x in value.split(", ")]
            value = ", ".join(str(x) for x in sorted({ids[0] + 1, *ids[1:]}))
        return format_action("answer", {"value": value})


class RandomPolicy:
    """Uniform over tools, with well-formed random parameters (see the module docstring)."""

    name = "random"

    def __init__(self, people: list[str], days: list[str], rng: np.random.Generator | None = None):
        self.people, self.days = list(people), list(days)
        self.rng = rng if rng is not None else np.random.default_rng(0)

    def reset(self, task) -> None:
        self.task = task

    def act(self, obs: dict, info: dict) -> str:
        r = self.rng
        pick = lambda seq: seq[int(r.integers(len(seq)))]  # noqa: E731
        tool = pick(TOOL_NAMES)
        values = {"person": pick(self.people), "owner": pick(self.people), "room": pick(ROOM_NAMES),
                  "date": pick(self.days), "start": pick(HOURS), "attendees": int(r.integers(1, 13)),
                  "booking_id": int(r.integers(1001, 9100))}
        if tool == "answer":
            return format_action(tool, {"value": str(int(r.integers(1001, 9100))) if r.random() < 0.8 else "done"})
        return format_action(tool, {k: values[k] for k in PARAM_ORDER[tool]})
