"""The served-model consistency check (pipeline.deploy.served_check) on a tiny project with a real SQLite MLflow store:
deploy registers the pyfunc, starts `agentrl serve` on that version in a subprocess, plays test tasks over loopback
HTTP and replays them in the training environment. It passes on the true served model with its figures in
deploy.json and the registry; it fails -- and the gate refuses promotion, naming why -- when the registered version
carries other weights than the trained policy; and the comparison itself names a serving side that renders prompts or
pays rewards differently from training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy_support import ENV, ROLL, TINY, build_project, deploy_config, tracking_uri

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NAME = "policy-served"
N_TASKS = 4


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = build_project(tmp_path_factory.mktemp("served_project"))
    with tracking_uri(f"sqlite:///{tmp_path_factory.mktemp('served_mlflow') / 'mlflow.db'}"):
        yield root


def run_deploy(project: Path, **over):
    from pipeline.deploy.main import deploy

    cfg = deploy_config(project, NAME, precisions=["fp32", "int8"], latency_tasks=2, max_test_tasks=12,
                        served_check={"enabled": True, "tasks": N_TASKS}, gate={"min_paired_tasks": 10}, **over)
    return deploy(cfg, ENV, ROLL, project / "metrics", project / "metrics" / "deploy.json")


@pytest.mark.slow
def test_the_served_version_passes_and_its_figures_reach_deploy_json_and_the_gate(project):
    from pipeline.deploy.registry import ModelRegistry

    out = run_deploy(project)
    written = json.loads((project / "metrics" / "deploy.json").read_text())
    s = written["served_consistency"]
    assert s["status"] == "pass" and s["reasons"] == [], s["reasons"]
    registry = ModelRegistry(NAME)
    run_id = registry.client.get_model_version(NAME, out["version"]).run_id  # the artefact the version points at
    assert s["model_uri"] == f"runs:/{run_id}/model" and s["tasks"] == N_TASKS and s["states"] >= N_TASKS
    assert s["prompts_identical"] and s["tokens_identical"] and s["replay_identical"]
    assert 0 < s["hidden_mse"]["max"] <= s["hidden_mse"]["bound"]  # int8 is not fp32, and within the bound
    assert s["hidden_mse"]["vs_training_path_max"] == 0.0  # the served weights are the trained ones, bit for bit
    assert s["action_agreement"]["served_vs_training_path"] >= s["action_agreement"]["min"]
    assert 0 <= s["action_agreement"]["fp32_vs_int8"] <= 1
    lat = s["latency"]
    assert lat["served_http_ms_per_action"] > 0 and lat["in_process_ms_per_action"] > 0
    assert lat["difference_ms_per_action"] == pytest.approx(lat["served_http_ms_per_action"]
                                                            - lat["in_process_ms_per_action"])
    assert out["decision"].passed
    assert registry.tags(out["version"])["gate.served_consistency"] == "pass"
    assert registry.gate_inputs(out["version"]).served_consistency["status"] == "pass"
    assert registry.alias_version("champion") == out["version"]


@pytest.mark.slow
def test_a_version_with_other_weights_fails_the_check_and_is_not_promoted(project, tmp_path, monkeypatch):
    import torch

    import pipeline.deploy.pyfunc as pyfunc
    from pipeline.deploy.registry import ModelRegistry
    from pipeline.policy.model import build_policy, load_policy, save_policy

    registry = ModelRegistry(NAME)
    if registry.alias_version("champion") is None:  # alone (-k): the true model first
        run_deploy(project)
    champion = registry.alias_version("champion")
    _, tok, _ = load_policy(project / "models" / "policy")
    other = build_policy(TINY.model_copy(update={"seed": 1}), tok)  # the same architecture, other weights
    save_policy(other, tok, tmp_path / "other", {"phase": "train", "step": 0})
    measured, tok2, meta = load_policy(project / "models" / "policy")
    with torch.no_grad():  # not the champion's weights (an unchanged deploy registers nothing), as good as them
        next(measured.parameters()).add_(1e-6)
    save_policy(measured, tok2, tmp_path / "measured", {"phase": "train", "step": 1})
    real = pyfunc.save_pyfunc
    # what gets registered (and served) is another model than the policy the phase measured
    monkeypatch.setattr(pyfunc, "save_pyfunc", lambda path, policy, world, settings:
                        real(path, tmp_path / "other", world, settings))
    out = run_deploy(project, policy=str(tmp_path / "measured"))
    s = json.loads((project / "metrics" / "deploy.json").read_text())["served_consistency"]
    assert s["status"] == "fail" and not s["passed"]
    assert any(r.startswith("hidden-state MSE of the served model vs the fp32 training model") for r in s["reasons"])
    assert s["hidden_mse"]["max"] > s["hidden_mse"]["bound"] and s["hidden_mse"]["vs_training_path_max"] > 0
    assert not out["decision"].passed and "served_consistency" in out["decision"].failed
    detail = registry.tags(out["version"])["gate.served_consistency.detail"]
    assert detail.startswith("served model differs from the training path: hidden-state MSE")
    assert registry.alias_version("champion") == champion  # not promoted
    assert registry.alias_version("challenger") == out["version"]


@pytest.mark.parametrize("serving_env, reason", [
    ({"history_window": 1}, "prompts differ"),  # the serving side folds the history the training side keeps
    ({"reward": {"shaping": "always", "efficiency": 3.0}}, "replayed reward"),
])
def test_a_serving_side_that_renders_or_rewards_differently_is_named(project, serving_env, reason):
    """The comparison on a served path run in-process (the pyfunc's solver over the packaged artefacts, as `agentrl
    serve` runs it) whose environment settings differ from training's."""
    from pipeline.deploy.config import QuantizationConfig
    from pipeline.deploy.pyfunc import PolicySolver, serving_settings
    from pipeline.deploy.served_check import compare_paths
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.model import load_policy

    cfg = deploy_config(project, NAME, served_check={"enabled": True, "tasks": N_TASKS})
    serving = EnvConfig(**{**ENV.model_dump(), **serving_env})
    settings = serving_settings(serving, ROLL, "int8", QuantizationConfig(), 0)
    solver = PolicySolver(project / "models/policy", project / "data/env", settings)
    runtime = open_environment(ENV.name, project / "data/env")
    try:
        tasks = load_task_file(cfg.test_tasks, runtime)[:N_TASKS]
        seeds = list(range(N_TASKS))
        served = [solver.solve_tasks([t], [s])[0] for t, s in zip(tasks, seeds)]
        model, tok, _ = load_policy(cfg.policy)
        same = compare_paths(served, [0.1] * N_TASKS, solver, tasks, seeds, cfg, serving, ROLL, model, tok, runtime)
        assert same["status"] == "pass", same["reasons"]  # against its own settings the serving side agrees
        result = compare_paths(served, [0.1] * N_TASKS, solver, tasks, seeds, cfg, ENV, ROLL, model, tok, runtime)
    finally:
        solver.close()
        runtime.close()
    assert result["status"] == "fail"
    assert any(reason in r for r in result["reasons"]), result["reasons"]


def test_a_version_that_cannot_be_served_is_a_failed_check_with_the_reason(project):
    import os

    from pipeline.deploy.served_check import check_served
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.model import load_policy

    cfg = deploy_config(project, NAME, served_check={"enabled": True, "tasks": 2, "startup_timeout_s": 60})
    runtime = open_environment(ENV.name, project / "data/env")
    model, tok, _ = load_policy(cfg.policy)
    try:
        tasks = load_task_file(cfg.test_tasks, runtime)
        result = check_served(f"models:/{NAME}/999", os.environ["MLFLOW_TRACKING_URI"], cfg, ENV, ROLL, tasks, model,
                              tok, runtime)
    finally:
        runtime.close()
    assert result["status"] == "fail" and not result["passed"]
    assert len(result["reasons"]) == 1 and result["reasons"][0].startswith(f"cannot load model 'models:/{NAME}/999'")
