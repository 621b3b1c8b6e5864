"""The repository lock (pipeline.core.lock) held by a real other process: `agentrl promote`, `deploy`, `rollback` and
`run` are refused at once with one error line naming the holder and exit 2, and the registry (a real SQLite MLflow
store with a champion) is left exactly as it was; a command inside the holder's run (its token) is let through; a
holder killed with SIGKILL frees the lock at once. The flow's own stages running inside `agentrl run`'s lock are
covered by tests/test_flow.py's full run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_support import deploy_config, write_params
from pipeline.core.errors import AgentRLError
from pipeline.core.lock import LOCK_ENV, LockHeld, lock_path, repo_lock

HOLD = """
import json, sys, time
from pipeline.core.lock import repo_lock
with repo_lock(sys.argv[1], sys.argv[2]) as holder:
    print(json.dumps(holder), flush=True)
    time.sleep(600)
"""


def hold(root: Path, command: str) -> tuple[subprocess.Popen, dict]:
    """A process that takes the lock of `root` as `command` and sleeps; returns it and what it wrote."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root), command], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    line = proc.stdout.readline()
    assert line, f"the holder exited with {proc.wait()}"
    return proc, json.loads(line)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()


@pytest.fixture
def registry_project(tmp_path, monkeypatch):
    """A project folder with params.yaml and a SQLite MLflow store holding model 'locked-model': v1 champion (with
    a history), v2 challenger."""
    from pipeline.deploy.registry import ModelRegistry

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv(LOCK_ENV, raising=False)
    write_params(tmp_path, deploy_config(tmp_path, "locked-model"))
    registry = ModelRegistry("locked-model", uri)
    registry.client.create_registered_model("locked-model", tags={"agentrl.champion_history": '["1"]'})
    for digest in ("aaa", "bbb"):
        registry.client.create_model_version("locked-model", (tmp_path / "src").as_uri(),
                                             tags={"weights.sha256": digest, "gate.decision": "promoted"})
    registry.client.set_registered_model_alias("locked-model", "champion", "1")
    registry.client.set_registered_model_alias("locked-model", "challenger", "2")
    return tmp_path, registry


def snapshot(registry) -> dict:
    rm = registry.client.get_registered_model(registry.name)
    return {"aliases": dict(rm.aliases), "tags": dict(rm.tags),
            "versions": {str(v.version): dict(v.tags) for v in registry.client.search_model_versions(
                f"name='{registry.name}'")}}


def test_commands_are_refused_while_another_process_holds_the_lock(registry_project, capsys):
    from flows.cli import main

    root, registry = registry_project
    params = str(root / "params.yaml")
    before = snapshot(registry)
    holder_proc, holder = hold(root, "deploy")
    try:
        for argv in (["promote", "--version", "2"], ["deploy"], ["rollback"], ["promote", "--dry-run"]):
            assert main([*argv, "--params", params]) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("error: this repository is locked by `agentrl deploy` "
                                                           f"(pid {holder_proc.pid} on "), err
            assert f"started {holder['started']})" in err and f"`agentrl {' '.join(argv)} --params" in err
            assert snapshot(registry) == before
        # the real command line, in a process of its own: `agentrl run` stops before Prefect or DVC start
        proc = subprocess.run([str(Path(sys.executable).parent / "agentrl"), "run"], cwd=root, capture_output=True,
                              text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != LOCK_ENV})
        assert proc.returncode == 2 and proc.stderr.startswith("error: this repository is locked by `agentrl deploy`")
        assert proc.stderr.count("\n") == 1 and not (root / ".prefect").exists()
    finally:
        stop(holder_proc)
    assert snapshot(registry) == before
    # free again: rollback gets past the lock to its own checks (v1 is the only champion the history holds)
    assert main(["rollback", "--params", params]) == 2
    assert "no previous champion" in capsys.readouterr().err


def test_a_command_inside_the_holders_run_passes_and_a_killed_holder_frees_the_lock(tmp_path, monkeypatch):
    monkeypatch.delenv(LOCK_ENV, raising=False)
    holder_proc, holder = hold(tmp_path, "run")
    try:
        assert json.loads(lock_path(tmp_path).read_text()) == holder  # who holds it, for the refused to read
        with pytest.raises(LockHeld, match=r"locked by `agentrl run` .*`agentrl train` is refused"):
            with repo_lock(tmp_path, "train"):
                pass
        monkeypatch.setenv(LOCK_ENV, "another-run's-token")  # a token of some other holder counts for nothing
        with pytest.raises(LockHeld):
            with repo_lock(tmp_path, "train"):
                pass
        monkeypatch.setenv(LOCK_ENV, holder["token"])  # a stage the run launched: runs inside the run's lock
        with repo_lock(tmp_path, "train") as inside:
            assert inside == holder
        assert json.loads(lock_path(tmp_path).read_text()) == holder  # the stage took nothing and left it as it was
        os.kill(holder_proc.pid, signal.SIGKILL)  # no cleanup code runs: the kernel drops the flock with the process
        holder_proc.wait()
        with repo_lock(tmp_path, "train") as mine:  # the stale token in the environment no longer matters
            assert mine["command"] == "train" and mine["pid"] == os.getpid() and os.environ[LOCK_ENV] == mine["token"]
        assert os.environ[LOCK_ENV] == holder["token"]  # the environment is restored on release
    finally:
        stop(holder_proc)
    with repo_lock(tmp_path, "deploy"):  # released after the block
        pass


def test_a_lock_that_cannot_be_created_is_one_error_naming_it(tmp_path):
    (tmp_path / ".agentrl").write_text("a file where the lock's folder belongs")
    with pytest.raises(AgentRLError, match=r"cannot open the repository lock .*\.agentrl/lock"):
        with repo_lock(tmp_path, "deploy"):
            pass
