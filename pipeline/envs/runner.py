"""The pipeline's side of every episode: a Gymnasium environment (``agentrl/ToolTasks-v0``) over any
:class:`~pipeline.envs.contract.Environment`.

What happens here, whatever the environment (the environment only executes calls and judges answers):

- the policy's text is parsed by :mod:`pipeline.envs.protocol`; an unparsable action, an unknown tool or parameters
  that break the tool's JSON Schema are *invalid* outcomes that cost a step and never reach the environment (a wrong
  tool name is an observation the policy learns from, not a crash);
- ``answer`` ends the episode; the environment's :meth:`Episode.correct` judges it;
- fault injection (`tool_failure_rate`, `tool_latency_s` and the random spikes of `tool_latency_spike_rate` against
  `tool_timeout_s`) and the budgets (`max_steps`, `max_policy_chars`) are applied here, so every environment gets
  them; the episode's end reports ``tool_faults``: the calls that reached a tool, the failures and spikes injected
  into them, and the tools' unexpected exceptions (what the training metrics ``faults/*`` add up);
- a :class:`~pipeline.envs.contract.SafetyViolation` is a refused call, any :class:`ToolError` an error the policy
  sees, and any other exception a tool failure (the episode goes on);
- the reward is the composite of :mod:`pipeline.envs.reward`, paid per step as its change; the rule verifier
  (:mod:`pipeline.envs.verifier`) judges the process at the end;
- the context is :func:`pipeline.envs.prompt.render_context` over the tools this task's environment offers;
- with ``env.context_actions.enabled``, the pipeline's own actions (note, remember, recall, plan:
  :mod:`pipeline.envs.context_actions`) join every task's tools; they are executed here, never by the environment,
  and each step's info then carries ``events`` (the episode's end also ``context_actions``, its counts).

Contract (Gymnasium 1.x): action space ``Dict(tool=Discrete(N), params=Text(max_action_chars))``; `step` also accepts
the policy's raw text. Observation ``Dict(context=Text(8192), memory=Box(0, 1, (8,)))``. ``terminated``: the agent
answered; ``truncated``: a budget ran out. Randomness comes only from ``self.np_random`` (task choice, the episode's
own draws, injected faults), so the same seed gives the same episode.
"""

from __future__ import annotations

import time
from pathlib import Path

import gymnasium as gym
import jsonschema
import numpy as np
from gymnasium import spaces

from pipeline.envs import reward as R
from pipeline.envs.config import EnvConfig
from pipeline.envs.context_actions import ContextState, context_specs
from pipeline.envs.contract import ANSWER_TOOL, Environment, SafetyViolation, ToolError
from pipeline.envs.prompt import render_context
from pipeline.envs.protocol import (CHARSET, InvalidAction, ParsedAction, format_action, format_observation,
                                    parse_action, parse_dict_action, sanitize)
from pipeline.envs.verifier import (ANSWER, FAILED, INVALID_ACTION, INVALID_PARAMS, OK, SAFETY_VIOLATION, TIMEOUT,
                                    TOOL_ERROR, verify)

MAX_CONTEXT_CHARS = 8192
MAX_RESULT_CHARS = 200
# what an episode's `tool_faults` counts (see the module docstring)
FAULT_COUNTS = ("tool_calls", "injected_failures", "latency_spikes", "tool_exceptions")
MEMORY_FIELDS = ("steps_used", "policy_chars_used", "ok_calls", "invalid_calls", "tool_errors", "safety_violations",
                 "wrote", "history_folded")


class ToolSet:
    """An environment's tools for one task, with their compiled schema validators (built once, shared)."""

    def __init__(self, specs: list):
        self.specs = list(specs)
        self.names = tuple(s.name for s in self.specs)
        self.by_name = {s.name: s for s in self.specs}
        self.validators = {s.name: jsonschema.Draft202012Validator(s.parameters) for s in self.specs}
        self.signatures = [s.signature() for s in self.specs]


def toolset(world: Environment, task, extra: tuple = ()) -> ToolSet:
    """The tools `task`'s environment offers, then the pipeline's `extra` ones (the context actions), cached on the
    world (one ToolSet per distinct tool list)."""
    specs = list(world.tools_for(task)) + list(extra)
    cache = world.__dict__.setdefault("_agentrl_toolsets", {})
    key = tuple(s.name for s in specs)
    if key not in cache:
        cache[key] = ToolSet(specs)
    return cache[key]


class AgentEnv(gym.Env):
    """See the module docstring. Build with ``AgentEnv(world, tasks, config)`` or
    ``gymnasium.make("agentrl/ToolTasks-v0", world=..., tasks=..., config=...)``.

    Args:
        world: a loaded :class:`Environment`, a world folder written by `build_env` (opened as `config.name`), or None
            for the small default world of `config.name`'s environment.
        tasks: the tasks to draw from (objects of `world`'s task type or their dicts), a task file, or None for the
            default world's.
        config: an :class:`EnvConfig` or a mapping of its keys.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, world: Environment | str | Path | None = None, tasks=None,
                 config: EnvConfig | dict | None = None, render_mode: str | None = None):
        from pipeline.envs.registry import environment_class, open_environment

        self.config = config if isinstance(config, EnvConfig) else EnvConfig.model_validate(config or {})
        from pipeline.core.recipe import require_resolved

        require_resolved(self.config, "env")  # `auto` limits are numbers by now (pipeline.core.recipe)
        self._owns_world = not isinstance(world, Environment)
        if world is None:
            world = environment_class(self.config.name).default()
        elif isinstance(world, (str, Path)):
            world = open_environment(self.config.name, world)
        self.world = world
        if tasks is None:
            tasks = getattr(world, "builtin_tasks", {}).get("train", [])
        elif isinstance(tasks, (str, Path)):
            from pipeline.envs.taskfile import load_task_file

            tasks = load_task_file(tasks, world, validate=False)
        self.tasks = [t if not isinstance(t, dict) else world.task_from_dict(t) for t in tasks]
        if not self.tasks:
            raise ValueError("the environment needs at least one task")
        self.render_mode = render_mode
        ctx_cfg = self.config.context_actions
        self._extra_tools = tuple(context_specs(ctx_cfg)) if ctx_cfg.enabled else ()
        self.tools = toolset(world, self.tasks[0], self._extra_tools)
        charset = "".join(sorted(CHARSET))
        self.action_space = spaces.Dict({
            "tool": spaces.Discrete(len(self.tools.names)),
            "params": spaces.Text(max_length=self.config.max_action_chars, min_length=0, charset=charset),
        })
        self.observation_space = spaces.Dict({
            "context": spaces.Text(max_length=MAX_CONTEXT_CHARS, min_length=1, charset=charset),
            "memory": spaces.Box(0.0, 1.0, shape=(len(MEMORY_FIELDS),), dtype=np.float32),
        })
        self._episode = None
        self._task = None
        self._ctx: ContextState | None = None
        self._done = True

    # ------------------------------------------------------------------------------------------------ gym interface
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        self._done = True  # until this reset succeeds: a refused option leaves no half-built episode to step
        task = self._choose_task(options)
        if self._episode is not None:
            self._episode.close()
            self._episode = None
        self._task, self.tools = task, toolset(self.world, task, self._extra_tools)
        self._episode = self.world.open_episode(task, self.np_random, randomize_values=self.config.randomize_values)
        self._truth = self._episode.truth
        self._history: list[tuple[str, str]] = []
        self._calls: list[dict] = []
        self._policy_chars = 0
        self._answer: str | None = None
        self._wrote = False
        self._faults = dict.fromkeys(FAULT_COUNTS, 0)
        self._components = R.RewardComponents()
        self._ctx = ContextState(self.config.context_actions, task.task_id) if self._extra_tools else None
        self._done = False
        info = {"task_id": task.task_id, "level": task.level, "family": task.family, "env": _env_name(self.world, task),
                "min_calls": task.min_calls, "reward_components": self._components.as_dict()}
        if self._ctx is not None:  # what a scripted expert needs to demonstrate the context actions
            info["context_actions"] = {"tools": list(self.config.context_actions.tools),
                                       "history_window": self.config.history_window}
        return self._obs(), info

    def step(self, action):
        if self._task is None or self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        names, max_chars = self.tools.names, self.config.max_action_chars
        if isinstance(action, str):
            parsed = parse_action(action, names, max_chars)
            action_text = sanitize(action.strip())[:max_chars]
        else:
            parsed = parse_dict_action(action, names, max_chars)
            action_text = (format_action(parsed.name, parsed.params) if isinstance(parsed, ParsedAction)
                           else sanitize(repr(action))[:max_chars])
        self._policy_chars += len(action_text)
        outcome, result = self._execute(parsed)
        tool = parsed.name if isinstance(parsed, ParsedAction) else None
        self._calls.append({"tool": tool, "params": parsed.params if tool else None, "outcome": outcome})
        terminated = outcome == ANSWER
        truncated = not terminated and (len(self._calls) >= self.config.max_steps
                                        or self._policy_chars >= self.config.max_policy_chars)
        observation_text = format_observation(sanitize(result)[:MAX_RESULT_CHARS])
        self._history.append((action_text, observation_text))
        folded = len(self._history) > self.config.history_window
        if self._ctx is not None:
            events, noted = self._ctx.after_step(tool, outcome, self._calls, len(self._history))
            folded = noted or len(self._history) - self._ctx.note_upto > self.config.history_window

        before = R.composite(self._components, self.config.reward)
        self._components = self._score(terminated)
        reward = R.composite(self._components, self.config.reward) - before
        self._done = terminated or truncated
        task = self._task
        info = {
            "task_id": task.task_id, "level": task.level, "family": task.family, "tool": tool,
            "env": _env_name(self.world, task), "outcome": outcome, "tool_result": result,
            "action_text": action_text, "observation_text": observation_text,
            "context_folded": folded,
            "n_calls": len(self._calls), "reward_components": self._components.as_dict(),
        }
        if self._ctx is not None:
            info["events"] = events
        if self._done:
            report = verify(self._calls, self.world.required_tools(task))
            info.update({
                "is_success": self._components.correctness == 1.0, "answer": self._answer,
                "ground_truth": self._truth, "verifier": report.as_dict(),
                "return": R.composite(self._components, self.config.reward),
                "n_violations": sum(c["outcome"] == SAFETY_VIOLATION for c in self._calls),
                "n_failed": sum(c["outcome"] in FAILED for c in self._calls),
                "calls": list(self._calls),
                "tool_faults": dict(self._faults),
            })
            if self._ctx is not None:
                info["context_actions"] = self._ctx.finish(info["is_success"])
        return self._obs(), float(reward), terminated, truncated, info

    def render(self):
        if self.render_mode == "ansi" and self._task is not None:
            return self._context()
        return None

    def close(self):
        if self._episode is not None:
            self._episode.close()
            self._episode = None
        if self._owns_world:
            self.world.close()
            self._owns_world = False

    # ------------------------------------------------------------------------------------------------------ internals
    @property
    def task(self):
        return self._task

    def _choose_task(self, options: dict):
        if options.get("task") is not None:
            task = options["task"]
            return self.world.task_from_dict(task) if isinstance(task, dict) else task
        if options.get("task_id") is not None:
            for t in self.tasks:
                if t.task_id == options["task_id"]:
                    return t
            raise ValueError(f"no task with task_id {options['task_id']!r}")
        pool = self.tasks
        if options.get("level") is not None:
            pool = [t for t in self.tasks if t.level == options["level"]]
            if not pool:
                raise ValueError(f"no task of level {options['level']!r}")
        return pool[int(self.np_random.integers(len(pool)))]

    def _execute(self, parsed: ParsedAction | InvalidAction) -> tuple[str, str]:
        if isinstance(parsed, InvalidAction):
            return INVALID_ACTION, f"error: invalid action: {parsed.reason}"
        errors = sorted(self.tools.validators[parsed.name].iter_errors(parsed.params), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "params"
            return INVALID_PARAMS, f"error: invalid parameters for {parsed.name}: {where}: {errors[0].message[:120]}"
        if parsed.name == ANSWER_TOOL:
            self._answer = str(parsed.params["value"])
            return ANSWER, self._answer
        if self._ctx is not None and parsed.name in self._ctx.names:  # the pipeline's own: no faults, no latency
            return OK, self._ctx.execute(parsed.name, parsed.params)
        cfg, faults = self.config, self._faults
        faults["tool_calls"] += 1
        # each draw only when its rate is on, so a run without faults draws exactly as before
        if cfg.tool_failure_rate > 0 and self.np_random.random() < cfg.tool_failure_rate:
            faults["injected_failures"] += 1
            return TOOL_ERROR, f"error: {parsed.name} is temporarily unavailable, try again"
        latency = cfg.tool_latency_s
        if cfg.tool_latency_spike_rate > 0 and self.np_random.random() < cfg.tool_latency_spike_rate:
            faults["latency_spikes"] += 1
            latency += cfg.tool_latency_spike_s
        if latency > 0:
            time.sleep(min(latency, cfg.tool_timeout_s))
            if latency >= cfg.tool_timeout_s:
                return TIMEOUT, f"error: {parsed.name} timed out after {cfg.tool_timeout_s:g}s"
        try:
            result = self._episode.call(parsed.name, parsed.params)
        except SafetyViolation as exc:
            return SAFETY_VIOLATION, f"error: refused: {exc}"
        except ToolError as exc:
            return TOOL_ERROR, f"error: {exc}"
        except Exception as exc:  # a tool that raises unexpectedly is a tool failure the policy sees, not a crash
            faults["tool_exceptions"] += 1
            return TOOL_ERROR, f"error: {parsed.name} failed ({type(exc).__name__})"
        if not isinstance(result, str):
            return TOOL_ERROR, f"error: {parsed.name} failed (returned {type(result).__name__}, not text)"
        if self.tools.by_name[parsed.name].writes:
            self._wrote = True
        return OK, result

    def _score(self, answered: bool) -> R.RewardComponents:
        n = len(self._calls) if self._ctx is None else self._ctx.env_calls(self._calls)
        right = answered and self._answer is not None and bool(self._episode.correct(self._answer))
        return R.RewardComponents(
            correctness=R.correctness(right),
            efficiency=R.efficiency(n, self._task.min_calls, self.config.max_steps),
            safety=R.safety(sum(c["outcome"] == SAFETY_VIOLATION for c in self._calls)),
            user_experience=R.user_experience(answered, sum(c["outcome"] in FAILED for c in self._calls), n),
        )

    def _context(self) -> str:
        note = (self._ctx.note, self._ctx.note_upto) if self._ctx is not None and self._ctx.note is not None else None
        return render_context(self._task.question, self.tools.signatures, self._history, self.config.history_window,
                              note)

    def _obs(self) -> dict:
        cfg, calls = self.config, self._calls
        count = lambda *outs: sum(c["outcome"] in outs for c in calls)  # noqa: E731
        memory = np.array([
            len(calls) / cfg.max_steps,
            self._policy_chars / cfg.max_policy_chars,
            count(OK, ANSWER) / cfg.max_steps,
            count(INVALID_ACTION, INVALID_PARAMS) / cfg.max_steps,
            count(TOOL_ERROR, TIMEOUT) / cfg.max_steps,
            count(SAFETY_VIOLATION) / cfg.max_steps,
            float(self._wrote),
            float(len(self._history) > cfg.history_window),
        ], dtype=np.float32)
        return {"context": self._context()[:MAX_CONTEXT_CHARS], "memory": np.clip(memory, 0.0, 1.0)}


def _env_name(world: Environment, task) -> str:
    return getattr(task, "env", "") or world.name


ENV_ID = "agentrl/ToolTasks-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="pipeline.envs.runner:AgentEnv")

