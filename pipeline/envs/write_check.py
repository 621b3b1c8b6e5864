"""Finding write tools that are not declared as such (``ToolSpec.writes`` left False).

The reward-hacking probe ``attempt_writes`` (:mod:`pipeline.envs.probes`) calls the tools whose ToolSpec says
``writes=True``; a tool that changes the world but is declared as the docs' plain ``ToolSpec(name, description,
parameters)`` would leave the probe with nothing to call. :func:`undeclared_writes` finds such tools for any
environment, on private episodes of a few training tasks (nothing is written to the world folder, and the build's
data and random draws are untouched), with the same parameters the probes use (:func:`pipeline.envs.schema_fill.fill`:
the strings quoted in the question, an enum's first value, a small integer):

- an episode that offers :class:`~pipeline.envs.capabilities.DigestsState` (``state_digest()``) is fingerprinted
  before and after each call of a tool not marked ``writes``; a changed digest marks the tool;
- otherwise, by what the tools return: in a fresh episode the *other* read tools are called once, then the tool, then
  the others again; the tool is marked when the others' results changed across its call (or its own second call
  returns something else than its first) while a control episode without the tool in between shows the others (and
  the tool's two calls in separate fresh episodes) give the same results each time. A tool whose effect no other
  tool can observe and that does not change its own answer is not found; declare it (``writes=True``).
"""

from __future__ import annotations

import numpy as np

from pipeline.envs.capabilities import DigestsState, has_capability
from pipeline.envs.contract import ANSWER_TOOL, Environment, ToolSpec

MAX_TASKS = 3  # training tasks examined (the check is about the tools, not the tasks)


def _call(episode, spec: ToolSpec, args: dict) -> str:
    try:
        return str(episode.call(spec.name, args))
    except Exception as exc:  # noqa: BLE001 -- any failure is an outcome to compare, as the runner reports it
        return f"error: {type(exc).__name__}: {exc}"


def _open(world: Environment, task, seed: int):
    return world.open_episode(task, np.random.default_rng(seed), randomize_values=False)


def _close(episode) -> None:
    try:
        episode.close()
    except Exception:  # noqa: BLE001
        pass


def undeclared_writes(world: Environment, tasks: list, seed: int = 0) -> list[str]:
    """The names of tools not declared ``writes`` that change an episode's state (see the module docstring), sorted."""
    from pipeline.envs.schema_fill import fill, quoted

    found: set[str] = set()
    for task in tasks[:MAX_TASKS]:
        reads = [s for s in world.tools_for(task) if s.name != ANSWER_TOOL and not s.writes]
        if not reads:
            continue
        strings = quoted(task.question) or [w for w in task.question.split() if w.isalpha()][:1]
        rng = np.random.default_rng([seed, 17])
        args = {s.name: fill(s.parameters, strings, rng) for s in reads}
        for spec in reads:
            if spec.name in found:
                continue
            others = [s for s in reads if s is not spec]
            ep = _open(world, task, seed)
            try:
                if has_capability(ep, DigestsState):
                    before = ep.state_digest()
                    _call(ep, spec, args[spec.name])
                    if ep.state_digest() != before:
                        found.add(spec.name)
                    continue
                first = [_call(ep, o, args[o.name]) for o in others]
                own = [_call(ep, spec, args[spec.name]), _call(ep, spec, args[spec.name])]
                second = [_call(ep, o, args[o.name]) for o in others]
            finally:
                _close(ep)
            control = _open(world, task, seed)
            try:
                c_first = [_call(control, o, args[o.name]) for o in others]
                c_second = [_call(control, o, args[o.name]) for o in others]
            finally:
                _close(control)
            fresh = _open(world, task, seed)
            try:
                c_own = _call(fresh, spec, args[spec.name])
            finally:
                _close(fresh)
            stable = c_first == c_second and c_own == own[0]
            if stable and (first != second or own[0] != own[1]):
                found.add(spec.name)
    return sorted(found)
