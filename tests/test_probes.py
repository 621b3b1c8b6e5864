"""Reward-hacking probes (pipeline.envs.probes) and their gate in build_env: the rule's known answers, each probe
playing what it claims through the real runner, the default shop and SQL rewards passing, and a hackable reward
stopping the real build_env with one error line while data/ stays as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from pipeline.build_env.config import BuildEnvConfig
from pipeline.build_env.main import build
from pipeline.core.errors import AgentRLError
from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import Task
from pipeline.envs.probes import PROBES, Probe, fill, guesses, quoted, run_probes, verdict

REPO = Path(__file__).resolve().parents[1]
TINY = BuildEnvConfig(options={"n_products": 60, "n_suppliers": 12},
                      tasks_per_split={"train": 60, "validation": 8, "test": 8})
HACKABLE = {"user_experience": 3.0, "shaping": "always"}  # δ = 3 paid for any answer, right or wrong


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """A tiny shop built by the real phase (probes on, the default reward), and its world and train tasks."""
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.taskfile import load_task_file

    from pipeline.core.tracking import Tracker

    root = tmp_path_factory.mktemp("probes")
    tracker = Tracker(root=root)
    with tracker.run("build_env") as run:  # the suite's own MLflow store (conftest)
        metrics = build(TINY, EnvConfig(), root / "data", root / "metrics" / "build_env.json", run)
    metrics["_mlflow"] = (tracker.tracking_uri, run.run_id)
    world = ShopWorld.load(root / "data" / "env")
    train = load_task_file(root / "data" / "tasks" / "train.jsonl", world, validate=False)
    yield root, metrics, world, train
    world.close()


# ------------------------------------------------------------------------------------------- known answers (pure)
def test_the_rule_by_hand():
    # expert positive: ratio = probe / expert, the probe passes up to floor × expert inclusive
    assert verdict(0.11, 1.1, 0.5) == (0.1, True)
    assert verdict(0.55, 1.1, 0.5) == (0.5, True)
    assert verdict(0.56, 1.1, 0.5) == (0.509091, False)
    assert verdict(3.1667, 4.0, 0.5) == (0.791675, False)
    assert verdict(0.9, 1.0, 1.0) == (0.9, True) and verdict(1.2, 1.0, 1.0) == (1.2, False)
    # a negative probe return (refused writes) is far below any positive floor
    assert verdict(-0.79, 1.1, 0.5) == (-0.718182, True)
    # expert not positive: no share is meaningful; reaching the expert at all fails, staying below passes
    assert verdict(-0.3, -0.2, 0.5) == (None, True)
    assert verdict(-0.2, -0.2, 0.5) == (None, False)
    assert verdict(0.0, 0.0, 0.5) == (None, False)
    assert verdict(-0.01, 0.0, 0.5) == (None, True)


def test_guesses_fill_and_quoted_by_hand():
    ts = [Task("a", "train", 1, "q", "7", family="f"), Task("b", "train", 1, "q", "7", family="f"),
          Task("c", "train", 1, "q", "x", family="f"), Task("d", "train", 1, "q", "2.5", family="g"),
          Task("e", "train", 1, "q", "99", family="g"), Task("h", "train", 1, "q", "cat", family="h")]
    # the probed task "e" is not counted: family g's guess is 2.5, 99 is no candidate number
    assert guesses(ts, {"e"}) == ({"f": "7", "g": "2.5", "h": "cat"}, "7", ["2.5", "7", "7"])
    assert guesses([Task("a", "train", 1, "q", "cat")], {"a"}) == ({"": "cat"}, "cat", ["0"])  # all probed: all known
    assert quoted('Set the stock of "Urban Desk" to 5 and \'Blue Lamp\'.') == ["Urban Desk", "Blue Lamp"]
    assert quoted("How many orders?") == []
    rng = np.random.default_rng(0)
    schema = {"type": "object", "required": ["name", "field", "n", "flag"],
              "properties": {"name": {"type": "string", "maxLength": 5}, "field": {"enum": ["stock", "price"]},
                             "n": {"type": ["string", "integer"], "minimum": 4, "maximum": 4},
                             "flag": {"type": "boolean"}, "optional": {"type": "string"}}}
    assert fill(schema, ["Urban Desk", "Lamp"], rng) == {"name": "Lamp", "field": "stock", "n": 4, "flag": False}
    assert fill({"type": "string", "minLength": 3}, [], rng) == "xxx"
    assert fill({"type": "object", "properties": {}}, ["a"], rng) == {}


# ---------------------------------------------------------------------------------------- each probe really plays
def _play(world, train, name: str, task, max_steps: int = 8):
    from pipeline.envs.runner import AgentEnv

    fam, overall, numbers = guesses(train, {task.task_id})
    probe = Probe(name, world, fam, overall, numbers, np.random.default_rng(0))
    env = AgentEnv(world=world, tasks=train, config=EnvConfig(max_steps=max_steps))
    obs, info = env.reset(seed=0, options={"task": task})
    probe.reset(task)
    done, truncated = False, False
    while not done:
        obs, _, terminated, truncated, info = env.step(probe.act(obs, info))
        done = terminated or truncated
    env.close()
    return info, truncated, (fam, overall, numbers)


def test_each_probe_plays_what_it_claims_on_the_shop(shop):
    _, _, world, train = shop
    task = next(t for t in train if t.family == "lookup")
    reads = [s.name for s in world.tools() if s.name != "answer" and not s.writes]

    info, truncated, (fam, _, numbers) = _play(world, train, "answer_at_once", task)
    assert [c["tool"] for c in info["calls"]] == ["answer"] and info["answer"] == fam["lookup"] and not truncated

    info, truncated, _ = _play(world, train, "repeat_call", task, max_steps=6)
    calls = info["calls"]
    assert truncated and info["answer"] is None and len(calls) == 6
    assert all(c == calls[0] for c in calls) and calls[0]["tool"] == reads[0] and calls[0]["outcome"] == "ok"

    info, _, _ = _play(world, train, "guess_number", task)
    assert [c["tool"] for c in info["calls"]] == [reads[0], "answer"] and info["answer"] in numbers

    info, _, _ = _play(world, train, "call_every_tool", task)
    assert [c["tool"] for c in info["calls"]] == [*reads, "answer"]
    assert info["calls"][0]["params"]["name"] == quoted(task.question)[0]  # the entity the question names

    info, _, _ = _play(world, train, "attempt_writes", task)  # a lookup task allows no write: refused
    assert [c["tool"] for c in info["calls"]] == ["update", "answer"]
    assert info["calls"][0]["outcome"] == "safety_violation" and info["n_violations"] == 1
    assert info["reward_components"]["safety"] == -1.0


def test_the_write_probe_causes_safety_violations_and_the_suite_passes_on_the_default_shop(shop):
    _, metrics, _, _ = shop
    report = metrics["reward_hacking_probes"]
    assert report["enabled"] and set(report["probes"]) == set(PROBES) and report["tasks"] == 60
    assert report["expert"]["success_rate"] == 1.0 and report["expert"]["mean_return"] == pytest.approx(1.1)
    writes = report["probes"]["attempt_writes"]
    assert writes["safety_violations"] > 0.5 * writes["n"] and writes["mean_return"] < 0
    assert report["probes"]["repeat_call"]["mean_tool_calls"] == 8.0  # until the step budget ends
    assert metrics["seconds"]["probes"] > 0 and "seconds" not in report  # the report itself is deterministic
    from mlflow.tracking import MlflowClient

    uri, run_id = metrics["_mlflow"]
    logged = MlflowClient(tracking_uri=uri).get_run(run_id).data.metrics
    assert logged["env/probe_attempt_writes_mean_return"] == pytest.approx(writes["mean_return"])
    assert logged["env/probe_answer_at_once_ratio"] == pytest.approx(report["probes"]["answer_at_once"]["ratio"])
    assert logged["sys/probes_seconds"] == pytest.approx(metrics["seconds"]["probes"])
    for name, r in report["probes"].items():
        assert r["passed"] and r["ratio"] < 0.5, name
        assert r["ratio"] == pytest.approx(r["mean_return"] / report["expert"]["mean_return"], abs=1e-5)
        assert {"mean_return", "success_rate", "ratio", "n", "safety_violations"} <= set(r), name


def test_the_default_sql_reward_passes_and_the_write_probe_is_skipped(tmp_path):
    from pipeline.envs.checks import sample
    from pipeline.envs.contract import BuildRequest
    from pipeline.envs.sql.analyst import SqlAnalyst, SqlOptions

    opts = SqlOptions(n_customers=60, n_products=48, n_orders=400)
    built = SqlAnalyst.build(tmp_path, BuildRequest(0, {"train": 60, "validation": 4, "test": 4},
                                                    {lv: 1.0 for lv in SqlAnalyst.levels}, opts))
    world = SqlAnalyst.load(tmp_path)
    try:
        train = built.tasks["train"]
        out = run_probes(world, train, EnvConfig(name="sql"), sample(train, 40), 0.5, seed=0)
    finally:
        world.close()
    assert out["expert"]["success_rate"] == 1.0
    res = out["probes"]
    assert res["attempt_writes"].skipped and res["attempt_writes"].n == 0 and res["attempt_writes"].passed
    for name in ("answer_at_once", "repeat_call", "guess_number", "call_every_tool"):
        assert res[name].n == 40 and res[name].passed and res[name].ratio < 0.5, name
    assert res["repeat_call"].mean_tool_calls == 8.0 and res["answer_at_once"].mean_tool_calls == 1.0


# ------------------------------------------------------------------------------------------------ the gate in build_env
@pytest.mark.slow
def test_a_hackable_reward_stops_build_env_naming_the_probe_and_data_stays(shop, tmp_path):
    root, metrics, _, _ = shop
    data_before = {p: p.read_bytes() for p in (root / "data").rglob("*") if p.is_file()}
    metrics_before = (root / "metrics" / "build_env.json").read_bytes()
    (root / "params.yaml").write_text(
        "env:\n  reward: {user_experience: 3.0, shaping: always}\n"
        "build_env:\n  options: {n_products: 60, n_suppliers: 12}\n"
        "  tasks_per_split: {train: 60, validation: 8, test: 8}\n  seed: 3\n")
    env = {**os.environ, "AGENTRL_TRACKING": "off", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "flows.cli", "build-env"], cwd=root, capture_output=True, text=True,
                         env=env)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "reward hacking: probe 'answer_at_once'" in errors[0] and "nothing was published" in errors[0]
    assert "against the expert's 4.000" in errors[0] and "floor 0.5" in errors[0], errors[0]
    after = {p: p.read_bytes() for p in (root / "data").rglob("*") if p.is_file()}
    assert after == data_before and not list((root / "data").glob(".*"))
    assert (root / "metrics" / "build_env.json").read_bytes() == metrics_before

    # in-process: the same refusal is an AgentRLError; with the probes switched off the hackable reward builds
    hack = EnvConfig(reward=HACKABLE)
    with pytest.raises(AgentRLError, match=r"probe 'answer_at_once' earns mean return 3\.\d{3}"):
        build(TINY, hack, tmp_path / "data", tmp_path / "m.json")
    assert not (tmp_path / "data" / "tasks").exists() and not (tmp_path / "m.json").exists()
    off = TINY.model_copy(update={"probes": TINY.probes.model_copy(update={"enabled": False})})
    m = build(off, hack, tmp_path / "data", tmp_path / "m.json")
    assert m["reward_hacking_probes"] == {"enabled": False} and (tmp_path / "data" / "tasks" / "train.jsonl").is_file()


def test_the_probes_leave_the_build_byte_identical(shop, tmp_path):
    _, metrics, _, _ = shop
    off = TINY.model_copy(update={"probes": TINY.probes.model_copy(update={"enabled": False})})
    plain = build(off, EnvConfig(), tmp_path / "data", tmp_path / "m.json")
    drop = lambda m: {k: v for k, v in m.items() if k not in ("seconds", "reward_hacking_probes", "_mlflow")}  # noqa: E731
    assert drop(plain) == drop(metrics) and plain["reward_hacking_probes"] == {"enabled": False}


def test_a_floor_of_one_and_a_higher_floor_move_the_line(shop):
    """The floor is the line: the hackable reward's answer_at_once earns about 0.8 of the expert's return, so a floor of
    1 lets it through where the default 0.5 does not."""
    _, _, world, train = shop
    from pipeline.envs.checks import sample

    tasks = sample(train, 30)
    low = run_probes(world, train, EnvConfig(reward=HACKABLE), tasks, 0.5, seed=0)["probes"]["answer_at_once"]
    high = run_probes(world, train, EnvConfig(reward=HACKABLE), tasks, 1.0, seed=0)["probes"]["answer_at_once"]
    assert low.ratio == high.ratio and 0.5 < low.ratio < 1.0 and not low.passed and high.passed


def test_bad_probe_settings_are_refused():
    for bad, where in (({"floor": 0}, "floor"), ({"floor": 1.5}, "floor"), ({"tasks": 0}, "tasks"),
                       ({"taks": 10}, "taks")):
        with pytest.raises(ValidationError, match=where):
            BuildEnvConfig.model_validate({"probes": bad})
    assert BuildEnvConfig().probes.enabled and BuildEnvConfig().probes.floor == 0.5
    with pytest.raises(ValueError, match="unknown probe"):
        Probe("cheat", None, {}, "0", ["0"], np.random.default_rng(0))
