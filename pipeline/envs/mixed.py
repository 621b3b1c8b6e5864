"""Several environments as one: a mixed run (``env.name: {shop: 1, sql: 1}`` in params.yaml).

Every phase sees one :class:`~pipeline.envs.contract.Environment`; this one dispatches each task to the environment it
belongs to. Decisions:

- **Every task carries its environment.** Tasks are wrapped in :class:`Tagged`: ``env`` names the member and
  ``task_id`` is ``<env>/<member's id>``, so ids stay unique across members; task files hold ``"env"`` in every
  record. Episode records carry ``env`` too (the runner writes it), which is what the per-environment metrics group by.
- **Only the task's own tools.** :meth:`MixedEnvironment.tools_for` is the member's tool list, so the prompt, the
  parser and the schema checks of an episode know that environment's tools alone: a shop episode cannot call `query`.
- **Build.** Each member builds into ``<world_dir>/<env>/`` with its share of every split (the weights, normalised;
  at least one task each) and its own options (``build_env.options: {shop: {...}, sql: {...}}``); the level mix is
  restricted to the levels the member has (all of its levels, evenly, when none is named).
- **Demonstration flaws** are those every member's expert supports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict

from pipeline.envs.contract import BuildOptions, BuildRequest, BuildResult, Environment

SEP = "/"


@dataclass(frozen=True)
class Tagged:
    """A member's task, tagged with its environment (attributes other than `task_id` are the member task's)."""

    env: str
    task: Any

    @property
    def task_id(self) -> str:
        return f"{self.env}{SEP}{self.task.task_id}"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.task, name)

    def to_dict(self) -> dict:
        return {**self.task.to_dict(), "task_id": self.task_id, "env": self.env}


def untag(record: dict) -> tuple[str, dict]:
    """(environment, the member's own record) of a mixed task record."""
    env = record.get("env")
    if not isinstance(env, str) or not env:
        raise ValueError("a task of a mixed run needs 'env', the name of its environment")
    rec = {k: v for k, v in record.items() if k != "env"}
    tid = rec.get("task_id")
    if isinstance(tid, str) and tid.startswith(env + SEP):
        rec["task_id"] = tid[len(env) + 1:]
    return env, rec


def interleave(tasks: list[Tagged]) -> list[Tagged]:
    """The members' tasks interleaved in proportion (stable), so that the first N of a split (evaluation's
    `max_tasks`, training's `eval_tasks`) hold every environment in its share."""
    size: dict[str, int] = {}
    for t in tasks:
        size[t.env] = size.get(t.env, 0) + 1
    seen: dict[str, int] = {}
    keyed = []
    for t in tasks:
        k = seen[t.env] = seen.get(t.env, -1) + 1
        keyed.append(((k + 0.5) / size[t.env], list(size).index(t.env), t))
    return [t for *_, t in sorted(keyed, key=lambda x: (x[0], x[1]))]


class MixedOptions(BuildOptions):
    """{member name: that member's options}; checked by each member's Options model at build."""

    model_config = ConfigDict(extra="allow")


def shares(total: int, weights: dict[str, float]) -> dict[str, int]:
    """`total` split by `weights` (largest remainders), every member getting at least one.

    >>> shares(10, {"a": 1, "b": 1}), shares(5, {"a": 3, "b": 1})
    ({'a': 5, 'b': 5}, {'a': 4, 'b': 1})
    """
    norm = sum(weights.values())
    raw = {k: total * w / norm for k, w in weights.items()}
    out = {k: max(1, int(v)) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: raw[k] - int(raw[k]), reverse=True):
        if sum(out.values()) >= total:
            break
        out[k] += 1
    return out


class MixedEnvironment(Environment):
    """Members are set by :func:`mixed_class`; see the module docstring."""

    name = "mixed"
    description = "several environments, each task in its own"
    Options = MixedOptions
    members: ClassVar[dict[str, type]] = {}
    weights: ClassVar[dict[str, float]] = {}

    def __init__(self, worlds: dict[str, Environment]):
        self.worlds = worlds

    def _of(self, task) -> Environment:
        return self.worlds[task.env]

    # ------------------------------------------------------------------------------------------------------ data
    @classmethod
    def member_options(cls, options: BuildOptions) -> dict[str, BuildOptions]:
        given = options.model_dump()
        unknown = sorted(set(given) - set(cls.members))
        if unknown:
            raise ValueError(f"build_env.options names {unknown}, which are not environments of this mix "
                             f"({', '.join(cls.members)}); give each environment's options under its name")
        return {n: m.Options.model_validate(given.get(n) or {}) for n, m in cls.members.items()}

    @classmethod
    def build(cls, out_dir: Path, request: BuildRequest) -> BuildResult:
        opts = cls.member_options(request.options)
        tasks: dict[str, list] = {split: [] for split in request.tasks_per_split}
        counts, files = {}, []
        sizes = {split: shares(n, cls.weights) for split, n in request.tasks_per_split.items()}
        for name, member in cls.members.items():
            mix = {lv: w for lv, w in request.level_mix.items() if lv in member.levels} or \
                {lv: 1.0 for lv in member.levels}
            sub = Path(out_dir) / name
            sub.mkdir(parents=True)
            res = member.build(sub, BuildRequest(request.seed, {s: sizes[s][name] for s in sizes}, mix, opts[name]))
            for split, ts in res.tasks.items():
                tasks[split] += [Tagged(name, t) for t in ts]
            counts.update({f"{name}_{k}": v for k, v in res.counts.items()})
            files += res.files
        return BuildResult({split: interleave(ts) for split, ts in tasks.items()}, counts, files)

    @classmethod
    def load(cls, world_dir: Path) -> "MixedEnvironment":
        return cls({n: m.load(Path(world_dir) / n) for n, m in cls.members.items()})

    def tools(self) -> list:
        seen, out = set(), []
        for w in self.worlds.values():
            for s in w.tools():
                if s.name not in seen:
                    seen.add(s.name)
                    out.append(s)
        return out

    def tools_for(self, task) -> list:
        return self._of(task).tools_for(task.task)

    def task_from_dict(self, row: dict) -> Tagged:
        env, rec = untag(row)
        if env not in self.worlds:
            raise ValueError(f"task names environment {env!r}, which is not in this mix ({', '.join(self.worlds)})")
        return Tagged(env, self.worlds[env].task_from_dict(rec))

    def open_episode(self, task, rng, randomize_values: bool = False):
        return self._of(task).open_episode(task.task, rng, randomize_values)

    def required_tools(self, task) -> list[str]:
        return self._of(task).required_tools(task.task)

    def close(self) -> None:
        for w in self.worlds.values():
            w.close()

    # ------------------------------------------------------------------------------------------------- optional
    def expert(self, flaw: str = "none", rng=None):
        experts = {n: w.expert(flaw, rng) for n, w in self.worlds.items()}
        return None if any(e is None for e in experts.values()) else _Dispatch(experts)

    def random_policy(self, rng):
        policies = {n: w.random_policy(rng) for n, w in self.worlds.items()}
        return None if any(p is None for p in policies.values()) else _Dispatch(policies)

    def _split_records(self, records: list[dict]) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {n: [] for n in self.worlds}
        for r in records:
            env, rec = untag(r)
            out.setdefault(env, []).append(rec)
        return out

    def validate(self, world_dir: Path, tasks: dict[str, list[dict]], demos: list[dict] | None) -> list:
        by_split = {s: self._split_records(rs) for s, rs in tasks.items()}
        demo_by_env: dict[str, list[dict]] = {n: [] for n in self.worlds}
        for d in demos or []:
            env, _, tid = d["task_id"].partition(SEP)
            demo_by_env.setdefault(env, []).append({**d, "task_id": tid})
        reports = []
        for n, w in self.worlds.items():
            reports += w.validate(Path(world_dir) / n, {s: by_split[s].get(n, []) for s in by_split},
                                  demo_by_env.get(n) if demos is not None else None)
        return reports

    def check_task_records(self, records: list[dict], dataset: str):
        for n, recs in self._split_records(records).items():
            report = self.worlds[n].check_task_records(recs, f"{dataset} ({n})") if recs else None
            if report is not None and not report.success:
                return report
        return None

    def check_episodes(self, records: list[dict], kind: str, dataset: str, env_cfg, require_tokens: bool = False):
        groups: dict[str, list[dict]] = {}
        for r in records:
            groups.setdefault(r.get("env", ""), []).append(r)
        for n, recs in groups.items():
            world = self.worlds.get(n)
            report = world.check_episodes(recs, kind, f"{dataset} ({n})", env_cfg, require_tokens) if world else None
            if report is not None and not report.success:
                return report
        return None

    def reference_calls(self, task):
        return self._of(task).reference_calls(task.task)

    def same_answer(self, given: str, truth: str) -> bool:
        return any(w.same_answer(given, truth) for w in self.worlds.values())

    def vocabulary(self) -> list[str]:
        return sorted({v for w in self.worlds.values() for v in w.vocabulary()})

    def leaks_heldout(self, task) -> bool:
        return self._of(task).leaks_heldout(task.task)

    def heldout_slices(self, task) -> list[str]:
        return self._of(task).heldout_slices(task.task)

    def verify_task(self, task) -> bool:
        return self._of(task).verify_task(task.task)

    def generate_tasks(self, weakness: dict, n: int, seed: int, options: BuildOptions | None = None):
        """The member named by ``weakness["env"]`` generates (its tasks tagged); None when it cannot."""
        env = weakness.get("env")
        if env not in self.worlds:
            raise ValueError(f"a weakness of a mixed run names its environment in 'env', one of {list(self.worlds)}")
        opts = self.member_options(options)[env] if options is not None else None
        got = self.worlds[env].generate_tasks({k: v for k, v in weakness.items() if k != "env"}, n, seed, opts)
        return None if got is None else [Tagged(env, t) for t in got]

    def request_task(self, request: dict):
        env = request.get("env")
        if env not in self.worlds:
            raise ValueError(f"a request to a mixed deployment names its environment in 'env', one of "
                             f"{', '.join(self.worlds)}; got {env!r}")
        return Tagged(env, self.worlds[env].request_task({k: v for k, v in request.items() if k != "env"}))

    def sample_tasks(self, split: str, n: int, level_mix: dict[int, float], seed: int, options: BuildOptions):
        opts = self.member_options(options)
        out = []
        for name, k in shares(n, self.weights).items():
            w = self.worlds[name]
            mix = {lv: x for lv, x in level_mix.items() if lv in type(w).levels} or {lv: 1.0 for lv in type(w).levels}
            ts = w.sample_tasks(split, k, mix, seed, opts[name])
            if ts is None:
                return None
            out += [Tagged(name, t) for t in ts]
        return out

    def entity_table(self):
        import pandas as pd

        tables = [t for t in (w.entity_table() for w in self.worlds.values()) if t is not None]
        return pd.concat(tables) if tables else None

    def entity_names(self) -> set[str] | None:
        names = [w.entity_names() for w in self.worlds.values()]
        return None if all(n is None for n in names) else set().union(*[n for n in names if n is not None])


class _Dispatch:
    """A scripted policy per member; each task goes to its environment's."""

    def __init__(self, policies: dict):
        self.policies = policies

    def reset(self, task) -> None:
        self.current = self.policies[task.env]
        self.current.reset(task.task)

    def act(self, obs: dict, info: dict) -> str:
        return self.current.act(obs, info)


def mixed_class(weights: dict[str, float], resolve) -> type[MixedEnvironment]:
    """A MixedEnvironment class over the environments named in `weights` (resolved by `resolve(name)`)."""
    if len(weights) < 2:
        raise ValueError(f"a mixed run names at least two environments, got {sorted(weights)}")
    bad = {k: v for k, v in weights.items() if not (isinstance(v, (int, float)) and v > 0)}
    if bad:
        raise ValueError(f"the weights of a mixed run must be positive numbers, got {bad}")
    members = {name: resolve(name) for name in weights}
    levels = tuple(sorted({lv for m in members.values() for lv in m.levels}))
    flaws = tuple(sorted(set.intersection(*[set(m.flaws) for m in members.values()])))
    return type("MixedEnvironment", (MixedEnvironment,),
                {"members": members, "weights": dict(weights), "levels": levels, "flaws": flaws,
                 "description": "a mix of " + ", ".join(f"{n} ({w:g})" for n, w in weights.items())})
