"""The scheduled retraining deployment on a real `prefect server`: `agentrl schedule` without a server says how to
start one; with one, the deployment served by `agentrl schedule` runs when triggered by hand, the same deployment from
prefect.yaml on a `process` work pool runs on a worker, and a schedule added to it fires on its own.

The project is a temporary copy of this repository (tests/test_flow.py builds it), with its own MLflow store and
Prefect home.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from test_flow import BIN, agentrl, clean_env, make_project, runs

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, what: str, timeout: float, procs: tuple = ()) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[:3]} exited with {p.returncode} while waiting for {what}")
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    """End a process-group leader and every child it started (a served flow run, the server's own)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # Prefect's worker, server and runner shut down cleanly on Ctrl-C
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _scheduled_run(port: int, deployment_id: str, due: datetime) -> dict | None:
    """The deployment's completed flow run that its schedule created for `due` (None while there is none)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/flow_runs/filter", method="POST",
                                 data=json.dumps({"deployments": {"id": {"any_": [deployment_id]}}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        found = json.loads(r.read())
    return next((f for f in found if f["auto_scheduled"] and f["state_type"] == "COMPLETED"
                 and datetime.fromisoformat(f["expected_start_time"]) == due), None)


def test_schedule_without_a_server_says_how_to_start_one(tmp_path):
    root = make_project(tmp_path / "project")
    env = clean_env(root)
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile with an API URL either
    proc = agentrl(root, "schedule", env=env, timeout=120)
    assert proc.returncode == 2
    assert "prefect server start" in proc.stderr and "PREFECT_API_URL" in proc.stderr and "--once" in proc.stderr


@pytest.mark.slow
@pytest.mark.services
def test_the_retraining_deployment_runs_by_hand_when_served_and_on_a_worker_and_its_schedule_fires(tmp_path):
    root = make_project(tmp_path / "project")  # no data yet: each run records that there is nothing to do
    port = _free_port()
    env = clean_env(root)
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
                "PREFECT_WORKER_QUERY_SECONDS": "2",  # the worker polls its pool every 2 s (default 10)
                "PREFECT_RUNNER_POLL_FREQUENCY": "2",  # and `agentrl schedule`'s runner its deployment (default 10)
                # the server's scheduler looks for schedules to fill every 2 s (default 60: a schedule created less
                # than a minute before its first run would miss it)
                "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"})
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("server", "serve", "worker")}
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=tmp_path, env=env, stdout=logs["server"], stderr=subprocess.STDOUT,
                              start_new_session=True)
    served = worker = None

    def prefect(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "prefect"), *args], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)

    try:
        _wait(lambda: _healthy(f"http://127.0.0.1:{port}/api/health"), "prefect server", 120, (server,))
        served = subprocess.Popen([str(BIN / "agentrl"), "schedule"], cwd=root, env=env, stdout=logs["serve"],
                                  stderr=subprocess.STDOUT, start_new_session=True)
        name = "agentrl-retrain/nightly-retrain"

        def deployed() -> bool:
            p = subprocess.run([str(BIN / "prefect"), "deployment", "inspect", name], env=env, capture_output=True,
                               text=True, timeout=60)
            return p.returncode == 0 and "0 3 * * *" in p.stdout  # the cron schedule of prefect.yaml

        _wait(deployed, "the served deployment", 120, (server, served))
        run = prefect("deployment", "run", name, "--watch", "--watch-timeout", "300", timeout=360)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout + run.stderr
        _stop(served)

        # The same deployment from prefect.yaml on a process work pool, run by a worker (README: past one machine).
        env["PWD"] = str(root)  # as a shell in the repository root sets it: prefect.yaml's pull step reads $PWD
        for args in (("work-pool", "create", "agentrl", "--type", "process"),
                     ("--no-prompt", "deploy", "--name", "nightly-retrain")):
            made = prefect(*args)
            assert made.returncode == 0, made.stdout + made.stderr
        started = time.monotonic()
        inspected = json.loads(prefect("deployment", "inspect", name, "--output", "json").stdout)
        cli_s = time.monotonic() - started  # what one `prefect` command takes on this machine now
        (step,) = inspected["pull_steps"]
        assert step["prefect.deployments.steps.set_working_directory"]["directory"] == str(root)  # runs in the project
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "agentrl"], cwd=tmp_path,
                                  env=env, stdout=logs["worker"], stderr=subprocess.STDOUT, start_new_session=True)
        run = prefect("deployment", "run", name, "--watch", "--watch-timeout", "300", timeout=360)
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout + run.stderr

        # The schedule fires: one more schedule on the deployment, due a few seconds from now (time for the command
        # that creates it, three times over); the server's scheduler creates the run and the worker runs it to
        # completion without anyone triggering it.
        due = (datetime.now(timezone.utc) + timedelta(seconds=6 + 3 * cli_s)).replace(microsecond=0)
        made = prefect("deployment", "schedule", "create", name, "--interval", "3600", "--anchor-date",
                       due.isoformat(), "--timezone", "UTC")
        assert made.returncode == 0, made.stdout + made.stderr
        _wait(lambda: _scheduled_run(port, inspected["id"], due) is not None, "the scheduled run", 240,
              (server, worker))
    finally:
        for proc in (worker, served, server):
            if proc is not None:
                _stop(proc)
        for log in logs.values():
            log.close()
    records = runs(root, "retrain")  # every run wrote to the project's own MLflow store
    assert len(records) == 3 and all(r.info.status == "FINISHED" for r in records)
    assert all(r.data.tags["retrain.decision"] == "nothing needed" for r in records)
    assert all(r.data.tags["retrain.reason"].startswith("no incoming tasks") for r in records)
