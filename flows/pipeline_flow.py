"""The whole pipeline as one Prefect flow: the stages of `dvc.yaml`, in the order `pipeline.core.graph` gives, one task each.

Each task runs ``dvc repro --single-item <stage>`` from the repository root, so DVC decides whether the stage is up to
date (and skips it), runs the stage's own command, and records `dvc.lock`; the flow adds ordering, one MLflow parent run
that every phase run nests under (through ``AGENTRL_PARENT_RUN_ID``), and wall times. A stage that exits non-zero fails
its task with the tail of its output, the flow stops there, and nothing downstream runs.

Lineage: the parent run and every nested phase run get the git commit (``git.commit``, ``git.dirty``) and the DVC hashes
of the data/ and models/ versions involved (``agentrl.data.<path>``, read from `dvc.lock`; a phase run gets its own
stage's deps and outs, the parent every output). A Prefect markdown artifact ``agentrl-pipeline-summary`` summarises
each phase's headline figures, the gate's decision and where to look next; a progress artifact and a ``[k/n]`` line per
stage show how far the run is. At the end the flow prints the wall time, the orchestration overhead (wall time minus
the stages' own command time, which each ``agentrl`` command reports through ``AGENTRL_STAGE_TIMES``) and peak memory,
and writes them to ``metrics/pipeline_run.json`` (no stage's output, so DVC does not track it; ``bench/targets.py``
reads it).

Retries only where a failure is transient: MLflow tracking and registry calls made by the flow, and ``dvc push``.
Deliberately left out: retrying a stage (a phase that fails is a bug or bad data, and training is too expensive to
repeat blindly) and Prefect result caching (DVC already knows what is up to date).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from flows import lineage, project_params, summary
from pipeline.core.errors import AgentRLError
from pipeline.core.graph import load_stages, select
from pipeline.core.jsonl import read_jsonl
from pipeline.core.tracking import PARENT_RUN_ENV, Tracker, require_tracking

TAIL_LINES = 40
STOP_GRACE_S = 60  # how long an interrupted stage may take to stop before it is killed
STAGE_TIMES_ENV = "AGENTRL_STAGE_TIMES"  # flows.cli appends each command's own wall time here
STAGE_TAG = "agentrl.flow_stage"  # set by the flow on the phase runs it has tagged
SUMMARY_KEY = "agentrl-pipeline-summary"
RUN_RECORD = summary.RUN_RECORD


class StageFailed(AgentRLError):
    """A stage's command exited non-zero; the message carries the end of its output, and `command_s` the command's
    own seconds (None when it recorded none), so a failed run's cost does not book them as orchestration overhead."""

    command_s: float | None = None


# torch.distributed's rank variables: a stage is never a rank of this process's group. A process that once ran a
# single in-process rank (a test run, a notebook) keeps them in os.environ with the port its own group still
# holds; a training stage that inherited them bound that port again and failed with EADDRINUSE.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def stage_env(root: str, tracking_uri: str, parent_run_id: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    env["PYTHONUNBUFFERED"] = "1"  # the phase's progress shows as it happens, not when its buffer fills
    # The stage commands (`agentrl ...`) live in the same environment as this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if parent_run_id:
        env[PARENT_RUN_ENV] = parent_run_id
    else:
        env.pop(PARENT_RUN_ENV, None)
    return env


def stop_stage(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a stage's `dvc repro` and the command it runs, as Ctrl-C in a terminal would: SIGINT to the whole process
    group (the stage's command ends as interrupted and leaves its outputs as they were), then SIGKILL after `grace_s`.
    A SIGTERM reaches only the flow's own process; without this the stage went on working after the run had said
    "interrupted", and `Popen` waited for it."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # already gone
        pass


@task(name="dvc-repro", task_run_name="{stage}", retries=0, cache_policy=NO_CACHE)
def repro_stage(stage: str, root: str, parent_run_id: str | None, tracking_uri: str,
                force: bool = False) -> dict[str, Any]:
    """Run one stage through ``dvc repro --single-item`` (``--force``: even when up to date), echoing its output.

    Returns wall seconds, ``command_s`` (the stage command's own seconds, None when it did not run), ``peak_mib``
    (the peak resident memory of the command's largest process, None when it did not run) and the status.
    """
    env = stage_env(root, tracking_uri, parent_run_id)
    fd, times_path = tempfile.mkstemp(prefix=f"agentrl-{stage}-", suffix=".jsonl")
    os.close(fd)
    env[STAGE_TIMES_ENV] = times_path
    args = ["dvc", "repro", "--single-item", *(["--force"] if force else []), stage]
    cmd = [sys.executable, "-m", *args]  # this environment's dvc, whatever PATH says
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    skipped = False
    start = time.perf_counter()
    try:
        with subprocess.Popen(
            cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True,  # its own process group: `stop_stage` reaches the stage's command through dvc
        ) as proc:
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                    tail.append(line.rstrip("\n"))
                    skipped = skipped or "didn't change, skipping" in line
            except BaseException:  # interrupted (Ctrl-C, or SIGTERM, which `agentrl` turns into the same)
                stop_stage(proc)
                raise
        seconds = time.perf_counter() - start
        records = read_jsonl(times_path, "stage timings", allow_empty=True)
    finally:
        os.unlink(times_path)
    command_s = sum(r["seconds"] for r in records) if records else None
    if proc.returncode != 0:
        failed = StageFailed(
            f"stage '{stage}' failed (`{' '.join(args)}` exited {proc.returncode}); last output:\n"
            + "\n".join(tail)
        )
        failed.command_s = command_s  # the failed command's own time is stage time, not orchestration overhead
        raise failed
    peaks = [r["peak_rss_mib"] for r in records if r.get("peak_rss_mib") is not None]
    return {"seconds": seconds, "command_s": command_s, "peak_mib": max(peaks) if peaks else None,
            "status": "up to date" if skipped else "ran"}


@task(name="mlflow-tags", retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def tag_runs(tracking_uri: str, parent_run_id: str, parent_tags: dict[str, str],
             stage: str | None = None, child_tags: dict[str, str] | None = None) -> int:
    """Tag the parent run, and (with `stage`) every phase run nested under it that the flow has not tagged yet.

    A tracking store is a network service in production: a failed call is retried. Returns the phase runs tagged.
    """
    tracker = Tracker(tracking_uri=tracking_uri)
    if parent_tags:
        tracker.set_tags(parent_run_id, parent_tags)
    if stage is None:
        return 0
    fresh = [run_id for run_id, tags in tracker.child_runs(parent_run_id) if STAGE_TAG not in tags]
    for run_id in fresh:
        tracker.set_tags(run_id, {**(child_tags or {}), STAGE_TAG: stage})
    return len(fresh)


@task(name="registry-read", retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def read_champion(tracking_uri: str, model_name: str) -> str | None:
    """The version the registry's `champion` alias points to now (None: no champion, or no registered model)."""
    from pipeline.deploy.registry import CHAMPION, ModelRegistry

    version = ModelRegistry(model_name, tracking_uri).find_alias(CHAMPION)  # a store that did not answer: retried
    return None if version is None else str(version.version)


@task(name="dvc-push", retries=3, retry_delay_seconds=5, cache_policy=NO_CACHE)
def push_data(root: str) -> str:
    """``dvc push`` to the default remote (.dvc/config); a remote that is briefly unreachable is retried."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "push"], cwd=root, capture_output=True, text=True,
                          timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`dvc push` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "pushed"


def _timing_table(results: dict[str, dict[str, Any]], total: float) -> str:
    width = max([len("total"), *map(len, results)])
    lines = [f"{name:<{width}}  {r['seconds']:8.1f} s  {r['status']}"
             + (f"  (peak {r['peak_mib']:.0f} MiB)" if r.get("peak_mib") is not None else "")
             for name, r in results.items()]
    lines.append(f"{'total':<{width}}  {total:8.1f} s")
    return "\n".join(lines)



@flow(name="agentrl-pipeline")
def pipeline_flow(params_path: str = "params.yaml", stages: list[str] | None = None, force: list[str] | None = None,
                  push: bool = False, mlflow_parent_run_id: str | None = None,
                  started_at: float | None = None) -> dict[str, Any]:
    """Run the `dvc.yaml` stages next to `params_path` (all, or only `stages`) in graph order.

    `force`: stages to rerun even when DVC finds them up to date (retraining). `push`: ``dvc push`` at the end.
    `mlflow_parent_run_id`: nest this run's MLflow parent run under another (the retraining flow's).
    `started_at`: the caller's start (``time.time()``), so the reported wall time includes Prefect's start-up.
    Returns {"stages": per-stage timings, "cost": wall/overhead/memory, "gate": the gate's outcome or None,
    "run_id": the MLflow parent run}.
    """
    require_tracking("the pipeline flow (its MLflow parent run)")
    logger = get_run_logger()
    wall0 = started_at if started_at is not None else time.time()
    params = project_params(params_path)  # a malformed params.yaml fails before any stage starts
    root = params.parent
    by_name = {s.name: s for s in load_stages(root / "dvc.yaml")}
    order = select(list(by_name), stages)
    forced = set(select(list(by_name), force)) if force else set()
    n = len(order)
    logger.info("stages in order: %s", ", ".join(order))

    tracker = Tracker(root=root)
    uri = tracker.tracking_uri
    git = lineage.git_state(root)
    results: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"stages": results, "cost": None, "gate": None, "run_id": None}
    error: str | None = None
    progress_id = create_progress_artifact(progress=0.0, description=f"agentrl pipeline: {n} stages")
    try:
        with tracker.run("pipeline", params={"stages": ",".join(order), "params_path": str(params),
                                             "force": ",".join(sorted(forced))},
                         parent_run_id=mlflow_parent_run_id) as run:
            out["run_id"] = run.run_id
            tag_runs(uri, run.run_id, {**git, **lineage.version_tags(lineage.data_versions(root))})
            for k, stage in enumerate(order, 1):
                print(f"[{k}/{n}] {stage}: running `dvc repro --single-item {stage}`"
                      + (" --force" if stage in forced else ""), flush=True)
                began = time.perf_counter()
                try:
                    result = repro_stage(stage, str(root), run.run_id, uri, force=stage in forced)
                except BaseException as exc:
                    results[stage] = {"seconds": time.perf_counter() - began,
                                      "command_s": getattr(exc, "command_s", None), "status": "FAILED"}
                    error = str(exc)
                    run.set_tags({f"agentrl.stage.{stage}": "FAILED", "agentrl.failed_stage": stage})
                    raise
                results[stage] = result
                _record_stage(k, n, stage, result, run, uri, root, git, progress_id)
            out["gate"] = _finish(root, order, push, run, uri, logger)
            run.log_metrics({"pipeline/total_wall_s": time.time() - wall0})
    finally:
        out["cost"] = _report(root, by_name, results, out, error, time.time() - wall0, uri, logger)
    return out


def _record_stage(k: int, n: int, stage: str, result: dict[str, Any], run, uri: str, root: Path, git: dict,
                  progress_id) -> None:
    """A stage that ran or was up to date: its `[k/n]` line, the progress artifact, its wall time and peak memory on
    the parent run, its status tag, and (when it ran) the lineage tags of its phase run."""
    print(f"[{k}/{n}] {stage}: {result['status']} in {result['seconds']:.1f} s", flush=True)
    update_progress_artifact(progress_id, progress=100.0 * k / n)
    run.log_metrics({f"pipeline/{stage}_wall_s": result["seconds"],
                     **({f"pipeline/{stage}_peak_mib": result["peak_mib"]}
                        if result.get("peak_mib") is not None else {})})
    run.set_tags({f"agentrl.stage.{stage}": result["status"]})
    if result["status"] == "ran":
        tag_runs(uri, run.run_id, {}, stage, {**git, **lineage.version_tags(lineage.stage_versions(root, stage))})


def _finish(root: Path, order: list[str], push: bool, run, uri: str, logger) -> dict[str, Any] | None:
    """After the last stage: the data versions on the parent run, `dvc push` when asked, and the gate's outcome
    (with the champion as the registry names it, and tags on the parent run) when `deploy` was among the stages."""
    tag_runs(uri, run.run_id, lineage.version_tags(lineage.data_versions(root)))
    if push:
        logger.info("dvc push: %s", push_data(str(root)))
    gate = summary.gate_decision(root) if "deploy" in order else None
    if gate is not None and gate.get("model_name"):
        gate["champion"] = read_champion(uri, gate["model_name"])  # the registry's word, not the file's
        run.set_tags({"agentrl.gate": "unchanged" if gate.get("unchanged") else
                      "promoted" if gate["passed"] else "rejected",
                      "agentrl.model_version": gate["version"]})
    return gate


def _report(root: Path, by_name: dict, results: dict[str, dict[str, Any]], out: dict[str, Any], error: str | None,
            wall_s: float, uri: str, logger) -> dict[str, Any]:
    """Whatever the outcome: the cost figures (returned), the run record, the timing table and cost lines, and the
    summary artifact (a summary that cannot be stored is a warning, never the run's outcome)."""
    cost = summary.cost_figures(wall_s, results)
    summary.write_run_record(root / RUN_RECORD, results, cost, error, out["run_id"])
    print(_timing_table(results, cost["total_s"]), flush=True)
    print(summary.describe_cost(cost), flush=True)
    figures = {s: summary.headlines(s, root / by_name[s].metrics[0]) for s in results if by_name[s].metrics}
    try:
        create_markdown_artifact(
            key=SUMMARY_KEY, description="phases, headline figures, the gate's decision, where to look next",
            markdown=summary.markdown("agentrl pipeline run", results, figures, out["gate"], cost, uri,
                                      out["run_id"], error))
    except Exception as exc:  # a summary that cannot be stored must not hide the run's own outcome
        logger.warning("could not store the summary artifact: %s", exc)
    return cost
