"""Adversarial task generation: the weakness statistics (known answers), the environments' generators (fresh training
tasks of the asked slice that pass the data suites and never name what validation and test hold out), the checks
the `train` phase runs on them, and a tiny training run with the switch on that adds them to the pool, samples them
and resumes with them."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest
import torch

from pipeline.core.errors import AgentRLError
from pipeline.envs.contract import BuildRequest, Task
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.environment import ShopOptions
from pipeline.envs.shop.tasks import FAMILIES, FAMILY_LEVEL
from pipeline.train.config import TaskGenerationConfig
from pipeline.train.extensions.task_generation import (REFUSALS, TaskGenerator, allocate, check_generated,
                                           renamed, slice_of, slice_stats, weakest_slices)

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- weakness statistics
def test_weakness_statistics_known_answers():
    keys = ["lookup/0", "lookup/0", "update/1", "update/1", "update/1", "update/1", "two_lookup/2"]
    wins = [1, 1, 0, 1, 0, 0, 0]
    stats = slice_stats(keys, wins)
    assert stats == {"lookup/0": {"n": 2, "success": 1.0}, "two_lookup/2": {"n": 1, "success": 0.0},
                     "update/1": {"n": 4, "success": 0.25}}
    # two_lookup/2 is the weakest but has 1 episode (< 2); lookup/0 is not below 0.5
    assert weakest_slices(stats, 3, min_episodes=2, min_success=0.5) == ["update/1"]
    assert weakest_slices(stats, 3, min_episodes=1, min_success=0.5) == ["two_lookup/2", "update/1"]
    assert weakest_slices(stats, 1, min_episodes=1, min_success=1.01) == ["two_lookup/2"]
    # ties by name
    assert weakest_slices({"b": {"n": 5, "success": 0.2}, "a": {"n": 5, "success": 0.2}}, 2, 1, 0.5) == ["a", "b"]
    # 10 tasks by failure 1.0 : 0.75 → 5.71.. : 4.28.. → 5 + 1 (larger remainder) and 4
    assert allocate(10, [1.0, 0.75]) == [6, 4]
    # 3.5, 1.75, 1.75 → 3, 1, 1 and two more by the larger remainders (.75, .75 beat .5)
    assert allocate(7, [0.5, 0.25, 0.25]) == [3, 2, 2]
    assert allocate(2, [0.5, 0.5, 0.5]) == [1, 1, 0]  # equal remainders: the earlier slices
    assert allocate(4, [0.0, 0.0, 0.0]) == [2, 1, 1]
    assert allocate(3, []) == []
    with pytest.raises(ValueError, match="2 slice keys for 1 outcomes"):
        slice_stats(["a", "b"], [1])


def test_slices_of_shop_and_sql_tasks():
    shop = dataclasses.make_dataclass("ShopLike", ["family", "level", "template_id"])("update", 3, "update/2")
    sql = Task("s", "train", 4, "q", "a", family="top_products", data={"template_id": "top_products/1"})
    plain = Task("p", "train", 1, "q", "a", family="count")
    assert slice_of(shop, "template") == ("update/2", {"family": "update", "level": 3, "template_id": "update/2"})
    assert slice_of(sql, "template")[0] == "top_products/1"
    assert slice_of(sql, "family") == ("top_products", {"family": "top_products", "level": 4})
    assert slice_of(plain, "template") == ("count", {"family": "count", "level": 1})  # no wording id: its family
    assert slice_of(shop, "level") == ("L3", {"level": 3})


def test_task_generation_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="exceeds window"):
        TaskGenerationConfig(window=16, min_episodes=32)
    with pytest.raises(ValueError):
        TaskGenerationConfig(by="entity")
    with pytest.raises(ValueError):
        TaskGenerationConfig(min_success=0)


# --------------------------------------------------------------------------------------------- the shop's hook
@pytest.fixture(scope="module")
def shop():
    world, env, tasks = ShopWorld.generate(BuildRequest(0, {"train": 60, "validation": 20, "test": 30},
                                                        {1: 1, 2: 1, 3: 1, 4: 1}, ShopOptions(n_products=60,
                                                                                              n_suppliers=16)))
    yield env, {s: [t.to_dict() for t in ts] for s, ts in tasks.items()}
    env.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_shop_generates_training_tasks_of_the_weak_wording_that_pass_the_suites(shop, family):
    from pipeline.envs.shop.suites import check_splits

    env, splits = shop
    weakness = {"family": family, "level": FAMILY_LEVEL[family], "template_id": f"{family}/2"}
    tasks = env.generate_tasks(weakness, 6, seed=5)
    assert len(tasks) == 6 and len({t.question for t in tasks}) == 6
    train_entities = ({n for n, s in env.world.product_split.items() if s == "train"}
                      | {n for n, s in env.world.supplier_split.items() if s == "train"})
    for t in tasks:
        assert (t.family, t.level, t.template_id, t.split, t.template_seen) == (family, FAMILY_LEVEL[family],
                                                                               f"{family}/2", "train", True)
        assert set(t.entities) <= train_entities and not env.leaks_heldout(t)
        assert env.verify_task(t)
    records = [t.to_dict() for t in tasks]
    assert env.check_task_records(records, "generated").success
    # the cross-split rules of the build (ids, held-out entities and wordings) hold with them in the training split
    assert check_splits({**splits, "train": splits["train"] + records}).success
    # same seed, same tasks; another seed, other tasks
    assert [t.to_dict() for t in env.generate_tasks(weakness, 6, seed=5)] == records
    assert [t.question for t in env.generate_tasks(weakness, 6, seed=6)] != [t.question for t in tasks]


def test_shop_generation_by_level_and_refusals(shop):
    env, _ = shop
    tasks = env.generate_tasks({"level": 2}, 30, seed=1)
    assert {t.family for t in tasks} == {"lookup_calc", "lookup_convert", "search_lookup"}
    ids = {int(t.template_id.split("/")[1]) for t in tasks}  # the default: the wording grammar
    assert ids & {0, 1, 2, 3} and max(ids) >= 9 and 4 not in ids  # fixed training wordings and grammar frames

    def template_ids(options):
        return {int(t.template_id.split("/")[1]) for t in env.generate_tasks({"level": 2}, 30, 1, options)}

    assert template_ids(ShopOptions(wordings="templates")) == {0, 1, 2, 3}  # the four training wordings
    assert template_ids(ShopOptions(wordings="templates", train_wordings=1)) == {0}
    with pytest.raises(ValueError, match="held out of training"):
        env.generate_tasks({"template_id": "lookup/4"}, 2, seed=0)
    with pytest.raises(ValueError, match="not one of family"):
        env.generate_tasks({"family": "update", "template_id": "lookup/1"}, 2, seed=0)
    with pytest.raises(ValueError, match="of level 1, not 3"):
        env.generate_tasks({"family": "lookup", "level": 3}, 2, seed=0)


# ---------------------------------------------------------------------------------------------- the sql hook
@pytest.fixture(scope="module")
def sql_world(tmp_path_factory):
    from pipeline.envs.sql import SqlAnalyst, SqlOptions

    out = tmp_path_factory.mktemp("sqlgen")
    built = SqlAnalyst.build(out, BuildRequest(0, {"train": 40, "validation": 16, "test": 20}, {1: 1, 2: 1, 3: 1, 4: 1},
                                               SqlOptions(n_customers=200, n_products=96, n_orders=1500)))
    env = SqlAnalyst.load(out)
    yield env, {s: [t.to_dict() for t in ts] for s, ts in built.tasks.items()}
    env.close()


@pytest.mark.slow
def test_sql_generates_training_tasks_of_the_weak_wording_that_pass_the_suites(sql_world):
    from pipeline.envs.sql.suites import check_splits
    from pipeline.envs.sql.tasks import FAMILIES as SQL_FAMILIES

    env, splits = sql_world
    generated = []
    for fam in SQL_FAMILIES:
        tasks = env.generate_tasks({"family": fam.name, "level": fam.level, "template_id": f"{fam.name}/3"}, 3, 9)
        assert len(tasks) == 3, fam.name
        assert env.check_task_records([t.to_dict() for t in tasks], fam.name).success
        for t in tasks:
            assert (t.family, t.level, t.data["template_id"], t.split) == (fam.name, fam.level, f"{fam.name}/3",
                                                                           "train")
            assert not env.leaks_heldout(t) and env.verify_task(t)
            assert all(v in env.meta["partition"][dim]["train"] for dim, v in t.data["heldout"].items())
        generated += tasks
    records = [t.to_dict() for t in generated]
    # the cross-split rules hold with them in the training split (renamed, as the train phase renames them)
    renamed = [{**r, "task_id": f"generated/{i}/{r['task_id']}"} for i, r in enumerate(records)]
    assert check_splits({**splits, "train": splits["train"] + renamed}).success
    assert [t.to_dict() for t in env.generate_tasks({"level": 4}, 5, 3)] == \
        [t.to_dict() for t in env.generate_tasks({"level": 4}, 5, 3)]
    with pytest.raises(ValueError, match="held out of training"):
        env.generate_tasks({"template_id": "max_spend/4"}, 2, 0)
    frame = env.generate_tasks({"template_id": "max_spend/7"}, 2, 0)  # a frame of the wording grammar
    assert len(frame) == 2 and {t.data["template_id"] for t in frame} == {"max_spend/7"}


def test_a_mixed_run_generates_in_the_member_of_the_weak_slice(shop, sql_world):
    from pipeline.envs.mixed import MixedEnvironment, Tagged

    env = MixedEnvironment({"shop": shop[0], "sql": sql_world[0]})
    shop_task = Tagged("shop", shop[0].task_from_dict(shop[1]["train"][0]))
    sql_task = Tagged("sql", sql_world[0].task_from_dict(sql_world[1]["train"][0]))
    assert slice_of(shop_task, "template") == (f"shop/{shop_task.template_id}", {
        "env": "shop", "family": shop_task.family, "level": shop_task.level, "template_id": shop_task.template_id})
    key, weakness = slice_of(sql_task, "family")
    assert (key, weakness) == (f"sql/{sql_task.family}", {"env": "sql", "family": sql_task.family,
                                                          "level": sql_task.level})
    got = env.generate_tasks(weakness, 3, seed=4)
    assert [(t.env, t.family) for t in got] == [("sql", sql_task.family)] * 3
    pool = [Tagged("sql", sql_world[0].task_from_dict(r)) for r in sql_world[1]["train"]]
    ok, counts = check_generated(got, env, pool, "mixed")
    assert len(ok) == 3 and not any(counts.values())
    moved = renamed(ok[0], f"generated/r1-0/{ok[0].task.task_id}")
    assert moved.task_id == f"sql/generated/r1-0/{ok[0].task.task_id}"
    assert env.task_from_dict(moved.to_dict()) == moved  # what a resumed run reads back from the checkpoint
    with pytest.raises(ValueError, match="names its environment"):
        env.generate_tasks({"family": "lookup"}, 1, 0)


# ------------------------------------------------------------------------------------------ the train side's checks
def test_check_generated_refuses_each_kind_of_bad_task(shop):
    env, splits = shop
    pool = [env.task_from_dict(r) for r in splits["train"]]
    good = env.generate_tasks({"family": "lookup_calc"}, 3, seed=11)
    heldout = env.task_from_dict({**splits["validation"][0], "task_id": "v", "split": "train"})
    unseen = dataclasses.replace(good[1], task_id="u", template_seen=False)
    duplicate = dataclasses.replace(pool[0], task_id="d")
    wrong = dataclasses.replace(good[2], task_id="w", answer=str(float(good[2].answer) + 7))
    used, counts = check_generated([good[0], heldout, unseen, duplicate, wrong, good[1]], env, pool, "t")
    assert [t.task_id for t in used] == [good[0].task_id, good[1].task_id]
    assert counts == {"refused_schema": 0, "refused_heldout_entities": 1, "refused_heldout_templates": 1,
                      "refused_duplicates": 1, "refused_unverifiable": 1}
    # a record that breaks the 'tasks' suite refuses the whole round
    bad = dataclasses.replace(good[0], task_id="b", min_calls=0)
    used, counts = check_generated([good[0], bad], env, pool, "t")
    assert used == [] and counts["refused_schema"] == 2
    assert set(counts) == set(REFUSALS)


def test_mix_in_gives_the_last_share_of_a_plan_to_the_least_played_newest_generated_tasks(shop):
    from types import SimpleNamespace

    env, splits = shop
    gen = TaskGenerator(TaskGenerationConfig(enabled=True, share=0.5), 0, env)
    loop = SimpleNamespace(tasks_by_level={}, tasks_by_id={})
    made = env.generate_tasks({"family": "lookup"}, 2, seed=1) + env.generate_tasks({"family": "update"}, 1, seed=2)
    for t in made:  # levels 1, 1, 3
        gen.add(loop, dataclasses.replace(t, task_id=f"generated/{t.task_id}"))
    plan = [env.task_from_dict(r) for r in splits["train"][:4]]
    ids = lambda tasks: [t.task_id for t in tasks]  # noqa: E731
    # all unplayed: newest first (the update task, then the second lookup) replace the last two of four
    assert ids(gen.mix_in(plan, [1, 2, 3], loop.tasks_by_id)) == ids(plan[:2]) + [
        "generated/gen-2-000000", "generated/gen-1-000001"]
    # then the one not played yet, then the newest of those played once
    assert ids(gen.mix_in(plan, [1, 2, 3], loop.tasks_by_id))[2:] == ["generated/gen-1-000000",
                                                                      "generated/gen-2-000000"]
    # closed levels are left out: level 1 only
    assert ids(gen.mix_in(plan, [1], loop.tasks_by_id))[2:] == ["generated/gen-1-000001", "generated/gen-1-000000"]
    assert gen.mixed_in == 2 and gen.plays == {"generated/gen-2-000000": 2, "generated/gen-1-000001": 2,
                                               "generated/gen-1-000000": 2}
    # a checkpoint's state puts the same tasks back into another pool and plans the same next
    again, loop2 = TaskGenerator(gen.cfg, 0, env), SimpleNamespace(tasks_by_level={}, tasks_by_id={})
    again.load_state_dict(gen.state_dict(), loop2)
    assert list(loop2.tasks_by_id) == list(loop.tasks_by_id) and again.state_dict() == gen.state_dict()
    assert ids(again.mix_in(plan, [1, 3], loop2.tasks_by_id)) == ids(gen.mix_in(plan, [1, 3], loop.tasks_by_id))


def test_an_environment_without_the_hook_is_refused_at_the_start(shop):
    from pipeline.envs.contract import Environment

    no_hook = type("NoHook", (ShopWorld,), {"name": "nohook", "generate_tasks": Environment.generate_tasks})
    world = no_hook(shop[0].world)
    with pytest.raises(AgentRLError, match="environment 'nohook' cannot generate tasks"):
        TaskGenerator(TaskGenerationConfig(enabled=True), 0, world)
    world.close()


# ----------------------------------------------------------------------------------------- a tiny training run
GEN = {"enabled": "true", "every": 1, "tasks": 4, "slices": 2, "min_episodes": 1, "min_success": 1.0, "share": 0.5}
TINY = """
env:
  max_steps: 3
rollout:
  max_new_tokens: 10
  batch_size: 8
train:
  updates: {updates}
  tasks_per_update: 2
  group_size: 2
  num_ranks: 1
  checkpoint_every: 2
  eval_every: 2
  eval_tasks: 4
  test_tasks: 4
  lr: 0.01
  deepspeed_config: {repo}/configs/deepspeed_zero2.json
{extra}"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build
    from pipeline.envs.config import EnvConfig
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy, save_policy
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer

    root = tmp_path_factory.mktemp("taskgen")
    cfg = BuildEnvConfig(options={"n_products": 40, "n_suppliers": 10},
                         tasks_per_split={"train": 24, "validation": 8, "test": 8})
    build(cfg, EnvConfig(), root / "data", root / "metrics" / "build_env.json")
    world = ShopWorld.load(root / "data" / "env")
    sigs = [s.signature() for s in world.tools()]
    world.close()
    tok = train_tokenizer(corpus_texts(root / "data", sigs), vocab_size=400)
    torch.manual_seed(0)
    model = build_policy(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_positions=512, seed=0), tok)
    save_policy(model, tok, root / "models" / "adapted", {"note": "tiny random test policy"})
    return root


def _params(root: Path, name: str, updates: int, gen: dict | None) -> str:
    extra = "" if gen is None else "  task_generation:\n" + "".join(f"    {k}: {v}\n" for k, v in gen.items())
    (root / name).write_text(TINY.format(updates=updates, repo=REPO, extra=extra))
    return name


def _client_state(ckpt: Path) -> dict:
    (latest,) = ckpt.glob("*/latest")
    tag = latest.read_text().strip()
    (states,) = latest.parent.joinpath(tag).glob("mp_rank_00_model_states.pt")
    return torch.load(states, map_location="cpu", weights_only=False)


@pytest.mark.slow
def test_a_training_run_with_task_generation_adds_weak_spot_tasks_to_the_pool_and_samples_them(project,
                                                                                                 monkeypatch):
    from pipeline.train.worker import run_worker

    monkeypatch.chdir(project)
    params = _params(project, "params-gen.yaml", 4, GEN)
    result = run_worker(params, ckpt="ckpt-gen", out="models/policy-gen", metrics_path="metrics/gen.json",
                        curve_path="metrics/gen.csv")
    assert result["completed"]
    hist = result["history"]
    # every update is a round (every: 1); the tiny random policy fails everything, so every slice seen is weak
    assert all(h["taskgen/weak_slices"] >= 1 and h["taskgen/weakest_success"] < 1.0 for h in hist)
    assert all(h["taskgen/generated"] == h["taskgen/accepted"] + h["taskgen/refused"] for h in hist)
    assert hist[0]["taskgen/accepted"] > 0
    accepted = [h["taskgen/accepted"] for h in hist]
    assert [h["taskgen/pool_generated"] for h in hist] == list(itertools.accumulate(accepted))
    assert any(k.startswith("taskgen/target/") for k in hist[0])
    # the checkpoint carries the generated tasks, and the goal sampler has drawn some of them
    client = _client_state(project / "ckpt-gen")
    state = client["extensions"]["task_generation"]  # the extension's state under its name
    assert len(state["accepted"]) == hist[-1]["taskgen/pool_generated"] and state["round"] == 4
    assert all(re.fullmatch(r"generated/r\d-[01]/gen-\d+-\d{6}", r["task_id"]) and r["split"] == "train"
               for r in state["accepted"])
    # one of the two tasks of every update after the first round is a generated one (share 0.5), least played first
    assert [h["taskgen/mixed_in"] for h in hist] == [0, 1, 1, 1]
    assert sum(state["plays"].values()) == 3 and max(state["plays"].values()) == 1

    # with the switch off (the default), nothing is generated and nothing is reported
    off = run_worker(_params(project, "params-off.yaml", 1, None), ckpt="ckpt-off", out="models/policy-off",
                     metrics_path="metrics/off.json", curve_path="metrics/off.csv", stop_after=1)
    assert not any(k.startswith("taskgen/") for k in off["history"][0])


@pytest.mark.slow
def test_a_resumed_run_with_task_generation_continues_identically(project, monkeypatch):
    from pipeline.train.worker import run_worker

    monkeypatch.chdir(project)
    params = _params(project, "params-resume.yaml", 4, {**GEN, "every": 2})
    straight = run_worker(params, ckpt="ckpt-straight", out="models/policy-straight",
                          metrics_path="metrics/straight.json", curve_path="metrics/straight.csv")
    first = run_worker(params, ckpt="ckpt-resumed", out="models/policy-resumed", metrics_path="metrics/resumed.json",
                       curve_path="metrics/resumed.csv", stop_after=2)
    assert not first["completed"] and first["history"][-1]["taskgen/pool_generated"] > 0
    resumed = run_worker(params, ckpt="ckpt-resumed", out="models/policy-resumed",
                         metrics_path="metrics/resumed.json", curve_path="metrics/resumed.csv")
    keys = ("rollout/success", "rollout/return", "taskgen/accepted", "taskgen/pool_generated", "losses/total")
    assert [[h.get(k) for k in keys] for h in resumed["history"]] == \
        [[h.get(k) for k in keys] for h in straight["history"]]
    assert _client_state(project / "ckpt-resumed")["sampler"]["goals"] == \
        _client_state(project / "ckpt-straight")["sampler"]["goals"]
