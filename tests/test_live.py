"""Shadow and canary challengers in `agentrl serve` (pipeline.deploy.live), against the real server over loopback
(`agentrl serve` on a champion and a challenger in a real MLflow server) driven by a bounded list of requests.

The champion is a tiny policy taught (a few steps of the real SFT loop) to answer "0" at once; the "worse"
challenger is the untrained tiny policy, which never answers. Requests carry the ground truth "0", so the champion
succeeds on each and the challenger fails on each: a real regression the paired test sees after a few requests.
A shadow challenger never answers a caller; a worse canary is rolled back, after which the champion answers every
request; the evidence lands as tags on the challenger's version, and `agentrl promote --require-live` refuses it
(and a challenger as good as the champion passes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy_support import ENV, ROLL, build_project, deploy_config, free_port, mlflow_server, nudged_policy, \
    parse_prometheus, snapshot, tracking_uri, wait_http, write_params
from pipeline.core.traffic import read_records
from pipeline.deploy.config import ChallengerConfig
from pipeline.deploy.live import Evidence, check_live, judge_now, require_live
from pipeline.core.errors import AgentRLError

NAME = "policy-live"
ROLL_ANSWER = ROLL.model_copy(update={"max_new_tokens": 16})  # the answer action is 12 tokens long
ACTION = '<call>answer {"value": "0"}</call>'

pytestmark = pytest.mark.usefixtures("one_thread")


def answering_policy(project: Path, dest: Path) -> str:
    """The project's tiny policy after 150 steps of the real SFT loop on demonstrations that answer "0" at once."""
    import numpy as np

    from pipeline.adapt.batching import batches
    from pipeline.adapt.sft import train_lm
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.demos import demo_examples, prompt_signatures
    from pipeline.policy.model import load_policy, save_policy

    runtime = open_environment(ENV.name, project / "data" / "env")
    tasks = load_task_file(project / "data" / "tasks" / "train.jsonl", runtime)[:16]
    model, tok, meta = load_policy(project / "models" / "policy")
    demos = [{"demo_id": f"d{i}", "task_id": t.task_id, "level": 1,
              "steps": [{"action": ACTION, "observation": "<obs>0</obs>\n"}]} for i, t in enumerate(tasks)]
    examples = demo_examples(tok, demos, {t.task_id: t.question for t in tasks}, window=8,
                             signatures=prompt_signatures(runtime, tasks))
    runtime.close()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    train_lm(model, batches(examples, 8, np.random.default_rng(0), pad), steps=150, lr=3e-3, warmup=10)
    save_policy(model, tok, dest, {"phase": "train", "step": 150})
    return str(dest)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Champion v1 (answers "0"), challenger v2 (the untrained policy, registered without the gate)."""
    from pipeline.deploy.main import deploy
    from pipeline.deploy.registry import ModelRegistry

    project = build_project(tmp_path_factory.mktemp("live_project"))
    good = answering_policy(project, project / "models" / "answering")
    with mlflow_server(tmp_path_factory.mktemp("live_mlflow")) as uri, tracking_uri(uri):
        base = dict(precisions=["fp32"], serve_precision="fp32", latency_tasks=0)
        cfg = deploy_config(project, NAME, policy=good, **base)
        out = deploy(cfg, ENV, ROLL_ANSWER, project / "metrics", project / "metrics" / "deploy.json")
        assert out["decision"].passed
        bad = deploy_config(project, NAME, promote=False, **base)
        deploy(bad, ENV, ROLL_ANSWER, project / "metrics", project / "metrics" / "deploy.json")
        reg = ModelRegistry(NAME)
        assert reg.alias_version("champion") == "1" and reg.alias_version("challenger") == "2"
        yield uri, project, cfg, reg


def start_server(registry, tmp: Path, challenger: dict):
    uri, project, cfg, _ = registry
    tmp.mkdir(parents=True, exist_ok=True)
    serve = type(cfg.serve).model_validate({**cfg.serve.model_dump(), "rate_limit_per_s": 1000.0, "rate_burst": 1000,
                                            "capture": {"enabled": True, "dir": str(tmp / "traffic")},
                                            "challenger": challenger})
    params = write_params(tmp, cfg.model_copy(update={"serve": serve}))
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(params),
                             "--port", str(port)],
                            env={**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/ready", timeout=180, proc=proc)
    return base, proc, params


def stop_server(proc) -> str:
    """SIGTERM (the server writes its evidence as it stops); its output."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.stdout.read()


def requests_with_truth(project: Path, n: int, start: int) -> list[dict]:
    """`n` distinct requests: test tasks whose ground truth is "0" (the champion's answer), seeds start, start+1..."""
    tasks = [json.loads(line) for line in (project / "data/tasks/test.jsonl").read_text().splitlines()]
    return [{**tasks[i % len(tasks)], "answer": "0", "seed": start + i} for i in range(n)]


def wait_state(client: httpx.Client, base: str, done, limit: int = 600) -> dict:
    """GET /challenger until `done(state)` (bounded: `limit` polls)."""
    for _ in range(limit):
        state = client.get(f"{base}/challenger").json()
        if done(state):
            return state
        time.sleep(0.2)
    raise AssertionError(f"the challenger's state never got there: {state}")


def promote_cli(params: Path, *argv: str) -> int:
    from flows.cli import main

    return main(["promote", "--params", str(params), *argv])


# ------------------------------------------------------------------------------------------------------- shadow
@pytest.mark.services
def test_a_shadow_challenger_never_answers_a_caller_and_its_regression_fails_the_live_check(registry, tmp_path,
                                                                                           capsys):
    _, project, _, reg = registry
    base, proc, params = start_server(registry, tmp_path, {"mode": "shadow", "min_paired": 6})
    try:
        with httpx.Client(timeout=120) as client:
            replies = [client.post(f"{base}/solve", json=r) for r in requests_with_truth(project, 12, 0)]
            state = wait_state(client, base, lambda s: s["rolled_back"])
            metrics = parse_prometheus(client.get(f"{base}/metrics").text)
    finally:
        out = stop_server(proc)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    answers = [r.json() for r in replies]
    assert all(a["answer"] == "0" and a["success"] is True for a in answers)  # the champion's, every one
    assert state["mode"] == "shadow" and state["canary_answers"] == 0 and state["worse_on"] == ["success"]
    assert state["paired_success"] == 7 and state["challenger_success"] == 0.0  # rolled back at the 7th loss
    assert "challenger models:/policy-live@challenger as shadow" in out and "rolled back" in out
    assert f"capture to {tmp_path / 'traffic'}/" in out
    g = lambda name, **labels: metrics[(f"agentrl_{name}", frozenset(labels.items()))]  # noqa: E731
    assert g("live_info", mode="shadow", challenger_uri="models:/policy-live@challenger", challenger_version="2") == 1
    assert g("live_active") == 0  # rolled back
    assert g("live_paired_requests", outcome="success") == 7  # the gauges stop with the comparison, at its rollback
    assert 7 <= g("live_episodes_total", role="champion") <= 12  # the callers' answers until then
    assert 7 <= g("live_episodes_total", role="challenger") <= 12  # its copies until then
    assert g("live_window_success_rate", role="champion") == 1.0 and g("live_window_success_rate", role="challenger") == 0
    assert g("live_window_judged_requests", role="challenger") == g("live_episodes_total", role="challenger")
    assert g("live_safety_violations_total", role="challenger") == 0 == g("live_window_unsafe_share", role="champion")
    for role in ("champion", "challenger"):
        assert 0 < g("live_window_latency_seconds", role=role, quantile="0.5") <= \
            g("live_window_latency_seconds", role=role, quantile="0.99")

    folder = tmp_path / "traffic"
    ids = {a["request_id"] for a in answers}
    served = [r for r in read_records(folder, "request")]
    assert {r["request_id"] for r in served} == ids
    assert all(r["role"] == "champion" and r["model_version"] == "1" for r in served)
    shadow = list(read_records(folder, "shadow"))
    assert len(shadow) >= 7 and {r["request_id"] for r in shadow} <= ids
    assert all(r["role"] == "challenger" and r["model_version"] == "2" and r["answer"] is None for r in shadow)

    tags = reg.tags("2")
    assert tags.get("live.paired_success") == "7", (tags, out)
    assert tags["gate.live"] == "fail" and tags["live.mode"] == "shadow"
    assert tags["live.champion_version"] == "1" and "worse than champion v1 on success" in tags["gate.live.detail"]

    before = snapshot(reg)
    capsys.readouterr()
    assert promote_cli(params, "--version", "2", "--require-live") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: promote: version 2 has no passing live check -- gate.live fail: worse")
    assert snapshot(reg) == before


# ------------------------------------------------------------------------------------------------------- canary
@pytest.mark.services
def test_a_worse_canary_is_rolled_back_and_the_champion_keeps_every_request(registry, tmp_path):
    _, project, _, reg = registry
    base, proc, _ = start_server(registry, tmp_path, {"mode": "canary", "share": 0.5, "min_paired": 6})
    try:
        with httpx.Client(timeout=120) as client:
            before = []
            for r in requests_with_truth(project, 80, 1000):  # bounded: stops at the rollback
                before.append(client.post(f"{base}/solve", json=r).json())
                state = client.get(f"{base}/challenger").json()
                if state["rolled_back"]:
                    break
            assert state["rolled_back"] and state["worse_on"] == ["success"]
            after = [client.post(f"{base}/solve", json=r).json() for r in requests_with_truth(project, 24, 5000)]
            again = [client.post(f"{base}/solve", json=r).json() for r in requests_with_truth(project, 24, 1000)]
            final = client.get(f"{base}/challenger").json()
            metrics = parse_prometheus(client.get(f"{base}/metrics").text)
            for _ in range(300):  # the evidence is written by a thread at the rollback
                if reg.tags("2").get("gate.live"):
                    break
                time.sleep(0.2)
            tags = reg.tags("2")
    finally:
        stop_server(proc)
    canary = [a for a in before if a["answer"] is None]
    assert canary and len(canary) == state["canary_answers"]  # the challenger did answer callers before
    assert all(a["answer"] == "0" and a["success"] is True for a in after + again)  # then the champion, always
    assert final["canary_answers"] == state["canary_answers"] and not final["active"]
    g = lambda name, **labels: metrics[(f"agentrl_{name}", frozenset(labels.items()))]  # noqa: E731
    assert g("live_active") == 0 and g("live_info", mode="canary", challenger_uri="models:/policy-live@challenger",
                                       challenger_version="2") == 1
    paired = g("live_paired_requests", outcome="safety")
    assert 6 <= paired <= g("live_episodes_total", role="challenger") <= len(canary)  # canary answers, until rollback
    assert paired <= g("live_episodes_total", role="champion") <= len(canary)  # the champion's copies of them
    assert g("live_window_success_rate", role="challenger") == 0 < g("live_window_success_rate", role="champion")

    records = {r["request_id"]: r for r in read_records(tmp_path / "traffic", "request")}
    assert {records[a["request_id"]]["role"] for a in canary} == {"challenger"}
    assert all(records[a["request_id"]]["model_version"] == "2" for a in canary)
    assert all(records[a["request_id"]]["role"] == "champion" and records[a["request_id"]]["model_version"] == "1"
               for a in after + again)
    champion_copies = list(read_records(tmp_path / "traffic", "shadow"))
    assert {r["role"] for r in champion_copies} == {"champion"} and all(r["answer"] == "0" for r in champion_copies)
    assert tags["gate.live"] == "fail" and tags["live.mode"] == "canary" and tags["live.rolled_back"] == "true"


# ------------------------------------------------------------------------------------------------ promote, live
@pytest.mark.services
def test_promote_requires_a_passing_live_check_when_asked(registry, tmp_path, capsys):
    from pipeline.deploy.main import deploy

    _, project, cfg, reg = registry
    same = nudged_policy(project, project / "models" / "nudged", 1e-6, cfg.policy)  # plays the champion's episodes
    deploy(deploy_config(project, NAME, policy=same, promote=False, precisions=["fp32"], serve_precision="fp32",
                         latency_tasks=0), ENV, ROLL_ANSWER, project / "metrics", project / "metrics" / "deploy.json")
    assert reg.alias_version("challenger") == "3"
    params = write_params(tmp_path, cfg)
    before = snapshot(reg)
    capsys.readouterr()
    assert promote_cli(params, "--require-live") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "version 3 has no passing live check -- no live evidence (no gate.live tag)" in err[0]
    assert snapshot(reg) == before

    base, proc, _ = start_server(registry, tmp_path / "serve", {"mode": "shadow", "min_paired": 4})
    try:
        with httpx.Client(timeout=120) as client:
            for r in requests_with_truth(project, 6, 9000):
                assert client.post(f"{base}/solve", json=r).json()["answer"] == "0"
            state = wait_state(client, base, lambda s: s["paired_success"] >= 6)
            metrics = parse_prometheus(client.get(f"{base}/metrics").text)
    finally:
        stop_server(proc)
    assert state["verdict"] == "pass" and not state["rolled_back"] and state["success_p_value"] == 1.0  # no loss
    assert metrics[("agentrl_live_active", frozenset())] == 1
    assert {role: metrics[("agentrl_live_window_success_rate", frozenset({("role", role)}))]
            for role in ("champion", "challenger")} == {"champion": 1.0, "challenger": 1.0}
    assert reg.tags("3")["gate.live"] == "pass"  # written as the server stopped
    assert promote_cli(params, "--require-live") == 0
    assert reg.alias_version("champion") == "3" and reg.tags("3")["gate.live"] == "pass"
    assert "pass  live: gate.live pass: not worse than champion v1" in capsys.readouterr().out


@pytest.mark.services
def test_a_deploy_under_require_live_leaves_the_new_version_challenger_until_it_met_live_traffic(registry, capsys):
    """With deploy.gate.require_live, the deploy stage judges a new version but cannot promote it: it has no live
    evidence yet. It stays challenger (gate.live fail, "no live evidence") and the champion stays where it was."""
    from pipeline.deploy.main import deploy, report

    _, project, cfg, reg = registry
    champion = reg.alias_version("champion")
    other = nudged_policy(project, project / "models" / "nudged-live", 2e-6, cfg.policy)  # as good as the champion
    gate = cfg.gate.model_copy(update={"require_live": True})
    out = deploy(deploy_config(project, NAME, policy=other, precisions=["fp32"], serve_precision="fp32",
                               latency_tasks=0, gate=gate.model_dump()),
                 ENV, ROLL_ANSWER, project / "metrics", project / "metrics" / "deploy.json")
    version = out["version"]
    assert reg.alias_version("challenger") == version and reg.alias_version("champion") == champion
    tags = reg.tags(version)
    assert tags["gate.live"] == "fail" and tags["gate.live.detail"].startswith("no live evidence")
    assert tags["gate.decision"] == "rejected" and tags["gate.vs_champion"] == "pass"  # judged on the rest
    assert "FAIL  live: no live evidence" in report(out)


# ----------------------------------------------------------------------------------------------------- evidence
def test_evidence_pairs_each_request_once_and_judges_success_and_safety():
    cfg = ChallengerConfig(mode="canary", min_paired=7)
    ev = Evidence()
    for i in range(7):
        assert not ev.add(f"k{i}", "champion", {"success": True, "n_violations": 0})
        assert ev.add(f"k{i}", "challenger", {"success": None, "n_violations": 1})  # no truth: safety only
        assert not ev.add(f"k{i}", "challenger", {"success": None, "n_violations": 1})  # a repeat counts once
    v = ev.verdict(cfg)
    assert v["paired_success"] == 0 and v["paired_safety"] == 7 and v["worse_on"] == ["safety"]
    assert v["verdict"] == "fail" and v["safety_p_value"] < cfg.alpha
    assert ev.verdict(ChallengerConfig(min_paired=7, paired_test="bootstrap"))["worse_on"] == ["safety"]
    fresh = Evidence()
    for i in range(7):
        fresh.add(str(i), "champion", {"success": i % 2 == 0, "n_violations": 0})
        fresh.add(str(i), "challenger", {"success": i % 2 == 0, "n_violations": 0})
    assert fresh.verdict(cfg)["verdict"] == "pass"
    assert fresh.verdict(ChallengerConfig(min_paired=8))["verdict"] == "insufficient"
    assert all(judge_now(n) for n in range(1, 1001)) and judge_now(2000) and not judge_now(2001)  # then every n/100


def test_the_live_check_reads_the_version_tags():
    assert not check_live({}).passed and check_live({"gate.live": "pass", "gate.live.detail": "x"}).passed
    with pytest.raises(AgentRLError, match="version 4 has no passing live check -- gate.live insufficient: few"):
        require_live({"gate.live": "insufficient", "gate.live.detail": "few"}, "4")
    assert require_live({"gate.live": "pass"}, "4").name == "live"
