"""Live monitoring of `agentrl serve`: a rolling window of the answered requests against the champion's training
data, as Prometheus text at ``GET /metrics`` and, every ``monitor.log_every_s``, as metrics of the MLflow run
``serve-monitor``.

What the window (the last ``monitor.window`` answered requests, cache hits included: a caller got each of them)
holds, and what it is compared with:

- task drift: the question's length in characters against the training tasks' (``monitor.reference_tasks``), as
  the two-sample Kolmogorov-Smirnov statistic D (0: same distribution, 1: disjoint) -- the one task feature every
  request has, whatever the environment (a bare question carries no family or level);
- behaviour drift: the tool mix (share of calls per tool) against the training demonstrations'
  (``monitor.reference_demos``) as the total variation distance (half the L1 distance of the two shares, in [0, 1]),
  calls per task as KS D, the shares of failed calls (invalid action or parameters, tool error, timeout) and of
  refused calls (safety violations), and of truncated episodes;
- success where it can be judged (requests that carried their ground truth), and its count;
- latency quantiles (p50, p90, p99, seconds, server side: from the request's arrival to its answer).

Decision: statistics (D, total variation), not p-values: the window slides by one request, so a test's p-value on
it would be tested thousands of times a day; the gauges are for dashboards and alert rules with thresholds, and the
offline drift check (``agentrl check-drift``) stays the place of the corrected tests. The text is written here (the
exposition format 0.0.4 is a few lines) rather than through prometheus_client's global registry, which would tie
the metrics to a process rather than to an app.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter, deque
from pathlib import Path

import numpy as np

FAILED = ("invalid_action", "invalid_params", "tool_error", "timeout")
REFUSED = ("safety_violation",)
QUANTILES = (0.5, 0.9, 0.99)
_TOOL = re.compile(r"\A\s*<call>\s*([A-Za-z_][A-Za-z0-9_]*)")


def ks_statistic(a, b) -> float | None:
    """Two-sample Kolmogorov-Smirnov D = sup |F_a - F_b| (None when a sample is empty).

    >>> ks_statistic([1, 2, 3], [1, 2, 3]), ks_statistic([0, 0], [5, 5])
    (0.0, 1.0)
    """
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    if not len(a) or not len(b):
        return None
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / len(a)
    fb = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def total_variation(p: Counter, q: Counter) -> float | None:
    """Half the L1 distance between the normalised counts (None when either is empty).

    >>> total_variation(Counter(a=1), Counter(a=3)), total_variation(Counter(a=1), Counter(b=1))
    (0.0, 1.0)
    """
    np_, nq = sum(p.values()), sum(q.values())
    if not np_ or not nq:
        return None
    return 0.5 * sum(abs(p[k] / np_ - q[k] / nq) for k in set(p) | set(q))


def _jsonl(path: str | None) -> list[dict]:
    if not path or not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Reference:
    """The champion's training data, reduced to what the window is compared with."""

    def __init__(self, tasks: list[dict], demos: list[dict]):
        self.question_chars = [len(t.get("question", "")) for t in tasks]
        self.tools: Counter = Counter()
        self.calls_per_task = []
        for d in demos:
            tools = [m.group(1) for s in d.get("steps", []) if (m := _TOOL.match(str(s.get("action", ""))))]
            self.tools.update(tools)
            self.calls_per_task.append(len(d.get("steps", [])))

    @classmethod
    def load(cls, cfg) -> "Reference":
        return cls(_jsonl(cfg.reference_tasks), _jsonl(cfg.reference_demos))


class Monitor:
    """The rolling window and the counters since start; ``observe`` from the event loop, ``metrics`` from any
    thread."""

    def __init__(self, cfg, reference: Reference, model: dict):
        self.cfg, self.ref, self.model = cfg, reference, model
        self.window: deque = deque(maxlen=cfg.window)
        self.lock = threading.Lock()
        self.answered = 0
        self.failures = 0
        self.feedback = 0

    def observe(self, request: dict, result: dict, latency_s: float) -> None:
        outcomes = [c.get("outcome") for c in result.get("calls") or []]
        row = {"question_chars": len(str(request.get("question", ""))),
               "tools": [c.get("tool") for c in result.get("calls") or [] if c.get("tool")],
               "n_calls": len(outcomes), "failed": sum(o in FAILED for o in outcomes),
               "refused": sum(o in REFUSED for o in outcomes), "truncated": bool(result.get("truncated")),
               "success": result.get("success"), "latency": latency_s}
        with self.lock:
            self.window.append(row)
            self.answered += 1

    def values(self) -> dict:
        """Every gauge: ``{name: value}`` or ``{name: {label value: value}}`` for labelled ones."""
        with self.lock:
            rows, answered, failures, feedback = list(self.window), self.answered, self.failures, self.feedback
        calls = sum(r["n_calls"] for r in rows)
        tools = Counter(t for r in rows for t in r["tools"])
        judged = [r["success"] for r in rows if r["success"] is not None]
        lat = [r["latency"] for r in rows]
        return {
            "requests_answered_total": answered, "requests_failed_total": failures, "feedback_total": feedback,
            "window_requests": len(rows),
            "window_latency_seconds": {str(q): float(np.quantile(lat, q)) for q in QUANTILES} if lat else {},
            "window_calls_per_task": float(np.mean([r["n_calls"] for r in rows])) if rows else None,
            "window_failed_call_share": sum(r["failed"] for r in rows) / calls if calls else None,
            "window_refused_call_share": sum(r["refused"] for r in rows) / calls if calls else None,
            "window_truncated_share": float(np.mean([r["truncated"] for r in rows])) if rows else None,
            "window_judged_requests": len(judged),
            "window_success_rate": float(np.mean(judged)) if judged else None,
            "window_tool_share": {t: n / sum(tools.values()) for t, n in sorted(tools.items())},
            "drift_question_chars_ks": ks_statistic([r["question_chars"] for r in rows], self.ref.question_chars),
            "drift_calls_per_task_ks": ks_statistic([r["n_calls"] for r in rows], self.ref.calls_per_task),
            "drift_tool_mix_tv": total_variation(tools, self.ref.tools),
        }

    def flat(self) -> dict[str, float]:
        """The gauges as flat MLflow metric names (``serve/<name>[/<label>]``), unset ones left out."""
        out = {}
        for name, v in self.values().items():
            if isinstance(v, dict):
                out.update({f"serve/{name}/{k}": x for k, x in v.items()})
            elif v is not None:
                out[f"serve/{name}"] = float(v)
        return out


HELP = {
    "requests_answered_total": ("counter", "Requests answered 200 since start (cache hits included)."),
    "requests_failed_total": ("counter", "Requests whose model batch failed (answered 500) since start."),
    "feedback_total": ("counter", "Feedback records accepted since start."),
    "requests_refused_total": ("counter", "Requests refused before the model since start, by reason."),
    "window_requests": ("gauge", "Answered requests in the rolling window."),
    "window_latency_seconds": ("gauge", "Latency quantiles over the window (server side)."),
    "window_calls_per_task": ("gauge", "Mean tool calls per answered request in the window."),
    "window_failed_call_share": ("gauge", "Share of the window's calls that failed (invalid, tool error, timeout)."),
    "window_refused_call_share": ("gauge", "Share of the window's calls refused as unsafe."),
    "window_truncated_share": ("gauge", "Share of the window's episodes cut at the step or length limit."),
    "window_judged_requests": ("gauge", "Requests in the window that carried ground truth."),
    "window_success_rate": ("gauge", "Success rate of the judged requests in the window."),
    "window_tool_share": ("gauge", "Share of the window's calls per tool."),
    "drift_question_chars_ks": ("gauge", "KS statistic of question length, window against the training tasks."),
    "drift_calls_per_task_ks": ("gauge", "KS statistic of calls per task, window against the demonstrations."),
    "drift_tool_mix_tv": ("gauge", "Total variation distance of the tool mix, window against the demonstrations."),
    "model_info": ("gauge", "The served model (value 1)."),
}
LABEL = {"window_latency_seconds": "quantile", "window_tool_share": "tool", "requests_refused_total": "reason"}


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(values: dict, prefix: str = "agentrl_") -> str:
    """The exposition text format 0.0.4: ``# HELP`` and ``# TYPE`` lines, then one sample per line; a gauge with no
    value yet (an empty window) is left out, a labelled one without labels keeps its HELP and TYPE only."""
    lines = []
    for name, v in values.items():
        if v is None:
            continue
        kind, text = HELP[name]
        lines += [f"# HELP {prefix}{name} {text}", f"# TYPE {prefix}{name} {kind}"]
        if isinstance(v, dict) and name == "model_info":
            labels = ",".join(f'{k}="{_escape(x)}"' for k, x in v.items())
            lines.append(f"{prefix}{name}{{{labels}}} 1")
        elif isinstance(v, dict):
            lines += [f'{prefix}{name}{{{LABEL[name]}="{_escape(k)}"}} {float(x)!r}' for k, x in v.items()]
        else:
            lines.append(f"{prefix}{name} {float(v)!r}")
    return "\n".join(lines) + "\n"


__all__ = ["Monitor", "Reference", "ks_statistic", "prometheus_text", "total_variation"]
