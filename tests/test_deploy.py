"""Deployment: quantised variants, the paired tests and checks of the promotion gate, and the registry operations
against a real MLflow tracking server (SQLite store, loopback port) started by this module: registration, the gate on a
good and on a broken challenger, alias moves, rollback, dry runs, and bad input leaving the registry unchanged."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploy_support import ENV, N_TEST, ROLL, build_project, deploy_config, mlflow_server, \
    nudged_policy, snapshot, tracking_uri, write_metrics, write_params
from pipeline.deploy.config import DeployConfig, DeployGateConfig, QuantizationConfig
from pipeline.deploy.gate import (bootstrap_worse, decide, extract_task_results, mcnemar_worse,
                                  pair_results, GateInputs)
from pipeline.deploy.quantize import Int8Embedding, make_variant, quantize_rows, state_size_bytes
from pipeline.core.errors import AgentRLError


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------------------------------- quantisation
@pytest.mark.parametrize("seed", range(5))
def test_row_quantisation_error_is_at_most_half_a_step(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 48, generator=g) * torch.linspace(0.01, 3.0, 64)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    # half a step, plus the fp32 rounding of q * scale: under one ulp of |w| over 2,000 seeds, so two ulps of slack
    # (a fixed 1e-7 was below one ulp for |w| near 3 and failed in CI on an unlucky unseeded draw)
    assert torch.all(err <= scale[:, None] / 2 + 2 * torch.finfo(torch.float32).eps * w.abs())


@pytest.fixture(scope="module")
def builtin_model():
    """The built-in policy at its default size (d_model 256, 4 layers, ~1k vocabulary, tied embeddings)."""
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy
    from pipeline.policy.tokenizer import train_tokenizer

    texts = [f'What is the price of "Item {i}"? <call>lookup {{"name": "Item {i}", "field": "price"}}</call> {i * 7.5}'
             for i in range(3000)]
    tok = train_tokenizer(texts, 1024)
    return build_policy(ModelConfig(vocab_size=1024), tok), tok


def test_int8_is_at_most_035_of_fp32_and_close_to_it(builtin_model):
    model, tok = builtin_model
    ids = torch.randint(0, len(tok), (2, 40))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        sizes = {}
        for name, prec, q in [("fp32", "fp32", None), ("bf16", "bf16", None), ("int8", "int8", QuantizationConfig()),
                              ("int8_tied_fp32_embedding", "int8", QuantizationConfig(embeddings=False)),
                              ("int8_weight_only", "int8", QuantizationConfig(linear="weight_only"))]:
            v = make_variant(model, prec, q)
            sizes[name] = state_size_bytes(v)
            out = v(input_ids=ids).logits.float()
            # quantised logits stay close to fp32 relative to their spread (int8: ~1% of a 127-level range per weight)
            assert (out - ref).abs().max() < 0.05 * ref.std() * 10, name
    assert sizes["int8"] <= 0.35 * sizes["fp32"], sizes
    assert sizes["int8"] < sizes["int8_tied_fp32_embedding"] < 0.4 * sizes["fp32"]  # the embedding matters here
    assert abs(sizes["bf16"] / sizes["fp32"] - 0.5) < 0.02
    assert isinstance(make_variant(model, "int8").get_input_embeddings(), Int8Embedding)
    assert next(model.parameters()).dtype == torch.float32 and type(model.lm_head) is torch.nn.Linear  # untouched
    with pytest.raises(AgentRLError, match="unknown precision 'int4'"):
        make_variant(model, "int4")


def test_weights_digest_tells_the_same_weights_from_changed_ones(builtin_model, tmp_path):
    """Two saves of the same weights with other lineage digest alike (policy.json is left out); one changed
    parameter, or an empty folder, does not pass for them."""
    from pipeline.deploy.registry import weights_digest
    from pipeline.policy.model import save_policy

    model, tok = builtin_model
    save_policy(model, tok, tmp_path / "a", meta={"phase": "train", "step": 10})
    save_policy(model, tok, tmp_path / "b", meta={"phase": "train", "step": 20})
    assert (tmp_path / "a/policy.json").read_text() != (tmp_path / "b/policy.json").read_text()
    assert weights_digest(tmp_path / "a") == weights_digest(tmp_path / "b")
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3
    save_policy(model, tok, tmp_path / "c", meta={"phase": "train"})
    assert weights_digest(tmp_path / "c") != weights_digest(tmp_path / "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AgentRLError, match="no policy files"):
        weights_digest(tmp_path / "empty")


def test_versions_with_the_same_weights_on_a_sqlite_store(tmp_path):
    """A SQLite store hands model versions back as ints, a tracking server as strings: both come out as strings."""
    from pipeline.deploy.registry import WEIGHTS_TAG, ModelRegistry

    registry = ModelRegistry("digest-model", f"sqlite:///{tmp_path / 'mlflow.db'}")
    registry.client.create_registered_model("digest-model")
    for digest in ("aaa", "bbb", "aaa"):
        registry.client.create_model_version("digest-model", (tmp_path / "src").as_uri(), tags={WEIGHTS_TAG: digest})
    assert registry.versions_with_weights("aaa", exclude="3") == ["1"]
    assert registry.versions_with_weights("aaa") == ["1", "3"] and registry.versions_with_weights("ccc") == []


def test_deploy_config_refuses_a_served_precision_it_does_not_measure():
    with pytest.raises(ValueError, match="serve_precision='bf16' must be one of the measured precisions"):
        DeployConfig(precisions=["fp32", "int8"], serve_precision="bf16")
    with pytest.raises(ValueError, match="must include 'fp32'"):
        DeployConfig(precisions=["int8"])


# ------------------------------------------------------------------------------------------------ the gate, pure
def test_mcnemar_counts_only_discordant_pairs():
    champ = [True] * 30 + [False] * 10
    same = mcnemar_worse(champ, champ)
    assert same == {"test": "mcnemar", "losses": 0, "wins": 0, "p_value": 1.0}
    worse = [False] * 12 + [True] * 18 + [False] * 10  # 12 losses, no wins
    assert mcnemar_worse(worse, champ)["p_value"] == pytest.approx(0.5 ** 12)
    mixed = [False] * 3 + [True] * 27 + [True] * 2 + [False] * 8  # 3 losses, 2 wins: noise
    r = mcnemar_worse(mixed, champ)
    assert (r["losses"], r["wins"]) == (3, 2) and r["p_value"] == pytest.approx(16 / 32)


def test_bootstrap_flags_a_real_drop_and_not_noise():
    champ = [True] * 30 + [False] * 10
    worse = [False] * 12 + [True] * 18 + [False] * 10
    assert bootstrap_worse(worse, champ, 2000, 0)["p_value"] < 0.01
    r = bootstrap_worse(champ, champ, 2000, 0)
    assert r["p_value"] == 1.0 and r["ci95"] == [0.0, 0.0]


def test_pairing_matches_tasks_and_seeds_and_drops_ambiguous_ones():
    a = [{"task_id": "t1", "seed": 1, "success": True}, {"task_id": "t2", "seed": 2, "success": False},
         {"task_id": "t3", "seed": 3, "success": True}]
    b = [{"task_id": "t2", "seed": 2, "success": True}, {"task_id": "t1", "seed": 1, "success": False},
         {"task_id": "t3", "seed": 9, "success": True}]
    x, y, keys = pair_results(a, b)
    assert keys == [("t1", 1), ("t2", 2)] and x == [True, False] and y == [False, True]
    no_seed = [{"task_id": "t1", "seed": None, "success": True}, {"task_id": "t1", "seed": None, "success": False},
               {"task_id": "t3", "seed": None, "success": False}]
    assert pair_results(no_seed, b)[2] == ["t3"]  # t1 twice without seeds cannot be paired


def test_task_results_are_found_in_an_evaluation_file_of_any_shape():
    per_task = [{"task_id": "a", "success": True, "seed": 0, "n_violations": 1}]
    nested = {"splits": {"train": {"rl": {"episodes": [{"task_id": "x", "success": False}]}},
                         "test": {"sft": {"episodes": [{"task_id": "y", "success": False}]},
                                  "rl": {"episodes": per_task}}}}
    assert extract_task_results(nested, "e.json") == [{"task_id": "a", "seed": 0, "success": True, "n_violations": 1}]
    assert extract_task_results({"per_task": per_task}, "e.json")[0]["task_id"] == "a"
    # the evaluate stage's format: success keyed by task id, per policy (SFT baseline and the RL policy)
    evaluate = {"gate": {"passed": True, "enabled": True}, "flags": {"rl": {"overfitting": {"flagged": False}}},
                "per_task_test_success": {"sft": {"a": False, "b": False}, "rl": {"a": True, "b": False}}}
    assert extract_task_results(evaluate, "evaluate.json") == [
        {"task_id": "a", "seed": None, "success": True, "n_violations": 0},
        {"task_id": "b", "seed": None, "success": False, "n_violations": 0}]
    with pytest.raises(AgentRLError, match="no per-task results"):
        extract_task_results({"overall": {"success_rate": 0.5}}, "e.json")
    with pytest.raises(AgentRLError, match="several per-task result lists"):
        extract_task_results({"a": per_task, "b": per_task}, "e.json")


def _inputs(successes: list[bool], violations: int = 0, parity_passed: bool = True) -> GateInputs:
    n = len(successes)
    return GateInputs(
        adapt={"gate": {"passed": True}},
        drift={"passed": True, "verdict": "pass", "failed_checks": [], "checks": {"consistency": {"status": "pass"}}},
        quantization={"serve_precision": "int8",
                      "variants": {"int8": {"episodes": n, "safety_violations": violations}},
                      "parity": {"int8": {"success": 0.5, "fp32_success": 0.5 if parity_passed else 0.7,
                                          "drop": 0.0 if parity_passed else 0.2, "tolerance": 0.02,
                                          "passed": parity_passed}}},
        test_results=[{"task_id": f"t{i}", "seed": i, "success": s, "n_violations": 0}
                      for i, s in enumerate(successes)])


def test_every_check_fails_on_its_own_broken_input():
    cfg = DeployGateConfig(min_paired_tasks=10)
    good = _inputs([True] * 20 + [False] * 20)
    assert decide("2", good, None, None, cfg).passed
    cases = {
        "capability": GateInputs(**{**good.__dict__, "adapt": {"gate": {"passed": None}}}),
        "drift": GateInputs(**{**good.__dict__, "drift": {**good.drift, "passed": False, "verdict": "fail"}}),
        "consistency": GateInputs(**{**good.__dict__, "drift": {**good.drift, "checks": {"consistency":
                                                                                         {"status": "skipped"}}}}),
        "safety": _inputs([True] * 20 + [False] * 20, violations=3),
        "quantization_parity": _inputs([True] * 20 + [False] * 20, parity_passed=False),
    }
    for name, inputs in cases.items():
        d = decide("2", inputs, None, None, cfg)
        assert d.failed == [name], (name, d.describe())
    champion = good.test_results
    broken = _inputs([False] * 40).test_results
    d = decide("3", GateInputs(**{**good.__dict__, "test_results": broken}), "2", champion, cfg)
    assert d.failed == ["vs_champion"] and "p(worse)" in d.describe()
    few = decide("3", good, "2", champion[:5], cfg)
    assert few.failed == ["vs_champion"] and "only 5 test tasks shared" in few.describe()


# ---------------------------------------------------------------------------------------- against an MLflow server
@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("deploy_project"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow_server")) as uri, tracking_uri(uri):
        yield uri


def run_deploy(project: Path, name: str, metrics: Path | None = None, **over):
    from pipeline.deploy.main import deploy

    cfg = deploy_config(project, name, **over)
    m = metrics or project / "metrics"
    return deploy(cfg, ENV, ROLL, m, m / "deploy.json")


def metrics_copy(project: Path, dest: Path, evaluate: list[bool] | None = None, **verdicts) -> Path:
    """A metrics folder like the project's, with other verdicts and (optionally) an evaluate.json holding per-task
    results on the project's test tasks (the evaluate stage's output)."""
    dest.mkdir(parents=True, exist_ok=True)
    write_metrics(dest, **verdicts)
    if evaluate is not None:
        ids = [json.loads(l)["task_id"] for l in (project / "data/tasks/test.jsonl").read_text().splitlines()]
        assert len(ids) == len(evaluate) == N_TEST
        (dest / "evaluate.json").write_text(json.dumps({"per_task_test_success": {  # the evaluate stage's format
            "sft": {t: False for t in ids}, "rl": dict(zip(ids, evaluate))}}))
    return dest


@pytest.mark.services
def test_gate_promotes_good_challengers_rejects_broken_ones_and_rolls_back(server, project, tmp_path, capsys):
    from pipeline.deploy.main import report
    from pipeline.deploy.registry import ModelRegistry, rollback

    name = "policy-gate"
    registry = ModelRegistry(name)
    # v1: the first model becomes champion on the absolute checks; results are its own episodes
    first = run_deploy(project, name)
    assert first["version"] == "1" and first["decision"].passed
    assert registry.alias_version("champion") == "1" and registry.alias_version("challenger") == "1"
    tags = registry.tags("1")
    assert {tags[f"gate.{c}"] for c in ("capability", "safety", "drift", "consistency", "quantization_parity",
                                         "vs_champion")} == {"pass"}
    assert tags["gate.decision"] == "promoted" and registry.history() == ["1"]
    written = json.loads((project / "metrics" / "deploy.json").read_text())
    assert set(written["variants"]) == {"fp32", "bf16", "int8"} and written["gate"]["passed"]
    assert written["variants"]["int8"]["size_ratio"] < 1 and written["variants"]["fp32"]["size_ratio"] == 1
    assert written["test_results_source"].startswith("fp32 greedy episodes")
    assert tags["weights.sha256"] == written["weights_sha256"] and written["same_weights_as"] == []

    # the same policy again (a rerun that reproduced the champion bit for bit): nothing registered, no alias moved
    before = snapshot(registry)
    again = run_deploy(project, name, precisions=["fp32", "int8"])
    assert again["unchanged"] == "1" and again["unchanged_alias"] == "champion" and again["decision"] is None
    assert snapshot(registry) == before and len(before["versions"]) == 1
    written = json.loads((project / "metrics" / "deploy.json").read_text())
    assert written["unchanged"] == "1" and written["version"] == "1" and again["decision"] is None
    # the figures stay those v1 was registered with, from the deploy run that registered it (nothing re-measured)
    v1_run = registry.client.get_model_version(name, "1").run_id
    assert written["recorded_by"] == v1_run and written["gate"]["passed"] and written["gate"]["version"] == "1"
    assert written["variants"] == first["variants"] and set(written["variants"]) == {"fp32", "bf16", "int8"}
    assert "unchanged: the policy's weights are those of v1 (alias champion" in report(again)

    # v2: other weights that play the same episodes: paired on the same tasks and seeds, not worse -> promoted
    second = run_deploy(project, name, precisions=["fp32", "int8"], policy=nudged_policy(project, tmp_path / "p2", 1e-6))
    vs = next(c for c in second["decision"].checks if c.name == "vs_champion")
    assert second["decision"].passed and vs.values["paired_tasks"] == N_TEST
    assert registry.alias_version("champion") == "2" and registry.history() == ["1", "2"]
    assert second["version"] == "2" and second["same_weights_as"] == [] and second["unchanged"] is None
    assert registry.tags("2")["gate.decision"] == "promoted" and registry.tags("2")["weights.sha256"] != \
        registry.tags("1")["weights.sha256"]

    # v3: v1's weights again, which no alias holds now, with an evaluation file in which they solve 20 of 24 tasks:
    # registered (recognised as v1's weights) and better than the champion -> promoted
    good = [True] * 20 + [False] * 4
    third = run_deploy(project, name, metrics_copy(project, tmp_path / "m3", evaluate=good), precisions=["fp32", "int8"])
    assert third["decision"].passed and registry.alias_version("champion") == "3"
    assert third["test_results_source"].endswith("evaluate.json")
    assert third["same_weights_as"] == ["1"] and "weights identical to v1 " in report(third)

    # v4: broken -- solves 4 of the same 24 tasks: significantly worse, never promoted, champion untouched
    before = snapshot(registry)
    broken = [False] * 16 + [True] * 4 + [False] * 4
    fourth = run_deploy(project, name, metrics_copy(project, tmp_path / "m4", evaluate=broken),
                        precisions=["fp32", "int8"], policy=nudged_policy(project, tmp_path / "p4", 2e-6))
    assert not fourth["decision"].passed and fourth["decision"].failed == ["vs_champion"]
    after = snapshot(registry)
    assert after["aliases"]["champion"] == "3" and after["aliases"]["challenger"] == "4"
    assert after["tags"] == before["tags"]  # history unchanged
    assert {v: t for v, t in after["versions"].items() if v != "4"} == before["versions"]  # other versions untouched
    assert after["versions"]["4"]["gate.vs_champion"] == "fail" and after["versions"]["4"]["gate.decision"] == "rejected"

    # v5: broken another way -- the drift verdict failed: rejected as well
    fifth = run_deploy(project, name, metrics_copy(project, tmp_path / "m5", evaluate=good, drift_passed=False),
                       precisions=["fp32", "int8"], policy=nudged_policy(project, tmp_path / "p5", 3e-6))
    assert fifth["decision"].failed == ["drift"] and registry.alias_version("champion") == "3"

    # rollback walks the history back; with no previous champion it refuses and changes nothing
    assert rollback(registry) == ("3", "2") and registry.alias_version("champion") == "2"
    assert rollback(registry) == ("2", "1") and registry.history() == ["1"]
    assert registry.tags("2")["rolled_back_at"]
    before = snapshot(registry)
    with pytest.raises(AgentRLError, match="no previous champion"):
        rollback(registry)
    assert snapshot(registry) == before


@pytest.mark.services
def test_promote_by_hand_dry_run_and_bad_input_leave_the_registry_unchanged(server, project, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from flows.cli import main
    from pipeline.deploy.registry import ModelRegistry

    name = "policy-manual"
    registry = ModelRegistry(name)
    cfg = deploy_config(project, name, precisions=["fp32", "int8"], promote=False)
    params = write_params(tmp_path, cfg)
    run_deploy(project, name, precisions=["fp32", "int8"], promote=False)
    assert registry.alias_version("challenger") == "1" and registry.alias_version("champion") is None
    # the challenger's weights again: nothing registered, the challenger stays (promote judges it by hand)
    before = snapshot(registry)
    again = run_deploy(project, name, precisions=["fp32", "int8"], promote=False)
    assert (again["unchanged"], again["unchanged_alias"]) == ("1", "challenger") and snapshot(registry) == before

    # dry run: the decision is shown, nothing is written
    before = snapshot(registry)
    assert main(["promote", "--dry-run", "--params", str(params)]) == 0
    out = capsys.readouterr().out
    assert "dry run (nothing written): version 1: PROMOTE" in out and "vs_champion: no champion yet" in out
    assert snapshot(registry) == before

    # bad input: an alias with no version, a version that does not exist, a challenger without its metrics
    client = MlflowClient()
    exp = client.get_experiment_by_name("agentrl").experiment_id
    bare = client.create_run(exp, run_name="no-metrics")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "MLmodel").write_text("flavors: {}\n")
    client.log_artifacts(bare.info.run_id, str(tmp_path / "m"), "model")
    client.create_model_version(name, f"{bare.info.artifact_uri}/model", run_id=bare.info.run_id)
    client.set_registered_model_alias(name, "nometrics", "2")
    capsys.readouterr()
    before = snapshot(registry)
    for argv, message in [(["--alias", "staging"], "alias 'staging' of model 'policy-manual' points to no version"),
                          (["--version", "42"], "has no version 42"),
                          (["--alias", "nometrics"], "version 2 of 'policy-manual' is missing gate metrics")]:
        assert main(["promote", *argv, "--params", str(params)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
        assert snapshot(registry) == before

    # by hand, for real: version 1 passes and becomes champion; the decision is tagged
    assert main(["promote", "--version", "1", "--params", str(params)]) == 0
    assert "champion: v1" in capsys.readouterr().out
    assert registry.alias_version("champion") == "1" and registry.tags("1")["gate.decision"] == "promoted"
    assert main(["rollback", "--params", str(params)]) == 2
    assert "no previous champion" in capsys.readouterr().err

    # a deploy whose drift verdict is missing registers nothing
    metrics = tmp_path / "metrics"
    shutil.copytree(project / "metrics", metrics)
    (metrics / "drift.json").unlink()
    before = snapshot(registry)
    with pytest.raises(AgentRLError, match="drift.json not found"):
        run_deploy(project, name, metrics, precisions=["fp32", "int8"])
    assert snapshot(registry) == before
    with pytest.raises(AgentRLError, match="does not exist"):
        ModelRegistry("never-registered").resolve(alias="champion")


@pytest.mark.services
def test_registered_model_loads_as_pyfunc_and_solves_tasks(server, project):
    import mlflow.pyfunc
    import pandas as pd

    from pipeline.deploy.pyfunc import load_solver

    name = "policy-pyfunc"
    run_deploy(project, name, precisions=["fp32", "int8"])
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    task = json.loads((project / "data/tasks/test.jsonl").read_text().splitlines()[0])
    out = model.predict([{"question": task["question"]}, task])
    assert len(out) == 2 and out[0]["success"] is None and isinstance(out[1]["success"], bool)
    for r in out:
        assert r["n_calls"] == len(r["trajectory"]) == len(r["calls"]) >= 1
        assert all(set(s) == {"action", "observation"} for s in r["trajectory"])
    frame = model.predict(pd.DataFrame({"question": [task["question"]]}))
    assert frame[0]["trajectory"] == out[0]["trajectory"]  # same task, same seed, greedy: the same episode
    solver = load_solver(f"models:/{name}@champion")
    assert solver.precision == "int8" and type(solver.model.lm_head) is not torch.nn.Linear  # quantised at load
    with pytest.raises(AgentRLError, match="cannot load model 'models:/no-such-model@champion'"):
        load_solver("models:/no-such-model@champion")
    with pytest.raises(AgentRLError, match="bad request: unknown fields"):
        model.predict([{"question": "q", "nonsense": 1}])


@pytest.mark.services
@pytest.mark.slow
def test_a_tracking_server_that_stops_during_deploy_leaves_every_version_whole_and_the_aliases_in_place(
        project, tmp_path, monkeypatch, capsys):
    """The server is killed just before the first alias move (the version exists by then): `agentrl deploy` fails
    with one error line that says what is left, and the restarted server shows the aliases and history where they
    were and every version with its tags. Killed at the same point and restarted while the client still retries,
    the deploy rides the outage out and completes."""
    import contextlib
    import os
    import signal
    import threading

    from mlflow.tracking import MlflowClient

    from flows.cli import main
    from pipeline.deploy.registry import ModelRegistry

    name, store, servers = "policy-outage", tmp_path / "store", []
    small = dict(precisions=["fp32"], serve_precision="fp32", max_test_tasks=4, latency_tasks=0,
                 gate={"min_paired_tasks": 4})  # what a deploy measures is not the point here
    real_set_alias = MlflowClient.set_registered_model_alias

    def kill_server() -> None:
        os.killpg(servers[-1].pid, signal.SIGKILL)
        servers[-1].wait()

    with contextlib.ExitStack() as stack:
        uri = stack.enter_context(mlflow_server(store, started=servers))
        stack.enter_context(tracking_uri(uri))
        port = int(uri.rsplit(":", 1)[1])
        assert run_deploy(project, name, **small)["decision"].passed  # v1: champion and challenger
        registry = ModelRegistry(name)
        before = snapshot(registry)

        # the server dies for good just before the challenger alias moves to v2
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a dead server fails fast here
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")

        def outage(self, *args, **kwargs):
            kill_server()
            return real_set_alias(self, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, "set_registered_model_alias", outage)
        params = write_params(tmp_path, deploy_config(project, name, policy=nudged_policy(project, tmp_path / "p2", 1e-6),
                                                      **small))
        monkeypatch.chdir(project)  # the stage reads and writes metrics/ where it runs: the project's
        capsys.readouterr()
        assert main(["deploy", "--params", str(params)]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and err.splitlines()[-1] == errors[0] and "Traceback" not in err, err
        assert errors[0].startswith(f"error: registering '{name}' version 2 failed: the MLflow tracking server at "
                                    f"{uri} did not answer"), errors[0]
        assert errors[0].endswith("left in the registry: version 2 stays registered, with all its tags")
        monkeypatch.setattr(MlflowClient, "set_registered_model_alias", real_set_alias)
        servers.clear()

        stack.enter_context(mlflow_server(store, port=port, started=servers))  # back, on the same store
        after = snapshot(registry)
        assert after["aliases"] == before["aliases"] and after["tags"] == before["tags"]  # champion v1, history [1]
        assert set(after["versions"]) == {"1", "2"}
        for version, tags in after["versions"].items():  # no version without its tags
            assert tags["weights.sha256"] and tags["gate.vs_champion"], version
        # promoted only where the champion moved: v2's decision passed, and no alias reached it
        assert {str(v): t["gate.decision"] for v, t in after["versions"].items()} == {"1": "promoted", "2": "passed"}

        # a short outage: the server comes back while the client retries (back-off 2, 4, 8, ... s) -> completed
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        restarted = []

        def blip(self, *args, **kwargs):
            monkeypatch.setattr(MlflowClient, "set_registered_model_alias", real_set_alias)
            kill_server()
            thread = threading.Thread(target=lambda: restarted.append(stack.enter_context(
                mlflow_server(store, port=port, started=servers))))
            thread.start()
            return real_set_alias(self, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, "set_registered_model_alias", blip)
        third = run_deploy(project, name, policy=nudged_policy(project, tmp_path / "p3", 2e-6), **small)
        assert restarted and third["version"] == "3" and third["decision"].passed
        assert registry.alias_version("champion") == "3" and registry.alias_version("challenger") == "3"
        assert registry.history() == ["1", "3"]


def test_http_retry_defaults_apply_unless_set_and_a_refused_connection_is_a_store_failure(monkeypatch):
    """Every MLflow client the pipeline makes retries with the pipeline's defaults (MLflow reads them per request)
    unless the environment sets its own; a refused connection, after those retries, is recognised as the store's
    absence, and a plain "does not exist" answer is not."""
    import os

    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR, MLFLOW_HTTP_REQUEST_MAX_RETRIES, \
        MLFLOW_HTTP_REQUEST_TIMEOUT
    from mlflow.exceptions import MlflowException

    from deploy_support import free_port
    from pipeline.core.tracking import HTTP_RETRY_DEFAULTS, mlflow_client, store_failure

    for key in HTTP_RETRY_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")  # the user's own value wins
    client = mlflow_client(f"http://127.0.0.1:{free_port()}")
    assert (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get(),
            MLFLOW_HTTP_REQUEST_TIMEOUT.get()) == (int(HTTP_RETRY_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]),
                                                   int(HTTP_RETRY_DEFAULTS["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"]), 7)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # nothing listens there: no need to wait
    with pytest.raises(MlflowException) as refused:
        client.get_registered_model("m")
    assert "did not answer" in store_failure(refused.value)
    assert store_failure(MlflowException("Registered Model with name=m not found",
                                         error_code="RESOURCE_DOES_NOT_EXIST")) is None
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "7"


def test_the_pyfunc_class_adds_no_mlflow_type_hint_warning_to_the_output():
    """MLflow warns when a PythonModel's `predict` has no type hints; ours checks its own requests, and the warning
    stood beside the one `error:` line of `agentrl serve` and `agentrl promote`. Importing the class is silent, while
    a class defined without the switch still warns (the check can fail)."""
    code = ("import warnings, mlflow.pyfunc\n"
            "import pipeline.deploy.pyfunc\n"
            "class Plain(mlflow.pyfunc.PythonModel):\n"
            "    def predict(self, context, model_input, params=None):\n"
            "        return model_input\n")
    proc = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("Add type hints to the `predict` method") == 1  # Plain's, not AgentPolicyModel's
