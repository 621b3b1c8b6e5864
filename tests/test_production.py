"""The production side of `agentrl serve`: capture, feedback and live monitoring, against the real server over loopback
(`agentrl serve` started by the test on a champion in a real MLflow server, as tests/test_serve.py does) driven by a
bounded traffic generator (a fixed list of requests from the test split).

Capture with redaction (a secret in a redacted field and copied into the question never reaches the disk) and
retention (small segments and a small size limit: the oldest segments go, the newest requests stay); a server killed
with SIGKILL under load leaves only whole records and every answer it returned in them; feedback reaches the
reward model's training data (and its report of agreement with people); ``/metrics`` parses as Prometheus text, and
its drift gauges move on shifted traffic. The redactor, the segment recovery and the label rule also get direct
tests on real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deploy_support import ENV, ROLL, build_project, deploy_config, free_port, mlflow_server, parse_prometheus, \
    tracking_uri, wait_http, write_params
from pipeline.deploy.capture import CaptureStore, Redactor, REDACTED
from pipeline.deploy.config import CaptureConfig
from pipeline.core.traffic import labelled_episodes, read_records, segment_files

NAME = "policy-production"
SECRET = "ticket-SECRET-4711"

pytestmark = pytest.mark.usefixtures("one_thread")  # the tests that start a server are marked `services` one by one


@pytest.fixture(scope="module")
def champion(tmp_path_factory):
    from pipeline.deploy.main import deploy

    project = build_project(tmp_path_factory.mktemp("prod_project"))
    with mlflow_server(tmp_path_factory.mktemp("prod_mlflow")) as uri, tracking_uri(uri):
        cfg = deploy_config(project, NAME, precisions=["fp32", "int8"])
        out = deploy(cfg, ENV, ROLL, project / "metrics", project / "metrics" / "deploy.json")
        assert out["decision"].passed
        yield uri, project, cfg


def start_server(champion, tmp: Path, capture: dict, monitor: dict | None = None, alarm: dict | None = None):
    """`agentrl serve` on models:/NAME@champion with these capture and monitor settings (and `alarm`: settings of
    deploy.snapshot, the drift alarm's thresholds): (base URL, process)."""
    uri, project, cfg = champion
    cfg = cfg.model_copy(update={"snapshot": cfg.snapshot.model_copy(update=alarm or {})})
    serve = cfg.serve.model_copy(update={"rate_limit_per_s": 1000.0, "rate_burst": 1000, "max_wait_ms": 20.0})
    serve = type(serve).model_validate({**serve.model_dump(), "capture": {"enabled": True, **capture},
                                        "monitor": {"reference_tasks": str(project / "data/tasks/train.jsonl"),
                                                    "reference_demos": str(project / "data/demos/train.jsonl"),
                                                    "window": 10, **(monitor or {})}})
    params = write_params(tmp, cfg.model_copy(update={"serve": serve}))
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(params),
                             "--port", str(port)],
                            env={**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/ready", timeout=120, proc=proc)
    return base, proc


def stop_server(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(champion, tmp_path_factory):
    """The module's one long-lived server: capture on with `task_id` redacted, small segments, a small size limit."""
    tmp = tmp_path_factory.mktemp("prod_serve")
    folder = tmp / "traffic"
    base, proc = start_server(champion, tmp, {"dir": str(folder), "redact": ["task_id"], "segment_max_bytes": 8192,
                                              "retention_bytes": 32768},
                              alarm={"min_requests": 10, "alarm_question_chars_ks": 0.95,  # question length alone
                                     "alarm_calls_per_task_ks": 1.0, "alarm_tool_mix_tv": 1.0})
    try:
        yield base, folder, champion[1]
    finally:
        stop_server(proc)


def traffic(project: Path, n: int, start: int = 0) -> list[dict]:
    """A bounded stream of requests: the test split's questions (some with their full record, which carries the ground
    truth), seeds start, start+1, ... (distinct: no cache hit)."""
    tasks = [json.loads(l) for l in (project / "data/tasks/test.jsonl").read_text().splitlines()]
    out = []
    for i in range(n):
        t = tasks[i % len(tasks)]
        out.append({**t, "seed": start + i} if i % 3 == 0 else {"question": t["question"], "seed": start + i})
    return out


def post_all(base: str, requests: list[dict], client: httpx.Client) -> list[dict]:
    replies = [client.post(f"{base}/solve", json=r) for r in requests]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json() for r in replies]


# ---------------------------------------------------------------------------------------------------------- capture
@pytest.mark.services
def test_answers_are_captured_with_a_request_id_and_redacted_fields_never_reach_the_disk(server):
    base, folder, project = server
    with httpx.Client(timeout=120) as client:
        secret = client.post(f"{base}/solve", json={"question": f"Status of {SECRET}: what is the price of "
                                                                '"Polar Kettle"?', "task_id": SECRET, "seed": 1})
        replies = post_all(base, traffic(project, 4, start=100), client)
        cached = client.post(f"{base}/solve", json=traffic(project, 1, start=100)[0]).json()
    assert secret.status_code == 200 and secret.json()["task_id"] == SECRET  # the caller's answer is not redacted
    ids = [secret.json()["request_id"]] + [r["request_id"] for r in replies] + [cached["request_id"]]
    assert len(set(ids)) == len(ids) and cached["cached"] is True
    records = {r["request_id"]: r for r in read_records(folder, "request")}
    assert set(ids) <= set(records)
    rec = records[secret.json()["request_id"]]
    assert rec["request"]["task_id"] == REDACTED and SECRET not in rec["request"]["question"]
    assert rec["request"]["question"].startswith(f"Status of {REDACTED}:")
    assert rec["trajectory"] == secret.json()["trajectory"] and rec["n_calls"] == secret.json()["n_calls"]
    assert rec["model_alias"] == "champion" and rec["model_version"] == "1" and rec["latency_ms"] > 0
    assert records[cached["request_id"]]["cached"] is True
    assert records[replies[0]["request_id"]]["success"] in (True, False)  # a full record carries its ground truth
    assert all(SECRET.encode() not in p.read_bytes() for p in segment_files(folder))


@pytest.mark.services
def test_retention_keeps_the_folder_under_its_size_limit_and_the_newest_requests(server):
    base, folder, project = server
    replies = []
    with httpx.Client(timeout=120) as client:
        for batch in range(15):  # bounded: at most 150 requests, until the first of them has aged out
            replies += post_all(base, traffic(project, 10, start=1000 + 10 * batch), client)
            kept = {r["request_id"] for r in read_records(folder, "request")}
            if replies[0]["request_id"] not in kept:
                break
    assert replies[0]["request_id"] not in kept and replies[-1]["request_id"] in kept  # the oldest went first
    assert len(segment_files(folder, include_open=False)) >= 2  # 8 kB segments were sealed as they filled
    total = sum(p.stat().st_size for p in segment_files(folder))
    assert total <= 32768 + 8192 + 16384  # the limit, plus the open segment and its last record


# --------------------------------------------------------------------------------------------------------- feedback
@pytest.mark.services
def test_feedback_is_recorded_checked_and_reaches_the_reward_models_training_data(server, tmp_path):
    from pipeline.reward_model.config import RewardModelConfig
    from pipeline.reward_model.main import train_reward_model

    base, folder, project = server
    with httpx.Client(timeout=120) as client:
        replies = post_all(base, traffic(project, 12, start=5000), client)
        sent = {}
        for i, r in enumerate(replies):
            body = {"request_id": r["request_id"], "rating": 5 if i % 2 else 1}
            if i == 0:
                body = {"request_id": r["request_id"], "rating": 5, "label": "failure", "text": "wrong answer"}
            fb = client.post(f"{base}/feedback", json=body)
            assert fb.status_code == 200, fb.text
            sent[r["request_id"]] = 0 if i == 0 else int(i % 2)
        bad = {"unknown id": ({"request_id": "f" * 32, "rating": 3}, 404, "unknown request_id"),
               "no rating or label": ({"request_id": replies[1]["request_id"]}, 422, "give field 'rating'"),
               "rating out of range": ({"request_id": replies[1]["request_id"], "rating": 9}, 422, "field 'rating'"),
               "rating a bool": ({"request_id": replies[1]["request_id"], "rating": True}, 422, "field 'rating'"),
               "unknown label": ({"request_id": replies[1]["request_id"], "label": "meh"}, 422, "field 'label'"),
               "unknown field": ({"request_id": replies[1]["request_id"], "rating": 2, "x": 1}, 422, "unknown fields"),
               "not an object": ([1], 422, "must be a JSON object")}
        answers = {k: client.post(f"{base}/feedback", json=b) for k, (b, _, _) in bad.items()}
        answers["not JSON"] = client.post(f"{base}/feedback", content=b"{oops",
                                          headers={"content-type": "application/json"})
    for k, (_, status, reason) in bad.items():
        assert answers[k].status_code == status and reason in answers[k].json()["error"], (k, answers[k].text)
    assert answers["not JSON"].status_code == 400
    labelled = {e["request_id"]: e for e in labelled_episodes(folder, 4)}
    assert {rid: labelled[rid]["label"] for rid in sent} == sent  # a label overrides the rating
    feedback_records = [r for r in read_records(folder, "feedback") if r["request_id"] in sent]
    assert len(feedback_records) == len(sent)  # the refused ones wrote nothing

    cfg = RewardModelConfig(policy=str(project / "models/policy"), rollout_tasks=0, max_demos=16, epochs=20,
                            hash_dim=256, holdout_fraction=0.5, feedback=str(folder))
    out = train_reward_model(cfg, ENV, ROLL, data_dir=project / "data", out_dir=tmp_path / "rm",
                             metrics_path=tmp_path / "rm.json")
    fb = out["feedback"]
    assert out["episodes"]["feedback"] == fb["episodes"] >= len(sent)
    assert fb["fit"] + fb["heldout_n"] == fb["episodes"] and fb["fit"] > 0 and fb["heldout_n"] > 0
    assert fb["heldout"]["n"] == fb["heldout_n"] and 0 <= fb["agreement"] <= 1
    no_fb = train_reward_model(cfg.model_copy(update={"feedback": None}), ENV, ROLL, data_dir=project / "data",
                               out_dir=tmp_path / "rm0", metrics_path=tmp_path / "rm0.json")
    assert no_fb["episodes"]["feedback"] == 0 and no_fb["episodes"]["fit"] < out["episodes"]["fit"]


@pytest.mark.services
def test_with_capture_off_nothing_is_recorded_feedback_is_409_and_the_monitor_logs_to_mlflow(champion, tmp_path):
    from mlflow import MlflowClient

    from pipeline.core.tracking import EXPERIMENT
    from pipeline.deploy.config import ServeConfig
    from pipeline.deploy.pyfunc import load_solver
    from pipeline.deploy.serve import ThreadedServer, create_app

    uri, _, _ = champion
    cfg = ServeConfig(capture={"dir": str(tmp_path / "traffic")}, monitor={"log_every_s": 0.2})
    with tracking_uri(uri):
        solver = load_solver(f"models:/{NAME}@champion")
        try:
            with ThreadedServer(create_app(solver, cfg), free_port()) as srv:
                answers = [httpx.post(f"{srv.url}/solve", json={"question": f"What is 2 + {i}?"}, timeout=120).json()
                           for i in range(3)]
                fb = httpx.post(f"{srv.url}/feedback", json={"request_id": "x", "rating": 5}, timeout=30)
        finally:
            solver.close()
    assert all("request_id" not in a for a in answers) and not (tmp_path / "traffic").exists()
    assert fb.status_code == 409 and "capture.enabled is false" in fb.json()["error"]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                              filter_string="tags.mlflow.runName = 'serve-monitor'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "serve/requests_answered_total")
    assert history[-1].value == 3  # the last values are logged when the server stops


class FailingSolver:
    """The real champion, except that a batch holding the question FAIL raises, as a model failure would."""

    FAIL = "What is the answer to FAIL?"

    def __init__(self, solver):
        self.solver, self.seed, self.runtime, self.precision = solver, solver.seed, solver.runtime, solver.precision

    def solve_tasks(self, tasks, seeds=None, truth=None):
        if any(getattr(t, "question", None) == self.FAIL for t in tasks):
            raise RuntimeError("the batch failed")
        return self.solver.solve_tasks(tasks, seeds, truth)


@pytest.mark.services
def test_a_model_failure_is_captured_with_its_outcome_and_counted_at_metrics(champion, tmp_path):
    from pipeline.deploy.config import ServeConfig
    from pipeline.deploy.pyfunc import load_solver
    from pipeline.deploy.serve import ThreadedServer, create_app

    uri, _, _ = champion
    cfg = ServeConfig(max_wait_ms=0, capture={"enabled": True, "dir": str(tmp_path / "traffic")})
    with tracking_uri(uri):
        solver = load_solver(f"models:/{NAME}@champion")
    try:
        with ThreadedServer(create_app(FailingSolver(solver), cfg), free_port()) as srv:
            ok = httpx.post(f"{srv.url}/solve", json={"question": "What is 2 + 2?"}, timeout=120)
            bad = httpx.post(f"{srv.url}/solve", json={"question": FailingSolver.FAIL}, timeout=120)
            metrics = parse_prometheus(httpx.get(f"{srv.url}/metrics", timeout=30).text)
    finally:
        solver.close()
    assert ok.status_code == 200 and bad.status_code == 500
    assert bad.json()["error"] == "model failure: RuntimeError: the batch failed"
    records = {r["request_id"]: r for r in read_records(tmp_path / "traffic", "request")}
    assert records[ok.json()["request_id"]]["outcome"] == "answered"
    failed = records[bad.json()["request_id"]]
    assert failed["outcome"] == "model_failure" and failed["error"] == bad.json()["error"]
    assert failed["trajectory"] is None and failed["request"] == {"question": FailingSolver.FAIL}
    assert metrics[("agentrl_requests_failed_total", frozenset())] == 1
    assert metrics[("agentrl_requests_answered_total", frozenset())] == 1


@pytest.mark.services
def test_serve_refuses_a_capture_folder_it_cannot_create_before_loading_the_model(champion, tmp_path):
    uri, _, cfg = champion
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    serve = cfg.serve.model_copy(update={"capture": cfg.serve.capture.model_copy(
        update={"enabled": True, "dir": str(blocker / "traffic")})})
    params = write_params(tmp_path, cfg.model_copy(update={"serve": serve}))
    proc = subprocess.run([str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(params), "--port",
                           str(free_port())], env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [l for l in proc.stderr.splitlines() if l.strip()] == [
        f"error: serve: cannot create the capture folder {blocker / 'traffic'} (deploy.serve.capture.dir): "
        f"Not a directory"]


# ------------------------------------------------------------------------------------------------------- monitoring
@pytest.mark.services
def test_metrics_parse_as_prometheus_text_and_drift_gauges_move_on_shifted_traffic(server):
    base, _, project = server
    with httpx.Client(timeout=120) as client:
        post_all(base, traffic(project, 10, start=9000), client)  # the window (10) holds test-split traffic
        before = client.get(f"{base}/metrics")
        long = [{"question": "Please, " + "very " * 40 + f"carefully: what is 2 + {i}?", "seed": i} for i in range(10)]
        post_all(base, long, client)
        after = client.get(f"{base}/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain; version=0.0.4")
    m0, m1 = parse_prometheus(before.text), parse_prometheus(after.text)
    g = lambda m, name, **labels: m[(f"agentrl_{name}", frozenset(labels.items()))]  # noqa: E731
    assert g(m1, "requests_answered_total") - g(m0, "requests_answered_total") == 10
    assert g(m1, "window_requests") == 10
    shares = [v for (n, _), v in m1.items() if n == "agentrl_window_tool_share"]  # none when no call named a tool
    assert not shares or abs(sum(shares) - 1.0) < 1e-9
    assert (("agentrl_drift_tool_mix_tv", frozenset()) in m1) == bool(shares)
    assert g(m1, "window_latency_seconds", quantile="0.5") <= g(m1, "window_latency_seconds", quantile="0.99")
    assert g(m1, "model_info", model_uri=f"models:/{NAME}@champion", model_version="1", model_alias="champion") == 1
    assert g(m0, "drift_question_chars_ks") < 0.9 and g(m1, "drift_question_chars_ks") == 1.0  # every one longer
    assert g(m0, "drift_alarm") == 0 and g(m1, "drift_alarm") == 1  # the threshold (0.95) of question length crossed
    assert ("agentrl_live_active", frozenset()) not in m1  # no challenger, no live gauges
    for name in ("drift_calls_per_task_ks", "window_failed_call_share", "window_calls_per_task"):
        assert 0 <= g(m1, name) <= (1 if "drift" in name or "share" in name else ENV.max_steps), name


def test_the_alarm_at_metrics_and_the_snapshots_alarm_are_one_rule():
    """The same requests give the same alarm in the monitor's gauge and in the snapshot's manifest (the one the
    scheduled retraining reads): calm requests none, then as many long ones raise both at the same request."""
    from pipeline.deploy.config import MonitorConfig, SnapshotConfig
    from pipeline.deploy.monitor import Monitor, Reference
    from pipeline.deploy.snapshot import drift

    calls = [{"tool": "search", "outcome": "ok"}, {"tool": "answer", "outcome": "ok"}]
    ref = Reference([{"question": "q" * (40 + i % 5)} for i in range(30)],
                    [{"steps": [{"action": '<call>search {"query": "x"}</call>'},
                                {"action": '<call>answer {"value": "1"}</call>'}]} for _ in range(30)])
    cfg = SnapshotConfig(min_requests=5, drift_window=50)
    monitor = Monitor(MonitorConfig(window=50), ref, {}, cfg)
    rows, seen = [], []
    for i in range(16):
        question = "q" * (40 + i % 5) if i < 8 else "q" * 400
        monitor.observe({"question": question}, {"calls": calls}, 0.01)
        rows.append({"question": question, "n_calls": len(calls), "calls": calls})
        snap = drift(rows, ref, cfg)
        assert monitor.values()["drift_alarm"] == int(snap["alarm"]), (i, snap)
        seen.append(snap["alarm"])
    assert seen == [False] * 11 + [True] * 5  # KS of length: 4 long questions of 12 (0.333) pass 0.3
    assert snap["reasons"] == ["question_chars_ks 0.500 > 0.3"]


@pytest.mark.services
def test_the_scheduled_check_decides_the_snapshots_alarm_by_the_thresholds_in_params(champion, tmp_path):
    """flows/retrain_flow.py reads the statistics a snapshot recorded and decides the alarm with the gauge's rule and
    today's thresholds: a threshold lowered since the snapshot raises it, one raised above them clears it."""
    from flows.retrain_flow import production_alarm
    from pipeline.deploy.config import SnapshotConfig
    from pipeline.deploy.monitor import drift_alarm

    stats = {"question_chars_ks": 0.25, "calls_per_task_ks": 0.1, "tool_mix_tv": None}
    recorded = drift_alarm(stats, 40, SnapshotConfig())  # 0.25 < 0.3: no alarm when it was taken
    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "snapshot.json").write_text(json.dumps({"digest": "d1", "episodes": 40, "tasks": 0,
                                                    "drift": {"window": 40, "statistics": stats, **recorded}}))
    uri = champion[0]  # the module's tracking server: the lookup of earlier retrains acting on this digest
    assert production_alarm.fn(str(snap), uri)["alarm"] is False  # the snapshot's own verdict
    assert production_alarm.fn(str(snap), uri, SnapshotConfig())["alarm"] is False
    lowered = production_alarm.fn(str(snap), uri, SnapshotConfig(alarm_question_chars_ks=0.2))
    assert lowered["alarm"] is True and lowered["reasons"] == ["question_chars_ks 0.250 > 0.2"]
    assert lowered["acted_on"] is None  # no earlier retrain acted on this digest
    assert production_alarm.fn(str(snap), uri, SnapshotConfig(alarm_question_chars_ks=0.2, min_requests=41))[
        "alarm"] is False  # too few requests for any alarm


# ------------------------------------------------------------------------------------------------------------- kill
@pytest.mark.services
def test_a_server_killed_under_load_leaves_whole_segments_holding_every_answer_it_gave(champion, tmp_path):
    folder = tmp_path / "traffic"
    base, proc = start_server(champion, tmp_path, {"dir": str(folder), "segment_max_bytes": 8192})
    answered, stop = [], threading.Event()

    def client(k: int) -> None:
        with httpx.Client(timeout=60) as http:
            for i in range(200):  # bounded: a client stops at 200 requests, the kill, or the event
                if stop.is_set():
                    return
                try:
                    r = http.post(f"{base}/solve", json={"question": f"What is {k} + {i}?", "seed": i})
                except httpx.TransportError:
                    return
                if r.status_code == 200:
                    answered.append(r.json()["request_id"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for _ in range(600):  # until several segments were sealed and one is open
            if len(segment_files(folder, include_open=False)) >= 2 and len(answered) >= 30:
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        stop_server(proc)
    files = segment_files(folder)
    assert any(p.name.endswith(".open") for p in files)  # the killed writer's segment
    for p in files:
        data = p.read_bytes()
        assert data.endswith(b"\n"), p  # no record was cut
        assert all(json.loads(line)["kind"] == "request" for line in data.splitlines())
    captured = {r["request_id"] for r in read_records(folder, "request")}
    assert set(answered) <= captured  # every answer a caller got was on disk before it was sent
    CaptureStore(CaptureConfig(dir=str(folder)))  # the next start seals the dead writer's segment
    assert not [p for p in segment_files(folder) if p.name.endswith(".open")]
    assert {r["request_id"] for r in read_records(folder, "request")} == captured


# ------------------------------------------------------------------------------------------------- direct, on files
def test_redactor_replaces_fields_at_any_depth_and_scrubs_their_values_from_every_text():
    rec = {"request": {"question": 'Mail "Ann Lee" at ann@x.org', "contact": {"email": "ann@x.org", "n": 7}},
           "trajectory": [{"action": '<call>notify {"email": "ann@x.org", "who": "Ann Lee"}</call>',
                           "observation": "<obs>sent to ann@x.org</obs>"}],
           "calls": [{"tool": "notify", "params": {"email": "ann@x.org", "who": "Ann Lee"}, "outcome": "ok"}]}
    out = Redactor(["email", "who"]).redact(rec)
    text = json.dumps(out)
    assert "ann@x.org" not in text and "Ann Lee" not in text
    assert out["request"]["contact"] == {"email": REDACTED, "n": 7}
    assert out["calls"][0]["params"] == {"email": REDACTED, "who": REDACTED} and out["calls"][0]["tool"] == "notify"
    assert out["trajectory"][0]["observation"] == f"<obs>sent to {REDACTED}</obs>"
    assert Redactor(["n"]).redact({"n": 7, "q": "7 of 7"}) == {"n": REDACTED, "q": "7 of 7"}  # too short to scrub


def test_recovery_cuts_a_partial_last_record_and_retention_deletes_old_segments(tmp_path):
    cfg = CaptureConfig(dir=str(tmp_path), segment_max_bytes=4096, retention_days=1.0)
    dead = tmp_path / "20260101T000000Z-999999999-000001.jsonl.open"  # a pid no process has
    dead.write_bytes(b'{"kind": "request", "request_id": "a"}\n{"kind": "request", "req')
    old = tmp_path / "20250101T000000Z-999999998-000001.jsonl"
    old.write_bytes(b'{"kind": "request", "request_id": "old"}\n')
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    store = CaptureStore(cfg)
    assert not old.exists() and not dead.exists()
    assert (tmp_path / dead.name[:-len(".open")]).read_bytes() == b'{"kind": "request", "request_id": "a"}\n'
    assert store.known == {"a"}
    store.append({"kind": "request", "request_id": "b"})
    store.close()
    assert [r["request_id"] for r in read_records(tmp_path)] == ["a", "b"]


def test_two_writers_of_one_process_in_one_second_never_reuse_a_segment_name(tmp_path):
    now = time.time()
    for rid in ("a", "b"):  # a restart within the second: the same stamp, pid and first sequence number
        store = CaptureStore(CaptureConfig(dir=str(tmp_path)), clock=lambda: now)
        store.append({"kind": "request", "request_id": rid})
        store.close()
    assert len(segment_files(tmp_path, include_open=False)) == 2
    assert [r["request_id"] for r in read_records(tmp_path)] == ["a", "b"]

