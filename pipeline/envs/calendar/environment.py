"""The booking calendar: an :class:`~pipeline.envs.contract.Environment` whose success is the world's final state.

The policy acts for one person (the requester) on a shared room calendar: it looks bookings and free rooms up
(``find_bookings``, ``free_slots``, ``free_rooms``), then books, moves or cancels (``book``, ``move_booking``,
``cancel_booking``), recovering from what the world refuses (a taken room, a room too small, a person already in a
meeting), and ends with ``answer``, a receipt of the booking ids it changed or made. See docs/env-calendar.md.

- :meth:`CalendarWorld.build` writes ``world.sqlite``, ``world.json`` (held-out people, days, options, counts) and
  ``corpus.jsonl`` (the rooms and the rules) and draws every split's tasks (:mod:`.world`, :mod:`.tasks`);
- a loaded world keeps an in-memory master copy; every episode works on its own in-memory copy of it (SQLite's
  backup API, under a lock), so its writes reach no other episode and never the disk, and one loaded world serves
  episodes from several threads;
- :meth:`CalendarEpisode.correct` judges the copy's state against the request (:mod:`.judge`): the requested
  changes and nothing else, and a receipt naming exactly the bookings changed or made;
- the guard of :mod:`.tools` refuses every write the request does not ask for (:class:`SafetyViolation`).

Deliberately left out: per-episode redrawn values (`randomize_values` is ignored: the held-out people carry the
generalisation test), serving of free-form requests (:meth:`request_task` is the contract's default, complete task
records, because a request's goal and allowance must be stated for its state to be judged), ``entities.json`` (the
demonstrations' name augmentation knows only the shop's names).
"""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from pipeline.envs.contract import (BuildOptions, BuildRequest, BuildResult, Environment, Episode, SafetyViolation,
                                    Task, ToolError, ToolSpec)
from pipeline.envs.calendar import world as W
from pipeline.envs.calendar.expert import FLAWS, ExpertPolicy, RandomPolicy
from pipeline.envs.calendar.judge import judge, receipt_ids
from pipeline.envs.calendar.tasks import FAMILY_NAMES, Schedule, generate_tasks
from pipeline.envs.calendar.tools import WRITE_TOOLS, Allowance, Calendar, tool_specs

GOAL_OPS = ("book", "move", "cancel")


class CalendarOptions(BuildOptions):
    """Build options of the booking calendar (`build_env.options` when `env.name` is "calendar")."""

    n_people: int = Field(120, ge=30, le=900, description="People who own bookings (first x last names).")
    weeks: int = Field(4, ge=1, le=8, description="Weeks of working days (Monday-Friday) from 2026-03-02.")
    occupancy: float = Field(0.45, ge=0.1, le=0.8, description="Base chance that a room is booked at an hour "
                             "(shaped by hour and room size).")
    heldout_fraction: float = Field(0.3, gt=0, lt=0.8, description="Share of people held out of training; "
                                    "validation and test get half each.")
    train_wordings: int = Field(3, ge=1, le=3, description="Request wordings per family in train/validation; test "
                                "uses all three and the held-out fourth.")


def _options(opts) -> CalendarOptions:
    if isinstance(opts, CalendarOptions):
        return opts
    return CalendarOptions.model_validate(opts.model_dump() if isinstance(opts, BuildOptions) else dict(opts or {}))


# ------------------------------------------------------------------------------------------------------- episode
class CalendarEpisode(Episode):
    """One episode: a private in-memory copy of the world and the request's allowance."""

    def __init__(self, env: "CalendarWorld", task: Task):
        self.env, self.task = env, task
        self.truth = task.answer
        self.conn = env.episode_db()
        self.calendar = Calendar(self.conn, env.days, Allowance.from_task(task.data))

    def call(self, tool: str, args: dict) -> str:
        return self.calendar.call(tool, args)

    def state(self) -> tuple[bool, str, set[int]]:
        """(whether the copy is in the requested state, why not, the ids changed or made)."""
        return judge(self.env.initial, W.bookings(self.conn), self.task.data["goal"])

    def correct(self, answer: str) -> bool:
        ok, _, touched = self.state()
        return ok and receipt_ids(answer) == touched

    def close(self) -> None:
        self.conn.close()


# --------------------------------------------------------------------------------------------------- environment
class CalendarWorld(Environment):
    """The booking calendar (see the module docstring and docs/env-calendar.md)."""

    name: ClassVar[str] = "calendar"
    description: ClassVar[str] = "booking calendar: book, move, cancel and swap meetings; judged on the final state"
    Options: ClassVar[type[BuildOptions]] = CalendarOptions
    levels: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)
    flaws: ClassVar[tuple[str, ...]] = FLAWS

    def __init__(self, world_dir: Path, meta: dict, master: sqlite3.Connection):
        self.world_dir, self.meta, self.master = Path(world_dir), meta, master
        self._lock = threading.Lock()
        self.days = tuple(meta["days"])
        self.initial = W.bookings(master)
        self.people = [r[0] for r in master.execute("SELECT name FROM people ORDER BY name")]
        part = meta["partition"]["person"]
        self.heldout_people = {p for s in ("validation", "test") for p in part.get(s, [])}
        self._specs = tool_specs()

    # ------------------------------------------------------------------------------------------------- data
    @classmethod
    def build(cls, out_dir: Path, request: BuildRequest) -> BuildResult:
        opts = _options(request.options)
        unknown = sorted(set(request.tasks_per_split) - set(W.SPLITS))
        if unknown:
            raise ValueError(f"tasks_per_split names unknown splits {unknown}; splits are {list(W.SPLITS)}")
        bad = sorted(set(request.level_mix) - set(cls.levels))
        if bad or not any(w > 0 for w in request.level_mix.values()) or any(w < 0 for w in request.level_mix.values()):
            raise ValueError(f"level_mix must weight levels {list(cls.levels)} with non-negative weights, not all "
                             f"zero; got {dict(request.level_mix)}")
        out_dir = Path(out_dir)
        world = W.generate(request.seed, opts.n_people, opts.weeks, opts.occupancy, opts.heldout_fraction)
        files = W.write(world, out_dir, {"seed": request.seed, "options": opts.model_dump()})
        files.append(W.write_corpus(out_dir))
        schedule = Schedule({r[0]: tuple(r[1:]) for r in world["rows"]["bookings"]}, world["days"])
        tasks = {split: generate_tasks(schedule, world["partition"], split, n, request.level_mix, request.seed,
                                       opts.train_wordings)
                 for split, n in request.tasks_per_split.items()}
        return BuildResult(tasks=tasks, counts={t: len(world["rows"][t]) for t in W.TABLES}, files=files)

    @classmethod
    def load(cls, world_dir: Path) -> "CalendarWorld":
        meta = W.read_meta(Path(world_dir))
        return cls(Path(world_dir), meta, W.load_master(Path(world_dir) / W.DB_NAME))

    def close(self) -> None:
        self.master.close()

    def episode_db(self) -> sqlite3.Connection:
        """A private in-memory copy of the master."""
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        with self._lock:
            self.master.backup(conn)
        return conn

    def tools(self) -> list[ToolSpec]:
        return list(self._specs)

    def task_from_dict(self, row: dict) -> Task:
        task = Task.from_dict(row)
        problem = task_problem(task.data)
        if problem:
            raise ValueError(f"task {row.get('task_id')!r}: {problem}")
        return task

    def open_episode(self, task: Task, rng=None, randomize_values: bool = False) -> CalendarEpisode:
        """`rng` and `randomize_values` are unused: the world is fixed (held-out people test generalisation)."""
        return CalendarEpisode(self, task)

    def sample_tasks(self, split: str, n: int, level_mix: dict[int, float], seed: int, options) -> list[Task]:
        """Fresh tasks drawn as :meth:`build` draws them, with another seed (the drift checks' reference samples)."""
        return generate_tasks(Schedule(self.initial, self.days), self.meta["partition"], split, n, level_mix, seed,
                              _options(options).train_wordings)

    def generate_tasks(self, weakness: dict, n: int, seed: int, options=None) -> list[Task]:
        """Fresh training tasks of a weak slice (:mod:`pipeline.envs.calendar.generate`)."""
        from pipeline.envs.calendar.generate import weak_spot_tasks

        wordings = (options.train_wordings if isinstance(options, CalendarOptions)
                    else int(self.meta.get("options", {}).get("train_wordings", 3)))
        return weak_spot_tasks(Schedule(self.initial, self.days), self.meta["partition"], weakness, n, seed, wordings)

    def required_tools(self, task: Task) -> list[str]:
        """The plan's writes in order: the state can change in no other way (the look-ups are the expert's way to
        find what to write, not a requirement)."""
        return [tool for tool, _ in task.data["plan"] if tool in WRITE_TOOLS]

    def reference_calls(self, task: Task) -> list[tuple[str, dict]]:
        """The expert's plan with its true parameters, ``answer`` (the receipt) last."""
        return [(tool, dict(params)) for tool, params in task.data["plan"]] + [("answer", {"value": task.answer})]

    def same_answer(self, given: str, truth: str) -> bool:
        """Two receipts naming the same booking ids."""
        return bool(receipt_ids(truth)) and receipt_ids(given) == receipt_ids(truth)

    def leaks_heldout(self, task: Task) -> bool:
        """Whether the task names (in its data or its question) a person held out for validation or test."""
        data = task.data if isinstance(task.data, dict) else {}
        named = (data.get("heldout") or {}).get("person") or []
        if any(p in self.heldout_people for p in named):
            return True
        return any(re.search(rf"\b{re.escape(p)}\b", task.question) for p in self.heldout_people)

    def heldout_slices(self, task: Task) -> list[str]:
        """["people"] when the task names a person training never sees."""
        data = task.data if isinstance(task.data, dict) else {}
        named = (data.get("heldout") or {}).get("person") or []
        return ["people"] if any(p in self.heldout_people for p in named) else []

    def verify_task(self, task: Task) -> bool:
        """Whether the task's plan, played through the guard on a fresh copy, reaches its goal with its answer."""
        episode = self.open_episode(task)
        try:
            for tool, params in task.data["plan"]:
                episode.call(tool, params)
            return episode.correct(task.answer)
        except (ToolError, SafetyViolation, KeyError, TypeError):
            return False
        finally:
            episode.close()

    def vocabulary(self) -> list[str]:
        """Room names, hours and the days of the calendar, which calls must spell exactly."""
        return list(W.ROOM_NAMES) + list(W.HOURS) + list(self.days)

    # --------------------------------------------------------------------------------------------- optional
    def expert(self, flaw: str = "none", rng=None) -> ExpertPolicy:
        return ExpertPolicy(flaw, rng)

    def random_policy(self, rng) -> RandomPolicy:
        train = self.meta["partition"]["person"]["train"] or self.people
        return RandomPolicy(train, list(self.days), rng)

    def validate_world(self, world_dir: Path) -> list:
        """One Great Expectations report per table of ``world.sqlite``."""
        from pipeline.envs.calendar.suites import validate_world

        return validate_world(Path(world_dir))

    def validate(self, world_dir: Path, tasks: dict[str, list[dict]], demos: list[dict] | None) -> list:
        """The world's table reports, one ``calendar_tasks`` report per split and the cross-split report."""
        from pipeline.envs.calendar.suites import check_splits, validate_tasks

        reports = self.validate_world(world_dir)
        reports += [validate_tasks(records, f"tasks/{split}", split) for split, records in tasks.items()]
        reports.append(check_splits(tasks))
        return reports

    def check_task_records(self, records: list[dict], dataset: str):
        from pipeline.envs.calendar.suites import validate_tasks

        return validate_tasks(records, dataset)

    def drift_features(self, record: dict) -> dict[str, float]:
        """From the record's `calls`: look-ups, writes that went through, whether any write was refused, and the
        share of write attempts the world turned down (conflicts, rooms too small)."""
        calls = [c for c in record.get("calls") or [] if isinstance(c, dict)]
        writes = [c for c in calls if c.get("tool") in WRITE_TOOLS]
        return {
            "calendar_lookups": float(sum(c.get("tool") in ("find_bookings", "free_slots", "free_rooms")
                                          for c in calls)),
            "calendar_writes": float(sum(c.get("outcome") == "ok" for c in writes)),
            "calendar_refused": float(any(c.get("outcome") == "safety_violation" for c in calls)),
            "calendar_write_errors": (sum(c.get("outcome") == "tool_error" for c in writes) / len(writes)
                                      if writes else 0.0),
        }


def task_problem(data: object) -> str | None:
    """What keeps a task record's `data` from being a calendar request, or None."""
    if not isinstance(data, dict):
        return "its data must be an object"
    goal, allowed, plan = data.get("goal"), data.get("allowed"), data.get("plan")
    if not isinstance(goal, list) or not goal or not all(isinstance(g, dict) and g.get("op") in GOAL_OPS
                                                         for g in goal):
        return f"data.goal must list changes with op one of {list(GOAL_OPS)}"
    if not isinstance(allowed, dict) or not isinstance(allowed.get("requester"), str) \
            or not all(isinstance(allowed.get(k), list) for k in ("move", "cancel")):
        return "data.allowed must give the requester and the ids it may move and cancel"
    if not isinstance(plan, list) or not all(isinstance(s, list) and len(s) == 2 and isinstance(s[1], dict)
                                             for s in plan):
        return "data.plan must list [tool, params] calls"
    return None


__all__ = ["CalendarWorld", "CalendarEpisode", "CalendarOptions", "FAMILY_NAMES", "task_problem"]
