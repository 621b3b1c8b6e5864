"""Scripted policies: the optimal expert, its imperfect demonstrations, and a random baseline.

The expert acts only on what the environment shows it: it executes the task's plan, filling every reference to an
earlier result from the `tool_result` of that step, and retries a step whose call failed (a transient tool error).
It therefore solves every task in exactly `min_calls` calls when nothing fails.

Imperfect demonstrations (for base-model adaptation, so that RL has something to improve) are the expert with one
flaw injected per demonstration, each drawn with the probability in `build_env.demos`:

- ``redundant_call``: one successful lookup or search is repeated (costs efficiency);
- ``wrong_order``: a later step is tried first with its inputs still unknown, fails, and the expert recovers
  (costs efficiency and user experience);
- ``wrong_value``: the answer copies a wrong value (the demonstration fails);
- context actions (``env.context_actions.enabled``; the runner's reset info says which and the history window): on a
  task whose plan has more calls before the answer than the window keeps, the expert first declares its ``plan``
  (the plan's tools, consecutive repeats collapsed: ``["lookup", "calc", "answer"]``), and before a step whose
  pair would push a result out of the window it writes a ``note`` holding every result so far (``"price so far: 320,
  536"``), so the values it needs stay in the context. On shorter tasks it acts as without them.
- partial coverage: only the share `level_coverage[level]` of training tasks of a level gets a demonstration at all,
  so the hard levels are scarce but present (scarce-but-present hard demonstrations gave RL its large gains; noise
  everywhere did not).
"""

from __future__ import annotations

import numpy as np

from pipeline.envs.protocol import format_action as _format_action
from pipeline.envs.shop.tasks import Task, resolve_params
from pipeline.envs.shop.tools import default_tools, format_number
from pipeline.envs.verifier import OK

FLAWS = ("none", "redundant_call", "wrong_order", "wrong_value")
PARAM_ORDER = {t.name: list(t.parameters["properties"]) for t in default_tools()}  # the prompt's signatures


def format_action(tool: str, params: dict) -> str:
    """The expert's action text, its parameters in the order of the tool's signature (`lookup(name, field)`), whatever
    the order of `params`: a task read back from its JSON Lines file has its plan's keys sorted (`{"field": ...,
    "name": ...}`), and an expert that wrote them so would write other text, other tokens, than the demonstrations
    (made from the tasks before they were written) that the policy learned from."""
    order = PARAM_ORDER.get(tool, [])
    ranked = sorted(params, key=lambda k: (order.index(k) if k in order else len(order), k))
    return _format_action(tool, {k: params[k] for k in ranked})


class ExpertPolicy:
    """Optimal scripted policy; `flaw` injects one documented imperfection (see the module docstring)."""

    name = "expert"

    def __init__(self, flaw: str = "none", rng: np.random.Generator | None = None):
        if flaw not in FLAWS:
            raise ValueError(f"unknown flaw {flaw!r}; flaws are {FLAWS}")
        self.flaw = flaw
        self.rng = rng or np.random.default_rng(0)

    def reset(self, task: Task) -> None:
        self.task = task
        self.results: list[str] = []
        self.queue: list[tuple[str, dict, bool]] = []  # (tool, params, is_plan_step)
        self._last_was_plan = False
        self.ctx: dict | None = None  # the context actions on offer (the reset info's `context_actions`)
        self.planned, self.since_note, self._acted, self._last_note = False, 0, False, False
        plan = task.plan
        self.extra_at: dict[int, tuple[str, dict]] = {}
        if self.flaw == "redundant_call":
            idx = [i for i, s in enumerate(plan) if s["tool"] in ("lookup", "search")]
            k = idx[int(self.rng.integers(len(idx)))]
            self.extra_at[k + 1] = ("repeat", {"of": k})
        elif self.flaw == "wrong_order":
            later = [i for i, s in enumerate(plan[:-1]) if i > 0]
            if later:
                j = later[int(self.rng.integers(len(later)))]
                self.extra_at[j - 1] = ("premature", {"step": j})  # before step j-1 runs, j's input is unknown
            else:
                self.extra_at[0] = ("premature_search", {})

    def _next_plan_action(self) -> tuple[str, dict]:
        step = self.task.plan[len(self.results)]
        params = resolve_params(step["params"], self.results)
        if step["tool"] == "answer" and self.flaw == "wrong_value":
            params = {"value": _wrong(params["value"], self.rng)}
        return step["tool"], params

    def _context_action(self) -> str | None:
        """A plan or a note when the context actions are on and the task outgrows the window (module docstring)."""
        ctx, plan = self.ctx, self.task.plan
        if ctx is None or len(plan) - 1 <= ctx["history_window"]:
            return None
        if not self.planned and "plan" in ctx["tools"]:
            self.planned = True
            steps = [s["tool"] for i, s in enumerate(plan) if i == 0 or plan[i - 1]["tool"] != s["tool"]]
            return format_action("plan", {"steps": steps})
        k = len(self.results)
        if "note" in ctx["tools"] and self.results and self.since_note >= ctx["history_window"] and k < len(plan) - 2:
            what = plan[0]["params"].get("field", "results")
            return format_action("note", {"text": f"{what} so far: {', '.join(self.results)}"[:200]})
        return None

    def act(self, obs: dict, info: dict) -> str:
        if not self._acted and info.get("context_actions") is not None:
            self.ctx = info["context_actions"]
        if self._acted:  # the pairs the context holds after the latest note (a note replaces itself too)
            self.since_note = 0 if self._last_note else self.since_note + 1
        self._acted, self._last_note = True, False
        if info.get("outcome") is not None and self._last_was_plan and info["outcome"] == OK:
            self.results.append(info["tool_result"])
        ctx_action = self._context_action()
        if ctx_action is not None:
            self._last_was_plan, self._last_note = False, ctx_action.startswith("<call>note")
            return ctx_action
        k = len(self.results)
        extra = self.extra_at.pop(k, None)
        if extra is not None:
            kind, arg = extra
            self._last_was_plan = False
            if kind == "repeat":
                prev = self.task.plan[arg["of"]]
                return format_action(prev["tool"], resolve_params(prev["params"], self.results))
            if kind == "premature":
                step = self.task.plan[arg["step"]]
                params = {key: (v if "{" not in str(v) else "x") for key, v in step["params"].items()}
                return format_action(step["tool"], params)
            return format_action("search", {"query": self.task.entities[0]})
        self._last_was_plan = True
        tool, params = self._next_plan_action()
        return format_action(tool, params)


def _wrong(value: object, rng: np.random.Generator) -> str:
    try:
        x = float(str(value))
    except ValueError:
        return str(value) + " Ltd"
    return format_number(x + float(rng.choice([-1, 1])) * float(rng.integers(1, 20)))


class RandomPolicy:
    """Uniform over tools, with parameters of the right shape drawn at random (names from the world)."""

    name = "random"

    def __init__(self, names: list[str], rng: np.random.Generator | None = None):
        self.names = names
        self.rng = rng or np.random.default_rng(0)

    def reset(self, task: Task) -> None:
        self.task = task

    def act(self, obs: dict, info: dict) -> str:
        r = self.rng
        name = self.names[int(r.integers(len(self.names)))]
        num = lambda: int(r.integers(0, 1000))  # noqa: E731
        tool = ("lookup", "calc", "search", "convert", "update", "answer")[int(r.integers(6))]
        params = {
            "lookup": lambda: {"name": name, "field": str(r.choice(["price", "stock", "supplier", "category"]))},
            "calc": lambda: {"expr": f"{num()}*{int(r.integers(1, 10))}"},
            "search": lambda: {"query": name},
            "convert": lambda: {"value": num(), "from": "kg", "to": str(r.choice(["lb", "g", "oz"]))},
            "update": lambda: {"name": name, "field": "stock", "value": num()},
            "answer": lambda: {"value": str(num())},
        }[tool]()
        return format_action(tool, params)


def draw_flaw(level: int, cfg, rng: np.random.Generator) -> str:
    """One flaw per demonstration, by the configured probabilities (checked in order, at most one)."""
    u = rng.random()
    for flaw, p in (("wrong_value", cfg.wrong_value_prob), ("wrong_order", cfg.wrong_order_prob),
                    ("redundant_call", cfg.redundant_call_prob)):
        if u < p:
            return flaw
        u -= p
    return "none"


def demo_record(demo_id: str, task: Task, flaw: str, steps: list[dict], success: bool, ret: float) -> dict:
    return {"demo_id": demo_id, "task_id": task.task_id, "level": task.level, "family": task.family, "flaw": flaw,
            "steps": steps, "success": bool(success), "return": round(float(ret), 6), "n_calls": len(steps)}
