""":class:`ShopWorld`: the shop world as an implementation of the environment contract (:mod:`pipeline.envs.contract`).

A loaded world keeps a master in-memory SQLite copy, the search index and the tools; every episode works on a private
in-memory copy of the master (SQLite's backup API), so writes never leak into another episode or onto disk.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from typing import Literal

from pydantic import Field

from pipeline.envs.contract import (ANSWER_SPEC, BuildOptions, BuildRequest, BuildResult, Environment, Episode,
                                    ToolSpec)
from pipeline.envs.shop.expert import FLAWS, ExpertPolicy, RandomPolicy
from pipeline.envs.shop.tasks import Task, answers_match, generate_tasks, resolve_params, run_plan
from pipeline.envs.shop.tools import SearchIndex, ToolContext, default_tools
from pipeline.envs.shop.world import World, draw_numeric, generate_world, load_world, world_to_sqlite, write_world

SPLITS = ("train", "validation", "test")
SHIFTED_PRICE_RANGE = (500, 999)  # value_shifted: the upper half of the 1..999 the world's schema allows


class ShopOptions(BuildOptions):
    """The shop world's build options (`build_env.options` when `env.name` is shop)."""

    n_products: int = Field(400, ge=30, le=100_000, description="Products in the SQLite world.")
    n_suppliers: int = Field(80, ge=10, le=10_000, description="Suppliers (each with a flagship product, described in the document corpus).")
    heldout_entity_fraction: float = Field(0.3, gt=0, lt=0.9, description="Share of products and suppliers held out of training; validation and test each get half.")
    train_wordings: int = Field(
        4, ge=1, le=8,
        description="Question wordings per family that train and validation draw from (the original four, then four "
                    "more); the held-out fifth wording stays test-only, and test draws from the original five, so the "
                    "test split does not depend on this.",
    )
    wordings: Literal["grammar", "templates"] = Field(
        "grammar",
        description="Where train and validation questions come from: grammar (the train_wordings fixed wordings and a "
                    "compositional grammar of frames, synonyms, openers and closers, pipeline.envs.shop.wordings) or "
                    "templates (the fixed wordings only); test is the same either way.",
    )
    long_task_share: float = Field(0.0, ge=0, le=1, description="Share of every split's tasks drawn from the long family (long_sum: the total price or stock of many products; needs env.max_steps above long_task_lookups + 2, and notes to keep the values in the context); 0 keeps the splits unchanged.")
    long_task_lookups: int = Field(20, ge=2, le=24, description="Products a long task adds up (at most the split's products).")


class ShopEpisode(Episode):
    def __init__(self, shop: "ShopWorld", task: Task, rng, randomize_values: bool):
        self.shop, self.task = shop, task
        self.conn = shop.episode_db()
        if randomize_values:  # the stored answer no longer applies: solve on this copy
            names = [e for e in task.entities
                     if self.conn.execute("SELECT 1 FROM products WHERE name = ?", (e,)).fetchone()]
            vals = draw_numeric(rng, len(names))
            self.conn.executemany("UPDATE products SET price = ?, stock = ?, weight_kg = ? WHERE name = ?",
                                  zip(vals["price"], vals["stock"], vals["weight_kg"], names))
            self.truth = shop.solve(task.plan, task.allowed_writes, self.conn)
        else:
            self.truth = task.answer
        self.ctx = ToolContext(self.conn, shop.index, list(task.allowed_writes))

    def call(self, tool: str, args: dict) -> str:
        return self.shop.by_name[tool].execute(args, self.ctx)

    def correct(self, answer: str) -> bool:
        return answers_match(answer, self.truth)

    def close(self) -> None:
        self.conn.close()


class ShopWorld(Environment):
    """The shop world: products, suppliers and documents, tasks in seven families at four levels."""

    name = "shop"
    description = "a generated shop (products, suppliers, documents): lookup, calc, search, convert, update, answer"
    Options = ShopOptions
    levels = (1, 2, 3, 4)
    flaws = tuple(f for f in FLAWS if f != "none")

    def __init__(self, world: World):
        self.world = world
        self.master = sqlite3.connect(":memory:", check_same_thread=False)
        world_to_sqlite(world, self.master)
        self.index = SearchIndex(world.corpus)
        self._tools = default_tools()
        self.by_name = {t.name: t for t in self._tools}
        self._specs = [ANSWER_SPEC if t.name == ANSWER_SPEC.name else
                       ToolSpec(t.name, t.description, t.parameters, writes=t.name == "update") for t in self._tools]

    # ------------------------------------------------------------------------------------------------------- data
    @classmethod
    def generate(cls, request: BuildRequest) -> tuple[World, "ShopWorld", dict[str, list[Task]]]:
        o = request.options
        world = generate_world(request.seed, o.n_products, o.n_suppliers, o.heldout_entity_fraction)
        shop = cls(world)
        tasks = {split: generate_tasks(world, split, request.tasks_per_split[split], request.level_mix, request.seed,
                                       solver=lambda plan, allowed: shop.solve(plan, allowed),
                                       train_wordings=o.train_wordings, long_share=o.long_task_share,
                                       grammar=o.wordings == "grammar",
                                       long_lookups=o.long_task_lookups)
                 for split in SPLITS}
        return world, shop, tasks

    @classmethod
    def build(cls, out_dir: Path, request: BuildRequest) -> BuildResult:
        world, shop, tasks = cls.generate(request)
        shop.close()
        paths = write_world(world, Path(out_dir))
        return BuildResult(tasks, counts={"products": len(world.products), "suppliers": len(world.suppliers),
                                          "documents": len(world.corpus)},
                           files=[paths["db"], paths["corpus"], paths["entities"]])

    @classmethod
    def load(cls, world_dir: Path) -> "ShopWorld":
        return cls(load_world(Path(world_dir)))

    @classmethod
    def default(cls) -> "ShopWorld":
        """The small world used when the environment is made without data (e.g. by `check_env`): 200 training tasks."""
        world = generate_world(0, n_products=120, n_suppliers=30, heldout_fraction=0.3)
        shop = cls(world)
        shop.builtin_tasks = {"train": generate_tasks(world, "train", 200, {1: 1, 2: 1, 3: 1, 4: 1}, seed=0,
                                                      solver=lambda plan, allowed: shop.solve(plan, allowed))}
        return shop

    def tools(self) -> list[ToolSpec]:
        return list(self._specs)

    def task_from_dict(self, row: dict) -> Task:
        return Task.from_dict(row)

    def open_episode(self, task: Task, rng, randomize_values: bool = False) -> ShopEpisode:
        return ShopEpisode(self, task, rng, randomize_values)

    def required_tools(self, task: Task) -> list[str]:
        return [s["tool"] for s in task.plan]

    def close(self) -> None:
        self.master.close()

    # --------------------------------------------------------------------------------------------------- optional
    def expert(self, flaw: str = "none", rng=None) -> ExpertPolicy:
        return ExpertPolicy(flaw, rng)

    def random_policy(self, rng) -> RandomPolicy:
        return RandomPolicy([p["name"] for p in self.world.products], rng)

    def validate(self, world_dir: Path, tasks: dict[str, list[dict]], demos: list[dict] | None) -> list:
        from pipeline.envs.shop.validate import validate_data

        return validate_data(Path(world_dir), tasks, demos)

    def check_task_records(self, records: list[dict], dataset: str):
        from pipeline.core.validation import validate_records
        from pipeline.envs.shop.suites import register_suites

        register_suites()
        return validate_records(records, suite="tasks", dataset=dataset)

    def request_task(self, request: dict) -> Task:
        from pipeline.envs.shop.requests import request_task

        return request_task(request)

    def check_episodes(self, records: list[dict], kind: str, dataset: str, env_cfg, require_tokens: bool = False):
        from pipeline.core.validation import validate_records
        from pipeline.envs.shop.suites import register_suites

        register_suites()
        extra = {"require_tokens": True} if require_tokens else {}
        return validate_records(records, kind, dataset=dataset, env_cfg=env_cfg, **extra)

    def reference_calls(self, task: Task) -> list[tuple[str, dict]]:
        """The plan with every reference resolved by the results of the plan's steps on the world as stored."""
        conn = self.master
        ctx = ToolContext(conn, self.index, list(task.allowed_writes))
        conn.execute("SAVEPOINT reference")
        try:
            results = run_plan(task.plan, lambda tool, params: self.by_name[tool].execute(params, ctx))
        finally:
            conn.execute("ROLLBACK TO reference")
            conn.execute("RELEASE reference")
        return [(step["tool"], resolve_params(step["params"], results)) for step in task.plan]

    def same_answer(self, given: str, truth: str) -> bool:
        return answers_match(given, truth)

    def sample_tasks(self, split: str, n: int, level_mix: dict[int, float], seed: int, options: ShopOptions) -> list:
        return generate_tasks(self.world, split, n, dict(level_mix), seed,
                              solver=lambda plan, allowed: self.solve(plan, allowed),
                              train_wordings=options.train_wordings, long_share=options.long_task_share,
                              long_lookups=options.long_task_lookups, grammar=options.wordings == "grammar")

    def value_shifted(self, seed: int) -> "ShopWorld":
        """Every product's price redrawn uniformly from the upper half (500..999) of the range the schema allows."""
        import dataclasses

        import numpy as np

        rng = np.random.default_rng([seed, 7])
        prices = rng.integers(SHIFTED_PRICE_RANGE[0], SHIFTED_PRICE_RANGE[1] + 1, size=len(self.world.products))
        products = [{**p, "price": int(v)} for p, v in zip(self.world.products, prices)]
        return ShopWorld(dataclasses.replace(self.world, products=products))

    def entity_table(self):
        import pandas as pd

        return pd.DataFrame.from_records(self.world.products,
                                         columns=["name", "price", "stock", "weight_kg"]).set_index("name")

    def entity_names(self) -> set[str]:
        return {p["name"] for p in self.world.products} | {s["name"] for s in self.world.suppliers}

    def leaks_heldout(self, task: Task) -> bool:
        w = self.world
        heldout = {n for split in (w.product_split, w.supplier_split) for n, s in split.items() if s != "train"}
        return bool(heldout.intersection(task.entities))

    def heldout_slices(self, task: Task) -> list[str]:
        """"products" / "suppliers" when the task names one that training never sees."""
        w = self.world
        return [kind for kind, split in (("products", w.product_split), ("suppliers", w.supplier_split))
                if any(split.get(n, "train") != "train" for n in task.entities)]

    def verify_task(self, task: Task) -> bool:
        from pipeline.envs.shop.tools import ToolError

        try:
            truth = self.solve(task.plan, task.allowed_writes)
        except (ToolError, KeyError, IndexError, ValueError):  # an entity the world lacks, a reference past the plan
            return False
        return answers_match(truth, task.answer)

    def generate_tasks(self, weakness: dict, n: int, seed: int, options: ShopOptions | None = None) -> list[Task]:
        from pipeline.envs.shop.generate import weak_spot_tasks

        conn = self.episode_db()  # a private copy: rollout threads may be copying the master meanwhile
        try:
            return weak_spot_tasks(self.world, weakness, n, seed, lambda plan, allowed: self.solve(plan, allowed, conn),
                                   train_wordings=(options or ShopOptions()).train_wordings,
                                   grammar=(options or ShopOptions()).wordings == "grammar")
        finally:
            conn.close()

    def entity_kinds(self) -> dict[str, float]:
        """The kinds of entities.json the drills and name augmentation use (capability NamesEntities): products
        three times as often as suppliers, as most questions name a product."""
        return {"products": 0.75, "suppliers": 0.25}

    def vocabulary(self) -> list[str]:
        from pipeline.envs.shop.tasks import FIELD_WORDS, UNIT_WORDS

        return sorted(FIELD_WORDS.values()) + sorted(UNIT_WORDS.values())

    # ------------------------------------------------------------------------------------------------- the shop's
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
