"""The whole pipeline as one Prefect flow: the stages of `dvc.yaml`, in the order `pipeline.graph` gives, one task each.

Each task runs ``dvc repro --single-item <stage>`` from the repository root, so DVC decides whether the stage is up to
date (and skips it), runs the stage's own command, and records `dvc.lock`; the flow adds ordering, one MLflow parent run
that every phase run nests under (through ``AGENTRL_PARENT_RUN_ID``), and wall times. A stage that exits non-zero fails
its task with the tail of its output, the flow stops there, and nothing downstream runs.

Deliberately left out: retries (a phase that fails is a bug or bad data, not a transient error, and training is too
expensive to repeat blindly) and Prefect result caching (DVC already knows what is up to date).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows import project_params
from pipeline.errors import AgentRLError
from pipeline.graph import select, stage_order
from pipeline.tracking import PARENT_RUN_ENV, Tracker

TAIL_LINES = 40


class StageFailed(AgentRLError):
    """A stage's command exited non-zero; the message carries the end of its output."""


@task(name="dvc-repro", task_run_name="{stage}", retries=0, cache_policy=NO_CACHE)
def repro_stage(stage: str, root: str, parent_run_id: str | None, tracking_uri: str) -> dict[str, object]:
    """Run one stage through ``dvc repro --single-item``, echoing its output; returns wall seconds and whether it ran."""
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    env["PYTHONUNBUFFERED"] = "1"  # the phase's progress shows as it happens, not when its buffer fills
    # The stage commands (`agentrl ...`) live in the same environment as this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if parent_run_id:
        env[PARENT_RUN_ENV] = parent_run_id
    args = ["dvc", "repro", "--single-item", stage]
    cmd = [sys.executable, "-m", *args]  # this environment's dvc, whatever PATH says
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    skipped = False
    start = time.perf_counter()
    with subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
            skipped = skipped or "didn't change, skipping" in line
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise StageFailed(
            f"stage '{stage}' failed (`{' '.join(args)}` exited {proc.returncode}); last output:\n"
            + "\n".join(tail)
        )
    return {"seconds": seconds, "status": "up to date" if skipped else "ran"}


def _timing_table(results: dict[str, dict[str, object]], total: float) -> str:
    width = max([len("total"), *map(len, results)])
    lines = [f"{name:<{width}}  {r['seconds']:8.1f} s  {r['status']}" for name, r in results.items()]
    lines.append(f"{'total':<{width}}  {total:8.1f} s")
    return "\n".join(lines)


@flow(name="agentrl-pipeline")
def pipeline_flow(params_path: str = "params.yaml", stages: list[str] | None = None) -> dict[str, dict[str, object]]:
    """Run the `dvc.yaml` stages next to `params_path` (all, or only `stages`) in graph order; return per-stage timings."""
    logger = get_run_logger()
    params = project_params(params_path)  # a malformed params.yaml fails before any stage starts
    root = params.parent
    order = select(stage_order(root / "dvc.yaml"), stages)
    logger.info("stages in order: %s", ", ".join(order))

    tracker = Tracker(root=root)
    results: dict[str, dict[str, object]] = {}
    start = time.perf_counter()
    try:
        with tracker.run("pipeline", params={"stages": ",".join(order), "params_path": str(params)}) as run:
            for stage in order:
                logger.info("stage %s: dvc repro --single-item %s", stage, stage)
                began = time.perf_counter()
                try:
                    result = repro_stage(stage, str(root), run.run_id, tracker.tracking_uri)
                except BaseException:
                    results[stage] = {"seconds": time.perf_counter() - began, "status": "FAILED"}
                    raise
                results[stage] = result
                run.log_metrics({f"pipeline/{stage}_wall_s": result["seconds"]})
                run.set_tags({f"agentrl.stage.{stage}": result["status"]})
            run.log_metrics({"pipeline/total_wall_s": time.perf_counter() - start})
    finally:
        print(_timing_table(results, time.perf_counter() - start), flush=True)
    return results
