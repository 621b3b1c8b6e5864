"""Scheduled retraining: check the newest data for drift against the data the champion was trained on, and retrain and
re-gate when it drifted (or when forced); otherwise record that nothing was needed.

One run of :func:`retrain_flow`:

1. reads the incoming tasks: every ``*.jsonl`` in ``data/incoming/`` (the folder the `check_drift` stage reads too;
   drop each new batch of production tasks there, in the task schema);
2. finds the champion in the registry (``deploy.model_name``, alias ``champion``) and the data versions its deploy
   run recorded (``agentrl.data.*`` tags, set by the pipeline flow); the reference tasks, world and policy are the
   workspace copies when they are those versions, else restored from the DVC cache (:mod:`flows.lineage`);
3. runs the drift checks (:func:`pipeline.check_drift.main.check`) of the incoming tasks against that reference;
4. drift found (``task_drift``, ``trajectory_drift`` or ``state_drift`` failed) or ``force``: runs the pipeline flow
   with every stage forced from the first one that reads the data that called for the retrain on
   (:func:`pipeline.core.graph.stages_from_first_reader`): a DVC dep on the incoming folder for drift found
   (``train`` in this graph), on the traffic snapshot's for a drift alarm (``reward_model``), on either when forced;
   the stages before it read nothing new, so DVC leaves them up to date unless their own deps changed (the adapted
   model is not refitted on the same inputs, nor the reward model on feedback it has already seen), and the policy is
   retrained and the deploy stage registers a challenger and runs the promotion gate (which reads the pipeline's own
   drift verdict on the same incoming data); otherwise nothing is retrained.
   A drift alarm of served traffic also retrains: when the traffic snapshot (``deploy.snapshot.out``, written by
   `agentrl snapshot`, :mod:`pipeline.deploy.snapshot`) raised its alarm and no earlier retrain acted on that same
   snapshot (the ``retrain.alarm_snapshot`` tag of the finished `retrain` runs holds the digests acted on; a retrain
   that failed does not count), the flow retrains as on drift found; the retrain trains on the snapshot's tasks
   (``train.production_tasks``). The alarm is decided at each decision by the rule and thresholds of the server's
   ``agentrl_drift_alarm`` gauge (:func:`pipeline.deploy.monitor.drift_alarm`, ``deploy.snapshot``) on the
   statistics the snapshot recorded;
5. records the decision either way: an MLflow run ``retrain`` (tags ``retrain.decision``, ``retrain.reason``; the
   verdict and the decision as artefacts; the pipeline's runs nest under it) and a Prefect markdown artifact.

A retrain trains on the newest data: the `train` stage adds the incoming tasks to its RL task pool
(``train.incoming_tasks``, :mod:`pipeline.train.incoming`). Each file must pass the "tasks" suite, or the stage stops
before anything trains. Tasks that name a validation/test entity or use a test-only template, copies of training tasks,
and tasks whose answer the training world does not reproduce are left out. The counts are in ``metrics/train.json``
(``incoming``) and the train run's ``incoming/*`` metrics. ``data/incoming`` is a DVC dep of `train` and `check_drift`,
so a new batch also reruns them in a plain ``agentrl run``. The stages read the folder from params; this flow's
`incoming` parameter steers only its own drift check.

Deliberately left out: writing the incoming tasks into the training split (`build_env` still generates ``data/tasks``
from params alone, and `adapt` needs demonstrations, which incoming tasks lack). The drift reference stays the
training split, so while the incoming data still differs from it, the gate (``deploy.gate.require_drift_pass``)
refuses the challenger.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows import lineage, project_params
from flows.pipeline_flow import pipeline_flow
from pipeline.core.config import load_section
from pipeline.core.errors import AgentRLError
from pipeline.core.graph import stages_from_first_reader
from pipeline.core.tracking import Tracker, require_tracking

INCOMING = "data/incoming"
DRIFT_CHECKS = ("task_drift", "trajectory_drift", "state_drift")
RETRAIN_FROM = "adapt"  # a graph where no stage reads the new data: every stage from this one on is forced
SCRATCH = ".retrain"  # restored reference versions (gitignored)
SUMMARY_KEY = "agentrl-retrain-summary"
ALARM_TAG = "retrain.alarm_snapshot"  # the digest of the traffic snapshot whose drift alarm a retrain acted on


@task(name="registry-champion-lineage", retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def champion_lineage(tracking_uri: str, model_name: str) -> dict[str, Any] | None:
    """The champion's version, its deploy run and the data versions recorded on that run (or on its parent).

    None when there is no champion. Registry calls go over the network in production: failures are retried.
    """
    from pipeline.deploy.registry import CHAMPION, ModelRegistry

    registry = ModelRegistry(model_name, tracking_uri)
    mv = registry.find_alias(CHAMPION)
    if mv is None:
        return None
    tags = registry.run_tags(mv.run_id) if mv.run_id else {}
    versions = lineage.versions_from_tags(tags)
    if not versions and tags.get("mlflow.parentRunId"):  # deployed by a flow that predates the per-phase tags
        versions = lineage.versions_from_tags(registry.run_tags(tags["mlflow.parentRunId"]))
    return {"version": str(mv.version), "run_id": mv.run_id, "data": versions}


def reference_path(root: Path, configured: str, versions: dict[str, str], scratch: Path) -> tuple[str, str]:
    """`configured` (a params path such as data/tasks/train.jsonl) at the version the champion used; (path, source)."""
    rel = PurePosixPath(configured)
    if rel.is_absolute():
        return configured, "configured absolute path"
    for tracked in sorted({*versions, *lineage.data_versions(root)}, key=len, reverse=True):
        if rel == PurePosixPath(tracked) or PurePosixPath(tracked) in rel.parents:
            base, source = lineage.at_version(root, tracked, versions.get(tracked), scratch)
            inner = rel.relative_to(tracked)
            return str(base / inner) if str(inner) != "." else str(base), source
    return str(root / rel), "workspace (not a DVC-tracked output)"


@task(name="production-drift-alarm", retries=3, retry_delay_seconds=2, cache_policy=NO_CACHE)
def production_alarm(snapshot_dir: str, tracking_uri: str, thresholds=None) -> dict[str, Any] | None:
    """The drift alarm of the traffic snapshot in `snapshot_dir` (None without a snapshot), with ``acted_on``: the id
    of an earlier `retrain` run that retrained on this same snapshot's alarm and finished (None when none did).

    With `thresholds` (``deploy.snapshot``) the alarm is decided now, by :func:`pipeline.deploy.monitor.drift_alarm`
    on the statistics the snapshot recorded: the rule and the thresholds of the server's ``agentrl_drift_alarm``
    gauge as params say them today (a threshold changed since the snapshot counts); without, the snapshot's own."""
    from mlflow import MlflowClient

    from pipeline.core.tracking import EXPERIMENT
    from pipeline.deploy.monitor import drift_alarm
    from pipeline.deploy.snapshot import read_manifest

    manifest = read_manifest(snapshot_dir)
    if manifest is None:
        return None
    drift = manifest.get("drift") or {}
    if thresholds is not None and isinstance(drift.get("statistics"), dict):
        drift = {**drift, **drift_alarm(drift["statistics"], int(drift.get("window") or 0), thresholds)}
    out = {"dir": snapshot_dir, "digest": manifest.get("digest"), "created": manifest.get("created"),
           "episodes": manifest.get("episodes"), "tasks": manifest.get("tasks"), "alarm": bool(drift.get("alarm")),
           "reasons": drift.get("reasons", []), "acted_on": None}
    if out["alarm"]:
        client = MlflowClient(tracking_uri)
        exp = client.get_experiment_by_name(EXPERIMENT)
        if exp is not None:
            earlier = client.search_runs([exp.experiment_id], max_results=1,
                                         filter_string=f"tags.`{ALARM_TAG}` = '{out['digest']}' "
                                                       "and attributes.status = 'FINISHED'")
            out["acted_on"] = earlier[0].info.run_id if earlier else None
    return out


@task(name="drift-check", cache_policy=NO_CACHE)
def drift_check(root: str, overrides: dict[str, Any], out_path: str, parent_run_id: str) -> dict[str, Any]:
    """The `check_drift` phase's checks on explicit reference and current data, as a run nested under the retrain run."""
    from pipeline.check_drift.config import DriftConfig
    from pipeline.envs.config import EnvConfig
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.check_drift.main import check
    from pipeline.policy.config import RolloutConfig

    params = Path(root) / "params.yaml"
    cfg = load_section(DriftConfig, "check_drift", params).model_copy(update=overrides)
    env_cfg = load_section(EnvConfig, "env", params)
    build_cfg = load_section(BuildEnvConfig, "build_env", params)
    rollout_cfg = load_section(RolloutConfig, "rollout", params)
    with Tracker(root=root).run("retrain_drift_check", params={"check_drift": cfg.model_dump()},
                                parent_run_id=parent_run_id) as run:
        return check(cfg, env_cfg, build_cfg, Path(out_path), run, rollout_cfg)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _markdown(record: dict[str, Any]) -> str:
    lines = ["# agentrl scheduled retraining", "", f"**Decision:** {record['decision']} ({record['reason']})", ""]
    lines.append(f"- incoming: {len(record['incoming'])} file(s) in `{record['incoming_dir']}`"
                 + "".join(f"\n  - `{f['path']}` ({f['sha256'][:12]})" for f in record["incoming"]))
    champ = record["champion"]
    lines.append(f"- champion before: v{champ['version']}" if champ else "- champion before: none")
    for name, where in record.get("reference", {}).items():
        lines.append(f"- reference {name}: {where}")
    alarm = record.get("production")
    if alarm:
        state = ("RAISED" if alarm["alarm"] else "none") + (f", already acted on by run {alarm['acted_on']}"
                                                             if alarm["acted_on"] else "")
        lines.append(f"- traffic snapshot `{alarm['dir']}` ({alarm['episodes']} episodes, {alarm['tasks']} tasks): "
                     f"drift alarm {state}")
    verdict = record.get("drift")
    if verdict:
        checks = ", ".join(f"{k} {v}" for k, v in verdict["checks"].items())
        lines.append(f"- drift check: {verdict['verdict']} ({checks})")
    if record.get("gate"):
        g = record["gate"]
        failed = f" (failed: {', '.join(g['failed'])})" if g.get("failed") else ""
        now = f"champion now v{g['champion']}" if g.get("champion") else "no champion"
        verdict = "UNCHANGED (same weights)" if g.get("unchanged") else "PROMOTED" if g["passed"] else "REJECTED"
        lines.append(f"- gate: v{g['version']} {verdict}{failed}; {now}")
    lines += ["", "## Where to look next", "",
              f"- MLflow run `retrain` `{record['run_id']}`: tags `retrain.*`, artefacts `retrain_decision.json` and "
              "the drift verdict; a retrain's pipeline run and phase runs nest under it",
              "- The pipeline run's own artifact `agentrl-pipeline-summary` when a retrain ran"]
    return "\n".join(lines) + "\n"


@flow(name="agentrl-retrain")
def retrain_flow(project: str = ".", incoming: str = INCOMING, force: bool = False) -> dict[str, Any]:
    """One scheduled retraining decision for the project at `project` (see the module docstring); returns the record."""
    from pipeline.check_drift.config import DriftConfig
    from pipeline.deploy.config import DeployConfig

    require_tracking("the retraining flow (its MLflow runs and the registry)")
    logger = get_run_logger()
    params = project_params(Path(project) / "params.yaml")
    root = params.parent
    deploy_cfg = load_section(DeployConfig, "deploy", params)
    model_name, snapshot_out = deploy_cfg.model_name, deploy_cfg.snapshot.out
    drift_cfg = load_section(DriftConfig, "check_drift", params)
    incoming_dir = (root / incoming).resolve()
    files = sorted(incoming_dir.glob("*.jsonl")) if incoming_dir.is_dir() else []

    tracker = Tracker(root=root)
    record: dict[str, Any] = {"incoming_dir": str(incoming_dir), "force": force, "gate": None, "drift": None,
                              "incoming": [{"path": str(f), "sha256": _sha256(f)} for f in files]}
    with tracker.run("retrain", params={"incoming": str(incoming_dir), "force": force}) as run:
        record["run_id"] = run.run_id
        run.set_tags(lineage.git_state(root))
        champion = champion_lineage(tracker.tracking_uri, model_name)
        record["champion"] = champion
        drift_found = False
        if files:
            scratch = root / SCRATCH
            versions = champion["data"] if champion else {}
            reference: dict[str, str] = {}
            overrides: dict[str, Any] = {"current": str(incoming_dir), "current_world_dir": None}
            for key in ("reference_tasks", "world_dir", "policy"):
                path, source = reference_path(root, getattr(drift_cfg, key), versions, scratch)
                overrides[key], reference[key] = path, f"{path} from {source}"
            record["reference"] = reference
            with tempfile.TemporaryDirectory() as tmp:
                verdict = drift_check(str(root), overrides, str(Path(tmp) / "drift.json"), run.run_id)
            statuses = {k: v["status"] for k, v in verdict["checks"].items()}
            record["drift"] = {"verdict": verdict["verdict"], "failed": verdict["failed_checks"], "checks": statuses}
            run.log_dict(verdict, "drift_verdict.json")
            drift_found = any(statuses.get(c) == "fail" for c in DRIFT_CHECKS)
        alarm = production_alarm(str(root / snapshot_out), tracker.tracking_uri, deploy_cfg.snapshot)
        record["production"] = alarm
        alarm_found = bool(alarm and alarm["alarm"] and alarm["acted_on"] is None)
        if drift_found:
            failed = [c for c in DRIFT_CHECKS if record["drift"]["checks"].get(c) == "fail"]
            reason = f"drift found ({', '.join(failed)})"
        elif alarm_found:
            reason = f"drift alarm on served traffic ({'; '.join(alarm['reasons'])})"
        elif force:
            reason = "forced"
        elif not files:
            reason = f"no incoming tasks in {incoming_dir}"
        else:
            reason = "no drift: the champion's training data still describes the incoming tasks"
        record["reason"] = reason
        if drift_found or alarm_found or force:
            record["decision"] = "retrain"
            if alarm_found:
                run.set_tags({ALARM_TAG: alarm["digest"]})
            logger.info("retraining: %s", reason)
            # the first stage that reads the data that called for the retrain, and every one after it: incoming
            # tasks that drifted are read from `train` on, a traffic snapshot from `reward_model` on; a stage before
            # it is still rerun by DVC if its own deps changed
            triggers = ([incoming_dir] if drift_found or force else []) + \
                ([root / snapshot_out] if alarm_found or force else [])
            forced = stages_from_first_reader(root, triggers, RETRAIN_FROM)
            record["forced"] = forced
            result = pipeline_flow(params_path=str(params), force=forced, mlflow_parent_run_id=run.run_id)
            record["gate"] = result["gate"]
            record["pipeline_run_id"] = result["run_id"]
        else:
            record["decision"] = "nothing needed"
            logger.info("nothing to do: %s", reason)
        run.set_tags({"retrain.decision": record["decision"], "retrain.reason": reason})
        run.log_metrics({"retrain/drift_found": drift_found, "retrain/drift_alarm": alarm_found,
                         "retrain/retrained": record["decision"] == "retrain"})
        run.log_dict(record, "retrain_decision.json")
    create_markdown_artifact(key=SUMMARY_KEY, markdown=_markdown(record),
                             description="the retraining decision, its reasons and where to look next")
    print(f"retrain: {record['decision']} ({reason})", flush=True)
    return record


def deployment_spec(root: str | Path, name: str | None = None) -> dict[str, Any]:
    """The retraining deployment of `root`/prefect.yaml (the one whose entrypoint is :func:`retrain_flow`)."""
    path = Path(root) / "prefect.yaml"
    if not path.is_file():
        raise AgentRLError(f"{path}: not found; the retraining schedule is defined there")
    doc = yaml.safe_load(path.read_text()) or {}
    found = [d for d in doc.get("deployments") or [] if str(d.get("entrypoint", "")).endswith(":retrain_flow")
             and (name is None or d.get("name") == name)]
    if not found:
        raise AgentRLError(f"{path}: no deployment of flows/retrain_flow.py:retrain_flow"
                           + (f" named {name!r}" if name else ""))
    return found[0]


def serve_retraining(root: str | Path, name: str | None = None, cron: str | None = None) -> None:
    """Serve the retraining deployment of prefect.yaml from this process (``flow.serve``) until interrupted: the
    schedule's runs and runs triggered by hand (``prefect deployment run agentrl-retrain/<name>``) execute here."""
    spec = deployment_spec(root, name)
    crons = [s["cron"] for s in spec.get("schedules") or [] if s.get("cron")]
    params = {**(spec.get("parameters") or {}), "project": str(Path(root).resolve())}
    retrain_flow.serve(name=spec["name"], cron=cron or (crons[0] if crons else None), parameters=params,
                       description=spec.get("description"), tags=spec.get("tags"))


__all__ = ["champion_lineage", "deployment_spec", "retrain_flow", "serve_retraining"]
