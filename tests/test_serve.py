"""Serving: `agentrl serve` started by the test on the registry's champion (a real MLflow server, SQLite store) and
called over loopback: answers and trajectories, dynamic batching (batched answers equal one-at-a-time answers), the
cache, health and readiness, and malformed, oversized and rate-limited requests refused before the model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from deploy_support import ENV, ROLL, build_project, deploy_config, free_port, mlflow_server, tracking_uri, wait_http, \
    write_params
from pipeline.deploy.config import ServeConfig

NAME = "policy-serve"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def registry_with_champion(tmp_path_factory):
    from pipeline.deploy.main import deploy

    project = build_project(tmp_path_factory.mktemp("serve_project"))
    with mlflow_server(tmp_path_factory.mktemp("serve_mlflow")) as uri, tracking_uri(uri):
        cfg = deploy_config(project, NAME, precisions=["fp32", "int8"],
                            serve={"max_body_bytes": 2048, "max_question_chars": 300, "max_wait_ms": 50,
                                   "rate_limit_per_s": 1000, "rate_burst": 1000})
        out = deploy(cfg, ENV, ROLL, project / "metrics", project / "metrics" / "deploy.json")
        assert out["decision"].passed
        yield uri, project, cfg


@pytest.fixture(scope="module")
def server(registry_with_champion, tmp_path_factory):
    """`agentrl serve` in a subprocess on models:/NAME@champion."""
    uri, project, cfg = registry_with_champion
    params = write_params(tmp_path_factory.mktemp("serve_params"), cfg)
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(params),
                             "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/ready", timeout=120, proc=proc)
        yield base, project
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_health_ready_and_a_task_in_answer_and_trajectory_out(server):
    base, project = server
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{base}/ready").json()
    assert ready["status"] == "ready" and ready["model_uri"] == f"models:/{NAME}@champion" and ready["precision"] == "int8"
    r = httpx.post(f"{base}/solve", json={"question": 'What is the price of "Polar Kettle"?'}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is None and body["cached"] is False and body["n_calls"] == len(body["trajectory"]) >= 1
    assert all(s["observation"].startswith("<obs>") for s in body["trajectory"])
    task = json.loads((project / "data/tasks/test.jsonl").read_text().splitlines()[0])
    r = httpx.post(f"{base}/solve", json=task, timeout=60)
    assert r.status_code == 200 and isinstance(r.json()["success"], bool)  # a full task carries its ground truth


def test_malformed_requests_get_4xx_with_a_reason_and_never_reach_the_model(server):
    base, project = server
    task = json.loads((project / "data/tasks/test.jsonl").read_text().splitlines()[0])
    before = httpx.get(f"{base}/stats").json()
    cases = [
        # a complete task record is type-checked too (these used to fail inside the episode, a 500)
        (json.dumps({**task, "allowed_writes": 5}).encode(), 422, "'allowed_writes' must be list"),
        (json.dumps({**task, "plan": 5}).encode(), 422, "'plan' must be list"),
        (json.dumps({**task, "plan": [{"tool": "lookup"}]}).encode(), 422, "list of {tool, params} steps"),
        (json.dumps({**task, "min_calls": "x"}).encode(), 422, "'min_calls' must be int"),
        (json.dumps({**task, "entities": [{"x": 1}]}).encode(), 422, "'entities' must be a list of strings"),
        (json.dumps({**task, "family": "heist"}).encode(), 422, "'family' must be one of"),
        (json.dumps({**task, "level": task["level"] % 4 + 1}).encode(), 422, "but family"),
        (json.dumps({**task, "plan": [{"tool": "rm_rf", "params": {}}]}).encode(), 422, "unknown tools ['rm_rf']"),
        (json.dumps({**task, "question": 7}).encode(), 422, "'question' must be str"),
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"task_id": "x"}).encode(), 422, "'question' must be a non-empty string"),
        (json.dumps({"question": ""}).encode(), 422, "non-empty"),
        (json.dumps({"question": "q", "tool": "update"}).encode(), 422, "unknown fields ['tool']"),
        (json.dumps({"question": "q" * 301}).encode(), 422, "more than the 300 allowed"),
        (json.dumps({"question": "q", "allowed_writes": "everything"}).encode(), 422, "allowed_writes"),
        (json.dumps({"question": "q", "seed": "zero"}).encode(), 422, "'seed' must be an integer"),
        (json.dumps([1, 2]).encode(), 422, "must be a JSON object"),
        (json.dumps({"question": "q" * 3000}).encode(), 413, "exceeds 2048"),
    ]
    for body, status, reason in cases:
        r = httpx.post(f"{base}/solve", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (body[:40], r.status_code, r.text)
        assert reason in r.json()["error"], r.json()
    after = httpx.get(f"{base}/stats").json()
    assert after["batched_requests"] == before["batched_requests"]  # none of them reached the model
    assert sum(after["rejected"].values()) - sum(before["rejected"].values()) == len(cases)


def test_concurrent_requests_share_batches_and_match_one_at_a_time_answers(server, registry_with_champion):
    from pipeline.deploy.config import ServeConfig
    from pipeline.deploy.pyfunc import load_solver, parse_task

    base, project = server
    tasks = [json.loads(l) for l in (project / "data/tasks/test.jsonl").read_text().splitlines()[:12]]
    before = httpx.get(f"{base}/stats").json()
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda t: client.post(f"{base}/solve", json={**t, "seed": 7}), tasks))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    after = httpx.get(f"{base}/stats").json()
    assert after["batches"] - before["batches"] < len(tasks)  # requests were batched together
    assert max(r.json()["batch_size"] for r in replies) > 1
    # the same tasks solved one at a time in this process give the same episodes
    solver = load_solver(f"models:/{NAME}@champion")
    for task, reply in zip(tasks, replies):
        (alone,) = solver.solve_tasks([parse_task(task, ServeConfig().max_question_chars, solver.runtime)], [7])
        assert reply.json()["trajectory"] == alone["trajectory"] and reply.json()["answer"] == alone["answer"]
    solver.close()


def test_identical_requests_are_served_from_the_cache(server):
    base, _ = server
    req = {"question": 'How much do 3 units of "Cache Probe" cost?', "seed": 3}
    first = httpx.post(f"{base}/solve", json=req, timeout=60).json()
    before = httpx.get(f"{base}/stats").json()
    second = httpx.post(f"{base}/solve", json=req, timeout=60).json()
    after = httpx.get(f"{base}/stats").json()
    assert first["cached"] is False and second["cached"] is True
    assert {k: v for k, v in second.items() if k != "cached"} == {k: v for k, v in first.items() if k != "cached"}
    assert after["cache_hits"] == before["cache_hits"] + 1 and after["batches"] == before["batches"]
    other = httpx.post(f"{base}/solve", json={**req, "seed": 4}, timeout=60).json()
    assert other["cached"] is False  # another seed is another request


def test_rate_limit_answers_429_per_client(registry_with_champion):
    from pipeline.deploy.pyfunc import load_solver
    from pipeline.deploy.serve import ThreadedServer, create_app

    solver = load_solver(f"models:/{NAME}@champion")
    app = create_app(solver, ServeConfig(rate_limit_per_s=0.5, rate_burst=3))
    with ThreadedServer(app, free_port()) as srv:
        codes = [httpx.post(f"{srv.url}/solve", content=b"{}", timeout=30).status_code for _ in range(6)]
        stats = httpx.get(f"{srv.url}/stats").json()
    solver.close()
    assert codes[:3] == [422, 422, 422] and codes[3:] == [429, 429, 429]
    assert stats["rejected"] == {"invalid": 3, "rate_limit": 3} and stats["batches"] == 0


def test_serving_a_model_uri_that_does_not_exist_fails_clearly(registry_with_champion, tmp_path):
    uri, _, cfg = registry_with_champion
    params = write_params(tmp_path, cfg)
    proc = subprocess.run([str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(params),
                           "--model-uri", f"models:/{NAME}/99", "--port", str(free_port())],
                          env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"error: cannot load model 'models:/{NAME}/99'" in proc.stderr


@pytest.mark.slow
def test_mlflow_models_serve_runs_the_logged_model(registry_with_champion, tmp_path):
    uri, project, _ = registry_with_champion
    port = free_port()
    log = tmp_path / "mlflow-serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m",
                                 f"models:/{NAME}@champion", "--env-manager", "local", "-p", str(port), "-h",
                                 "127.0.0.1"], env={**os.environ, "MLFLOW_TRACKING_URI": uri,  # mlflow execs `uvicorn` by name
                                                 "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
                                stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/ping", timeout=180, proc=proc)
        except RuntimeError as exc:  # show why the server did not come up
            raise RuntimeError(f"{exc}; its output ends with:\n{log.read_text()[-3000:]}") from None
        r = httpx.post(f"http://127.0.0.1:{port}/invocations", json={"inputs": [{"question": "What is 2 + 2?"}]},
                       timeout=120)
        assert r.status_code == 200, r.text
        (pred,) = r.json()["predictions"]
        assert pred["n_calls"] == len(pred["trajectory"]) >= 1
    finally:
        if proc.poll() is None:  # a server that already exited must not hide the real failure
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
