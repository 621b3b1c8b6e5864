"""`agentrl registry check` against a real `mlflow server`: each kind of damage that a stopped command or a writer
that skips the registry lease leaves, listed, repaired with --repair, and gone afterwards.

The damaged states are written with the same client calls the pipeline makes (a version created with its gate tags,
aliases set one request at a time), stopped at the point each kind of stop leaves them; a real hand `agentrl promote`
SIGKILLed while it writes its gate tags is the last case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_support import build_project, deploy_config, mlflow_server, tracking_uri, write_params

ROOT = Path(__file__).resolve().parents[1]
OLD = "2026-01-01T00:00:00Z"  # a gate.decided_at long past

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("check_server")) as uri, tracking_uri(uri):
        yield uri


def gated(decision: str, against: str = "none", **extra) -> dict:
    return {"weights.sha256": "x", "gate.capability": "pass", "gate.decision": decision,
            "gate.champion_at_decision": against, "gate.decided_at": OLD, **extra}


def make_model(name: str, versions: list[dict], champion: str | None = None, challenger: str | None = None,
               history: list[str] | None = None):
    """A registered model whose versions carry `versions`' tags (each pointing at one bare run), with the aliases and
    history given."""
    import json

    from pipeline.deploy.registry import HISTORY_TAG, ModelRegistry

    registry = ModelRegistry(name)
    client = registry.client
    exp = client.get_experiment_by_name("registry-check")
    exp_id = exp.experiment_id if exp else client.create_experiment("registry-check")
    run = client.create_run(exp_id)
    client.create_registered_model(name)
    for tags in versions:
        client.create_model_version(name, f"{run.info.artifact_uri}/model", run_id=run.info.run_id, tags=tags,
                                    await_creation_for=0)
    for alias, version in (("champion", champion), ("challenger", challenger)):
        if version:
            client.set_registered_model_alias(name, alias, version)
    if history is not None:
        client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    return registry


def state(registry) -> dict:
    return {"champion": registry.alias_version("champion"), "challenger": registry.alias_version("challenger"),
            "history": registry.history(),
            "decisions": {str(mv.version): mv.tags.get("gate.decision")
                          for mv in registry.client.search_model_versions(f"name='{registry.name}'")}}


# name: (versions' tags, champion, challenger, history, kind found, state after --repair)
CASES = {
    "orphan-promoted": (  # an older deploy killed after creating its version, tags written before the aliases
        [gated("promoted"), gated("promoted", "1")], "1", "1", ["1"], "orphan",
        {"champion": "1", "challenger": "1", "history": ["1"], "decisions": {"1": "promoted", "2": "abandoned"}}),
    "orphan-passed": (  # a deploy killed after creating its version, before any alias moved
        [gated("promoted"), gated("passed", "1")], "1", "1", ["1"], "orphan",
        {"champion": "1", "challenger": "1", "history": ["1"], "decisions": {"1": "promoted", "2": "abandoned"}}),
    "orphan-outdated": (  # killed between its alias moves, and another champion came since: the decision is void
        [gated("promoted"), gated("passed", "1"), gated("promoted", "1")], "3", "2", ["1", "3"], "orphan",
        {"champion": "3", "challenger": "2", "history": ["1", "3"],
         "decisions": {"1": "promoted", "2": "abandoned", "3": "promoted"}}),
    "half-moved": (  # killed between the challenger and champion moves: finished as the gate decided
        [gated("promoted"), gated("passed", "1")], "1", "2", ["1"], "half-moved",
        {"champion": "2", "challenger": "2", "history": ["1", "2"], "decisions": {"1": "promoted", "2": "promoted"}}),
    "unrecorded-champion": (  # killed between the champion move and the history
        [gated("promoted"), gated("passed", "1")], "2", "2", ["1"], "unrecorded-champion",
        {"champion": "2", "challenger": "2", "history": ["1", "2"], "decisions": {"1": "promoted", "2": "promoted"}}),
    "ungated-champion": (  # champion moved by hand, past the gate, to a rejected version
        [gated("promoted"), gated("promoted", "1"), gated("rejected", "2")], "3", "3", ["1", "2"],
        "ungated-champion",
        {"champion": "2", "challenger": "3", "history": ["1", "2"],
         "decisions": {"1": "promoted", "2": "promoted", "3": "rejected"}}),
    "half-judged": (  # a hand promote killed while writing its tags one by one
        [gated("promoted"), gated("judging", "1")], "1", "2", ["1"], "half-judged",
        {"champion": "1", "challenger": "2", "history": ["1"], "decisions": {"1": "promoted", "2": "abandoned"}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_lists_each_kind_of_damage_and_repair_fixes_it(server, case):
    from pipeline.deploy.registry_check import check

    versions, champion, challenger, history, kind, repaired = CASES[case]
    registry = make_model(f"check-{case}", versions, champion, challenger, history)
    before, lines = state(registry), []
    found = check(registry, min_age_s=0, say=lines.append)
    assert [f.kind for f in found] == [kind], lines
    assert state(registry) == before  # listing writes nothing
    assert lines[-1] == "registry check: 1 problem(s); `agentrl registry check --repair` repairs those marked 'repair'"
    lines.clear()
    assert check(registry, repair=True, min_age_s=0, say=lines.append) == [], lines
    assert lines[1].startswith(f"  repaired {kind} ") and lines[-1] == "registry check: consistent"
    assert state(registry) == repaired
    if repaired["decisions"].get("2") == "abandoned":
        assert registry.tags("2")["gate.abandoned_reason"] and registry.tags("2")["gate.capability"] == "pass"
    assert check(registry, min_age_s=0, say=lambda line: None) == []


def test_what_repair_cannot_or_must_not_touch_is_listed_and_left(server):
    from pipeline.core.tracking import mlflow_client
    from pipeline.deploy.lease import TICKET_SOURCE, lease_name
    from pipeline.deploy.registry_check import check

    # a champion that never passed the gate, with no gated version to fall back on: listed, left, exit status 1
    registry = make_model("check-no-fallback", [gated("rejected")], "1", "1", [])
    lines: list[str] = []
    found = check(registry, repair=True, min_age_s=0, say=lines.append)
    assert [f.kind for f in found] == ["ungated-champion"] and "not repaired here" in found[0].describe()
    assert registry.alias_version("champion") == "1"

    # a version created moments ago may be a deploy still publishing it: listed, not repaired
    registry = make_model("check-young", [gated("promoted"), gated("passed", "1")], "1", "1", ["1"])
    found = check(registry, repair=True, say=lambda line: None)
    assert [(f.kind, f.detail) for f in found] == [
        ("orphan", "created moments ago: a deploy may still be publishing it")]
    assert registry.tags("2")["gate.decision"] == "passed"

    # a lease ticket left by a process of this host that has exited: listed, deleted by --repair
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    client = mlflow_client(server, registry_uri=server)
    registry = make_model("check-ticket", [gated("promoted")], "1", "1", ["1"])
    client.create_registered_model(lease_name(registry.name))
    ticket = client.create_model_version(lease_name(registry.name), TICKET_SOURCE, await_creation_for=0, tags={
        "command": "deploy", "pid": str(dead.pid), "host": os.uname().nodename, "started": OLD})
    found = check(registry, min_age_s=0, say=lambda line: None)
    assert [(f.kind, f.subject) for f in found] == [("stale-ticket", f"lease ticket {ticket.version}")]
    assert check(registry, repair=True, min_age_s=0, say=lambda line: None) == []
    assert client.search_model_versions(f"name='{lease_name(registry.name)}'") == []


def test_the_command_exits_1_on_problems_0_when_repaired_and_2_on_bad_input(server, tmp_path, capsys):
    from flows.cli import main

    make_model("check-cli", [gated("promoted"), gated("promoted", "1")], "1", "1", ["1"])
    params = write_params(tmp_path, deploy_config(tmp_path, "check-cli"))
    assert main(["registry", "check", "--params", str(params), "--min-age", "0"]) == 1
    out = capsys.readouterr().out
    assert "  orphan" in out and "v2: gate.decision promoted (judged against v1) but v2 is not the champion" in out
    assert main(["registry", "check", "--params", str(params), "--min-age", "0", "--repair"]) == 0
    assert "repaired orphan v2" in capsys.readouterr().out
    assert main(["registry", "check", "--params", str(params)]) == 0
    assert capsys.readouterr().out.endswith("registry check: consistent\n")
    (tmp_path / "other").mkdir()
    unknown = write_params(tmp_path / "other", deploy_config(tmp_path, "never-deployed"))
    for argv, message in [(["--params", str(params), "--min-age", "-1"], "--min-age -1 is negative"),
                          (["--params", str(unknown)], "registered model 'never-deployed' does not exist")]:
        assert main(["registry", "check", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


# `agentrl promote` SIGKILLed at its `n`-th gate tag write
KILLED_PROMOTE = """
import os, signal, sys
from mlflow.tracking import MlflowClient

real, calls = MlflowClient.set_model_version_tag, []

def set_tag(self, *args, **kwargs):
    calls.append(args)
    if len(calls) == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *args, **kwargs)

MlflowClient.set_model_version_tag = set_tag
from flows.cli import main
sys.exit(main(["promote", "--params", sys.argv[2]]))
"""


@pytest.mark.slow
def test_a_hand_promote_killed_among_its_gate_tags_is_found_half_judged_and_judged_again(server, tmp_path_factory):
    from pipeline.deploy.main import deploy
    from pipeline.deploy.registry import ModelRegistry
    from pipeline.deploy.registry_check import check
    from deploy_support import ENV, ROLL

    project = build_project(tmp_path_factory.mktemp("promote_project"))
    name = "check-promote"
    small = dict(precisions=["fp32"], serve_precision="fp32", max_test_tasks=4, latency_tasks=0,
                 gate={"min_paired_tasks": 4}, promote=False)
    deploy(deploy_config(project, name, **small), ENV, ROLL, project / "metrics", project / "metrics" / "d.json")
    params = write_params(project, deploy_config(project, name, **small))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": server}
    env.pop("AGENTRL_LOCK", None)
    killed = subprocess.run([sys.executable, "-c", KILLED_PROMOTE, "4", str(params)], cwd=project, env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    registry = ModelRegistry(name)
    assert registry.tags("1")["gate.decision"] == "judging" and registry.alias_version("champion") is None
    found = check(registry, min_age_s=0, say=lambda line: None)
    assert [(f.kind, f.subject) for f in found] == [("half-judged", "v1")]
    assert check(registry, repair=True, min_age_s=0, say=lambda line: None) == []
    assert registry.tags("1")["gate.decision"] == "abandoned"
    again = subprocess.run([sys.executable, "-m", "flows.cli", "promote", "--version", "1", "--params", str(params)],
                           cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert registry.alias_version("champion") == "1" and registry.tags("1")["gate.decision"] == "promoted"
    assert registry.history() == ["1"] and check(registry, min_age_s=0, say=lambda line: None) == []
