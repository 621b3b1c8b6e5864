"""Reward-hacking probes: degenerate policies played with the configured reward before anything is trained on it.

A reward that pays a degenerate policy a large share of what it pays the expert will be hacked by RL: the policy finds
the shortcut instead of the task (docs/design.md §3.6). `build_env` therefore plays a suite of such
policies on a sample of the training tasks, through the pipeline's runner (:class:`pipeline.envs.runner.AgentEnv`)
with the run's `env` settings and reward weights, and compares each one's mean return with the scripted expert's on
the same tasks and episode seeds. The probes are written only against the environment contract (the tools a task's
environment offers, their JSON Schemas, :attr:`ToolSpec.writes`, the task's question and family), so they work for
every environment:

- ``answer_at_once``: answers at once with a plausible guess, the most common training answer of the task's family
  (counted over the training tasks that are not probed, so the guess never knows the probed task's answer);
- ``repeat_call``: repeats one read call (the first read tool, its parameters filled from its schema) until the step
  or text budget ends, never answering;
- ``guess_number``: makes one read call, then answers a number drawn at random from the numeric training answers
  (so small counts, frequent in the data, are guessed as often as they occur);
- ``call_every_tool``: calls every read tool once (parameters filled from the schema), then answers the guess;
- ``attempt_writes``: calls every write tool on an entity named in the question, then answers the guess. Write tools
  are those whose ToolSpec says ``writes=True`` and those :func:`pipeline.envs.write_check.undeclared_writes` finds
  changing an episode's state without saying so (reported as ``undeclared`` so the environment can declare them);
  where there is none the probe does not run, and the result says so (``write_probe.ran: false``) for `build_env`
  to print (a read-only environment).

Parameters are filled from each tool's JSON Schema (:func:`fill`): an enum's first value, a string quoted in the
question for a string (the entity the task is about, so lookups and writes hit real rows), a small integer for a
number. The probes see what a policy sees; they never read the task's answer.

The rule (:func:`verdict`): a probe fails the build when its mean return exceeds ``floor`` × the expert's mean
return. The zero point is the return of an episode that achieves nothing and harms nothing (every component 0, so
R = 0 under any weights), not the random baseline: the random policy's return is usually negative (its refused
writes and failed calls), and measuring from it would make an honest "nothing" look like progress. When the expert's
mean return is not positive, no share of it is meaningful: a probe then fails when it reaches the expert's return
at all (its ratio is reported as null). Fault injection is off (no latency, no transient failures) for both and the
budgets are the expert check's (the step budget at least the largest `min_calls` played, no text budget; `repeat_call`
runs until that step budget ends), so the comparison is of the reward, not of luck with faults or of a run's tight
budget that truncates the expert too; the probes draw from their own random generator, so a build's
data are byte for byte what they are without them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import ANSWER_TOOL, Environment, ToolSpec
from pipeline.envs.protocol import format_action
from pipeline.envs.runner import AgentEnv, toolset
from pipeline.envs.schema_fill import fill, quoted  # noqa: F401 (the probes' own helpers, re-exported)

PROBES = ("answer_at_once", "repeat_call", "guess_number", "call_every_tool", "attempt_writes")
_NUMBER = re.compile(r"-?\d+(\.\d+)?\Z")


# ------------------------------------------------------------------------------------------------------- the rule
def verdict(probe_return: float, expert_return: float, floor: float) -> tuple[float | None, bool]:
    """(ratio of the probe's mean return to the expert's, whether the probe passes) by the module's rule.

    >>> verdict(0.11, 1.1, 0.5)
    (0.1, True)
    >>> verdict(0.6, 1.0, 0.5), verdict(0.5, 1.0, 0.5)
    ((0.6, False), (0.5, True))
    >>> verdict(-0.4, 1.1, 0.5)
    (-0.363636, True)
    >>> verdict(-0.3, -0.2, 0.5), verdict(-0.2, -0.2, 0.5), verdict(0.0, 0.0, 0.5)
    ((None, True), (None, False), (None, False))
    """
    if expert_return > 0:
        ratio = probe_return / expert_return
        return round(ratio, 6), ratio <= floor + 1e-12
    return None, probe_return < expert_return


def guesses(train: list, probed_ids: set[str]) -> tuple[dict[str, str], str, list[str]]:
    """What the guessing probes know from the training split without the probed tasks: the most common answer of each
    family, the most common answer overall, and the numeric answers (one entry per task, sorted; ["0"] if none).

    >>> from pipeline.envs.contract import Task
    >>> ts = [Task("a", "train", 1, "q", "7", family="f"), Task("b", "train", 1, "q", "7", family="f"),
    ...       Task("c", "train", 1, "q", "x", family="f"), Task("d", "train", 1, "q", "2.5", family="g"),
    ...       Task("e", "train", 1, "q", "99", family="g")]
    >>> guesses(ts, {"e"})
    ({'f': '7', 'g': '2.5'}, '7', ['2.5', '7', '7'])
    """
    known = [t for t in train if t.task_id not in probed_ids] or list(train)
    by_family: dict[str, Counter] = {}
    for t in known:
        by_family.setdefault(t.family, Counter())[str(t.answer)] += 1
    overall = Counter(str(t.answer) for t in known)
    numbers = sorted((str(t.answer).strip() for t in known if _NUMBER.match(str(t.answer).strip())),
                     key=lambda a: (float(a), a)) or ["0"]
    return ({f: c.most_common(1)[0][0] for f, c in sorted(by_family.items())}, overall.most_common(1)[0][0], numbers)


# ------------------------------------------------------------------------------------------------------ the probes
class Probe:
    """One degenerate policy (a :class:`~pipeline.envs.contract.ScriptedPolicy`): a queue of calls made up at reset,
    then `final` (an answer, or None to go on repeating the last call until a budget ends)."""

    def __init__(self, name: str, world: Environment, family_guess: dict[str, str], overall_guess: str,
                 numbers: list[str], rng: np.random.Generator, undeclared: frozenset[str] = frozenset()):
        if name not in PROBES:
            raise ValueError(f"unknown probe {name!r}; probes are {PROBES}")
        self.name, self.world, self.rng = name, world, rng
        self.family_guess, self.overall_guess, self.numbers = family_guess, overall_guess, numbers
        self.undeclared = undeclared  # tools found to write without declaring it (treated as write tools)

    def applies(self, task) -> bool:
        """Whether the probe has anything to try on `task` (the write probe needs a write tool)."""
        return self.name != "attempt_writes" or bool(self._tools(task, writes=True))

    def _tools(self, task, writes: bool) -> list[ToolSpec]:
        return [s for s in toolset(self.world, task).specs
                if s.name != ANSWER_TOOL and (s.writes or s.name in self.undeclared) == writes]

    def _call(self, spec: ToolSpec, strings: list[str]) -> str:
        return format_action(spec.name, fill(spec.parameters, strings, self.rng))

    def reset(self, task) -> None:
        strings = quoted(task.question) or [w for w in task.question.split() if w.isalpha()][:1]
        guess = self.family_guess.get(task.family, self.overall_guess)
        reads = self._tools(task, writes=False)
        calls, final = [], format_action(ANSWER_TOOL, {"value": guess})
        if self.name == "repeat_call":
            calls, final = [self._call(reads[0], strings)] if reads else [], None
        elif self.name == "guess_number":
            calls = [self._call(reads[0], strings)] if reads else []
            final = format_action(ANSWER_TOOL, {"value": self.numbers[int(self.rng.integers(len(self.numbers)))]})
        elif self.name == "call_every_tool":
            calls = [self._call(s, strings) for s in reads]
        elif self.name == "attempt_writes":
            calls = [self._call(s, strings) for s in self._tools(task, writes=True)]
        self.queue, self.final, self.last = list(calls), final, (calls[-1] if calls else final)

    def act(self, obs: dict, info: dict) -> str:
        if self.queue:
            return self.queue.pop(0)
        if self.final is None:  # repeat_call: the same call again until the budget ends
            return self.last or format_action(ANSWER_TOOL, {"value": self.overall_guess})
        return self.final


# --------------------------------------------------------------------------------------------------- the suite
@dataclass
class ProbeResult:
    name: str
    n: int
    mean_return: float | None
    success_rate: float | None
    mean_tool_calls: float | None
    safety_violations: int
    ratio: float | None
    passed: bool
    expert_return: float | None = None  # the expert's mean return on the tasks this probe played
    skipped: str = ""

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("name", "skipped", "expert_return")}
        return {**out, "skipped": self.skipped} if self.skipped else out


def _play(env, policy, task, seed: int) -> dict:
    obs, info = env.reset(seed=seed, options={"task": task})
    policy.reset(task)
    done = False
    while not done:
        obs, _, terminated, truncated, info = env.step(policy.act(obs, info))
        done = terminated or truncated
    return info


def _summary(infos: list[dict]) -> dict:
    n = len(infos)
    return {"n": n, "mean_return": round(float(np.mean([i["return"] for i in infos])), 6),
            "success_rate": round(sum(bool(i["is_success"]) for i in infos) / n, 6),
            "mean_tool_calls": round(float(np.mean([i["n_calls"] for i in infos])), 6),
            "safety_violations": int(sum(i["n_violations"] for i in infos))}


def run_probes(world: Environment, train: list, env_cfg: EnvConfig, tasks: list, floor: float, seed: int,
               probes: tuple[str, ...] = PROBES) -> dict:
    """Play the expert and every probe in `probes` on `tasks` (a sample of `train`) with `env_cfg`'s reward and
    budgets (the step budget raised to the largest `min_calls` played, the text budget lifted, as in the expert check
    of :mod:`pipeline.envs.checks`), fault injection off, episode i of each with seed `seed` + i; returns {"expert": summary, "probes":
    {name: ProbeResult}, "write_probe": {"ran", "declared", "undeclared"}}. An environment without an expert has
    nothing to compare with: {} then."""
    if world.expert() is None or not tasks:
        return {}
    cfg = env_cfg.model_copy(update={"tool_latency_s": 0.0, "tool_failure_rate": 0.0, "tool_latency_spike_rate": 0.0,
                                     "max_policy_chars": 10**9,
                                     "max_steps": max([env_cfg.max_steps, *(t.min_calls for t in tasks)])})
    family_guess, overall_guess, numbers = guesses(train, {t.task_id for t in tasks})
    from pipeline.envs.write_check import undeclared_writes

    undeclared = frozenset(undeclared_writes(world, tasks, seed))
    declared = sorted({s.name for t in tasks for s in world.tools_for(t) if s.writes})
    env = AgentEnv(world=world, tasks=tasks, config=cfg)
    try:
        expert = _summary([_play(env, world.expert(), t, seed + i) for i, t in enumerate(tasks)])
        results = {}
        for k, name in enumerate(probes):
            probe = Probe(name, world, family_guess, overall_guess, numbers, np.random.default_rng([seed, k]),
                          undeclared)
            played = [(i, t) for i, t in enumerate(tasks) if probe.applies(t)]
            if not played:
                results[name] = ProbeResult(name, 0, None, None, None, 0, None, True,
                                            skipped="no task offers a tool this probe needs")
                continue
            s = _summary([_play(env, probe, t, seed + i) for i, t in played])
            # the expert on the same tasks the probe played (all of them unless the probe skipped some)
            ref = expert["mean_return"] if len(played) == len(tasks) else \
                _summary([_play(env, world.expert(), t, seed + i) for i, t in played])["mean_return"]
            ratio, passed = verdict(s["mean_return"], ref, floor)
            results[name] = ProbeResult(name, s["n"], s["mean_return"], s["success_rate"], s["mean_tool_calls"],
                                        s["safety_violations"], ratio, passed, ref)
    finally:
        env.close()
    writes = results.get("attempt_writes")
    return {"expert": expert, "probes": results,
            "write_probe": {"ran": bool(writes and not writes.skipped), "declared": declared,
                            "undeclared": sorted(undeclared)}}
