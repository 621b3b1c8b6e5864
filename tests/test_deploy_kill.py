"""`agentrl deploy` killed with SIGKILL at each point where it writes to the registry, then run again.

A real `agentrl deploy` process on a tiny project and a real SQLite MLflow store is killed (SIGKILL, from inside, at
an exact point) just before its version is created, between the version and its aliases, and between the
`challenger` and `champion` moves. After each kill: every version in the registry carries its weights digest and its
gate tags, the aliases point where they did or to a whole version, `metrics/deploy.json` is the earlier run's, and
the lock is free. The rerun then finishes the job: the new weights end as champion, at the end of the history, and a
deploy killed between its alias moves is completed rather than registered again. What each kill leaves is what
`agentrl registry check` lists: a version whose decision says passed (never promoted, since no alias reached it), or
a half-made move with the killed holder's lease ticket, which blocks no one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy_support import ENV, ROLL, build_project, deploy_config, nudged_policy, snapshot, write_params

ROOT = Path(__file__).resolve().parents[1]
NAME = "policy-killed"
SMALL = dict(precisions=["fp32"], serve_precision="fp32", max_test_tasks=4, latency_tasks=0,
             gate={"min_paired_tasks": 4})  # what a deploy measures is not the point here

# Runs `agentrl deploy` in this process after making one registry method SIGKILL the process when it is reached.
KILLED_DEPLOY = """
import os, signal, sys
import pipeline.deploy.registry as registry

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

setattr(registry.ModelRegistry, sys.argv[1], die)
from flows.cli import main
sys.exit(main(["deploy", "--params", sys.argv[2]]))
"""

KILL_POINTS = {
    "create_version": "the deploy run's artefacts and gate inputs are logged, no version exists",
    "publish": "the version exists with every tag, no alias has moved",
    "_move_champion": "challenger points to the new version, champion still to the old one",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("kill_project"))


def agentrl_deploy(params: Path, project: Path, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AGENTRL_LOCK", None)
    cmd = ([sys.executable, "-c", KILLED_DEPLOY, kill_at, str(params)] if kill_at else
           [sys.executable, "-m", "flows.cli", "deploy", "--params", str(params)])
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", list(KILL_POINTS))
def test_a_deploy_killed_at_each_registry_write_leaves_it_whole_and_the_rerun_finishes(project, tmp_path,
                                                                                        monkeypatch, kill_at):
    from pipeline.core.lock import repo_lock
    from pipeline.deploy.main import deploy
    from pipeline.deploy.registry import ModelRegistry, weights_digest
    from pipeline.deploy.registry_check import inspect

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    metrics = project / "metrics"
    first = deploy(deploy_config(project, NAME, **SMALL), ENV, ROLL, metrics, metrics / "deploy.json")
    assert first["decision"].passed  # v1: champion
    registry = ModelRegistry(NAME)
    before = snapshot(registry)
    deploy_json = (metrics / "deploy.json").read_bytes()

    new_policy = nudged_policy(project, tmp_path / "p2", 1e-6)  # other weights, the same episodes: it passes
    params = write_params(tmp_path, deploy_config(project, NAME, policy=new_policy, **SMALL))
    killed = agentrl_deploy(params, project, kill_at)
    assert killed.returncode == -signal.SIGKILL, (kill_at, killed.returncode, killed.stderr[-2000:])

    after = snapshot(registry)
    for version, tags in after["versions"].items():  # no version without its tags
        assert tags.get("weights.sha256") and tags.get("gate.decision") and tags.get("gate.vs_champion"), version
    if kill_at == "create_version":
        assert after == before
    elif kill_at == "publish":
        assert after["aliases"] == before["aliases"] and after["tags"] == before["tags"]
        assert {str(v) for v in after["versions"]} == {"1", "2"}
        # no alias reached v2, so its decision says passed, not promoted; `agentrl registry check` finds the orphan
        assert {str(v): t for v, t in after["versions"].items()}["2"]["gate.decision"] == "passed"
        assert [(f.kind, f.subject) for f in inspect(registry, time.time() * 1000, min_age_s=0)] == [("orphan", "v2")]
    else:
        aliases = {k: str(v) for k, v in before["aliases"].items()}
        assert {k: str(v) for k, v in after["aliases"].items()} == {**aliases, "challenger": "2"}
        assert after["tags"] == before["tags"]
        found = inspect(registry, time.time() * 1000, min_age_s=0)  # the move the killed deploy left half-made, and
        assert [f.kind for f in found] == ["half-moved", "stale-ticket"]  # its lease ticket (which blocks no one)
        assert found[0].subject == "v2"
    assert (metrics / "deploy.json").read_bytes() == deploy_json  # the killed run wrote no metrics
    assert not [p.name for p in metrics.iterdir() if p.name.startswith(".")]  # nor left a temporary file
    with repo_lock(tmp_path, "test"):  # the kernel released the killed holder's lock (its record stays, stale)
        pass

    rerun = agentrl_deploy(params, project)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    registry = ModelRegistry(NAME)
    champion = registry.alias_version("champion")
    assert registry.tags(champion)["weights.sha256"] == weights_digest(new_policy)
    assert registry.history()[-1] == champion and registry.history()[:-1] == ["1"]
    written = json.loads((metrics / "deploy.json").read_text())
    if kill_at == "_move_champion":  # completed, not registered again
        assert champion == "2" and written["unchanged"] == "2" and written["finished"].startswith("promoted v2")
        assert written["recorded_by"] is None and written["variants"] == {}  # killed before its run logged the record
        assert {str(v) for v in snapshot(registry)["versions"]} == {"1", "2"}
    else:
        assert written["version"] == champion and written["unchanged"] is None
