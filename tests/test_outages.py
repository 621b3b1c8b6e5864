"""Outages while `train` runs: a disk that fills up under a checkpoint, a tracking server that goes away.

- A full disk is simulated as in tests/test_faults.py, with the file-size limit (``RLIMIT_FSIZE``; Python ignores
  SIGXFSZ), so a write past the limit fails with EFBIG as one on a full disk fails with ENOSPC; torch's zip writer
  (which DeepSpeed's checkpoints go through) reports either without an errno. The limit is set on the running
  `agentrl train` and every process it started (``prlimit``) once the run has resumed from its checkpoint: DeepSpeed
  builds its C++ communication op when it starts, and a compiler under the limit fails first. The limit lies between
  the optimizer state's size and that of every other file the run writes, so the run trains, validates and saves
  its best policy, and fails in the checkpoint. Two cases: one rank in the `agentrl train` process (a DeepSpeed
  engine, ZeRO-2 with one partition) and two DeepSpeed ranks started by the launcher (each writes its own optimizer
  partition). Each time: one ``error:`` line naming the checkpoint, no traceback, the previous checkpoint
  byte-identical and still the one ``latest`` names, no half-written checkpoint left, no policy or metrics
  published; the rerun on a disk with room resumes from the previous checkpoint and finishes.
- A real `mlflow server` killed (SIGKILL) while `agentrl train` logs to it: the run keeps training untracked, says
  so in one ``warning:`` line, and publishes the same policy and metrics as a run that was never tracked; the
  restarted server has the run with what it logged before. A server that is down when `train` starts is one
  ``error:`` line before anything trains; one killed once `agentrl evaluate` has opened its run is one ``error:``
  line from the command line, with the phase's outputs absent or whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_kills import reference  # noqa: F401 - the tiny project every phase ran in once (a module fixture)

BIN = Path(sys.executable).parent


def files(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def train_env(**extra: str) -> dict[str, str]:
    from pipeline.train.distributed import child_env

    return child_env({"PYTHONUNBUFFERED": "1", "AGENTRL_TRACKING": "off", "PYTHONWARNINGS": "ignore", **extra})


def agentrl_train(project: Path, env: dict, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "agentrl"), "train"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=900, preexec_fn=preexec_fn)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


# ------------------------------------------------------------------------------------ a full disk in a checkpoint


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += [c for c, parent in parents.items() if parent == p]
    return tree


def fill_the_disk_once_resumed(project: Path, limit: int) -> tuple[int, str]:
    """`agentrl train` in `project`; once it has resumed from its checkpoint (every rank past DeepSpeed's start-up,
    which builds its C++ ops and must not meet the limit), the file-size limit of it and of every process it started
    is set to `limit` bytes, as if the disk had just filled up. Returns the exit status and the whole output."""
    import resource

    proc = subprocess.Popen([str(BIN / "agentrl"), "train"], cwd=project, env=train_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            assert not line.startswith("update "), "the run started over instead of resuming:\n" + "".join(lines)
            if line.startswith("resumed from"):
                for pid in descendants(proc.pid):
                    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, limit))
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-deepspeed-ranks"])
def test_a_full_disk_in_a_checkpoint_is_one_error_line_and_keeps_the_previous_checkpoint(ranks, tmp_path):
    from test_train import _worker, make_project

    proj = make_project(tmp_path / "p", updates=4, ranks=ranks)
    first = _worker(proj, "--stop-after", "2", env_extra={"AGENTRL_TRACKING": "off"}, ranks=ranks)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (run,) = (proj / "checkpoints" / "train").iterdir()
    assert (run / "latest").read_text().strip() == "update-2"
    before = files(run / "update-2")
    size = {name: (run / "update-2" / name).stat().st_size for name in before}
    optim = [size[name] for name in size if "optim_states" in name]  # one partition per rank
    assert len(optim) == ranks, size
    limit = (min(optim) + max(v for name, v in size.items() if "optim_states" not in name)) // 2
    assert max(v for name, v in size.items() if "optim_states" not in name) < limit < min(optim), size
    assert (run / "best" / "model.safetensors").stat().st_size < limit  # the best policy can still be saved

    rc, out = fill_the_disk_once_resumed(proj, limit)
    assert rc == 2, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-4000:]
    assert errors[0].startswith(f"error: {run.relative_to(proj)}/update-4: cannot write it: write failed (disk full, "
                                "file too large or a failing disk); the previous version, if any, is unchanged"), errors
    assert "update 4/4" in out  # it trained updates 3 and 4 and failed in their checkpoint
    assert (run / "latest").read_text().strip() == "update-2"
    assert files(run / "update-2") == before
    assert not (run / "update-4").exists()  # the half-written checkpoint is gone
    assert not (proj / "models" / "policy").exists() and not (proj / "metrics" / "train.json").exists()

    again = agentrl_train(proj, train_env())  # room again: resumes from update 2 and finishes
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "resumed from" in again.stdout and "at update 2" in again.stdout
    assert (run / "latest").read_text().strip() == "update-4"
    assert (proj / "models" / "policy" / "model.safetensors").is_file()
    assert json.loads((proj / "metrics" / "train.json").read_text())["updates"] == 4


# ------------------------------------------------------------------------------ the tracking server lost in train

FAST_FAILURE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}  # a dead server is given up on in seconds, not half a minute


def outputs(project: Path) -> dict:
    """What a train run publishes, without its timings: the policy's bytes, the metrics' figures, the curve's
    columns that are not times."""
    metrics = json.loads((project / "metrics" / "train.json").read_text())
    curve = [line.split(",")[:5] for line in (project / "metrics" / "train_curve.csv").read_text().splitlines()]
    return {"policy": files(project / "models" / "policy"), "evals": metrics["evals"], "test": metrics["test"],
            "best_update": metrics["best_update"], "curve": curve}


@pytest.mark.services
def test_the_tests_mlflow_server_runs_no_job_consumers_and_leaves_nothing_in_dev_shm(tmp_path):
    """The `mlflow server` the tests start (tests/services.py SERVER_ENV) is the server and its one worker: MLflow 3's
    GenAI job execution, on by default, would start eight huey consumers beside it and leave its store folder in
    /dev/shm after it stops, on every start in the suite."""
    import time

    from deploy_support import mlflow_server

    shm = Path("/dev/shm")
    before = set(shm.iterdir()) if shm.is_dir() else set()
    servers: list = []
    with mlflow_server(tmp_path / "store", started=servers):
        time.sleep(2)  # job consumers start after the server answers
        assert len(descendants(servers[0].pid)) == 2  # `mlflow server` and its uvicorn worker
    left = {p for p in (set(shm.iterdir()) if shm.is_dir() else set()) - before
            if p.is_dir() and any(f.name.endswith(".mlflow-huey-store") for f in p.iterdir())}
    assert not left, left


@pytest.mark.slow
@pytest.mark.services
def test_a_tracking_server_lost_during_train_is_one_line_and_the_run_finishes(tmp_path):
    from deploy_support import mlflow_server
    from mlflow.tracking import MlflowClient
    from test_train import make_project, trained_reference

    reference = trained_reference()  # the same run, never tracked (built once per test run)
    proj = make_project(tmp_path / "p", updates=4)
    store, servers = tmp_path / "store", []
    with mlflow_server(store, started=servers) as uri:
        port = int(uri.rsplit(":", 1)[1])
        proc = subprocess.Popen([str(BIN / "agentrl"), "train"], cwd=proj,
                                env=train_env(AGENTRL_TRACKING="on", MLFLOW_TRACKING_URI=uri, **FAST_FAILURE),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("update 2/4"):  # updates 1 and 2 are logged: the server dies
                    os.killpg(servers[0].pid, signal.SIGKILL)
                    servers[0].wait()
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out = "".join(lines)
        assert servers[0].returncode == -signal.SIGKILL, out[-3000:]  # it was killed mid-run
    assert proc.returncode == 0, out[-4000:]
    said = [line for line in out.splitlines() if "did not answer" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: train: the MLflow tracking server at {uri} did not "
                                                 "answer"), out[-4000:]
    assert "is not tracked from here on" in said[0]
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    assert "update 4/4" in out
    assert outputs(proj) == outputs(reference)  # trained and published as if nothing had happened

    with mlflow_server(store, port=port) as uri:  # back on the same store: the run has what it logged before
        client = MlflowClient(uri)
        (run,) = client.search_runs([client.get_experiment_by_name("agentrl").experiment_id])
        assert run.data.tags["mlflow.runName"] == "train" and run.info.status == "RUNNING"
        steps = {m.step for m in client.get_metric_history(run.info.run_id, "rollout/success")}
        assert steps and steps <= {1, 2}, steps


@pytest.mark.slow
def test_a_tracking_server_down_when_train_starts_is_one_error_line_and_nothing_is_run(tmp_path):
    from services import free_port
    from test_train import make_project

    proj = make_project(tmp_path / "p", updates=2)
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = agentrl_train(proj, train_env(AGENTRL_TRACKING="on", MLFLOW_TRACKING_URI=uri, **FAST_FAILURE))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    errors = error_lines(proc)
    assert len(errors) == 1 and "Traceback" not in out, out[-4000:]
    assert errors[0].startswith(f"error: train: cannot open its MLflow run: the MLflow tracking server at {uri} did "
                                "not answer"), errors
    assert errors[0].endswith("nothing was run; start the tracking server (or set AGENTRL_TRACKING=off for a phase "
                              "that can run untracked)")
    assert not (proj / "checkpoints").exists() and not (proj / "models" / "policy").exists()


@pytest.mark.services
@pytest.mark.parametrize("on_outage", ["fail", "continue"])
def test_a_store_lost_inside_a_phase_run_is_raised_once_or_ridden_out(on_outage, tmp_path, monkeypatch, capsys,
                                                                       caplog):
    """The tracker's own handling, in process, against a real server killed inside a run: a phase's run raises the
    store's failure as it is (the caller or the command line says it in one line) without asking the dead store again
    to mark the run; a run made with on_outage="continue" says so in one line and its later calls do nothing."""
    from deploy_support import mlflow_server

    from pipeline.core.tracking import Tracker, store_failure

    for key, value in FAST_FAILURE.items():
        monkeypatch.setenv(key, value)
    servers: list = []
    outcome = None
    with mlflow_server(tmp_path / "store", started=servers) as uri:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        tracker = Tracker(root=tmp_path, on_outage=on_outage)
        try:
            with tracker.run("phase", params={"a": 1}) as run:
                run.log_metrics({"x": 1.0}, step=1)
                os.killpg(servers[0].pid, signal.SIGKILL)
                servers[0].wait()
                run.log_metrics({"x": 2.0}, step=2)
                run.set_tags({"after": "outage"})
                outcome = "went on"
        except Exception as exc:  # noqa: BLE001 - what the store's failure is raised as is the point
            outcome = store_failure(exc)
    said = [line for line in capsys.readouterr().err.splitlines() if "did not answer" in line]
    if on_outage == "fail":
        assert outcome is not None and outcome.startswith(f"the MLflow tracking server at {uri} did not answer")
        assert not said and "could not mark" not in caplog.text  # the dead store was not asked again
    else:
        assert outcome == "went on" and run.lost is not None
        assert len(said) == 1 and said[0].startswith(f"warning: phase: the MLflow tracking server at {uri}"), said


@pytest.mark.slow
@pytest.mark.services
def test_a_tracking_server_lost_inside_another_phase_is_one_error_line(reference, tmp_path):
    """`agentrl evaluate` whose server dies once its run is open: exit 2, one `error:` line, no traceback, and its
    outputs absent or whole (the phase logs after it wrote them)."""
    import shutil
    import time

    from deploy_support import mlflow_server
    from mlflow.tracking import MlflowClient
    from test_kills import env_of, published

    ref, _ = reference
    root = tmp_path / "project"
    shutil.copytree(ref, root, symlinks=True, ignore=shutil.ignore_patterns(".agentrl"))
    outs = ("metrics/evaluate.json", "metrics/evaluate_success.csv")
    expected = {path: published(ref, path) for path in outs}
    for path in outs:
        (root / path).unlink()
    servers: list = []
    with mlflow_server(tmp_path / "store", started=servers) as uri:
        env = {**env_of(root), "AGENTRL_TRACKING": "on", "MLFLOW_TRACKING_URI": uri, **FAST_FAILURE}
        log = tmp_path / "evaluate.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([str(BIN / "agentrl"), "evaluate"], cwd=root, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            client = MlflowClient(uri)
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:  # until the phase's run is open
                exp = client.get_experiment_by_name("agentrl")
                if exp is not None and client.search_runs([exp.experiment_id]):
                    break
                time.sleep(0.2)
            os.killpg(servers[0].pid, signal.SIGKILL)
            servers[0].wait()
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert proc.returncode == 2, text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in text, text[-4000:]
    assert errors[0].startswith(f"error: evaluate: the MLflow tracking server at {uri} did not answer"), errors
    for path in outs:
        assert published(root, path) in (None, expected[path]), path
