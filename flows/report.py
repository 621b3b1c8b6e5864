"""`agentrl report`: a markdown report card of one pipeline run.

It reads what a run leaves behind and writes it on one page:

- the phases in run order with their status, wall time and peak memory (``metrics/pipeline_run.json``, which
  ``agentrl run`` writes last);
- every phase's headline figures from its metrics file (the files dvc.yaml declares; the same picks as the Prefect
  summary artifact, :data:`flows.summary.HEADLINES`);
- the promotion gate's decision and each of its checks (``metrics/deploy.json``);
- the run's cost: wall time, orchestration overhead, peak memory;
- the MLflow parent run (id, status, start, duration, git commit, the gate tag) and its phase runs; the run is the
  one ``metrics/pipeline_run.json`` names, or ``--run-id``, or else the latest run named ``pipeline``;
- the plot files dvc.yaml declares that exist, and the commands that draw them.

Where it goes: ``metrics/report.md`` by default (``--out`` for another path). The report describes the metrics files
it sits beside, which describe the last run of the project; git tracks ``metrics/``, so a commit of a run's metrics
carries that run's report, and ``git log -p metrics/report.md`` is the record of runs.

Decisions: a phase whose metrics file is missing is reported as not run, so the report of a run that stopped early
still says how far it got; a project with no metrics at all, or a metrics file that is not JSON, is an error (one
``error:`` line). The report never creates a tracking store: a SQLite store that does not exist, or
``AGENTRL_TRACKING=off``, leaves the MLflow section saying so. Nothing here imports Prefect.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from flows import summary
from pipeline.core import atomic
from pipeline.core.errors import AgentRLError
from pipeline.core.graph import load_stages

RUN_RECORD = summary.RUN_RECORD
DEFAULT_OUT = "metrics/report.md"
PLOT_SUFFIXES = (".csv", ".tsv", ".json", ".png", ".svg", ".jpg", ".html")


def _read_json(path: Path) -> Any:
    """The JSON document at `path`, None when the file is missing; an AgentRLError naming it when it is not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AgentRLError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AgentRLError(f"{path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); rerun the "
                           "phase that writes it") from None


def collect(root: Path) -> dict[str, Any]:
    """What the project at `root` holds of its last run: stages in run order with their metrics file and headline
    figures, the run record, the gate, the plot files. Raises AgentRLError when no metrics file exists."""
    stages = load_stages(root / "dvc.yaml")
    record = _read_json(root / RUN_RECORD) or {}
    phases: dict[str, dict[str, Any]] = {}
    for stage in stages:
        metrics_file = stage.metrics[0] if stage.metrics else None
        doc = _read_json(root / metrics_file) if metrics_file else None
        phases[stage.name] = {
            "metrics_file": metrics_file, "present": doc is not None,
            "figures": summary.headlines(stage.name, root / metrics_file) if doc is not None else {},
            "run": (record.get("stages") or {}).get(stage.name),
        }
    if not any(p["present"] for p in phases.values()):
        declared = ", ".join(p["metrics_file"] for p in phases.values() if p["metrics_file"]) or "none declared"
        raise AgentRLError(f"{root / 'metrics'}: no metrics of any phase ({declared}); run the pipeline first "
                           "(`agentrl run`)")
    plots = [out for stage in stages for out in stage.outs
             if out.startswith("metrics/") and Path(out).suffix in PLOT_SUFFIXES and out not in stage.metrics
             and (root / out).is_file()]
    return {"phases": phases, "record": record, "gate": summary.gate_decision(root), "plots": plots}


def _sqlite_missing(uri: str) -> bool:
    return uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file()


def mlflow_run(root: Path, run_id: str | None, recorded: str | None = None) -> dict[str, Any]:
    """The MLflow parent run of the report and its phase runs, or {"note": why there is none}.

    `run_id`: the run the user asked for (an error when the store lacks it). Otherwise `recorded`, the run the run
    record names, and when the store lacks that, the latest run named ``pipeline`` (a note says so).
    """
    from pipeline.core.tracking import EXPERIMENT, Tracker, store_failure, tracking_enabled

    if not tracking_enabled():
        return {"note": "tracking is off (AGENTRL_TRACKING=off)"}
    tracker = Tracker(root=root)
    uri = tracker.tracking_uri
    if _sqlite_missing(uri):
        if run_id:
            raise AgentRLError(f"run {run_id}: no tracking store at {uri}")
        return {"note": f"no tracking store at {uri}", "uri": uri}
    from mlflow.exceptions import MlflowException

    client = tracker.client()
    note = ""
    if run_id is None and recorded:
        try:
            client.get_run(recorded)
            run_id = recorded
        except MlflowException as exc:
            if store_failure(exc):  # the store did not answer: the caller's one error line
                raise
            note = f"the run record's run {recorded} is not in this store; the latest pipeline run instead"
    try:
        if run_id is None:
            exp = client.get_experiment_by_name(EXPERIMENT)
            runs = client.search_runs([exp.experiment_id], filter_string="tags.`mlflow.runName` = 'pipeline'",
                                      order_by=["attributes.start_time DESC"], max_results=1) if exp else []
            if not runs:
                return {"note": f"no pipeline run in {uri}", "uri": uri}
            run = runs[0]
        else:
            run = client.get_run(run_id)
        children = client.search_runs([run.info.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'",
                                      order_by=["attributes.start_time ASC"])
    except MlflowException as exc:
        if store_failure(exc):
            raise
        raise AgentRLError(f"run {run_id or '(latest)'} in {uri}: {str(exc).splitlines()[0]}") from None

    def describe(r: Any) -> dict[str, Any]:
        end = r.info.end_time
        return {"run_id": r.info.run_id, "name": r.data.tags.get("mlflow.runName", ""), "status": r.info.status,
                "start": dt.datetime.fromtimestamp(r.info.start_time / 1000, dt.timezone.utc),
                "seconds": (end - r.info.start_time) / 1000 if end else None}

    return {"uri": uri, **describe(run), "other": note, "commit": run.data.tags.get("git.commit", ""),
            "dirty": run.data.tags.get("git.dirty", ""), "gate_tag": run.data.tags.get("agentrl.gate", ""),
            "failed_stage": run.data.tags.get("agentrl.failed_stage", ""),
            "children": [describe(c) for c in children]}


def _phase_rows(phases: dict[str, dict[str, Any]]) -> list[str]:
    rows = ["| phase | status | wall s | peak MiB | metrics |", "|---|---|---|---|---|"]
    for name, p in phases.items():
        run = p["run"] or {}
        status = run.get("status") or ("(metrics present)" if p["present"] else "not run")
        wall = f"{run['seconds']:.1f}" if run.get("seconds") is not None else ""
        peak = f"{run['peak_mib']:.0f}" if run.get("peak_mib") is not None else ""
        where = f"`{p['metrics_file']}`" if p["present"] else "missing"
        rows.append(f"| {name} | {status} | {wall} | {peak} | {where} |")
    return rows


def _gate_lines(gate: dict[str, Any] | None) -> list[str]:
    if gate is None:
        return ["Not reached (no `metrics/deploy.json`)."]
    if gate.get("unchanged"):
        verdict = "UNCHANGED (the weights an alias already holds; nothing registered)"
    else:
        verdict = {True: "PROMOTED", False: "REJECTED"}.get(gate.get("passed"), "not run")
    lines = [f"`{gate.get('model_name')}` version {gate.get('version')}: **{verdict}**; champion: "
             f"{'version ' + str(gate['champion']) if gate.get('champion') else 'none'}."]
    if gate.get("checks"):
        lines += ["", "| check | passed |", "|---|---|"]
        lines += [f"| {name} | {'yes' if ok else 'NO'} |" for name, ok in gate["checks"].items()]
    return lines


def _mlflow_lines(run: dict[str, Any]) -> list[str]:
    if "note" in run:
        return [f"No MLflow run: {run['note']}."]
    took = f"{run['seconds']:.0f} s" if run["seconds"] is not None else "still open"
    lines = [f"Parent run `{run['run_id']}` ({run['status']}), started {run['start']:%Y-%m-%d %H:%M:%S} UTC, "
             f"{took}; store `{run['uri']}`."]
    if run["commit"]:
        dirty = " with uncommitted changes." if run["dirty"] == "true" else "."
        lines.append(f"Git commit `{run['commit']}`{dirty}")
    if run["other"]:
        lines.append(f"Note: {run['other']}.")
    if run["failed_stage"]:
        lines.append(f"Failed stage: {run['failed_stage']}.")
    if run["children"]:
        lines += ["", "| phase run | status | seconds | run id |", "|---|---|---|---|"]
        for c in run["children"]:
            took = "" if c["seconds"] is None else f"{c['seconds']:.1f}"
            lines.append(f"| {c['name']} | {c['status']} | {took} | `{c['run_id']}` |")
    lines += ["", f"`mlflow ui --backend-store-uri {run['uri']}` shows its parameters, metrics and artefacts."]
    return lines


def _cost_line(c: dict[str, float]) -> str:
    return (f"Wall time {c['total_s']:.1f} s, of which the stages' own commands {c['stage_commands_s']:.1f} s and "
            f"orchestration {c['overhead_s']:.1f} s ({100 * c['overhead_share']:.1f} %). Peak memory "
            f"{c['peak_rss_children_mib']:.0f} MiB (the largest stage, with the child processes it waits on); the "
            f"flow's own process {c['peak_rss_self_mib']:.0f} MiB.")


def render(root: Path, facts: dict[str, Any], run: dict[str, Any]) -> str:
    """The report card as markdown (see the module docstring for its sections)."""
    record = facts["record"]
    title = run.get("run_id") or "last run"
    lines = [f"# Run report: {root.name}, {title}", ""]
    if record.get("failed"):
        lines += [f"**Failed:** {record['failed']}", ""]
    lines += ["## Phases", "", *_phase_rows(facts["phases"]), "", "## Headline figures", ""]
    for name, p in facts["phases"].items():
        if p["present"]:
            shown = ", ".join(f"`{k}` {summary.fmt(v)}" for k, v in p["figures"].items()) or "(no scalar figures)"
            lines.append(f"- **{name}**: {shown}")
    lines += ["", "## Promotion gate", "", *_gate_lines(facts["gate"]), "", "## Time and memory", ""]
    cost = record.get("cost")
    lines.append(_cost_line(cost) if cost else
                 f"No run record (`{RUN_RECORD}`): the phases ran one by one, not through `agentrl run`.")
    lines += ["", "## MLflow", "", *_mlflow_lines(run), "", "## Plots", ""]
    if facts["plots"]:
        lines += [f"- `{p}`" for p in facts["plots"]]
        lines.append("- `dvc plots show` draws them (HTML in `dvc_plots/`)")
    else:
        lines.append("None of the plot files dvc.yaml declares exists.")
    return "\n".join(lines) + "\n"


def write_report(root: str | Path, out: str | Path | None = None, run_id: str | None = None) -> Path:
    """Write the report card of the project at `root` to `out` (default ``<root>/metrics/report.md``; a relative
    `out` is taken from the working directory). Returns the path written."""
    root = Path(root).resolve()
    path = atomic.check_target(Path(out) if out is not None else root / DEFAULT_OUT)
    facts = collect(root)
    from pipeline.core.tracking import store_errors

    with store_errors("agentrl report (the run's MLflow run)", "no report was written"):
        run = mlflow_run(root, run_id, facts["record"].get("run_id"))
    atomic.write_text(path, render(root, facts, run))
    return path


__all__ = ["DEFAULT_OUT", "collect", "mlflow_run", "render", "write_report"]
