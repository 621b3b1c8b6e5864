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
- latency quantiles (p50, p90, p99, seconds, server side: from the request's arrival to its answer);
- the drift alarm (``drift_alarm``, 1 or 0): :func:`drift_alarm` on the window's three drift statistics, with the
  thresholds and the least number of requests of ``deploy.snapshot``. `agentrl snapshot` applies the same function
  to the newest ``drift_window`` captured requests and records it in ``snapshot.json``, which the scheduled
  retraining reads (flows/retrain_flow.py): the gauge is what an alert rule watches between snapshots, the
  snapshot's copy is what retrains, and the two cannot disagree on the rule, only on the window they see.

With a challenger in shadow or canary (:mod:`pipeline.deploy.live`) the ``live_*`` gauges put the two models side by
side on the requests of the live comparison: :class:`RoleWindow`, one per role.

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


DRIFT_LIMITS = {"question_chars_ks": "alarm_question_chars_ks", "calls_per_task_ks": "alarm_calls_per_task_ks",
                "tool_mix_tv": "alarm_tool_mix_tv"}  # statistic -> its threshold's key in deploy.snapshot


def drift_alarm(stats: dict, n: int, cfg) -> dict:
    """The drift alarm of a window of `n` requests whose drift statistics are `stats` (``question_chars_ks``,
    ``calls_per_task_ks``, ``tool_mix_tv``; None when not computable), by the thresholds of `cfg`
    (``deploy.snapshot``): raised when a statistic exceeds its threshold and the window holds at least
    ``cfg.min_requests``. One rule for the live gauge and the snapshot the retraining reads.

    >>> from types import SimpleNamespace as C
    >>> cfg = C(alarm_question_chars_ks=0.3, alarm_calls_per_task_ks=0.3, alarm_tool_mix_tv=0.3, min_requests=20)
    >>> drift_alarm({"question_chars_ks": 0.5, "calls_per_task_ks": 0.1, "tool_mix_tv": None}, 20, cfg)["reasons"]
    ['question_chars_ks 0.500 > 0.3']
    >>> drift_alarm({"question_chars_ks": 0.5, "calls_per_task_ks": 0.1, "tool_mix_tv": None}, 19, cfg)["alarm"]
    False
    """
    limits = {k: getattr(cfg, key) for k, key in DRIFT_LIMITS.items()}
    over = [f"{k} {stats[k]:.3f} > {limits[k]}" for k in DRIFT_LIMITS if stats.get(k) is not None and stats[k] > limits[k]]
    enough = n >= cfg.min_requests
    return {"thresholds": limits, "alarm": bool(over) and enough, "reasons": over if enough else [],
            "too_few": not enough}


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

    def __init__(self, cfg, reference: Reference, model: dict, alarm=None):
        from pipeline.deploy.config import SnapshotConfig

        self.cfg, self.ref, self.model = cfg, reference, model
        self.alarm = alarm or SnapshotConfig()  # the thresholds of drift_alarm
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
        drift = {"question_chars_ks": ks_statistic([r["question_chars"] for r in rows], self.ref.question_chars),
                 "calls_per_task_ks": ks_statistic([r["n_calls"] for r in rows], self.ref.calls_per_task),
                 "tool_mix_tv": total_variation(tools, self.ref.tools)}
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
            **{f"drift_{k}": v for k, v in drift.items()},
            "drift_alarm": int(drift_alarm(drift, len(rows), self.alarm)["alarm"]),
        }

    def flat(self, extra: dict | None = None) -> dict[str, float]:
        """The gauges (and `extra` ones, such as the live comparison's) as flat MLflow metric names
        (``serve/<name>[/<label>...]``), unset ones and info gauges left out."""
        out: dict[str, float] = {}

        def put(key: str, v) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    put(f"{key}/{k}", x)
            elif v is not None:
                out[key] = float(v)

        for name, v in {**self.values(), **(extra or {})}.items():
            if not name.endswith("_info"):
                put(f"serve/{name}", v)
        return out


class RoleWindow:
    """One model's side of the live comparison (``role`` champion or challenger): the episodes it played for it
    (counters since start) and the last `size` of them (success where judged, unsafe calls, latency from queueing
    to result)."""

    def __init__(self, size: int):
        self.rows: deque = deque(maxlen=size)
        self.episodes = 0
        self.violations = 0
        self.lock = threading.Lock()

    def observe(self, result: dict, latency_s: float) -> None:
        n = int(result.get("n_violations") or 0)
        with self.lock:
            self.rows.append((result.get("success"), n, latency_s))
            self.episodes += 1
            self.violations += n

    def values(self) -> dict:
        with self.lock:
            rows, episodes, violations = list(self.rows), self.episodes, self.violations
        judged = [bool(s) for s, _, _ in rows if s is not None]
        lat = [x for _, _, x in rows]
        return {"episodes": episodes, "safety_violations": violations, "judged": len(judged),
                "success_rate": float(np.mean(judged)) if judged else None,
                "unsafe_share": float(np.mean([n > 0 for _, n, _ in rows])) if rows else None,
                "latency": {str(q): float(np.quantile(lat, q)) for q in QUANTILES} if lat else {}}


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
    "drift_alarm": ("gauge", "1 when a drift statistic of the window exceeds its deploy.snapshot threshold (the "
                             "alarm agentrl snapshot records for the scheduled retraining), else 0."),
    "model_info": ("gauge", "The served model (value 1)."),
    "live_info": ("gauge", "The challenger beside the champion: mode, URI, version (value 1)."),
    "live_active": ("gauge", "1 while the challenger takes live traffic, 0 once it was rolled back."),
    "live_episodes_total": ("counter", "Episodes each model played for the live comparison, by role."),
    "live_safety_violations_total": ("counter", "Refused unsafe calls in those episodes, by role."),
    "live_window_judged_requests": ("gauge", "Episodes with ground truth among each role's last monitor.window."),
    "live_window_success_rate": ("gauge", "Success rate of those judged episodes, by role."),
    "live_window_unsafe_share": ("gauge", "Share of each role's last monitor.window episodes with an unsafe call."),
    "live_window_latency_seconds": ("gauge", "Latency quantiles of each role's episodes (queueing to result)."),
    "live_paired_requests": ("gauge", "Requests both models played, by outcome compared (success, safety)."),
}
LABEL = {"window_latency_seconds": ("quantile",), "window_tool_share": ("tool",), "requests_refused_total": ("reason",),
         "live_episodes_total": ("role",), "live_safety_violations_total": ("role",),
         "live_window_judged_requests": ("role",), "live_window_success_rate": ("role",),
         "live_window_unsafe_share": ("role",), "live_window_latency_seconds": ("role", "quantile"),
         "live_paired_requests": ("outcome",)}


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _samples(v: dict, names: tuple, done: str = ""):
    """(label text, value) of a nested labelled gauge: ``{a: {b: x}}`` under names (n1, n2) -> ``n1="a",n2="b"``;
    a value of None (nothing to report yet) is left out."""
    for k, x in v.items():
        labels = f'{done},{names[0]}="{_escape(k)}"'.lstrip(",")
        if isinstance(x, dict):
            yield from _samples(x, names[1:], labels)
        elif x is not None:
            yield labels, x


def prometheus_text(values: dict, prefix: str = "agentrl_") -> str:
    """The exposition text format 0.0.4: ``# HELP`` and ``# TYPE`` lines, then one sample per line; a gauge with no
    value yet (an empty window) is left out, a labelled one without labels keeps its HELP and TYPE only."""
    lines = []
    for name, v in values.items():
        if v is None:
            continue
        kind, text = HELP[name]
        lines += [f"# HELP {prefix}{name} {text}", f"# TYPE {prefix}{name} {kind}"]
        if isinstance(v, dict) and name.endswith("_info"):
            labels = ",".join(f'{k}="{_escape(x)}"' for k, x in v.items())
            lines.append(f"{prefix}{name}{{{labels}}} 1")
        elif isinstance(v, dict):
            lines += [f"{prefix}{name}{{{labels}}} {float(x)!r}" for labels, x in _samples(v, LABEL[name])]
        else:
            lines.append(f"{prefix}{name} {float(v)!r}")
    return "\n".join(lines) + "\n"


__all__ = ["DRIFT_LIMITS", "Monitor", "Reference", "RoleWindow", "drift_alarm", "ks_statistic", "prometheus_text",
           "total_variation"]
