"""Scripted policies of the SQL analyst: the expert (optionally with one flaw) and a random baseline.

The expert's plan for a task is ``describe_table`` of each table its reference SQL reads (``data["tables"]``, in
order), one ``query`` with the reference SQL, and ``answer`` with the value read from the query's observation
(``info["tool_result"]``: the single value, or the names of a one-column result joined by ", "). It solves every task
in exactly `min_calls` calls when nothing fails; a plan step whose call failed (``info["outcome"]`` "tool_error" or
"timeout", e.g. an injected transient failure) is tried again.

Flaws (one per demonstration, see `build_env.demos`):

- ``redundant_call``: one ``describe_table`` or the ``query`` is repeated right after itself (one extra call);
- ``wrong_order``: the expert first runs its query before looking at the schema, guessing the first table's name in
  the singular (``FROM customer``); SQLite reports "no such table" (or a syntax error for ``order``, a keyword), then
  the expert follows its plan (one extra, failing call: a ``tool_error``);
- ``wrong_value``: the answer is wrong: a number is shifted by 1-19, a list of names is given in reverse order, a
  single name gets " Co" appended (the episode fails).

The random baseline draws a tool uniformly and well-formed parameters: a table name (sometimes one that does not
exist), a simple SELECT over a random table and column, or an answer (a random number or name).
"""

from __future__ import annotations

import json
import re

import numpy as np

from pipeline.envs.sql.tools import format_number
from pipeline.envs.sql.world import CITIES, TABLES

FLAWS = ("redundant_call", "wrong_order", "wrong_value")
RETRY_OUTCOMES = ("tool_error", "timeout")  # the pipeline's outcomes of a call that may succeed when repeated
PARAM_ORDER = {"describe_table": ["table"], "query": ["sql"], "answer": ["value"], "list_tables": []}


def format_action(tool: str, params: dict) -> str:
    """The action text ``<call>tool {json}</call>`` (the pipeline's protocol), parameters in signature order."""
    order = PARAM_ORDER.get(tool, [])
    ranked = sorted(params, key=lambda k: (order.index(k) if k in order else len(order), k))
    return f"<call>{tool} {json.dumps({k: params[k] for k in ranked}, ensure_ascii=True)}</call>"


def read_answer(result: str, kind: str) -> str:
    """The answer the expert reads off a ``query`` observation (see the module docstring)."""
    text = str(result).strip()
    if kind == "names" and "\n" in text:
        lines = [ln.strip() for ln in text.splitlines()]
        if lines and " rows, first " in lines[0]:
            lines = lines[1:]
        return ", ".join(ln for ln in lines[1:] if ln)
    return text


def _singular(table: str) -> str:
    return table[:-1] if table.endswith("s") else table + "s"


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
        data = task.data
        plan = [("describe_table", {"table": t}, True) for t in data["tables"]]
        plan.append(("query", {"sql": data["sql"]}, True))
        if self.flaw == "redundant_call":
            i = int(self.rng.integers(len(plan)))
            plan.insert(i + 1, (plan[i][0], plan[i][1], False))
        elif self.flaw == "wrong_order":
            first = data["tables"][0]
            bad = re.sub(rf"\b{first}\b", _singular(first), data["sql"], count=1)
            plan.insert(0, ("query", {"sql": bad}, False))
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
        value = read_answer(info.get("tool_result", ""), self.task.data["kind"])
        if self.flaw == "wrong_value":
            value = _wrong(value, self.rng)
        return format_action("answer", {"value": value})


def _wrong(value: str, rng: np.random.Generator) -> str:
    try:
        x = float(value)
    except ValueError:
        names = [v.strip() for v in value.split(",")]
        return ", ".join(reversed(names)) if len(names) > 1 else value + " Co"
    return format_number(x + float(rng.choice([-1, 1])) * float(rng.integers(1, 20)))


class RandomPolicy:
    """Uniform over tools, with well-formed random parameters (see the module docstring)."""

    name = "random"

    def __init__(self, columns: dict[str, list[str]], rng: np.random.Generator | None = None):
        self.columns = columns
        self.rng = rng if rng is not None else np.random.default_rng(0)

    def reset(self, task) -> None:
        self.task = task

    def act(self, obs: dict, info: dict) -> str:
        r = self.rng
        table = TABLES[int(r.integers(len(TABLES)))]
        tool = ("list_tables", "describe_table", "query", "answer")[int(r.integers(4))]
        if tool == "list_tables":
            return format_action(tool, {})
        if tool == "describe_table":
            return format_action(tool, {"table": table if r.random() < 0.8 else _singular(table)})
        if tool == "query":
            col = self.columns[table][int(r.integers(len(self.columns[table])))]
            how = ("SELECT {c} FROM {t} LIMIT 5", "SELECT COUNT(*) FROM {t}", "SELECT MAX({c}) FROM {t}",
                   "SELECT {c}, COUNT(*) FROM {t} GROUP BY {c} LIMIT 5")[int(r.integers(4))]
            return format_action(tool, {"sql": how.format(c=col, t=table)})
        value = str(int(r.integers(0, 1000))) if r.random() < 0.7 else CITIES[int(r.integers(len(CITIES)))]
        return format_action("answer", {"value": value})
