"""Extension `task_generation` (``train.task_generation``; docs/design.md §2.2: adversarial samples aimed at the
policy's weak spots).

With ``train.task_generation.enabled``, every `every` updates the `train` phase asks the environment for new training
tasks where the policy is weakest, checks them like every other task set, and adds them to the RL task pool:

1. **Weakness statistics** (pure functions, :func:`slice_stats`, :func:`weakest_slices`, :func:`allocate`): every
   rank's rollout outcomes (gathered, so every rank holds the same figures) are keyed by the slice of their task
   (:func:`slice_of`: the wording ``template_id`` — family and wording —, the family, or the level; `by`) and kept
   for the last `window` episodes. A slice is weak when it has at least `min_episodes` recent episodes and a success
   rate below `min_success`; the `slices` weakest (lowest success, then name) are targeted, and the round's `tasks`
   are shared among them in proportion to their failure rate (largest remainders).
2. **Generation** through the environment's optional hook :meth:`pipeline.envs.contract.Environment.generate_tasks`
   (the shop: :mod:`pipeline.envs.shop.generate`; sql: :mod:`pipeline.envs.sql.generate`), with a seed fixed by
   `train.seed`, the round and the slice: the same run generates the same tasks, on every rank.
3. **Checks** (:func:`check_generated`), in this order, each task counted under the first that refuses it: the
   pipeline's task keys (:func:`pipeline.envs.taskfile.record_problem`) and the environment's Great Expectations
   'tasks' suite (:meth:`~pipeline.envs.contract.Environment.check_task_records`, as every task file is checked, on
   each slice's batch in the environment's own ids; a failed suite refuses the batch), held-out entities
   (:meth:`~pipeline.envs.contract.Environment.leaks_heldout`) and held-out wordings (``template_seen`` false),
   duplicates of a pool task (the incoming filter's notion of the same task), and the world's recomputed answer
   (:meth:`~pipeline.envs.contract.Environment.verify_task`).
4. **The pool**: accepted tasks are renamed ``generated/r<round>-<slice>/<id>`` and join ``tasks_by_level`` and
   ``tasks_by_id``. In a pool of thousands of unplayed tasks the goal sampler (p ∝ 1/(count + 1)) would find a few
   new ones only by chance, so :meth:`TaskGenerator.mix_in` also replaces a `share` of every update's planned tasks
   by generated tasks of open levels, least played first, then newest (deterministic: every rank plans the same).

Metrics, every update: ``taskgen/mixed_in`` (generated tasks in the latest plan), ``taskgen/generated``,
``taskgen/accepted``, ``taskgen/refused`` and one ``taskgen/refused_<reason>`` each (0 between rounds),
``taskgen/pool_generated`` (accepted so far); in an update that runs a round also ``taskgen/weak_slices``,
``taskgen/weakest_success``, ``taskgen/slice_errors`` (slices the environment could not generate in, e.g. an
incoming task's unknown wording; logged) and ``taskgen/target/<slice>`` (the recent success of each slice
targeted). The state (round, outcome window, accepted tasks as records, play counts) rides in the checkpoint, so a resumed run holds the same pool and continues identically.

A mixed run keys slices by environment too (``shop/lookup/2``) and asks that member
(:meth:`pipeline.envs.mixed.MixedEnvironment.generate_tasks`); an environment without the hook is refused at the start.

Deliberately left out: removing generated tasks again, and the environment-specific notion of an entity kind (in both built-in environments it is a
function of the family, so a family or wording slice targets it).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from pipeline.core.errors import AgentRLError
from pipeline.train.config import TaskGenerationConfig
from pipeline.train.extensions.base import Extension

PREFIX = "generated"
REFUSALS = ("refused_schema", "refused_heldout_entities", "refused_heldout_templates", "refused_duplicates",
            "refused_unverifiable")


# ------------------------------------------------------------------------------------------------ pure statistics
def slice_stats(keys: list[str], successes: list[float]) -> dict[str, dict]:
    """{slice: {"n": episodes, "success": success rate}} of parallel lists of slice keys and outcomes.

    >>> slice_stats(["a", "b", "a", "a"], [1, 0, 0, 1])
    {'a': {'n': 3, 'success': 0.6666666666666666}, 'b': {'n': 1, 'success': 0.0}}
    """
    if len(keys) != len(successes):
        raise ValueError(f"{len(keys)} slice keys for {len(successes)} outcomes")
    out: dict[str, dict] = {}
    for k, s in zip(keys, successes):
        e = out.setdefault(k, {"n": 0, "hits": 0.0})
        e["n"] += 1
        e["hits"] += float(s)
    return {k: {"n": e["n"], "success": e["hits"] / e["n"]} for k, e in sorted(out.items())}


def weakest_slices(stats: dict[str, dict], k: int, min_episodes: int, min_success: float) -> list[str]:
    """The (at most) `k` slices with at least `min_episodes` episodes and success below `min_success`, weakest first
    (ties: by name).

    >>> weakest_slices({"a": {"n": 9, "success": 0.4}, "b": {"n": 9, "success": 0.1}, "c": {"n": 2, "success": 0.0},
    ...                 "d": {"n": 9, "success": 0.9}}, 5, min_episodes=4, min_success=0.5)
    ['b', 'a']
    """
    weak = [s for s, e in stats.items() if e["n"] >= min_episodes and e["success"] < min_success]
    return sorted(weak, key=lambda s: (stats[s]["success"], s))[:k]


def allocate(n: int, failure: list[float]) -> list[int]:
    """`n` tasks shared in proportion to `failure` (each slice's 1 − success), largest remainders first (ties: the
    earlier slice); equal shares when every failure is 0.

    >>> allocate(8, [0.9, 0.6]), allocate(5, [1.0, 1.0, 1.0]), allocate(3, [0.0, 0.0])
    ([5, 3], [2, 2, 1], [2, 1])
    """
    if not failure:
        return []
    total = sum(failure)
    exact = [n * f / total for f in failure] if total > 0 else [n / len(failure)] * len(failure)
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))[: n - sum(counts)]:
        counts[i] += 1
    return counts


def template_of(task: Any) -> str | None:
    """A task's wording id: the shop's `template_id` attribute, or ``data["template_id"]`` (sql)."""
    tid = getattr(task, "template_id", None)
    if tid is None and isinstance(getattr(task, "data", None), dict):
        tid = task.data.get("template_id")
    return tid if isinstance(tid, str) else None


def slice_of(task: Any, by: str) -> tuple[str, dict]:
    """(slice key, the weakness the environment is asked to generate in) of a task; a task without a wording id falls
    back to its family under ``by="template"``; a mixed run's task (with `env`) is keyed and asked within its
    environment.

    >>> from pipeline.envs.contract import Task
    >>> t = Task("t1", "train", 2, "q", "a", family="calc", data={"template_id": "calc/3"})
    >>> slice_of(t, "template"), slice_of(t, "level")
    (('calc/3', {'family': 'calc', 'level': 2, 'template_id': 'calc/3'}), ('L2', {'level': 2}))
    """
    if by == "level":
        key, weakness = f"L{task.level}", {"level": task.level}
    else:
        tid = template_of(task) if by == "template" else None
        key, weakness = tid or task.family, {"family": task.family, "level": task.level}
        if tid is not None:
            weakness["template_id"] = tid
    env = getattr(task, "env", None)
    if isinstance(env, str) and env:
        key, weakness = f"{env}/{key}", {"env": env, **weakness}
    return key, weakness


def renamed(task: Any, task_id: str) -> Any:
    """A copy of `task` with another id (a mixed run's task keeps its environment prefix)."""
    from pipeline.envs.mixed import Tagged

    if isinstance(task, Tagged):
        return dataclasses.replace(task, task=dataclasses.replace(task.task, task_id=task_id))
    return dataclasses.replace(task, task_id=task_id)


# ------------------------------------------------------------------------------------------------------- checks
def _content(task: Any) -> str:
    from pipeline.train.incoming import _content as same_task_key

    return same_task_key(task)


def check_generated(tasks: list, runtime, pool: list, dataset: str) -> tuple[list, dict[str, int]]:
    """The generated `tasks` that may join `pool`, and the count per refusal reason (module docstring, step 3)."""
    from pipeline.envs.taskfile import record_problem

    counts = dict.fromkeys(REFUSALS, 0)
    records = [t.to_dict() for t in tasks]
    report = runtime.check_task_records(records, dataset) if records else None
    if any(record_problem(r) for r in records) or (report is not None and not report.success):
        counts["refused_schema"] = len(tasks)
        return [], counts
    seen = {_content(t) for t in pool}
    used = []
    for task in tasks:
        if runtime.leaks_heldout(task):
            counts["refused_heldout_entities"] += 1
        elif not task.template_seen:
            counts["refused_heldout_templates"] += 1
        elif _content(task) in seen:
            counts["refused_duplicates"] += 1
        elif not runtime.verify_task(task):
            counts["refused_unverifiable"] += 1
        else:
            seen.add(_content(task))
            used.append(task)
    return used, counts


# ------------------------------------------------------------------------------------------------------ the loop
class TaskGenerator(Extension):
    """Generation state of one run (identical on every rank); :meth:`step` runs after every update's learning."""

    name = "task_generation"
    curve_keys = ("taskgen/generated", "taskgen/accepted", "taskgen/mixed_in", "taskgen/pool_generated",
                  "taskgen/weakest_success")

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(cfg.task_generation, cfg.seed, runtime) if cfg.task_generation.enabled else None

    def plan(self, loop, tasks: list) -> list:
        return self.mix_in(tasks, loop.sampler.curriculum.open_levels, loop.tasks_by_id)

    def after_learn(self, loop, u: int, records: list[dict]) -> dict:
        return self.step(loop, records, u)

    def __init__(self, cfg: TaskGenerationConfig, seed: int, runtime):
        from pipeline.envs.contract import Environment

        if getattr(type(runtime), "generate_tasks", None) is Environment.generate_tasks:
            raise AgentRLError(f"train.task_generation.enabled, but environment {runtime.name!r} cannot generate "
                               f"tasks (it has no generate_tasks); disable task generation for it")
        self.cfg, self.seed, self.runtime = cfg, seed, runtime
        self.round = 0
        self.window: deque[tuple[str, float]] = deque(maxlen=cfg.window)
        self.weakness: dict[str, dict] = {}
        self.accepted: list[dict] = []  # records of every accepted task, in the order they joined the pool
        self.plays: dict[str, int] = {}  # generated task id -> updates it was mixed into
        self.mixed_in = 0  # generated tasks mixed into the latest plan

    def record_outcomes(self, task_ids: list[str], successes: list[float], tasks_by_id: dict) -> None:
        for tid, s in zip(task_ids, successes):
            key, weakness = slice_of(tasks_by_id[tid], self.cfg.by)
            self.weakness.setdefault(key, weakness)
            self.window.append((key, float(s)))

    def targets(self) -> tuple[dict[str, dict], list[str]]:
        stats = slice_stats([k for k, _ in self.window], [s for _, s in self.window])
        return stats, weakest_slices(stats, self.cfg.slices, self.cfg.min_episodes, self.cfg.min_success)

    def mix_in(self, tasks: list, open_levels: list[int], tasks_by_id: dict) -> list:
        """The planned `tasks` with their last `share` replaced by generated tasks of `open_levels`, least played
        first, then newest."""
        k = int(round(self.cfg.share * len(tasks)))
        ids = [r["task_id"] for r in self.accepted]
        order = sorted((self.plays.get(t, 0), -i, t) for i, t in enumerate(ids) if tasks_by_id[t].level in open_levels)
        chosen = [tasks_by_id[t] for *_, t in order[:k]]
        for t in chosen:
            self.plays[t.task_id] = self.plays.get(t.task_id, 0) + 1
        self.mixed_in = len(chosen)
        return tasks[:len(tasks) - len(chosen)] + chosen

    def step(self, loop, records: list[dict], u: int) -> dict:
        """Observe update `u`'s outcomes (every rank's) and, every `every` updates, run a generation round."""
        gathered = loop.dist.all_gather([(r["task_id"], float(r["success"])) for r in records])
        flat = [o for part in gathered for o in part]
        self.record_outcomes([t for t, _ in flat], [s for _, s in flat], loop.tasks_by_id)
        metrics = {"taskgen/mixed_in": self.mixed_in, "taskgen/generated": 0, "taskgen/accepted": 0,
                   "taskgen/refused": 0, **{f"taskgen/{r}": 0 for r in REFUSALS}}
        room = self.cfg.max_tasks - len(self.accepted)
        if (u + 1) % self.cfg.every == 0 and room > 0:
            metrics.update(self.generate_round(loop, min(room, self.cfg.tasks)))
        metrics["taskgen/pool_generated"] = len(self.accepted)
        return metrics

    def generate_round(self, loop, n: int) -> dict:
        stats, weak = self.targets()
        self.round += 1
        out: dict[str, float] = {"taskgen/weak_slices": len(weak)}
        if not weak:
            return out
        out["taskgen/weakest_success"] = stats[weak[0]]["success"]
        generated, used, errors = 0, 0, []
        counts = dict.fromkeys(REFUSALS, 0)
        for i, (key, k) in enumerate(zip(weak, allocate(n, [1.0 - stats[s]["success"] for s in weak]))):
            out[f"taskgen/target/{key}"] = stats[key]["success"]
            if k == 0:
                continue
            try:
                seed = self.seed * 1_000_003 + self.round * 64 + i
                got = list(self.runtime.generate_tasks(self.weakness[key], k, seed=seed) or [])[:k]
            except ValueError as exc:  # e.g. an incoming task's wording the environment does not know
                errors.append(f"{key}: {exc}")
                continue
            # each slice's batch is checked in the environment's own ids, as a task file is, then renamed
            pool = [t for ts in loop.tasks_by_level.values() for t in ts]
            ok, refused = check_generated(got, self.runtime, pool, f"{PREFIX}/r{self.round}/{key}")
            for task in ok:
                self.add(loop, renamed(task, f"{PREFIX}/r{self.round}-{i}/{getattr(task, 'task', task).task_id}"))
            generated, used = generated + len(got), used + len(ok)
            counts = {r: counts[r] + refused[r] for r in REFUSALS}
        out.update({"taskgen/generated": generated, "taskgen/accepted": used,
                    "taskgen/refused": sum(counts.values()), "taskgen/slice_errors": len(errors),
                    **{f"taskgen/{r}": c for r, c in counts.items()}})
        if loop.dist.is_main:
            refused = ", ".join(f"{r.removeprefix('refused_')} {c}" for r, c in counts.items() if c)
            loop.hooks.log(f"task generation round {self.round}: weak slices "
                           + ", ".join(f"{s} ({stats[s]['success']:.2f})" for s in weak)
                           + f"; {generated} generated, {used} joined the pool"
                           + (f" (refused: {refused})" if refused else "")
                           + (f"; not generated: {'; '.join(errors)}" if errors else ""))
        return out

    def add(self, loop, task) -> None:
        if task.task_id in loop.tasks_by_id:
            raise AgentRLError(f"generated task id {task.task_id!r} is already in the pool")
        loop.tasks_by_level.setdefault(task.level, []).append(task)
        loop.tasks_by_id[task.task_id] = task
        self.accepted.append(task.to_dict())

    def state_dict(self) -> dict:
        return {"round": self.round, "window": [list(o) for o in self.window], "weakness": dict(self.weakness),
                "accepted": list(self.accepted), "plays": dict(self.plays), "mixed_in": self.mixed_in}

    def load_state_dict(self, state: dict | None, loop) -> None:
        """Restore a checkpoint's state and put its generated tasks back into the pool (in their original order)."""
        if state is None:  # a checkpoint of a run without task generation
            return
        self.round = state["round"]
        self.window = deque((tuple(o) for o in state["window"]), maxlen=self.cfg.window)
        self.weakness = dict(state["weakness"])
        self.plays, self.mixed_in = dict(state["plays"]), state["mixed_in"]
        self.accepted = []
        for rec in state["accepted"]:
            self.add(loop, self.runtime.task_from_dict(rec))
