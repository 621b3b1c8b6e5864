"""The checks the pipeline runs on any environment before it trusts it (`build_env` runs them on every build, right
after loading the freshly built world and before anything is written or published).

Each refusal is an :class:`~pipeline.envs.registry.EnvironmentError_` (an ``AgentRLError``: the command line prints one
``error:`` line and exits 2) whose message names the environment and what is wrong:

- the class: a subclass of :class:`~pipeline.envs.contract.Environment` with every required method, an identifier
  ``name`` and integer ``levels`` (:func:`pipeline.envs.registry.contract_problems`);
- the tools (those of :meth:`Environment.tools` and of :meth:`Environment.tools_for` each checked task): every one a
  :class:`ToolSpec` whose name is what the action parser reads (a letter or ``_``, then letters, digits or ``_``, at
  most 32) and whose parameters are a valid JSON Schema (Draft 2020-12) of ``"type": "object"``; names unique within
  a list; ``answer`` among them;
- the tasks: every split of :data:`pipeline.envs.config.SPLITS` present and non-empty; each task with the
  :class:`~pipeline.envs.contract.TaskFields` attributes of the types task files hold (``bool`` is not an ``int``),
  its ``split`` the split it was built for, and a ``to_dict()`` record with those keys; no task id in two splits or
  twice in one;
- the expert, when the environment has one: replayed through the pipeline's runner
  (:class:`pipeline.envs.runner.AgentEnv`) on a sample of every split (up to :data:`EXPERT_SAMPLE` tasks each: the
  first task of every level and family, then evenly spaced ones), it must answer correctly in exactly the task's
  ``min_calls`` calls with no failed call, i.e. reach the top return; the first task where it does not is reported
  with its steps. The replay uses the run's ``env`` settings (reward weights, ``randomize_values``,
  ``max_action_chars``) with fault injection off (no latency, no failures) and the budgets lifted (``max_steps`` at
  least the largest ``min_calls`` checked, no policy-text budget): it judges the environment, not the run's budget.
  It has its own episode seeds and no random generator of the build's, and it writes nothing, so a build is byte
  for byte what it was without it.

What is not checked here because the runner already guarantees it for every episode: a tool that raises anything
but :class:`~pipeline.envs.contract.ToolError` becomes an error observation (``error: TOOL failed (TypeName)``), and a
tool that returns something other than text becomes one too; the episode goes on (tests/test_env_plugins.py).
"""

from __future__ import annotations

import re

import jsonschema

from pipeline.envs import reward as R
from pipeline.envs.config import SPLITS, EnvConfig
from pipeline.envs.contract import ANSWER_TOOL, Environment, ToolSpec
from pipeline.envs.registry import EnvironmentError_, contract_problems
from pipeline.envs.runner import AgentEnv
from pipeline.envs.taskfile import TASK_KEYS, record_problem

EXPERT_SAMPLE = 20  # tasks per split the expert is replayed on
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}\Z")  # what pipeline.envs.protocol reads as a tool name
MAX_STEPS_SHOWN = 12


def _name(world) -> str:
    return str(getattr(world, "name", type(world).__name__))


def check_class(cls: object, label: str | None = None) -> None:
    """The class keeps the contract's shape (every required method, `name`, `levels`)."""
    problems = contract_problems(cls)
    if problems:
        label = label or getattr(cls, "name", None) or getattr(cls, "__name__", repr(cls))
        raise EnvironmentError_(f"environment {label!r} breaks the contract: " + "; ".join(problems))


def tool_problems(specs: object) -> list[str]:
    """What is wrong with one list of tools (empty when nothing is)."""
    if not isinstance(specs, (list, tuple)):
        return [f"tools must be a list of ToolSpec, got {type(specs).__name__}"]
    problems, names = [], []
    for i, spec in enumerate(specs):
        if not isinstance(spec, ToolSpec):
            problems.append(f"tool #{i} is a {type(spec).__name__}, not a ToolSpec")
            continue
        names.append(spec.name)
        if not isinstance(spec.name, str) or not TOOL_NAME.match(spec.name):
            problems.append(f"tool name {spec.name!r} is not an identifier of at most 32 ASCII characters")
        schema = spec.parameters
        if not isinstance(schema, dict):
            problems.append(f"tool {spec.name!r}: parameters must be a JSON Schema object, got {type(schema).__name__}")
            continue
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "/".join(str(p) for p in exc.path) or "the schema"
            problems.append(f"tool {spec.name!r}: parameters are not a valid JSON Schema (Draft 2020-12) at "
                            f"{where}: {exc.message[:160]}")
            continue
        if schema.get("type") != "object":
            problems.append(f"tool {spec.name!r}: parameters must be a JSON Schema of \"type\": \"object\", "
                            f"got type {schema.get('type')!r}")
    dup = sorted({n for n in names if names.count(n) > 1}, key=str)
    if dup:
        problems.append(f"tool names {dup} occur more than once")
    if ANSWER_TOOL not in names:
        problems.append(f"no {ANSWER_TOOL!r} tool among {names} (use contract.ANSWER_SPEC)")
    return problems


def check_tools(world: Environment, tasks: list = ()) -> None:
    """`world.tools()` and `world.tools_for(task)` of every task in `tasks` keep the rules above."""
    lists = [("tools()", world.tools())]
    lists += [(f"tools_for({getattr(t, 'task_id', t)!r})", world.tools_for(t)) for t in tasks]
    seen = set()
    for where, specs in lists:
        key = tuple(id(s) for s in specs) if isinstance(specs, (list, tuple)) else id(specs)
        if key in seen:
            continue
        seen.add(key)
        problems = tool_problems(specs)
        if problems:
            raise EnvironmentError_(f"environment {_name(world)!r}: {where}: " + "; ".join(problems))


def check_split_ids(tasks: dict[str, list], name: str) -> None:
    """A task id belongs to one split and one task."""
    seen: dict[str, str] = {}
    for split, ts in tasks.items():
        for t in ts:
            if t.task_id in seen:
                raise EnvironmentError_(f"environment {name!r}: task id {t.task_id!r} occurs in {seen[t.task_id]} "
                                        f"and {split} (task ids must be unique across splits)")
            seen[t.task_id] = split


def _field_problem(task, split: str) -> str | None:
    for key, typ in TASK_KEYS.items():
        if not hasattr(task, key):
            return f"has no attribute {key!r}"
        value = getattr(task, key)
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            return f"attribute {key!r} must be {typ.__name__}, got {type(value).__name__} {value!r:.60}"
    if task.split != split:
        return f"was built for split {split!r} but its split attribute says {task.split!r}"
    if task.min_calls < 1:
        return f"min_calls must be at least 1 (the answer counts), got {task.min_calls}"
    to_dict = getattr(task, "to_dict", None)
    if not callable(to_dict):
        return "has no to_dict() method"
    record = to_dict()
    if not isinstance(record, dict):
        return f"to_dict() must return a dict, got {type(record).__name__}"
    problem = record_problem(record)
    return f"to_dict(): {problem}" if problem else None


def check_tasks(tasks: dict[str, list], name: str) -> None:
    """Every split present and non-empty, every task with the task fields of the right types, ids unique."""
    if not isinstance(tasks, dict) or set(tasks) != set(SPLITS) or any(not ts for ts in tasks.values()):
        got = ({k: len(v) for k, v in tasks.items()} if isinstance(tasks, dict) else type(tasks).__name__)
        raise EnvironmentError_(f"environment {name!r} must build tasks for every split {list(SPLITS)}, got {got}")
    for split, ts in tasks.items():
        for i, t in enumerate(ts):
            problem = _field_problem(t, split)
            if problem:
                raise EnvironmentError_(f"environment {name!r}: {split} task #{i} "
                                        f"({getattr(t, 'task_id', '?')!r}) {problem}")
    check_split_ids(tasks, name)


def sample(tasks: list, n: int = EXPERT_SAMPLE) -> list:
    """Up to `n` tasks: the first of every (level, family), then evenly spaced ones, in their original order."""
    picked: dict[int, None] = {}
    groups = set()
    for i, t in enumerate(tasks):
        if len(picked) >= n:
            break
        if (t.level, t.family) not in groups:
            groups.add((t.level, t.family))
            picked[i] = None
    step = max(1, len(tasks) // n)
    for i in range(0, len(tasks), step):
        if len(picked) >= n:
            break
        picked.setdefault(i, None)
    return [tasks[i] for i in sorted(picked)]


def _replay(env, policy, task, seed: int) -> tuple[dict, list[tuple[str, str]]]:
    obs, info = env.reset(seed=seed, options={"task": task})
    policy.reset(task)
    steps, done = [], False
    while not done:
        obs, _, terminated, truncated, info = env.step(policy.act(obs, info))
        steps.append((info["action_text"], info["observation_text"].strip()))
        done = terminated or truncated
    return info, steps


def check_expert(world: Environment, tasks: dict[str, list], env_cfg: EnvConfig,
                 per_split: int = EXPERT_SAMPLE) -> int:
    """Replay the expert on a sample of every split (see the module docstring); returns the episodes checked."""
    chosen = [(split, t) for split, ts in tasks.items() for t in sample(ts, per_split)]
    if world.expert() is None or not chosen:
        return 0
    name = _name(world)
    cfg = env_cfg.model_copy(update={
        "tool_latency_s": 0.0, "tool_failure_rate": 0.0, "tool_latency_spike_rate": 0.0,
        "max_policy_chars": 10**9,
        "context_actions": env_cfg.context_actions.model_copy(update={"enabled": False}),  # the environment's tools only
        "max_steps": max([env_cfg.max_steps, *(t.min_calls for _, t in chosen)])})
    top = R.composite(R.RewardComponents(correctness=1.0, user_experience=1.0), cfg.reward)
    env = AgentEnv(world=world, tasks=[t for _, t in chosen], config=cfg)
    try:
        for i, (split, task) in enumerate(chosen):
            try:
                info, steps = _replay(env, world.expert(), task, seed=i)
            except Exception as exc:  # the expert or the episode crashed: that is the finding
                raise EnvironmentError_(f"environment {name!r}: its expert crashed on {split} task {task.task_id!r} "
                                        f"({type(exc).__name__}: {str(exc)[:200]})") from None
            failed = info["n_failed"]  # invalid, erroring and refused calls
            if info["is_success"] and info["n_calls"] == task.min_calls and not failed \
                    and abs(info["return"] - top) < 1e-9:
                continue
            shown = steps[:MAX_STEPS_SHOWN]
            trail = "; ".join(f"{a} -> {o}" for a, o in shown) + (" ..." if len(steps) > len(shown) else "")
            raise EnvironmentError_(
                f"environment {name!r}: its expert does not reach the top return on {split} task {task.task_id!r}: "
                f"{'correct' if info['is_success'] else 'wrong'} answer {info['answer']!r} (truth "
                f"{info['ground_truth']!r}), {info['n_calls']} calls for min_calls {task.min_calls}, {failed} failed, "
                f"return {info['return']:.3f} of {top:.3f}; steps: {trail}")
    finally:
        env.close()
    return len(chosen)


def check_environment(world: Environment, tasks: dict[str, list], env_cfg: EnvConfig,
                      per_split: int = EXPERT_SAMPLE) -> dict:
    """Every check above on a loaded world and the tasks its build returned; returns what was checked."""
    check_class(type(world), _name(world))
    name = _name(world)
    check_tasks(tasks, name)
    checked = [t for ts in tasks.values() for t in sample(ts, per_split)]
    check_tools(world, checked)
    return {"tasks": sum(len(ts) for ts in tasks.values()), "expert_episodes": check_expert(world, tasks, env_cfg,
                                                                                            per_split)}
