"""`agentrl/ToolTasks-v0`: a Gymnasium environment in which an agent solves tasks with real tools.

Contract (Gymnasium 1.x, kept exactly):

- action space: ``Dict(tool=Discrete(N_TOOLS), params=Text(max_action_chars))``; `step` also accepts the policy's raw
  text in the protocol of :mod:`pipeline.env.protocol`, which is how a language model acts. Any input at all becomes an
  action or an invalid-action outcome; `step` raises only when called before `reset` or after the episode ended.
- observation: ``Dict(context=Text(8192), memory=Box(0, 1, (8,)))``; `context` is the prompt of
  :mod:`pipeline.env.prompt`, `memory` the episode summary listed in :data:`MEMORY_FIELDS`.
- ``terminated`` means the agent answered; ``truncated`` means the step budget or the policy-text budget ran out.
- randomness comes only from ``self.np_random`` (task choice, value redraws, injected tool faults), so the same seed
  gives the same episode.

Every episode works on a private in-memory copy of the SQLite world (SQLite's backup API), so writes never leak into
another episode or onto disk. The reward is paid per step as the change of the composite reward
(:mod:`pipeline.env.reward`); every component is reported in ``info["reward_components"]``.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import gymnasium as gym
import jsonschema
import numpy as np
from gymnasium import spaces

from pipeline.env import reward as R
from pipeline.env.config import EnvConfig
from pipeline.env.prompt import render_context
from pipeline.env.protocol import (CHARSET, InvalidAction, ParsedAction, format_action, format_observation,
                                   parse_action, parse_dict_action, sanitize)
from pipeline.env.tasks import Task, answers_match, generate_tasks, run_plan
from pipeline.env.taskfile import load_task_file
from pipeline.env.tools import SafetyViolation, SearchIndex, ToolContext, ToolError, default_tools, signature
from pipeline.env.verifier import (ANSWER, FAILED, INVALID_ACTION, INVALID_PARAMS, OK, SAFETY_VIOLATION, TIMEOUT,
                                   TOOL_ERROR, verify)
from pipeline.env.world import World, draw_numeric, generate_world, load_world, world_to_sqlite

MAX_CONTEXT_CHARS = 8192
MAX_RESULT_CHARS = 200
MEMORY_FIELDS = ("steps_used", "policy_chars_used", "ok_calls", "invalid_calls", "tool_errors", "safety_violations",
                 "wrote", "history_folded")


class WorldRuntime:
    """A world ready to serve episodes: a master in-memory SQLite copy, the search index and the tools."""

    def __init__(self, world: World):
        self.world = world
        self.master = sqlite3.connect(":memory:", check_same_thread=False)
        world_to_sqlite(world, self.master)
        self.index = SearchIndex(world.corpus)
        self.tools = default_tools()
        self.tool_names = tuple(t.name for t in self.tools)
        self.by_name = {t.name: t for t in self.tools}
        self.validators = {t.name: jsonschema.Draft202012Validator(t.parameters) for t in self.tools}

    def episode_db(self) -> sqlite3.Connection:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        self.master.backup(conn)
        return conn

    def solve(self, plan: list[dict], allowed_writes: list[dict], conn: sqlite3.Connection | None = None) -> str:
        """Ground truth: run the plan with the tools; writes are rolled back, so the database is left unchanged."""
        conn = conn or self.master
        ctx = ToolContext(conn, self.index, allowed_writes)
        conn.execute("SAVEPOINT solve")
        try:
            results = run_plan(plan, lambda tool, params: self.by_name[tool].execute(params, ctx))
        finally:
            conn.execute("ROLLBACK TO solve")
            conn.execute("RELEASE solve")
        return results[-1]

    def close(self) -> None:
        self.master.close()


def default_world(seed: int = 0) -> World:
    """The small world used when the environment is made without data (e.g. by `check_env`)."""
    return generate_world(seed, n_products=120, n_suppliers=30, heldout_fraction=0.3)


def load_tasks(source: str | Path | list) -> list[Task]:
    """Tasks from a task file (read by :func:`~pipeline.env.taskfile.load_task_file` without the GX suite: the phase
    that hands the environment a file checks it at its boundary) or from a list of tasks or task dicts."""
    if isinstance(source, (str, Path)):
        return load_task_file(source, validate=False)
    return [t if isinstance(t, Task) else Task.from_dict(t) for t in source]


class ToolTasksEnv(gym.Env):
    """See the module docstring. Build with `gymnasium.make("agentrl/ToolTasks-v0", world=..., tasks=..., config=...)`.

    Args:
        world: a :class:`World`, a directory written by `build_env` (`data/env`), a shared :class:`WorldRuntime`, or
            None for a small generated world.
        tasks: a list of tasks (dicts or :class:`Task`), a JSON Lines path, or None for 200 generated tasks of `split`.
        config: an :class:`EnvConfig` or a mapping of its keys.
        split: which split to generate when `tasks` is None.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, world=None, tasks=None, config: EnvConfig | dict | None = None, split: str = "train",
                 render_mode: str | None = None):
        self.config = config if isinstance(config, EnvConfig) else EnvConfig.model_validate(config or {})
        if isinstance(world, WorldRuntime):
            self.runtime, self._owns_runtime = world, False
        else:
            w = world if isinstance(world, World) else default_world() if world is None else load_world(Path(world))
            self.runtime, self._owns_runtime = WorldRuntime(w), True
        if tasks is None:
            tasks = generate_tasks(self.runtime.world, split, 200, {1: 1, 2: 1, 3: 1, 4: 1}, seed=0,
                                   solver=lambda plan, allowed: self.runtime.solve(plan, allowed))
        self.tasks = load_tasks(tasks)
        if not self.tasks:
            raise ValueError("the environment needs at least one task")
        self.render_mode = render_mode
        self.signatures = [signature(t) for t in self.runtime.tools]
        charset = "".join(sorted(CHARSET))
        self.action_space = spaces.Dict({
            "tool": spaces.Discrete(len(self.runtime.tools)),
            "params": spaces.Text(max_length=self.config.max_action_chars, min_length=0, charset=charset),
        })
        self.observation_space = spaces.Dict({
            "context": spaces.Text(max_length=MAX_CONTEXT_CHARS, min_length=1, charset=charset),
            "memory": spaces.Box(0.0, 1.0, shape=(len(MEMORY_FIELDS),), dtype=np.float32),
        })
        self._conn: sqlite3.Connection | None = None
        self._task: Task | None = None
        self._done = True

    # ------------------------------------------------------------------------------------------------ gym interface
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        self._done = True  # until this reset succeeds: a refused option leaves no half-built episode to step
        self._task = self._choose_task(options)
        if self._conn is not None:
            self._conn.close()
        self._conn = self.runtime.episode_db()
        if self.config.randomize_values:  # the stored answer no longer applies: solve on this copy
            self._redraw_values()
            self._truth = self.runtime.solve(self._task.plan, self._task.allowed_writes, self._conn)
        else:
            self._truth = self._task.answer
        self._ctx = ToolContext(self._conn, self.runtime.index, list(self._task.allowed_writes))
        self._history: list[tuple[str, str]] = []
        self._calls: list[dict] = []
        self._policy_chars = 0
        self._answer: str | None = None
        self._wrote = False
        self._components = R.RewardComponents()
        self._done = False
        obs = self._obs()
        info = {"task_id": self._task.task_id, "level": self._task.level, "family": self._task.family,
                "min_calls": self._task.min_calls, "reward_components": self._components.as_dict()}
        return obs, info

    def step(self, action):
        if self._task is None or self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        if isinstance(action, str):
            parsed = parse_action(action, self.runtime.tool_names, self.config.max_action_chars)
            action_text = sanitize(action.strip())[: self.config.max_action_chars]
        else:
            parsed = parse_dict_action(action, self.runtime.tool_names, self.config.max_action_chars)
            action_text = (format_action(parsed.name, parsed.params) if isinstance(parsed, ParsedAction)
                           else sanitize(repr(action))[: self.config.max_action_chars])
        self._policy_chars += len(action_text)
        outcome, result = self._execute(parsed)
        tool = parsed.name if isinstance(parsed, ParsedAction) else None
        self._calls.append({"tool": tool, "params": parsed.params if tool else None, "outcome": outcome})
        terminated = outcome == ANSWER
        truncated = not terminated and (len(self._calls) >= self.config.max_steps
                                        or self._policy_chars >= self.config.max_policy_chars)
        observation_text = format_observation(sanitize(result)[:MAX_RESULT_CHARS])
        self._history.append((action_text, observation_text))

        before = R.composite(self._components, self.config.reward)
        self._components = self._score(terminated)
        reward = R.composite(self._components, self.config.reward) - before
        self._done = terminated or truncated
        info = {
            "task_id": self._task.task_id, "level": self._task.level, "family": self._task.family, "tool": tool,
            "outcome": outcome, "tool_result": result, "action_text": action_text,
            "observation_text": observation_text, "context_folded": len(self._history) > self.config.history_window,
            "n_calls": len(self._calls), "reward_components": self._components.as_dict(),
        }
        if self._done:
            report = verify(self._calls, self._task.plan)
            info.update({
                "is_success": self._components.correctness == 1.0, "answer": self._answer,
                "ground_truth": self._truth, "verifier": report.as_dict(),
                "return": R.composite(self._components, self.config.reward),
                "n_violations": sum(c["outcome"] == SAFETY_VIOLATION for c in self._calls),
                "n_failed": sum(c["outcome"] in FAILED for c in self._calls),
                "calls": list(self._calls),
            })
        return self._obs(), float(reward), terminated, truncated, info

    def render(self):
        if self.render_mode == "ansi" and self._task is not None:
            return self._context()
        return None

    def close(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._owns_runtime:
            self.runtime.close()
            self._owns_runtime = False

    # ------------------------------------------------------------------------------------------------------ internals
    @property
    def task(self) -> Task | None:
        return self._task

    def _choose_task(self, options: dict) -> Task:
        if options.get("task") is not None:
            return load_tasks([options["task"]])[0]
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

    def _redraw_values(self) -> None:
        """Redraw the numeric attributes of the products the task names (the only rows its answer depends on)."""
        names = [e for e in self._task.entities
                 if self._conn.execute("SELECT 1 FROM products WHERE name = ?", (e,)).fetchone()]
        vals = draw_numeric(self.np_random, len(names))
        self._conn.executemany("UPDATE products SET price = ?, stock = ?, weight_kg = ? WHERE name = ?",
                               zip(vals["price"], vals["stock"], vals["weight_kg"], names))

    def _execute(self, parsed: ParsedAction | InvalidAction) -> tuple[str, str]:
        if isinstance(parsed, InvalidAction):
            return INVALID_ACTION, f"error: invalid action: {parsed.reason}"
        errors = sorted(self.runtime.validators[parsed.name].iter_errors(parsed.params), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "params"
            return INVALID_PARAMS, f"error: invalid parameters for {parsed.name}: {where}: {errors[0].message[:120]}"
        if parsed.name == "answer":
            self._answer = str(parsed.params["value"])
            return ANSWER, self._answer
        cfg = self.config
        if cfg.tool_failure_rate > 0 and self.np_random.random() < cfg.tool_failure_rate:
            return TOOL_ERROR, f"error: {parsed.name} is temporarily unavailable, try again"
        if cfg.tool_latency_s > 0:
            time.sleep(min(cfg.tool_latency_s, cfg.tool_timeout_s))
            if cfg.tool_latency_s >= cfg.tool_timeout_s:
                return TIMEOUT, f"error: {parsed.name} timed out after {cfg.tool_timeout_s:g}s"
        try:
            result = self.runtime.by_name[parsed.name].execute(parsed.params, self._ctx)
        except SafetyViolation as exc:
            return SAFETY_VIOLATION, f"error: refused: {exc}"
        except ToolError as exc:
            return TOOL_ERROR, f"error: {exc}"
        except Exception as exc:  # a tool that raises unexpectedly is a tool failure the policy sees, not a crash
            return TOOL_ERROR, f"error: {parsed.name} failed ({type(exc).__name__})"
        if parsed.name == "update":
            self._wrote = True
        return OK, result

    def _score(self, answered: bool) -> R.RewardComponents:
        n = len(self._calls)
        return R.RewardComponents(
            correctness=R.correctness(answered and answers_match(self._answer, self._truth)),
            efficiency=R.efficiency(n, self._task.min_calls, self.config.max_steps),
            safety=R.safety(sum(c["outcome"] == SAFETY_VIOLATION for c in self._calls)),
            user_experience=R.user_experience(answered, sum(c["outcome"] in FAILED for c in self._calls), n),
        )

    def _context(self) -> str:
        return render_context(self._task.question, self.signatures, self._history, self.config.history_window)

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
