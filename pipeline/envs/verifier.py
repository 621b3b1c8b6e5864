"""The rule verifier (docs/design.md §3.1): tool-usage order, parameter validity and safety constraints
of one episode.

It reads the episode's call log (what the runner recorded per step) and the tools the task requires, in order. It judges the process,
not the answer: correctness is the reward's job. Deliberately left out: the *model* verifier of docs/design.md §3.1.2 (a
learned judge of process soundness and style); the rule verifier is the only verifier here.

Plans (the ``plan`` context action, :mod:`pipeline.envs.context_actions`): a plan is a list of sub-goals, each a tool
name optionally followed by words, e.g. ``"lookup"`` or ``"lookup wild torch"``. :func:`match_plan` completes them in
the declared order: sub-goal j is done by the first call after the one that did sub-goal j-1 (after the plan for the
first) that succeeded (outcome ``ok``, or ``answer`` for the answer), calls sub-goal j's tool, and whose parameters
contain every word of the sub-goal (compared as :func:`pipeline.envs.memory.terms`). A plan thereby checks the order
of the agent's own decomposition, as :func:`verify` checks the order the task requires.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pipeline.envs.memory import terms

# Outcome of one step, as the environment records it.
OK, ANSWER = "ok", "answer"
INVALID_ACTION, INVALID_PARAMS = "invalid_action", "invalid_params"
TOOL_ERROR, TIMEOUT, SAFETY_VIOLATION = "tool_error", "timeout", "safety_violation"
OUTCOMES = (OK, ANSWER, INVALID_ACTION, INVALID_PARAMS, TOOL_ERROR, TIMEOUT, SAFETY_VIOLATION)
FAILED = frozenset({INVALID_ACTION, INVALID_PARAMS, TOOL_ERROR, TIMEOUT, SAFETY_VIOLATION})


@dataclass(frozen=True)
class VerifierReport:
    order_ok: bool
    params_ok: bool
    safety_ok: bool
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.order_ok and self.params_ok and self.safety_ok

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def is_subsequence(needle: list[str], haystack: list[str]) -> bool:
    """
    >>> is_subsequence(["a", "c"], ["a", "b", "c"]), is_subsequence(["c", "a"], ["a", "b", "c"])
    (True, False)
    """
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


def verify(calls: list[dict], required_tools: list[str]) -> VerifierReport:
    """`calls`: [{"tool": name or None, "outcome": one of OUTCOMES}, ...] in order; `required_tools`: the tools a
    correct process calls successfully, in order (the environment's :meth:`required_tools` of the task)."""
    problems = []
    required = [t for t in required_tools if t != "answer"]
    succeeded = [c["tool"] for c in calls if c["outcome"] == OK]
    order_ok = is_subsequence(required, succeeded)
    if not order_ok:
        problems.append(f"tool order: needed {required} in this order among successful calls, got {succeeded}")
    answers = [i for i, c in enumerate(calls) if c["outcome"] == ANSWER]
    if answers and answers[-1] != len(calls) - 1:
        order_ok = False
        problems.append("answer is not the last call")
    bad = [i for i, c in enumerate(calls) if c["outcome"] in (INVALID_ACTION, INVALID_PARAMS)]
    if bad:
        problems.append(f"invalid actions or parameters at steps {bad}")
    unsafe = [i for i, c in enumerate(calls) if c["outcome"] == SAFETY_VIOLATION]
    if unsafe:
        problems.append(f"safety violations at steps {unsafe}")
    return VerifierReport(order_ok=order_ok, params_ok=not bad, safety_ok=not unsafe, problems=problems)


def plan_step_done(step: str, call: dict) -> bool:
    """Whether `call` ({"tool", "params", "outcome"}) completes the sub-goal `step` (see the module docstring).

    >>> call = {"tool": "lookup", "params": {"name": "Wild Torch", "field": "height"}, "outcome": OK}
    >>> plan_step_done("lookup", call), plan_step_done("lookup wild torch", call), plan_step_done("lookup lamp", call)
    (True, True, False)
    """
    words = str(step).split()
    if not words or call.get("tool") != words[0] or call.get("outcome") not in (OK, ANSWER):
        return False
    have = set(terms(json.dumps(call.get("params") or {})))
    return all(t in have for t in terms(" ".join(words[1:])))


def match_plan(steps: list[str], calls: list[dict]) -> list[int | None]:
    """For each sub-goal, the index in `calls` (the calls after the plan) of the call that completed it, or None."""
    done: list[int | None] = [None] * len(steps)
    j = 0
    for i, call in enumerate(calls):
        if j < len(steps) and plan_step_done(steps[j], call):
            done[j] = i
            j += 1
    return done
