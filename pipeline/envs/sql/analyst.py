"""The read-only SQL analyst: an :class:`~pipeline.envs.contract.Environment` over a generated shop database.

The policy answers analytic questions ("How many 'cancelled' orders were placed between '2023-04-03' and
'2023-04-17'?", "Name the top 3 products in category 'garden' by units ordered, best first.") by exploring the schema
(``list_tables``, ``describe_table``) and writing SQL (``query``), then calling ``answer``. See docs/env-sql.md.

- :meth:`SqlAnalyst.build` writes ``world.sqlite`` and ``world.json`` (held-out partition, options, row counts) and
  draws every split's tasks (:mod:`.world`, :mod:`.tasks`);
- each episode opens its own read-only connection (URI ``mode=ro``, ``check_same_thread=False``) on its first query,
  guarded by the authorizer, progress handler and limits of :mod:`.tools`; nothing is shared between episodes, so the
  loaded environment (immutable: paths, schema text, limits) can open episodes from several threads;
- :meth:`SqlEpisode.correct`: numbers within 0.005 (answers are rounded to 2 decimals), name lists by exact order,
  case- and whitespace-insensitive.

Deliberately left out: per-episode redrawn values (the world is fixed; held-out values carry the generalisation test)
and write tools (the analyst is read-only by construction; `ToolSpec.writes` is False everywhere).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from pipeline.envs.contract import (BuildOptions, BuildRequest, BuildResult, Environment, Episode, Task, ToolError,
                                    ToolSpec)
from pipeline.envs.sql import world as W
from pipeline.envs.sql.expert import FLAWS, ExpertPolicy, RandomPolicy, read_answer
from pipeline.envs.sql.tasks import generate_tasks
from pipeline.envs.sql.tools import QueryLimits, QueryRunner, tool_specs

KINDS = ("number", "names")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_JOIN = re.compile(r"\bjoin\b", re.IGNORECASE)


class SqlOptions(BuildOptions):
    """Build options of the SQL analyst (`build_env.options` when `env.name` is "sql")."""

    n_customers: int = Field(800, ge=50, le=1600, description="Customers in the database.")
    n_products: int = Field(320, ge=32, le=2304, description="Products in the database (16 categories).")
    n_orders: int = Field(6000, ge=200, le=200_000, description="Orders, each with 1-4 order lines.")
    heldout_fraction: float = Field(0.3, gt=0, lt=0.8, description="Share of cities, categories and months held out "
                                    "of training; validation and test get half each.")
    train_wordings: int = Field(4, ge=1, le=4, description="Fixed question wordings per family in train/validation, "
                                "beside the wording grammar's frames; test uses all four and the held-out fifth.")
    query_timeout_s: float = Field(1.0, gt=0, le=30, description="Wall-clock limit of one query, in seconds.")
    max_rows: int = Field(20, ge=1, le=1000, description="Result rows shown per query (the rest are counted).")


# ------------------------------------------------------------------------------------------------------- answers
def normalize(text: object) -> str:
    return " ".join(str(text).strip().strip("'\"").strip().lower().split())


def _number(text: str) -> float | None:
    s = normalize(text)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    try:
        return float(s)
    except ValueError:
        return None


def answers_match(given: object, truth: str, kind: str = "number") -> bool:
    """Numbers within 0.005 (both are read as rounded to 2 decimals); names as an ordered, comma-separated list.

    >>> answers_match("1234.567", "1234.57"), answers_match(" blue lamp ,RED MUG", "Blue Lamp, Red Mug", "names")
    (True, True)
    >>> answers_match("Red Mug, Blue Lamp", "Blue Lamp, Red Mug", "names"), answers_match("12.3", "12.35")
    (False, False)
    """
    if given is None:
        return False
    if kind == "names":
        g, t = [normalize(x) for x in str(given).split(",")], [normalize(x) for x in str(truth).split(",")]
        return g == t and all(g)
    a, b = _number(str(given)), _number(str(truth))
    if a is not None and b is not None:
        return abs(a - b) <= 0.005 + 1e-9
    return normalize(given) == normalize(truth) != ""


# ------------------------------------------------------------------------------------------------------- episode
class SqlEpisode(Episode):
    """One episode: its own read-only, guarded connection, opened on the first query."""

    def __init__(self, env: "SqlAnalyst", task: Task):
        self.env, self.task = env, task
        self.truth = task.answer
        self.kind = task.data.get("kind", "number")
        self._runner: QueryRunner | None = None

    def call(self, tool: str, args: dict) -> str:
        if tool == "list_tables":
            return self.env.tables_text
        if tool == "describe_table":
            name = str(args.get("table", "")).strip().lower()
            if name not in self.env.describe_texts:
                raise ToolError(f"no such table {args.get('table')!r}; tables are {', '.join(W.TABLES)}")
            return self.env.describe_texts[name]
        if tool == "query":
            if self._runner is None:
                self._runner = QueryRunner(W.connect_ro(self.env.db_path), self.env.limits)
            return self._runner.run(str(args.get("sql", "")))
        raise ToolError(f"unknown tool {tool!r}; tools are list_tables, describe_table, query, answer")

    def correct(self, answer: str) -> bool:
        return answers_match(answer, self.truth, self.kind)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None


# --------------------------------------------------------------------------------------------------- environment
class SqlAnalyst(Environment):
    """The read-only SQL analyst (see the module docstring and docs/env-sql.md)."""

    name: ClassVar[str] = "sql"
    description: ClassVar[str] = "read-only SQL analyst: answer questions by querying a generated shop database"
    Options: ClassVar[type[BuildOptions]] = SqlOptions
    levels: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)
    flaws: ClassVar[tuple[str, ...]] = FLAWS

    def __init__(self, world_dir: Path, meta: dict, schema: dict[str, dict]):
        self.world_dir = Path(world_dir)
        self.db_path = self.world_dir / W.DB_NAME
        self.meta, self.schema = meta, schema
        opts = meta.get("options", {})
        self.limits = QueryLimits(timeout_s=float(opts.get("query_timeout_s", 1.0)),
                                  max_rows=int(opts.get("max_rows", 20)))
        self.tables_text = ", ".join(f"{t} ({schema[t]['rows']} rows)" for t in W.TABLES)
        self.describe_texts = W.describe_texts(schema)
        part = meta["partition"]
        self.heldout_values = {dim: {v for s in ("validation", "test") for v in part.get(dim, {}).get(s, [])}
                               for dim in W.HELDOUT_DIMENSIONS}

    # ------------------------------------------------------------------------------------------------- data
    @classmethod
    def build(cls, out_dir: Path, request: BuildRequest) -> BuildResult:
        opts = request.options
        if not isinstance(opts, SqlOptions):
            raw = opts.model_dump() if isinstance(opts, BuildOptions) else dict(opts or {})
            opts = SqlOptions.model_validate(raw)
        unknown = sorted(set(request.tasks_per_split) - set(W.SPLITS))
        if unknown:
            raise ValueError(f"tasks_per_split names unknown splits {unknown}; splits are {list(W.SPLITS)}")
        bad_levels = sorted(set(request.level_mix) - set(cls.levels))
        if bad_levels or not any(w > 0 for w in request.level_mix.values()) or any(
                w < 0 for w in request.level_mix.values()):
            raise ValueError(f"level_mix must weight levels {list(cls.levels)} with non-negative weights, not all "
                             f"zero; got {dict(request.level_mix)}")
        out_dir = Path(out_dir)
        world = W.generate(request.seed, opts.n_customers, opts.n_products, opts.n_orders, opts.heldout_fraction)
        files = W.write(world, out_dir, {"seed": request.seed, "options": opts.model_dump()})
        files.append(W.write_corpus(out_dir, W.read_schema(out_dir / W.DB_NAME)))
        conn = W.connect_ro(out_dir / W.DB_NAME)
        try:
            tasks = {split: generate_tasks(conn, world["partition"], split, n, request.level_mix, request.seed,
                                           opts.train_wordings)
                     for split, n in request.tasks_per_split.items()}
        finally:
            conn.close()
        counts = {t: len(world["rows"][t]) for t in W.TABLES}
        return BuildResult(tasks=tasks, counts=counts, files=files)

    @classmethod
    def load(cls, world_dir: Path) -> "SqlAnalyst":
        meta = W.read_meta(Path(world_dir))
        return cls(Path(world_dir), meta, W.read_schema(Path(world_dir) / W.DB_NAME))

    def tools(self) -> list[ToolSpec]:
        return tool_specs()

    def task_from_dict(self, row: dict) -> Task:
        task = Task.from_dict(row)
        data = task.data
        problem = None
        if not isinstance(data, dict) or not isinstance(data.get("sql"), str) or not data["sql"].strip():
            problem = "its data has no reference SQL (data.sql)"
        elif not isinstance(data.get("tables"), list) or not set(data["tables"]) <= set(W.TABLES) \
                or not data["tables"]:
            problem = f"data.tables must list tables of {list(W.TABLES)}"
        elif data.get("kind") not in KINDS:
            problem = f"data.kind must be one of {list(KINDS)}"
        if problem:
            raise ValueError(f"task {row.get('task_id')!r}: {problem}")
        return task

    def open_episode(self, task: Task, rng=None, randomize_values: bool = False) -> SqlEpisode:
        """`rng` and `randomize_values` are unused: the world is fixed (held-out values test generalisation)."""
        return SqlEpisode(self, task)

    def sample_tasks(self, split: str, n: int, level_mix: dict[int, float], seed: int, options) -> list[Task]:
        """Fresh tasks drawn as :meth:`build` draws them, with another seed (the drift checks' reference samples)."""
        opts = options if isinstance(options, SqlOptions) else SqlOptions.model_validate(
            options.model_dump() if isinstance(options, BuildOptions) else dict(options or {}))
        conn = W.connect_ro(self.db_path)
        try:
            return generate_tasks(conn, self.meta["partition"], split, n, level_mix, seed, opts.train_wordings)
        finally:
            conn.close()

    def generate_tasks(self, weakness: dict, n: int, seed: int, options=None) -> list[Task]:
        """Fresh training tasks of a weak slice (:mod:`pipeline.envs.sql.generate`); wordings as the world was built."""
        from pipeline.envs.sql.generate import weak_spot_tasks

        wordings = (options.train_wordings if isinstance(options, SqlOptions)
                    else int(self.meta.get("options", {}).get("train_wordings", 4)))
        conn = W.connect_ro(self.db_path)
        try:
            return weak_spot_tasks(conn, self.meta["partition"], weakness, n, seed, wordings)
        finally:
            conn.close()

    def required_tools(self, task: Task) -> list[str]:
        """A correct process queries; describing tables first is the expert's habit, not a requirement."""
        return ["query"]

    def reference_calls(self, task: Task) -> list[tuple[str, dict]]:
        """The expert's plan with its true parameters, ``answer`` last."""
        return ([("describe_table", {"table": t}) for t in task.data["tables"]]
                + [("query", {"sql": task.data["sql"]}), ("answer", {"value": task.answer})])

    def same_answer(self, given: str, truth: str) -> bool:
        return answers_match(given, truth, "number" if _number(str(truth)) is not None else "names")

    def leaks_heldout(self, task: Task) -> bool:
        """Whether the task filters on, or its question quotes, a city, category or month of validation or test."""
        data = task.data if isinstance(task.data, dict) else {}
        for dim, v in (data.get("heldout") or {}).items():
            if v in self.heldout_values.get(dim, ()):
                return True
        text = f"{task.question} {data.get('sql', '')}"
        return any(f"'{v}" in text for values in self.heldout_values.values() for v in values)

    def heldout_slices(self, task: Task) -> list[str]:
        """The dimensions (city, category, month) whose value in this task training never sees."""
        data = task.data if isinstance(task.data, dict) else {}
        return sorted(dim for dim, v in (data.get("heldout") or {}).items() if v in self.heldout_values.get(dim, ()))

    def verify_task(self, task: Task) -> bool:
        """Whether the task's reference SQL, run through the guarded runner, gives its stated answer."""
        episode = self.open_episode(task)
        try:
            result = episode.call("query", {"sql": task.data["sql"]})
        except ToolError:
            return False
        finally:
            episode.close()
        return episode.correct(read_answer(result, task.data.get("kind", "number")))

    def vocabulary(self) -> list[str]:
        """Table and column names and the shared categorical values, which queries must spell exactly."""
        words = list(W.TABLES) + sorted({c for t in W.TABLES for c, _ in self.schema[t]["columns"]})
        return words + list(W.STATUSES) + list(W.CHANNELS) + list(W.SEGMENTS)

    # --------------------------------------------------------------------------------------------- optional
    def expert(self, flaw: str = "none", rng=None) -> ExpertPolicy:
        return ExpertPolicy(flaw, rng)

    def random_policy(self, rng) -> RandomPolicy:
        return RandomPolicy({t: [c for c, _ in self.schema[t]["columns"]] for t in W.TABLES}, rng)

    def validate_world(self, world_dir: Path) -> list:
        """One Great Expectations report per table of ``world.sqlite``."""
        from pipeline.envs.sql.suites import validate_world

        return validate_world(Path(world_dir))

    def validate(self, world_dir: Path, tasks: dict[str, list[dict]], demos: list[dict] | None) -> list:
        """The world's table reports, one ``sql_tasks`` report per split and the cross-split report."""
        from pipeline.envs.sql.suites import check_splits, validate_tasks

        reports = self.validate_world(world_dir)
        reports += [validate_tasks(records, f"tasks/{split}", split) for split, records in tasks.items()]
        return reports + [check_splits(tasks)]

    def check_task_records(self, records: list[dict], dataset: str):
        from pipeline.envs.sql.suites import validate_tasks

        return validate_tasks(records, dataset)

    def drift_features(self, record: dict) -> dict[str, float]:
        """From the record's `calls`: query count, whether any query was refused, the share of queries that failed,
        their mean SQL length and mean number of JOINs."""
        calls = [c for c in record.get("calls") or [] if isinstance(c, dict) and c.get("tool") == "query"]
        sqls = [c["params"]["sql"] for c in calls
                if isinstance(c.get("params"), dict) and isinstance(c["params"].get("sql"), str)]
        failed = sum(c.get("outcome") not in ("ok",) for c in calls)
        return {
            "sql_queries": float(len(calls)),
            "sql_refused": float(any(c.get("outcome") == "safety_violation" for c in calls)),
            "sql_failed_share": failed / len(calls) if calls else 0.0,
            "sql_mean_chars": sum(map(len, sqls)) / len(sqls) if sqls else 0.0,
            "sql_mean_joins": sum(len(_JOIN.findall(s)) for s in sqls) / len(sqls) if sqls else 0.0,
        }
