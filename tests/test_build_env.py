"""The build_env phase: outputs, validation at the boundary, atomic publish, demonstration flaws, and bad input at
the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.envs.config import EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.core.errors import AgentRLError
from pipeline.build_env.main import build, validate_outputs

TINY = BuildEnvConfig(options={"n_products": 60, "n_suppliers": 12},
                      tasks_per_split={"train": 80, "validation": 24, "test": 24},
                      demos={"level_coverage": {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.5}})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    metrics = build(TINY, EnvConfig(), root / "data", root / "metrics" / "build_env.json")
    return root, metrics


def test_outputs_metrics_and_baselines(built):
    root, metrics = built
    for rel in ("env/world.sqlite", "env/corpus.jsonl", "env/entities.json", "tasks/train.jsonl",
                "tasks/validation.jsonl", "tasks/test.jsonl", "demos/train.jsonl"):
        assert (root / "data" / rel).is_file(), rel
    on_disk = json.loads((root / "metrics" / "build_env.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert metrics["counts"]["tasks_train"] == 80 and metrics["validation"]["expectations_failed"] == 0
    assert metrics["environment"] == "shop" and metrics["counts"]["products"] == 60
    for split in ("train", "validation", "test"):
        assert metrics["baselines"][f"{split}/expert"]["success_rate"] == 1.0
        assert metrics["baselines"][f"{split}/random"]["success_rate"] < 0.05
    assert set(metrics["checksums"]) >= {"data/tasks/train.jsonl", "data/env/world.sqlite"}
    assert not list((root / "data").glob(".staging*"))


def test_same_seed_gives_identical_data(built, tmp_path):
    root, metrics = built
    again = build(TINY, EnvConfig(), tmp_path / "data", tmp_path / "m.json")
    assert again["checksums"] == metrics["checksums"]


def test_train_wordings_reach_train_and_validation_through_the_phase_and_leave_test_alone(built, tmp_path):
    root, _ = built
    wide = TINY.model_copy(update={"options": {**TINY.options, "train_wordings": 8}})
    build(wide, EnvConfig(), tmp_path / "data", tmp_path / "m.json")  # validates the data at the boundary (GX)

    def rows(base, split):
        return [json.loads(line) for line in (base / f"data/tasks/{split}.jsonl").read_text().splitlines()]

    used = {int(r["template_id"].split("/")[1]) for split in ("train", "validation") for r in rows(tmp_path, split)}
    assert used & {5, 6, 7, 8} and 4 not in used  # the extra wordings are drawn, the held-out one never
    assert (tmp_path / "data/tasks/test.jsonl").read_bytes() == (root / "data/tasks/test.jsonl").read_bytes()


@pytest.mark.slow
def test_data_failing_validation_stops_the_phase_and_keeps_the_previous_outputs(built, tmp_path):
    root, _ = built
    first = build(TINY, EnvConfig(), tmp_path / "data", tmp_path / "metrics.json")
    before = {p: p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file()}

    def corrupting_validator(stage: Path, world):
        path = stage / "tasks" / "test.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[3]["level"] = 9
        rows[5]["answer"] = ""
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return validate_outputs(stage, world)

    other = TINY.model_copy(update={"seed": 5})
    with pytest.raises(AgentRLError) as err:
        build(other, EnvConfig(), tmp_path / "data", tmp_path / "metrics.json", validator=corrupting_validator)
    msg = str(err.value)
    assert "previous outputs are left untouched" in msg
    assert "test-000003" in msg and "level" in msg and "test-000005" in msg
    after = {p: p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file()}
    assert after == before
    assert json.loads((tmp_path / "metrics.json").read_text())["checksums"] == first["checksums"]


def _agentrl(*args, cwd):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.slow
def test_eval_cli_scores_the_expert_and_refuses_a_corrupt_task_file(built, tmp_path):
    root, _ = built
    (root / "params.yaml").write_text("env:\n  max_steps: 8\n")
    out = _agentrl("eval", "--policy", "expert", "--tasks", "data/tasks/test.jsonl", "--out", str(tmp_path / "e.json"),
                   cwd=root)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "e.json").read_text())
    assert result["overall"]["success_rate"] == 1.0 and set(result["per_level"]) <= {"1", "2", "3", "4"}
    for key in ("mean_return", "mean_correctness", "mean_efficiency", "mean_safety", "mean_user_experience",
                "mean_tool_calls", "safety_violations"):
        assert key in result["overall"]

    bad = tmp_path / "bad.jsonl"
    lines = (root / "data/tasks/test.jsonl").read_text().splitlines()
    bad.write_text(lines[0] + "\n{not json\n")
    out = _agentrl("eval", "--policy", "expert", "--tasks", str(bad), "--out", str(tmp_path / "x.json"), cwd=root)
    assert out.returncode == 2 and f"{bad}:2" in out.stderr and "not valid JSON" in out.stderr
    row = json.loads(lines[0])
    row["family"] = "teleport"
    bad.write_text(json.dumps(row) + "\n")
    out = _agentrl("eval", "--policy", "expert", "--tasks", str(bad), "--out", str(tmp_path / "x.json"), cwd=root)
    assert out.returncode == 2 and "family" in out.stderr and row["task_id"] in out.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_build_env_cli_refuses_bad_params_and_keeps_data(built, tmp_path):
    root, _ = built
    before = (root / "data/tasks/train.jsonl").read_bytes()
    (root / "params.yaml").write_text("env:\n  reward:\n    correctness: -1\n")
    out = _agentrl("build-env", cwd=root)
    assert out.returncode == 2 and "env.reward.correctness" in out.stderr
    (root / "params.yaml").write_text("build_env:\n  options:\n    n_prodcts: 10\n")
    out = _agentrl("build-env", cwd=root)
    assert out.returncode == 2 and "did you mean 'n_products'" in out.stderr, out.stderr
    (root / "params.yaml").write_text("build_env:\n  options:\n    train_wordings: 9\n")
    out = _agentrl("build-env", cwd=root)
    assert out.returncode == 2 and "build_env.options" in out.stderr and "train_wordings" in out.stderr
    assert "less than or equal to 8" in out.stderr, out.stderr
    (root / "params.yaml").write_text("build_env: [1, 2\n")
    out = _agentrl("build-env", cwd=root)
    assert out.returncode == 2 and "line" in out.stderr
    assert (root / "data/tasks/train.jsonl").read_bytes() == before


def test_the_expert_writes_the_demonstrations_text_also_for_tasks_read_back_from_disk(built):
    """Task files are written with sorted keys, so a plan read back has `{"field": ..., "name": ...}`; the expert
    still writes its calls in the tools' signature order, the text of the demonstrations (which were made before the
    tasks were written) and so the tokens the policy learned. Without it, expert-guided RL groups
    (`train.guide_failed_groups`) trained on field-first calls."""
    from pipeline.envs.runner import AgentEnv
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.shop.expert import ExpertPolicy
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.episodes import run_episode

    root, _ = built
    runtime = ShopWorld.load(root / "data" / "env")
    tasks = {t.task_id: t for t in load_task_file(root / "data" / "tasks" / "train.jsonl", runtime, validate=False)}
    demos = [json.loads(line) for line in (root / "data" / "demos" / "train.jsonl").read_text().splitlines()]
    clean = [d for d in demos if d["flaw"] == "none"]
    assert any('"field"' in d["steps"][0]["action"] for d in clean)
    assert any(list(tasks[d["task_id"]].plan[0]["params"]) == ["field", "name"] for d in clean)  # sorted on disk
    try:
        env = AgentEnv(world=runtime, tasks=list(tasks.values()), config=EnvConfig())
        for d in clean[:30]:
            rec = run_episode(env, ExpertPolicy(), tasks[d["task_id"]], seed=0)
            assert [s["action"] for s in rec["steps"]] == [s["action"] for s in d["steps"]]
        env.close()
    finally:
        runtime.close()


def test_flaw_chances_that_add_up_to_more_than_one_are_refused():
    """A demonstration gets one flaw at most (the chances share one draw), so chances summing past 1 would silently
    drop the later flaws: refused, naming the three keys."""
    from pipeline.build_env.config import DemoConfig

    assert DemoConfig(wrong_value_prob=0.5, wrong_order_prob=0.25, redundant_call_prob=0.25)
    with pytest.raises(ValueError, match="wrong_value_prob \\+ wrong_order_prob \\+ redundant_call_prob must be at most 1"):
        DemoConfig(wrong_value_prob=1.0)  # with the default 0.1 + 0.1


def test_family_coverage_overrides_its_level_and_names_only_known_families(built):
    from pipeline.build_env.main import build_demos
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.shop.tasks import FAMILY_LEVEL
    from pipeline.envs.taskfile import load_task_file

    root, _ = built
    runtime = ShopWorld.load(root / "data/env")
    train = load_task_file(root / "data/tasks/train.jsonl", runtime, validate=False)
    full = {"level_coverage": {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}}
    try:
        def demos(**over):
            cfg = TINY.model_copy(update={"demos": TINY.demos.model_validate({**full, **over})})
            return build_demos(train, runtime, cfg, EnvConfig())

        plain = demos()
        families = {t.task_id: t.family for t in train}
        without_update = demos(family_coverage={"update": 0.0})
        assert {families[d["task_id"]] for d in without_update} == {t.family for t in train} - {"update"}
        assert len(without_update) == sum(t.family != "update" for t in train)
        # naming every family with its level's share changes nothing: the same draws, the same bytes
        assert demos(family_coverage={f: 1.0 for f in FAMILY_LEVEL}) == plain
    finally:
        runtime.close()
    # the families are the environment's: a name it does not build is refused when the phase runs, before anything
    # is published
    bad = TINY.model_copy(update={"demos": TINY.demos.model_validate({**full, "family_coverage": {"updates": 0.1}})})
    before = (root / "data/tasks/train.jsonl").read_bytes()
    with pytest.raises(AgentRLError, match=r"family_coverage names task families \['updates'\]"):
        build(bad, EnvConfig(), root / "data", root / "metrics" / "refused.json")
    assert (root / "data/tasks/train.jsonl").read_bytes() == before and not (root / "metrics/refused.json").exists()
    with pytest.raises(ValueError, match=r"family_coverage values must lie in \[0, 1\]"):
        BuildEnvConfig.model_validate({"demos": {"family_coverage": {"update": 1.5}}})


TINY_PARAMS = """\
build_env:
  options: {n_products: 60, n_suppliers: 12}
  tasks_per_split: {train: 80, validation: 24, test: 24}
"""


@pytest.mark.slow
def test_tracking_off_builds_without_mlflow_and_a_bad_switch_stops_first(tmp_path):
    """``AGENTRL_TRACKING=off``: the phase runs and writes its outputs with MLflow not importable, and no store is made;
    a value that is neither on nor off is refused, naming the variable, before anything is written."""
    import os

    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    root = tmp_path / "project"
    root.mkdir()
    (root / "params.yaml").write_text(TINY_PARAMS)
    store = tmp_path / "store" / "mlflow.db"
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{Path(__file__).resolve().parents[1]}",
           "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}

    out = subprocess.run([sys.executable, "-m", "flows.cli", "build-env"], cwd=root, capture_output=True,
                         text=True, env={**env, "AGENTRL_TRACKING": "maybe"})
    assert out.returncode == 2 and "AGENTRL_TRACKING='maybe'" in out.stderr and "'off'" in out.stderr, out.stderr
    assert not (root / "data").exists() and not (root / "metrics").exists()

    out = subprocess.run([sys.executable, "-m", "flows.cli", "build-env"], cwd=root, capture_output=True,
                         text=True, env={**env, "AGENTRL_TRACKING": "off"})
    assert out.returncode == 0, out.stderr
    assert "the build_env run is not tracked" in out.stderr
    metrics = json.loads((root / "metrics/build_env.json").read_text())
    assert metrics["counts"]["tasks_train"] == 80 and (root / "data/tasks/test.jsonl").is_file()
    assert not store.parent.exists() and not (root / "mlflow.db").exists()

    out = subprocess.run([sys.executable, "-m", "flows.cli", "build-env"], cwd=root, capture_output=True,
                         text=True, env=env)  # tracking on, MLflow not importable: a clear error, not a traceback
    assert out.returncode == 2 and "MLflow cannot be imported" in out.stderr and "AGENTRL_TRACKING=off" in out.stderr
    assert "Traceback" not in out.stderr


def test_wrong_value_prob_makes_demonstrations_that_answer_a_wrong_value(built, tmp_path, monkeypatch):
    """`build_env.demos.wrong_value_prob: 1.0` (set in params.yaml, run through the phase): every demonstration carries
    the flaw `wrong_value`: it makes the expert's calls and then answers a wrong value (a number off by 1 to 19, a text
    with a suffix), so it fails; the default (0) makes no such demonstration."""
    from pipeline.build_env.main import main
    from pipeline.envs.protocol import parse_action
    from pipeline.envs.shop.tasks import answers_match
    from pipeline.envs.shop.tools import TOOL_NAMES

    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    (tmp_path / "params.yaml").write_text(
        "build_env:\n  options: {n_products: 60, n_suppliers: 12}\n  tasks_per_split: {train: 40, validation: 8, test: 8}\n"
        "  demos:\n    level_coverage: {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}\n    wrong_value_prob: 1.0\n"
        "    wrong_order_prob: 0.0\n    redundant_call_prob: 0.0\n")
    metrics = main(str(tmp_path / "params.yaml"), str(tmp_path / "data"), str(tmp_path / "metrics.json"))
    assert metrics["demos"]["per_flaw"] == {"wrong_value": 40} and metrics["demos"]["success_rate"] == 0.0
    assert metrics["validation"]["expectations_failed"] == 0

    tasks = {json.loads(line)["task_id"]: json.loads(line)
             for line in (tmp_path / "data/tasks/train.jsonl").read_text().splitlines()}
    demos = [json.loads(line) for line in (tmp_path / "data/demos/train.jsonl").read_text().splitlines()]
    assert len(demos) == 40
    for d in demos:
        task = tasks[d["task_id"]]
        calls = [parse_action(s["action"], TOOL_NAMES) for s in d["steps"]]
        assert [c.name for c in calls] == [s["tool"] for s in task["plan"]]  # the expert's calls, nothing extra
        given = calls[-1].params["value"]
        assert not d["success"] and not answers_match(given, task["answer"]), (given, task["answer"])
        try:
            assert 1 <= abs(float(given) - float(task["answer"])) <= 19
        except ValueError:
            assert given == f"{task['answer']} Ltd"
    assert "wrong_value" not in built[1]["demos"]["per_flaw"]  # the default: the switch off


def test_every_family_gets_at_least_min_per_family_demonstrations_and_a_met_floor_changes_nothing(tmp_path):
    """build_env's top-up: a family that coverage leaves below `min_per_family` gets more of its own training tasks
    demonstrated (never one twice, never more than it has); when every family already reaches the floor the
    demonstrations are exactly those of coverage alone."""
    from collections import Counter

    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build_demos
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.contract import BuildRequest
    from pipeline.envs.sql import SqlAnalyst, SqlOptions

    out = tmp_path / "env"
    out.mkdir()
    result = SqlAnalyst.build(out, BuildRequest(0, {"train": 48, "validation": 8, "test": 8}, {1: 1, 4: 1},
                                                SqlOptions(n_customers=200, n_products=96, n_orders=1500)))
    world = SqlAnalyst.load(out)
    train = result.tasks["train"]
    tasks_of = Counter(t.family for t in train)
    try:
        def demos(level4: float, floor: int) -> list[dict]:
            cfg = BuildEnvConfig(demos={"level_coverage": {1: 1.0, 4: level4}, "min_per_family": floor})
            return build_demos(train, world, cfg, EnvConfig(name="sql"))

        scarce, topped = demos(0.0, 0), demos(0.0, 6)
        full, full_floor = demos(1.0, 0), demos(1.0, 6)
    finally:
        world.close()
    level4 = {t.family for t in train if t.level == 4}
    assert level4 and not {d["family"] for d in scarce} & level4  # coverage alone: no level-4 demonstration
    have = Counter(d["family"] for d in topped)
    assert all(have[f] >= min(6, n) for f, n in tasks_of.items())
    assert all(have[f] == min(6, tasks_of[f]) for f in level4)  # topped up to the floor exactly
    assert len({d["task_id"] for d in topped}) == len(topped)  # no task demonstrated twice
    # the coverage pass is untouched, and every demonstration is in its task's order, numbered in it
    strip = lambda ds: [{k: v for k, v in d.items() if k != "demo_id"} for d in ds]  # noqa: E731
    position = {t.task_id: i for i, t in enumerate(train)}
    assert all(d in strip(topped) for d in strip(scarce))
    assert [position[d["task_id"]] for d in topped] == sorted(position[d["task_id"]] for d in topped)
    assert [d["demo_id"] for d in topped] == [f"demo-{k:06d}" for k in range(len(topped))]
    assert full_floor == full  # every family already at the floor: the same demonstrations
