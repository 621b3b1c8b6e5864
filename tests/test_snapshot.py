"""From traffic to data: `agentrl snapshot` over capture segments written by the real capture writer, in a tiny project
that is a git repository with DVC: the snapshot joins feedback, keeps the tasks the environment verifies, passes the
"production" suite, is recorded by `dvc add`, and is what the reward model's feedback and `train`'s task pool read;
shifted traffic raises the drift alarm and calm traffic does not. (The scheduled retraining acting on the alarm:
tests/test_flow.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_support import build_project
from pipeline.core.traffic import labelled_episodes
from pipeline.deploy.capture import CaptureStore, request_record
from pipeline.deploy.config import CaptureConfig

BIN = Path(sys.executable).parent
TOOL = re.compile(r"\A\s*<call>\s*([A-Za-z_][A-Za-z0-9_]*)")
MODEL = {"model_uri": "models:/p@champion", "model_version": "1", "model_alias": "champion"}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny built project (data/ by the real build_env) as a git repository with DVC initialised."""
    root = build_project(tmp_path_factory.mktemp("snap_project"))
    (root / "data/production").mkdir(parents=True, exist_ok=True)
    (root / "data/production/README.md").write_text("captured traffic\n")
    (root / "params.yaml").write_text(yaml.safe_dump({"deploy": {"snapshot": {"min_requests": 10}}}))
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"],
                [sys.executable, "-m", "dvc", "config", "core.analytics", "false"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "tiny project"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    return root


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def result_of(steps: list[dict], success) -> dict:
    calls = [{"tool": m.group(1) if (m := TOOL.match(s["action"])) else None, "outcome": "ok"} for s in steps]
    return {"answer": "x", "success": success, "trajectory": steps, "calls": calls, "n_calls": len(calls),
            "n_violations": 0, "truncated": False, "batch_size": 1}


def calm_traffic(root: Path, folder: Path, redact=(), asked: list[dict] | None = None) -> dict:
    """Requests like the training data: each training task as asked with its demonstration's trajectory (or, with
    `asked`, these task records, each with a demonstration's trajectory), plus a bare question, a task with a wrong
    stated answer and a model failure; feedback on some. Sealed."""
    tasks = {t["task_id"]: t for t in jsonl(root / "data/tasks/train.jsonl")}
    demos = [d for d in jsonl(root / "data/demos/train.jsonl") if d["task_id"] in tasks][:24]
    asked = asked or [tasks[d["task_id"]] for d in demos]
    store = CaptureStore(CaptureConfig(dir=str(folder), redact=list(redact)))
    ids = {}
    for i, task in enumerate(asked):
        rid = f"calm{i:04d}"
        steps = demos[i % len(demos)]["steps"]
        store.append(request_record(rid, task, i, result_of(steps, True), 0.01, False, MODEL))
        ids[rid] = task
    first = tasks[demos[0]["task_id"]]
    store.append(request_record("bare", {"question": first["question"]}, 0, result_of(demos[0]["steps"], None),
                                0.01, False, MODEL))
    store.append(request_record("wrong", {**first, "task_id": "w1", "answer": "no such answer 9999"}, 0,
                                result_of(demos[0]["steps"], False), 0.01, False, MODEL))
    store.append(request_record("failed", first, 0, {}, 0.01, False, MODEL, error="model failure: boom"))
    for rid, rating, label in (("calm0000", 5, None), ("calm0001", 2, None), ("calm0002", 5, "failure"),
                               ("bare", 4, None)):
        store.append({"kind": "feedback", "request_id": rid, "time": "t", "rating": rating, "label": label,
                      "text": "ok"})
    store.close()
    return ids


def shifted_traffic(folder: Path, n: int = 30) -> None:
    """Long questions answered in one call each: far from the training data in length and in calls per task."""
    store = CaptureStore(CaptureConfig(dir=str(folder)))
    for i in range(n):
        q = "Please, " + "very " * 60 + f"carefully: what is {i} + {i}?"
        steps = [{"action": f'<call>answer {{"value": "{2 * i}"}}</call>', "observation": "<obs>done</obs>"}]
        store.append(request_record(f"shift{i:04d}", {"question": q}, i, result_of(steps, None), 0.02, False, MODEL))
    store.close()


def snapshot(root: Path, capture: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "agentrl"), "snapshot", "--params", str(root / "params.yaml"), "--capture",
                           str(capture)], cwd=root, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_snapshot_is_a_validated_dvc_dataset_with_feedback_and_verified_tasks(project, tmp_path):
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.taskfile import load_task_file
    from pipeline.train.incoming import load_incoming

    capture = tmp_path / "traffic"
    calm = calm_traffic(project, capture, redact=["nothing-here"])  # a redacted field no request has
    CaptureStore(CaptureConfig(dir=str(capture))).append({"kind": "request", "request_id": "open-one",
                                                          "trajectory": []})  # left open: not in the snapshot
    proc = snapshot(project, capture)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = project / "data/production/snapshot"
    manifest = json.loads((out / "snapshot.json").read_text())
    assert manifest["episodes"] == len(calm) + 2 and manifest["model_failures"] == 1  # + bare and wrong
    assert manifest["with_feedback"] == 4 and manifest["unverifiable"] == 1
    assert manifest["sealed_segments"] == 1 and len(manifest["segments"][0]["sha256"]) == 64
    assert "open-one" not in (out / "episodes.jsonl").read_text()
    assert manifest["drift"]["alarm"] is False and manifest["drift"]["window"] == len(calm) + 2

    world = ShopWorld.load(project / "data/env")
    try:
        tasks = load_task_file(out / "tasks" / "production.jsonl", world)  # the environment's own suite passes
        assert 0 < len(tasks) <= len(calm) and all(t.task_id.startswith("req-calm") for t in tasks)
        train = load_task_file(project / "data/tasks/train.jsonl", world, validate=False)
        test = load_task_file(project / "data/tasks/test.jsonl", world, validate=False)
        used = load_incoming([project / "data/incoming", out / "tasks"], train_tasks=train, test_tasks=test,
                             runtime=world)
    finally:
        world.close()
    assert used.summary["files"] == 1 and used.summary["read"] == len(tasks)  # train reads the snapshot's tasks
    assert used.summary["dropped_duplicates"] == len(tasks)  # (they are the training tasks themselves here)

    labels = {e["request_id"]: e["label"] for e in labelled_episodes(out, 4)}
    assert labels == {"calm0000": 1, "calm0001": 0, "calm0002": 0, "bare": 1}  # a label overrides the rating

    assert (project / "data/production/snapshot.dvc").is_file()  # recorded by DVC ...
    assert "/snapshot" in (project / "data/production/.gitignore").read_text()  # ... and out of git
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "data/production/snapshot.dvc"], cwd=project,
                            capture_output=True, text=True)
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr
    assert (project / "data/production/README.md").is_file()


@pytest.mark.slow
def test_shifted_traffic_raises_the_drift_alarm_and_bad_input_loses_nothing(project, tmp_path):
    capture = tmp_path / "traffic"
    shifted_traffic(capture)
    proc = snapshot(project, capture)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "drift alarm: RAISED" in proc.stdout
    out = project / "data/production/snapshot"
    drift = json.loads((out / "snapshot.json").read_text())["drift"]
    assert drift["alarm"] is True and drift["statistics"]["question_chars_ks"] == 1.0
    assert any(r.startswith("question_chars_ks") for r in drift["reasons"])
    assert not (out / "tasks").exists()  # bare questions carry no ground truth: no task
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    empty = tmp_path / "empty"
    empty.mkdir()
    bad = snapshot(project, empty)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: snapshot: no answered request in the sealed segments of {empty} (0 sealed segment(s)); "
        f"data/production/snapshot was left as it was"]
    missing = snapshot(project, tmp_path / "nowhere")
    assert missing.returncode == 2 and "error: snapshot: no capture folder" in missing.stderr
    broken = tmp_path / "broken"  # segments copied by hand: a step without its observation, a rating of 9
    store = CaptureStore(CaptureConfig(dir=str(broken)))
    store.append(request_record("b1", {"question": "q?"}, 0, result_of([{"action": "<call>x {}</call>"}], None),
                                0.01, False, MODEL))
    store.append({"kind": "feedback", "request_id": "b1", "time": "t", "rating": 9, "label": None, "text": None})
    store.close()
    refused = snapshot(project, broken)
    assert refused.returncode == 2 and "the episodes break the suite 'production'" in refused.stderr
    assert "steps_well_formed" in refused.stderr and "rating" in refused.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
