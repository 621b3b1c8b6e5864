"""Mixed runs: several environments as one (pipeline.envs.mixed), on the built-in shop and SQL analyst.

Every task carries its environment, each episode sees only its environment's tools, every summary reports per
environment, the drift check tests each environment's tasks on their own, and the gate refuses a challenger that is
worse on one environment even when it is better overall.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.envs.config import EnvConfig
from pipeline.envs.mixed import Tagged, interleave, shares
from pipeline.envs.registry import EnvironmentError_, environment_class, open_environment
from pipeline.envs.runner import AgentEnv
from pipeline.envs.taskfile import load_task_file
from pipeline.policy.episodes import evaluate

MIX = {"shop": 1.0, "sql": 1.0}
ENV = EnvConfig(name=MIX, max_steps=8)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A mixed project built by the build_env phase with small worlds."""
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build

    root = tmp_path_factory.mktemp("mixed")
    cfg = BuildEnvConfig(tasks_per_split={"train": 60, "validation": 20, "test": 20},
                         options={"shop": {"n_products": 60, "n_suppliers": 15},
                                  "sql": {"n_customers": 100, "n_products": 64, "n_orders": 600}},
                         demos={"level_coverage": {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}})
    build(cfg, ENV, root / "data", root / "metrics" / "build_env.json")
    return root


def test_shares_split_by_weight_and_give_everyone_one():
    assert shares(10, {"a": 1, "b": 1}) == {"a": 5, "b": 5}
    assert shares(3, {"a": 100, "b": 1}) == {"a": 2, "b": 1}
    assert sum(shares(401, {"a": 2, "b": 1, "c": 1}).values()) == 401


def test_mixed_class_needs_two_environments_with_positive_weights():
    with pytest.raises(EnvironmentError_, match="at least two"):
        environment_class({"shop": 1})
    with pytest.raises(EnvironmentError_, match="positive"):
        environment_class({"shop": 1, "sql": 0})
    with pytest.raises(EnvironmentError_, match="unknown environment 'nope'"):
        environment_class({"shop": 1, "nope": 1})


def test_every_task_carries_its_environment_and_ids_stay_unique(built):
    metrics = json.loads((built / "metrics" / "build_env.json").read_text())
    assert metrics["environment"] == "mixed" and metrics["baselines"]["test/expert"]["success_rate"] == 1.0
    assert (built / "data" / "env" / "shop" / "world.sqlite").is_file()
    assert (built / "data" / "env" / "sql" / "world.sqlite").is_file()
    ids = []
    for split in ("train", "validation", "test"):
        rows = [json.loads(line) for line in (built / "data" / "tasks" / f"{split}.jsonl").read_text().splitlines()]
        assert {r["env"] for r in rows} == {"shop", "sql"}
        assert all(r["task_id"].startswith(r["env"] + "/") for r in rows)
        assert sum(r["env"] == "shop" for r in rows) == len(rows) // 2  # equal weights
        first = [r["env"] for r in rows[:4]]
        assert set(first) == {"shop", "sql"}  # interleaved: the first few hold both
        ids += [r["task_id"] for r in rows]
    assert len(ids) == len(set(ids))


def test_interleave_keeps_each_environments_order():
    class T:  # noqa: D401 - a minimal task
        def __init__(self, i):
            self.task_id = str(i)

    tasks = [Tagged("a", T(i)) for i in range(4)] + [Tagged("b", T(i)) for i in range(2)]
    out = interleave(tasks)
    assert [t.task_id for t in out if t.env == "a"] == ["a/0", "a/1", "a/2", "a/3"]
    assert [t.env for t in out][:3] == ["a", "b", "a"]


def test_each_episode_sees_only_its_environments_tools(built):
    world = open_environment(MIX, built / "data" / "env")
    try:
        tasks = load_task_file(built / "data" / "tasks" / "test.jsonl", world)
        shop_task = next(t for t in tasks if t.env == "shop")
        sql_task = next(t for t in tasks if t.env == "sql")
        env = AgentEnv(world=world, tasks=[shop_task], config=ENV)
        obs, _ = env.reset(seed=0, options={"task": shop_task})
        assert "lookup(" in obs["context"] and "query(" not in obs["context"]
        _, _, _, _, info = env.step('<call>query {"sql": "SELECT 1"}</call>')
        assert info["outcome"] == "invalid_action" and "unknown tool 'query'" in info["tool_result"]
        assert info["env"] == "shop"
        obs, _ = env.reset(seed=0, options={"task": sql_task})
        assert "query(" in obs["context"] and "lookup(" not in obs["context"]
        env.close()
    finally:
        world.close()


def test_summaries_report_per_environment(built):
    world = open_environment(MIX, built / "data" / "env")
    try:
        tasks = load_task_file(built / "data" / "tasks" / "test.jsonl", world)
        summary, records = evaluate("expert", tasks, world, ENV)
    finally:
        world.close()
    assert {r["env"] for r in records} == {"shop", "sql"}
    per_env = summary["per_env"]
    assert set(per_env) == {"shop", "sql"}
    assert per_env["shop"]["n"] + per_env["sql"]["n"] == summary["overall"]["n"] == len(tasks)
    assert per_env["shop"]["success_rate"] == per_env["sql"]["success_rate"] == 1.0
    assert set(per_env["sql"]["per_level"]) <= {"1", "2", "3", "4"}


def test_drift_check_tests_each_environment(built):
    from pipeline.check_drift.config import DriftConfig
    from pipeline.check_drift.main import run_checks

    world = open_environment(MIX, built / "data" / "env")
    try:
        opts = type(world).Options.model_validate({})
        ref = [t.to_dict() for t in world.sample_tasks("validation", 120, {1: 1, 2: 1, 3: 1, 4: 1}, 11, opts)]
        cur = [t.to_dict() for t in world.sample_tasks("validation", 120, {1: 1, 2: 1, 3: 1, 4: 1}, 12, opts)]
        verdict = run_checks(DriftConfig(false_alarm_repeats=0), ENV, {1: 1, 2: 1, 3: 1, 4: 1}, opts, ref, cur,
                             world, world)
    finally:
        world.close()
    per_env = verdict["checks"]["task_drift_per_env"]
    assert set(per_env["environments"]) == {"shop", "sql"} and per_env["status"] == "pass"


def _results(env: str, n: int, successes: int) -> list[dict]:
    return [{"task_id": f"{env}/test-{i:04d}", "seed": i, "success": i < successes, "n_violations": 0}
            for i in range(n)]


def test_gate_refuses_a_challenger_worse_on_one_environment_though_better_overall():
    from pipeline.deploy.config import DeployGateConfig
    from pipeline.deploy.gate import GateInputs, decide

    cfg = DeployGateConfig(require_capability_gate=False, require_drift_pass=False, require_consistency_pass=False,
                           min_paired_tasks=10)
    champion = _results("shop", 40, 40) + _results("sql", 40, 20)
    challenger = _results("shop", 40, 25) + _results("sql", 40, 40)  # 65 vs 60 overall; shop down 15 tasks
    inputs = GateInputs(adapt={}, quantization={"parity": {}, "safety_violations_per_episode": 0.0},
                        drift={}, test_results=challenger)
    decision = decide("2", inputs, "1", champion, cfg)
    checks = {c.name: c for c in decision.checks}
    assert checks["vs_champion"].passed  # not worse overall
    assert not checks["vs_champion_per_env"].passed and "shop" in checks["vs_champion_per_env"].detail
    assert "vs_champion_per_env" in decision.failed
    # the same challenger without the shop regression passes the per-environment check
    better = _results("shop", 40, 40) + _results("sql", 40, 40)
    decision = decide("3", GateInputs(adapt={}, quantization=inputs.quantization, drift={}, test_results=better),
                      "1", champion, cfg)
    assert {c.name: c for c in decision.checks}["vs_champion_per_env"].passed


def test_params_name_a_mix_in_yaml(tmp_path):
    from pipeline.core.config import load_section

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"env": {"name": {"shop": 2, "sql": 1}}}))
    cfg = load_section(EnvConfig, "env", tmp_path / "params.yaml")
    cls = environment_class(cfg.name)
    assert cls.weights == {"shop": 2.0, "sql": 1.0} and cls.levels == (1, 2, 3, 4)
