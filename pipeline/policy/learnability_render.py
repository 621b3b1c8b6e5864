"""A learnability report (:mod:`pipeline.policy.learnability`) as a compact text table and as flat tracking metrics.

:func:`render` is what a phase prints at the end of its output; :func:`flat_metrics` the numeric figures a phase logs
to its tracking run (``learnability/copy_rate``, ``learnability/tool/<tool>/schema_error_rate``, ...), beside the
whole report as a JSON artefact. Names of tools, families and levels are kept in metric keys after replacing what the
tracking store does not accept by ``_``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

PREFIX = "learnability"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\- ]", "_", str(name)) or "_"


def flat_metrics(report: Mapping, prefix: str = PREFIX) -> dict[str, float]:
    """The report's numeric figures, one flat key each (None figures left out)."""
    out: dict[str, float | None] = {
        f"{prefix}/episodes": report["episodes"], f"{prefix}/success": report["success"],
        f"{prefix}/findings": len(report["findings"]),
    }
    a, c = report["actions"], report["copy"]
    out.update({f"{prefix}/{k}_share": a[f"{k}_share"]
                for k in ("token_limit", "char_limit", "unknown_tool", "parse_failure")})
    out.update({f"{prefix}/copy_{k}": c[k] for k in ("copyable", "attempted", "copied", "near_misses")})
    out[f"{prefix}/copy_rate"], out[f"{prefix}/copy_reached"] = c["copy_rate"], c["reached"]
    for tool, t in report["tools"].items():
        for k in ("calls", "invalid_rate", "schema_error_rate", "tool_error_rate", "safety_violations"):
            out[f"{prefix}/tool/{_key(tool)}/{k}"] = t[k]
    for param, p in c["by_param"].items():
        out[f"{prefix}/copy/{_key(param)}/copy_rate"] = p["copy_rate"]
    for kind in ("family", "level"):
        for name, g in report[f"{kind}_figures"].items():
            out[f"{prefix}/{kind}/{_key(name)}/success"] = g["success"]
            out[f"{prefix}/{kind}/{_key(name)}/demos"] = g["demos"]
    return {k: float(v) for k, v in out.items() if v is not None}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)  # noqa: E731
                              for i, (v, w) in enumerate(zip(r, widths)))
    return [fmt(header)] + [fmt(r) for r in rows]


def render(report: Mapping, title: str = "learnability") -> str:
    """The report as a few aligned tables and the findings (what a phase prints last)."""
    a, c, lim = report["actions"], report["copy"], report["limits"]
    lines = [f"{title}: {report['episodes']} episodes, success {_pct(report['success'])}"]
    lines += ["  " + x for x in _table(
        ["tool", "calls", "invalid", "schema err", "tool err", "safety"],
        [[t, v["calls"], _pct(v["invalid_rate"]), _pct(v["schema_error_rate"]), _pct(v["tool_error_rate"]),
          v["safety_violations"]] for t, v in report["tools"].items()])]
    lines.append(f"  actions {a['n']}: token limit ({lim['max_new_tokens']}) {_pct(a['token_limit_share'])}, "
                 f"char limit ({lim['max_action_chars']}) {_pct(a['char_limit_share'])}, unknown tool "
                 f"{_pct(a['unknown_tool_share'])}, unparsable {_pct(a['parse_failure_share'])}")
    source = ", ".join(f"{k} {v}" for k, v in c["source"].items()) or "no episodes"
    lines.append(f"  copy: {c['copied']}/{c['attempted']} exact ({_pct(c['copy_rate'])}), {c['near_misses']} near "
                 f"misses, {c['attempted']}/{c['copyable']} copyable values reached (episodes by source: {source})")
    if c["by_param"]:
        lines.append("    " + "; ".join(
            f"{p} {_pct(v['copy_rate'])} ({v['copied']}/{v['attempted']} of {v['copyable']})"
            for p, v in c["by_param"].items()))
    for m in c["near_miss_examples"]:
        lines.append(f"    {m['param']}: wanted {m['wanted']!r}, wrote {m['wrote']!r} ({m['task_id']})")
    for kind in ("family", "level"):
        groups = report[f"{kind}_figures"]
        lines += ["  " + x for x in _table(
            [kind, "episodes", "success", "demos", "ok demos"],
            [[k, g["episodes"], _pct(g["success"]), g["demos"], g["demos_successful"]] for k, g in groups.items()])]
    if report["findings"]:
        lines.append("  findings:")
        lines += [f"  - {f['text']} (threshold {_threshold(f)})" for f in report["findings"]]
    else:
        lines.append("  findings: none (every figure within its threshold)")
    return "\n".join(lines)


def _threshold(finding: Mapping) -> str:
    t = finding["threshold"]
    if finding["code"] in ("few_demos", "safety"):
        return f"{'<' if finding['code'] == 'few_demos' else '>='} {t:g}"
    if finding["code"] in ("copy", "copy_param"):
        return f"< {100 * t:.0f} %"
    if finding["code"] == "low_success":
        return f"<= {100 * t:.0f} %"
    return f">= {100 * t:.0f} %"
