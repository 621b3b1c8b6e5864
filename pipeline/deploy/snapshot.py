"""From traffic to data: a snapshot of captured traffic as the dataset ``data/production/snapshot``
(`agentrl snapshot`; the command records it with DVC: :mod:`flows.snapshot`).

It reads the *sealed* segments of the capture folder (``deploy.serve.capture.dir``; a sealed segment never changes,
so the list of their names and digests in ``snapshot.json`` says exactly what the snapshot was made from; an open
segment joins the next snapshot once the server seals it) and writes, replacing the folder as a whole
(:func:`pipeline.core.atomic.replace_dir`: a reader sees the old snapshot or the complete new one):

- ``episodes.jsonl``: one row per answered request (a model failure has no episode; it is counted), with the
  last feedback a person gave on it joined (``rating``, ``label``, ``feedback_text``; null when none), checked
  with the Great Expectations suite "production" (:mod:`pipeline.core.production_suite`). The `reward_model`
  stage reads the labelled rows (:func:`pipeline.core.traffic.labelled_episodes`);
- ``tasks/production.jsonl``: the requests the environment can check turned into tasks in its task-file format:
  the request must read as a task (:meth:`Environment.request_task`) that carries the pipeline's task keys, and the
  world must give its stated answer (:meth:`Environment.verify_task`); a bare question has no ground truth and is
  left out. Ids become ``req-<request id>``; a task asked twice is kept once. The file is read back through
  :func:`pipeline.envs.taskfile.load_task_file` (the environment's own suite) before the snapshot is published.
  `train` adds them to its RL pool as it adds ``data/incoming`` (``train.production_tasks``);
- ``snapshot.json``: what it was made from and what it holds (segments with their SHA-256, counts, ``digest``), and
  the drift of the newest ``drift_window`` answered requests against the champion's training data (the monitor's
  statistics, :mod:`pipeline.deploy.monitor`: KS of question length and of calls per task, total variation of the
  tool mix) with ``alarm`` true when one of them exceeds its threshold and the window holds at least
  ``min_requests`` (:func:`pipeline.deploy.monitor.drift_alarm`: the rule of the ``drift_alarm`` gauge of
  ``GET /metrics`` too). The scheduled retraining flow reads the alarm (flows/retrain_flow.py).

The alarm is a trigger, not a test: thresholds on a distance over a window of a few hundred requests, as monitoring
services set them; a retrain it triggers still meets the promotion gate. A snapshot without any answered request is
refused (the old one stays).

Deliberately left out: merging snapshots (each one is the capture folder's sealed traffic at the time, which
retention bounds; DVC keeps every earlier version), and tasks for questions without ground truth.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

from pipeline.core.errors import AgentRLError
from pipeline.core.traffic import EPISODES, read_records, segment_files, utc_now
from pipeline.deploy.monitor import Reference, drift_alarm, ks_statistic, total_variation

MANIFEST = "snapshot.json"
TASKS_DIR = "tasks"
TASKS_FILE = "production.jsonl"


def collect(capture_dir: str | Path) -> tuple[list[Path], list[dict], dict]:
    """(sealed segments, episode rows, counts) of the capture folder (see the module docstring)."""
    folder = Path(capture_dir)
    if not folder.is_dir():
        raise AgentRLError(f"snapshot: no capture folder {folder} (deploy.serve.capture.dir, or --capture)")
    segments = segment_files(folder, include_open=False)
    requests, feedback, failures = {}, {}, 0
    for rec in read_records(folder, include_open=False):
        if rec.get("kind") == "feedback":
            feedback[rec.get("request_id")] = rec
        elif rec.get("kind") == "request" and isinstance(rec.get("trajectory"), list):
            requests[rec.get("request_id")] = rec
        elif rec.get("kind") == "request":
            failures += 1
    rows = [episode_row(rec, feedback.get(rid)) for rid, rec in requests.items()]
    counts = {"sealed_segments": len(segments), "requests": len(rows) + failures, "model_failures": failures,
              "episodes": len(rows), "with_feedback": sum(r["rating"] is not None or r["label"] is not None
                                                          for r in rows)}
    return segments, rows, counts


def episode_row(rec: dict, fb: dict | None) -> dict:
    """One row of ``episodes.jsonl``: a captured request with its feedback (or None)."""
    request = rec.get("request") if isinstance(rec.get("request"), dict) else {}
    fb = fb or {}
    return {"request_id": rec.get("request_id"), "time": rec.get("time"), "model_version": rec.get("model_version"),
            "model_alias": rec.get("model_alias"), "question": str(request.get("question", "")), "request": request,
            "seed": rec.get("seed"), "steps": rec["trajectory"], "calls": rec.get("calls") or [],
            "n_calls": rec.get("n_calls") if rec.get("n_calls") is not None else len(rec.get("calls") or []),
            "answer": rec.get("answer"), "success": rec.get("success"), "truncated": rec.get("truncated"),
            "latency_ms": rec.get("latency_ms"), "rating": fb.get("rating"), "label": fb.get("label"),
            "feedback_text": fb.get("text"), "task_id": None}


def verified_tasks(rows: list[dict], world) -> tuple[list, int]:
    """(tasks, unverifiable): the tasks of the rows the environment can check (module docstring); each row that
    gives one gets its ``task_id``."""
    from dataclasses import replace

    from pipeline.envs.taskfile import record_problem

    tasks, seen, unverifiable = [], set(), 0
    for row in rows:
        try:
            task = world.request_task(row["request"])
            record = task.to_dict()
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a task record the environment reads (a redacted field, a bare question's shape)
        if record_problem(record) or not str(record.get("answer", "")).strip():
            continue
        if not world.verify_task(task):
            unverifiable += 1
            continue
        key = json.dumps({k: v for k, v in record.items() if k != "task_id"}, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        row["task_id"] = f"req-{row['request_id']}"
        tasks.append(replace(task, task_id=row["task_id"]))
    return tasks, unverifiable


def drift(rows: list[dict], reference: Reference, cfg) -> dict:
    """The drift of the newest ``cfg.drift_window`` rows against `reference`, and the alarm (module docstring)."""
    window = rows[-cfg.drift_window:]
    tools = Counter(c.get("tool") for r in window for c in r["calls"] if c.get("tool"))
    stats = {"question_chars_ks": ks_statistic([len(r["question"]) for r in window], reference.question_chars),
             "calls_per_task_ks": ks_statistic([r["n_calls"] for r in window], reference.calls_per_task),
             "tool_mix_tv": total_variation(tools, reference.tools)}
    return {"window": len(window), "statistics": stats, **drift_alarm(stats, len(window), cfg)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def take_snapshot(capture_dir: str | Path, out: str | Path, world, reference: Reference, cfg) -> dict:
    """Write the snapshot of `capture_dir` to `out` (module docstring); its manifest. `cfg`: SnapshotConfig."""
    from pipeline.core.atomic import replace_dir, write_json, write_jsonl
    from pipeline.core.production_suite import register
    from pipeline.core.validation import DataValidationError, validate_records
    from pipeline.envs.taskfile import load_task_file, write_tasks

    segments, rows, counts = collect(capture_dir)
    if not rows:
        raise AgentRLError(f"snapshot: no answered request in the sealed segments of {capture_dir} "
                           f"({counts['sealed_segments']} sealed segment(s)); {out} was left as it was")
    tasks, unverifiable = verified_tasks(rows, world)
    listed = [{"name": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in segments]
    manifest = {"created": utc_now(), "capture_dir": str(capture_dir), "segments": listed,
                "digest": hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest(),
                **counts, "tasks": len(tasks), "unverifiable": unverifiable,
                "models": sorted({str(r["model_version"]) for r in rows if r["model_version"] is not None}),
                "drift": drift(rows, reference, cfg)}
    report = validate_records(rows, register(), dataset=f"{out}/{EPISODES}")
    try:
        report.raise_if_failed()
    except DataValidationError as exc:
        raise AgentRLError(f"snapshot: the episodes break the suite 'production' ({out} was left as it was): "
                           f"{exc}") from None

    def write(tmp: Path) -> None:
        write_jsonl(tmp / EPISODES, rows)
        if tasks:
            path = tmp / TASKS_DIR / TASKS_FILE
            path.parent.mkdir(parents=True)
            write_tasks(tasks, path)
            load_task_file(path, world)  # the environment's own suite, on the file as written
        write_json(tmp / MANIFEST, manifest)

    replace_dir(out, write)
    return manifest


def read_manifest(out: str | Path) -> dict | None:
    """The manifest of the snapshot in `out`, or None when there is none."""
    path = Path(out) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise AgentRLError(f"{path}: not a JSON manifest ({exc}); rerun agentrl snapshot") from None


def main(params_path: str | Path, capture_dir: str | None = None) -> dict:
    """`agentrl snapshot`: read the `deploy` and `env` sections, snapshot, print a summary; the manifest."""
    from pipeline.core.config import load_section
    from pipeline.deploy.config import DeployConfig
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment

    cfg = load_section(DeployConfig, "deploy", params_path)
    env_cfg = load_section(EnvConfig, "env", params_path)
    world = open_environment(env_cfg.name, Path(cfg.world_dir))
    try:
        manifest = take_snapshot(capture_dir or cfg.serve.capture.dir, cfg.snapshot.out, world,
                                 Reference.load(cfg.serve.monitor), cfg.snapshot)
    finally:
        world.close()
    d = manifest["drift"]
    print(f"snapshot: {manifest['episodes']} episodes ({manifest['with_feedback']} with feedback), "
          f"{manifest['tasks']} verified tasks from {manifest['sealed_segments']} sealed "
          f"segment(s) -> {cfg.snapshot.out}; drift alarm: "
          f"{'RAISED (' + '; '.join(d['reasons']) + ')' if d['alarm'] else 'no'}", flush=True)
    return manifest


__all__ = ["MANIFEST", "TASKS_DIR", "TASKS_FILE", "collect", "drift", "main", "read_manifest",
           "take_snapshot", "verified_tasks"]
