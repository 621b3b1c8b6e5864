"""What a flow run reports: each phase's headline figures from its metrics file, the gate's decision, where to look
next (markdown for a Prefect artifact), and the run's cost (wall time, orchestration overhead, peak memory).

Pure functions over files and numbers: no Prefect, no MLflow, so they are cheap to test and to call from any flow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.core import isolation
# The figures a reader wants first from each phase's metrics file (dotted paths; missing ones are left out, and a file
# with none of them shows its first scalar fields instead, so a phase that changes its format still reports).
HEADLINES: dict[str, tuple[str, ...]] = {
    "build_env": ("counts.tasks_train", "counts.tasks_validation", "counts.tasks_test", "counts.demos",
                  "demos.success_rate", "validation.expectations_failed", "seconds.total"),
    "adapt": ("gate.enabled", "gate.passed", "capability.eval/greedy/success", "capability.eval/greedy/tool_first_acc",
              "capability.eval/greedy/param_acc", "sft.loss_final", "seconds.total"),
    "reward_model": ("heldout.success.auc", "heldout.sound.auc", "heldout.success.ece", "heldout.sound.ece",
                     "episodes.demos", "episodes.rollouts", "seconds.total"),
    "train": ("algorithm", "updates", "best_update", "best_val_success", "test.sft.overall.success_rate",
              "test.rl.overall.success_rate", "delta_rl_minus_sft.overall_success",
              "delta_rl_minus_sft.level_4_success", "seen_wording_headroom.overall",
              "seen_wording_headroom.level_4", "early_stopping.stopped",
              "mean_rollout_share", "seconds"),
    "evaluate": ("policies.sft.test.overall.success.mean", "policies.rl.test.overall.success.mean",
                 "policies.rl.validation.overall.success.mean", "flags.sft.unseen_templates.seen_success",
                 "flags.sft.unseen_templates.unseen_success", "flags.rl.unseen_templates.seen_success",
                 "flags.rl.unseen_templates.unseen_success", "flagged", "seconds"),
    "check_drift": ("verdict", "failed_checks", "checks.task_drift.status", "checks.state_drift.status",
                    "checks.consistency.status", "seconds.total"),
    "deploy": ("version", "gate.passed", "gate.failed", "champion", "serve_precision", "variants.int8.size_ratio",
               "variants.int8.success", "seconds"),
}
MAX_FALLBACK = 6
# The last run's stage times, peak memory, status and MLflow parent run (tracked by git, not DVC).
RUN_RECORD = "metrics/pipeline_run.json"


def _get(doc: Any, dotted: str) -> Any:
    """`doc` at a dotted path; a key may itself contain dots or slashes, so the longest matching key wins."""
    if not dotted:
        return doc
    if not isinstance(doc, dict):
        raise KeyError(dotted)
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in doc:
            return _get(doc[key], ".".join(parts[i:]))
    raise KeyError(dotted)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, list) and len(value) <= 8 and all(isinstance(v, (bool, int, float, str)) for v in value))


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def headlines(stage: str, metrics_file: str | Path) -> dict[str, Any]:
    """The headline figures of `stage` from its metrics file ({} when the file is missing or not JSON)."""
    path = Path(metrics_file)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, Any] = {}
    for key in HEADLINES.get(stage, ()):
        try:
            value = _get(doc, key)
        except KeyError:
            continue
        if _scalar(value):
            out[key] = value
    if not out and isinstance(doc, dict):
        for key, value in doc.items():
            if _scalar(value) and not (isinstance(value, str) and len(value) > 80):
                out[key] = value
            if len(out) >= MAX_FALLBACK:
                break
    return out


def gate_decision(root: str | Path) -> dict[str, Any] | None:
    """The promotion gate's outcome from ``metrics/deploy.json`` (None when deploy has not written it)."""
    try:
        doc = json.loads((Path(root) / "metrics" / "deploy.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    gate = doc.get("gate") or {}
    return {"model_name": doc.get("model_name"), "version": doc.get("version"), "champion": doc.get("champion"),
            "unchanged": doc.get("unchanged"), "passed": gate.get("passed"), "failed": gate.get("failed", []),
            "checks": {c["name"]: c.get("passed") for c in gate.get("checks", []) if "name" in c}}


def peak_memory_mib() -> dict[str, float]:
    """Peak resident memory in MiB: this process, and the largest finished child (stage commands and their children).

    RUSAGE_CHILDREN covers descendants that have been waited for, so a server still running (Prefect's temporary
    server) is not counted.
    """
    return {"self": isolation.self_peak_mib(), "children": isolation.children_peak_mib()}


def cost_figures(total_s: float, stages: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Total wall time, the stages' own command time, the rest (orchestration overhead: Prefect, MLflow and DVC
    bookkeeping, interpreter starts) and its share, and peak memory."""
    own = sum(float(r.get("command_s") or 0.0) for r in stages.values())
    overhead = max(total_s - own, 0.0)
    mem = peak_memory_mib()
    # A stage's recorded peak counts the child processes it ran parts in on top of its own resident size
    # (pipeline.core.isolation), which the kernel's largest-single-process figure does not.
    stage_peaks = [float(r["peak_mib"]) for r in stages.values() if r.get("peak_mib") is not None]
    return {"total_s": total_s, "stage_commands_s": own, "overhead_s": overhead,
            "overhead_share": overhead / total_s if total_s > 0 else 0.0,
            "peak_rss_self_mib": mem["self"], "peak_rss_children_mib": max([mem["children"], *stage_peaks])}


def write_run_record(path: Path, stages: dict[str, dict[str, Any]], cost: dict[str, float], error: str | None,
                     run_id: str | None = None) -> None:
    """The run's stages (status, wall seconds, command seconds, peak MiB), its cost and outcome, and its MLflow parent
    run (`run_id`, which `agentrl report` describes), as JSON at `path`."""
    record = {"run_id": run_id, "stages": {name: {k: r.get(k) for k in ("status", "seconds", "command_s", "peak_mib")}
                         for name, r in stages.items()},
              "cost": cost, "failed": error.splitlines()[0] if error else None}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def describe_cost(c: dict[str, float]) -> str:
    return (f"wall time {c['total_s']:.1f} s; stage commands {c['stage_commands_s']:.1f} s; orchestration overhead "
            f"{c['overhead_s']:.1f} s ({100 * c['overhead_share']:.1f} %); peak memory {c['peak_rss_children_mib']:.0f} "
            f"MiB (largest stage, with the child processes it waits on), {c['peak_rss_self_mib']:.0f} MiB (this process)")


def markdown(title: str, stages: dict[str, dict[str, Any]], figures: dict[str, dict[str, Any]],
             gate: dict[str, Any] | None, cost: dict[str, float], tracking_uri: str, parent_run_id: str | None,
             error: str | None = None) -> str:
    """The run summary as markdown: a table of phases, their headline figures, the gate, and where to look next."""
    lines = [f"# {title}", ""]
    if error:
        lines += [f"**Failed:** {error.splitlines()[0]}", ""]
    lines += ["| phase | status | wall s | command s |", "|---|---|---|---|"]
    for name, r in stages.items():
        cmd = r.get("command_s")
        lines.append(f"| {name} | {r.get('status')} | {float(r.get('seconds', 0.0)):.1f} | "
                     f"{'' if cmd is None else f'{cmd:.1f}'} |")
    lines += ["", "## Headline figures", ""]
    for name, figs in figures.items():
        shown = ", ".join(f"`{k}` {fmt(v)}" for k, v in figs.items()) or "(no metrics file)"
        lines.append(f"- **{name}**: {shown}")
    lines += ["", "## Promotion gate", ""]
    if gate is None:
        lines.append("Not reached in this run (no `metrics/deploy.json`).")
    else:
        verdict = ("UNCHANGED (same weights; nothing registered)" if gate.get("unchanged") else
                   "PROMOTED" if gate["passed"] else ("REJECTED" if gate["passed"] is False else "not run"))
        checks = ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in gate["checks"].items())
        lines.append(f"{gate['model_name']} v{gate['version']}: **{verdict}**; champion is now "
                     f"v{gate['champion']}." if gate["champion"] else
                     f"{gate['model_name']} v{gate['version']}: **{verdict}**; no champion yet.")
        if checks:
            lines.append(f"Checks: {checks}.")
    lines += ["", "## Cost", "", describe_cost(cost), "", "## Where to look next", ""]
    lines.append(f"- MLflow: `mlflow ui --backend-store-uri {tracking_uri}`"
                 + (f", parent run `{parent_run_id}` (one nested run per phase)" if parent_run_id else ""))
    if gate is not None:
        lines.append(f"- Registry: model `{gate['model_name']}` (aliases `challenger`, `champion`); version tags "
                     "`gate.*` hold each check; `agentrl promote --dry-run` explains the decision again")
    lines.append("- Figures: `dvc metrics show`, `dvc plots show` (metrics/*.json, metrics/*.csv)")
    if error:
        lines.append("- Fix the failing phase's input and run `agentrl run` again: DVC skips the phases already done")
    return "\n".join(lines) + "\n"


__all__ = ["HEADLINES", "cost_figures", "describe_cost", "gate_decision", "headlines", "markdown", "peak_memory_mib"]
