"""Serving: `agentrl serve` started by the test on the registry's champion (a real MLflow server, SQLite store) and
called over loopback: answers and trajectories, dynamic batching (batched answers equal one-at-a-time answers), the
cache, health and readiness; malformed, invalid (every field: wrong JSON type, out of range), oversized and
rate-limited requests refused with a 4xx before the model; a full queue answered 503 with Retry-After; the API key
(required to bind a non-loopback address, 401 without it); and a soak of 32 clients sending a mixed stream (no 5xx,
bounded memory). Servers that need a setting the subprocess lacks run in this process on the same champion."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from deploy_support import ENV, ROLL, build_project, deploy_config, free_port, mlflow_server, tracking_uri, wait_http, \
    write_params
from pipeline.deploy.config import ServeConfig

NAME = "policy-serve"


pytestmark = [pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
              pytest.mark.services]  # every test here reads from an MLflow server, most also from `agentrl serve`


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
    """`agentrl serve` in a subprocess on models:/NAME@champion: (base URL, project folder, the process)."""
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
        yield base, project, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_health_ready_and_a_task_in_answer_and_trajectory_out(server):
    base, project, _ = server
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
    base, project, _ = server
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
        (json.dumps({**task, "question": 7}).encode(), 422, "field 'question': input should be a valid string"),
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"task_id": "x"}).encode(), 422, "field 'question' is required"),
        (json.dumps({"question": ""}).encode(), 422, "at least 1 character"),
        (json.dumps({"question": "q", "tool": "update"}).encode(), 422, "unknown fields ['tool']"),
        (json.dumps({"question": "q" * 301}).encode(), 422, "more than the 300 allowed"),
        (json.dumps({"question": "q", "allowed_writes": "everything"}).encode(), 422, "allowed_writes"),
        (json.dumps({"question": "q", "seed": "zero"}).encode(), 422, "field 'seed': input should be a valid integer"),
        (json.dumps([1, 2]).encode(), 422, "must be a JSON object"),
        (json.dumps({"question": "q" * 3000}).encode(), 413, "exceeds the limit of 2048 bytes"),
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

    base, project, _ = server
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
    base, _, _ = server
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


# ------------------------------------------------------------------------------------------- invalid request fields
# Well-formed requests whose fields are of the wrong JSON type or out of range. The ones marked "was 500" reached the
# model and failed the whole batch before serve_validation.py; the others were accepted or misreported.
INVALID = [
    ("seed negative (was 500)", {"question": "q?", "seed": -1}, 422, "field 'seed': input should be greater than"),
    ("seed of 40 digits (was 500)", {"question": "q?", "seed": 10**40}, 422, "field 'seed': input should be less than"),
    ("seed past 64 bits (was 500)", {"question": "q?", "seed": 2**64}, 422, "field 'seed'"),
    ("seed past 32 bits", {"question": "q?", "seed": 2**32}, 422, "field 'seed'"),
    ("seed a bool", {"question": "q?", "seed": True}, 422, "field 'seed': input should be a valid integer"),
    ("seed a float", {"question": "q?", "seed": 1.5}, 422, "field 'seed': input should be a valid integer"),
    ("seed a string", {"question": "q?", "seed": "7"}, 422, "field 'seed': input should be a valid integer"),
    ("question missing", {"task_id": "x"}, 422, "field 'question' is required"),
    ("question blank", {"question": " \n\t "}, 422, "field 'question': must not be blank"),
    ("question a number", {"question": 7}, 422, "field 'question': input should be a valid string"),
    ("question a list", {"question": ["a"]}, 422, "field 'question': input should be a valid string"),
    ("question too long", {"question": "q" * 301}, 422, "field 'question': has 301 characters, more than the 300"),
    ("question with a lone surrogate", '{"question": "\\ud800 price?"}', 422, "field 'question': a string holds"),
    ("task_id a bool", {"question": "q?", "task_id": True}, 422, "field 'task_id': must be a string or an integer"),
    ("task_id a list", {"question": "q?", "task_id": []}, 422, "field 'task_id': must be a string or an integer"),
    ("task_id too long", {"question": "q?", "task_id": "x" * 300}, 422, "field 'task_id': has 300 characters"),
    ("task_id of 40 digits", {"question": "q?", "task_id": 10**40}, 422, "field 'task_id': must be an integer"),
    ("task_id with a lone surrogate (was 500)", '{"question": "q?", "task_id": "\\udfff"}', 422, "field 'task_id'"),
    ("answer an object", {"question": "q?", "answer": {"x": 1}}, 422, "field 'answer': must be a string or a number"),
    ("answer a bool", {"question": "q?", "answer": False}, 422, "field 'answer': must be a string or a number"),
    ("answer too long", {"question": "q?", "answer": "a" * 301}, 422, "field 'answer': has 301 characters"),
    ("answer NaN", '{"question": "q?", "answer": NaN}', 400, "NaN is not a JSON number"),
    ("answer Infinity", '{"question": "q?", "answer": -Infinity}', 400, "Infinity is not a JSON number"),
    ("integer of 1500 digits", '{"question": "q?", "task_id": ' + "9" * 1500 + "}", 422, "field 'task_id'"),
    ("nesting past 16 levels", {"question": "q?", "allowed_writes": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}, 422,
     "field 'allowed_writes[0]"),
    ("unknown field", {"question": "q?", "tool": "update"}, 422, "unknown fields ['tool']"),
    ("allowed_writes a string", {"question": "q?", "allowed_writes": "all"}, 422, "'allowed_writes' must be a list"),
    ("a number, not a task", 5, 422, "must be a JSON object"),
    ("a bare null", None, 422, "must be a JSON object"),
]


@pytest.mark.parametrize("body,status,reason", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_fields_get_4xx_naming_the_field_and_never_reach_the_model(server, body, status, reason):
    base, _, _ = server
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    before = httpx.get(f"{base}/stats").json()
    r = httpx.post(f"{base}/solve", content=content, headers={"content-type": "application/json"}, timeout=60)
    after = httpx.get(f"{base}/stats").json()
    assert r.status_code == status, (r.status_code, r.text)
    assert reason in r.json()["error"], r.json()
    assert after["batched_requests"] == before["batched_requests"]  # refused before the batcher


@pytest.fixture(scope="module")
def champion_solver(registry_with_champion):
    """The champion loaded in this process, for servers that need a setting or a model the subprocess lacks."""
    from pipeline.deploy.pyfunc import load_solver

    solver = load_solver(f"models:/{NAME}@champion")
    yield solver
    solver.close()


def test_json_the_parser_cannot_read_is_400_not_500(champion_solver):
    from pipeline.deploy.serve import ThreadedServer, create_app

    cfg = ServeConfig()  # the default body limit lets both bodies reach the parser
    bodies = [b'{"question": "q?", "seed": ' + b"9" * 4400 + b"}",  # past CPython's 4300-digit int limit (was 500)
              b"[" * 5000 + b"]" * 5000]  # past the recursion limit (was 500)
    assert all(len(b) <= cfg.max_body_bytes for b in bodies)
    with ThreadedServer(create_app(champion_solver, cfg), free_port()) as srv:
        replies = [httpx.post(f"{srv.url}/solve", content=b, timeout=60) for b in bodies]
    assert [r.status_code for r in replies] == [400, 400], [r.text for r in replies]
    assert "4300 digits" in replies[0].json()["error"] and "nests too deeply" in replies[1].json()["error"]


# ------------------------------------------------------------------------------------------------ oversized bodies
def test_oversized_bodies_get_413_over_http_even_while_the_client_still_sends(server):
    """A body over max_body_bytes (2048 here) is a 413 the client reads: declared in Content-Length, chunked (no
    length: counted as it streams), or declared huge by a client that then stalls; the connection is not reset."""
    import socket

    base, _, _ = server
    blob = b'{"question": "' + b"q" * 4_000_000 + b'"}'
    with httpx.Client(timeout=60) as client:
        declared = client.post(f"{base}/solve", content=blob)
        chunked = client.post(f"{base}/solve", content=(blob[i:i + 65536] for i in range(0, len(blob), 65536)))
        after = client.post(f"{base}/solve", json={"question": ""})  # the client's connection still works
    assert declared.status_code == 413 and "request body of 4000016 bytes exceeds the limit of 2048" in declared.text
    assert chunked.status_code == 413 and "exceeds the limit of 2048 bytes" in chunked.text
    assert after.status_code == 422
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /solve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n" + b"q" * 5000)  # a gigabyte declared, 5 kB sent, then nothing
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413 "), head[:100]
    assert httpx.get(f"{base}/health").status_code == 200


# ------------------------------------------------------------------------------------------------------ full queue
class GatedSolver:
    """The real champion, held at the start of each batch until `gate` opens: the queue behind it fills."""

    def __init__(self, solver):
        self.solver, self.gate = solver, threading.Event()
        self.seed, self.runtime, self.precision = solver.seed, solver.runtime, solver.precision

    def solve_tasks(self, tasks, seeds=None, truth=None):
        self.gate.wait(timeout=120)
        return self.solver.solve_tasks(tasks, seeds, truth)


def test_a_full_queue_answers_503_with_retry_after_and_no_500(champion_solver):
    from pipeline.deploy.serve import ThreadedServer, create_app

    gated = GatedSolver(champion_solver)
    cfg = ServeConfig(max_queue=2, max_batch_size=1, max_wait_ms=0, retry_after_s=3)
    with ThreadedServer(create_app(gated, cfg), free_port()) as srv, httpx.Client(timeout=120) as client, \
            ThreadPoolExecutor(24) as pool:
        def post(seed):
            return client.post(f"{srv.url}/solve", json={"question": 'What is the price of "Polar Kettle"?',
                                                         "seed": seed})

        def wait_for(pred):
            for _ in range(600):
                stats = client.get(f"{srv.url}/stats").json()
                if pred(stats):
                    return
                time.sleep(0.05)
            raise AssertionError(f"server state not reached: {stats}")

        running = pool.submit(post, 0)
        wait_for(lambda st: st["batches"] == 1)  # the first request is in the model, held at the gate
        waiting = [pool.submit(post, s) for s in (1, 2)]
        wait_for(lambda st: st["queued"] == 2)  # the queue is full
        refused = list(pool.map(post, range(3, 23)))  # 20 concurrent requests on a full queue
        gated.gate.set()
        served = [running.result()] + [f.result() for f in waiting]
        stats = client.get(f"{srv.url}/stats").json()
    assert [r.status_code for r in refused] == [503] * 20, [r.text for r in refused]
    assert all(r.headers["retry-after"] == "3" and "2 requests already waiting" in r.json()["error"] for r in refused)
    assert [r.status_code for r in served] == [200] * 3
    assert stats["rejected"] == {"busy": 20} and stats["batched_requests"] == 3


# --------------------------------------------------------------------------------------------------------- API key
def serve_cmd(params, *args) -> list[str]:
    return [str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(params), *args]


@pytest.mark.parametrize("args,key,expected", [
    (["--host", "0.0.0.0"], None, "error: serve: binding '0.0.0.0' (not a loopback address) requires an API key: set "
                                  "the environment variable AGENTRL_SERVE_API_KEY"),
    (["--host", "192.0.2.1"], "", "error: serve: binding '192.0.2.1' (not a loopback address) requires an API key"),
    (["--host", "0.0.0.0"], "short", "error: serve: the API key in AGENTRL_SERVE_API_KEY has 5 characters; use at "
                                     "least 16"),
    (["--port", "70000"], None, "error: serve: --port 70000 is not a TCP port"),
], ids=["any-address-without-key", "an-address-with-an-empty-key", "key-too-short", "port-out-of-range"])
def test_serve_refuses_to_start_with_one_error_line(registry_with_champion, tmp_path, args, key, expected):
    uri, _, cfg = registry_with_champion
    params = write_params(tmp_path, cfg)
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_SERVE_API_KEY"}
    if key is not None:
        env["AGENTRL_SERVE_API_KEY"] = key
    proc = subprocess.run(serve_cmd(params, *args, "--model-uri", f"models:/{NAME}@champion"),
                          env={**env, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr


def test_a_port_in_use_is_one_error_line_before_the_model_loads(registry_with_champion, tmp_path):
    import socket

    uri, _, cfg = registry_with_champion
    params = write_params(tmp_path, cfg)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(serve_cmd(params, "--port", str(port), "--model-uri", f"models:/{NAME}@champion"),
                              env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [l for l in proc.stderr.splitlines() if l.strip()] == [
        f"error: serve: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.slow
def test_with_an_api_key_requests_need_it_and_health_stays_open(registry_with_champion, tmp_path):
    uri, _, cfg = registry_with_champion
    params = write_params(tmp_path, cfg)
    key = "k3y-" + "x" * 28
    port = free_port()
    proc = subprocess.Popen(serve_cmd(params, "--port", str(port)), env={
        **os.environ, "MLFLOW_TRACKING_URI": uri, "AGENTRL_SERVE_API_KEY": key}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base, task = f"http://127.0.0.1:{port}", {"question": 'What is the price of "Polar Kettle"?'}
    try:
        wait_http(f"{base}/health", timeout=120, proc=proc)  # open: liveness probes carry no key
        good = {"Authorization": f"Bearer {key}"}
        for _ in range(600):  # /health answers once uvicorn runs; /ready once the batcher does
            if httpx.get(f"{base}/ready", headers=good).status_code == 200:
                break
            time.sleep(0.05)
        replies = {
            "no key": httpx.post(f"{base}/solve", json=task, timeout=60),
            "wrong key": httpx.post(f"{base}/solve", json=task, headers={"Authorization": f"Bearer {key[:-1]}y"},
                                    timeout=60),
            "not bearer": httpx.post(f"{base}/solve", json=task, headers={"Authorization": f"Basic {key}"},
                                     timeout=60),
            "non-ASCII key": httpx.post(f"{base}/solve", json=task,
                                        headers={"Authorization": "Bearer cl\u00e9".encode("latin-1")}, timeout=60),
            "stats without key": httpx.get(f"{base}/stats"),
            "ready without key": httpx.get(f"{base}/ready"),
        }
        ok = httpx.post(f"{base}/solve", json=task, headers=good, timeout=60)
        stats = httpx.get(f"{base}/stats", headers=good).json()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert {k: r.status_code for k, r in replies.items()} == {k: 401 for k in replies}
    assert replies["no key"].headers["www-authenticate"] == "Bearer"
    assert "missing or wrong API key" in replies["no key"].json()["error"]
    assert ok.status_code == 200 and ok.json()["n_calls"] >= 1
    assert stats["rejected"] == {"unauthorized": 6} and stats["batched_requests"] == 1
    assert key not in proc.stdout.read()  # the key is never printed


# ------------------------------------------------------------------------------------------------------------ soak
@pytest.mark.slow
def test_soak_32_clients_mixed_requests_no_5xx_and_bounded_memory(server):
    """bench/serve_soak.py's load for 20 s after a 5 s warm-up on the tiny champion: no 5xx, no broken connection,
    every malformed, invalid or oversized request a 4xx, valid ones 200, and resident memory after the warm-up
    growing less than 15 % (a leak check: the response cache and the batcher's state are bounded)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from serve_soak import run_soak

    base, project, proc = server
    tasks = [json.loads(l) for l in (project / "data/tasks/test.jsonl").read_text().splitlines()]
    rep = run_soak(base, proc.pid, clients=32, seconds=20, warmup_s=5, tasks=tasks, max_body=2048, max_chars=300)
    counts = rep["counts"]
    assert rep["n5xx"] == 0 and rep["transport_errors"] == {}, counts
    for kind in ("malformed_json", "invalid_field", "oversized"):
        assert counts[kind] and all(400 <= s < 500 for s in counts[kind]), (kind, counts[kind])
    assert set(counts["malformed_json"]) <= {400, 413} and set(counts["oversized"]) == {413}  # 413: over 2048 bytes
    assert set(counts["valid"]) <= {200, 429} and counts["valid"].get(200, 0) > 0, counts["valid"]
    assert rep["rss_end"] < 1.15 * rep["rss_start"], (rep["rss_start"], rep["rss_end"])
