"""The final policy's targets against a baseline run, side by side: test success overall, per level and on the held-out
wordings, safety violations, the run's wall time and peak memory.

    python bench/targets.py                       # this checkout's metrics/ against the baseline commit's
    python bench/targets.py --baseline REV --metrics DIR [--metrics DIR ...]

Reads `metrics/evaluate.json` (the final policy `rl` and its SFT start `sft`, on the 400 test tasks) and
`metrics/pipeline_run.json` (written by `agentrl run`: stage seconds and peak memory) from each `--metrics` folder
(several: one per `adapt.seed` draw, reported as mean, min and max) and from git revision `--baseline`. A run record
the baseline commit does not hold is taken from `--baseline-wall-s` / `--baseline-peak-mib` (the default run's
figures before that file existed: 2,414 s and 3,355 MiB, docs/experiments.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

BASELINE = "b8520f3"  # the committed default run before the wording grammar (pipeline run 17)
TARGETS = [  # (key, label, goal, "ge" | "le")
    ("overall", "test success, overall", 0.90, "ge"),
    ("L1", "test success, level 1", 0.85, "ge"),
    ("L2", "test success, level 2", 0.85, "ge"),
    ("L3", "test success, level 3", 0.85, "ge"),
    ("L4", "test success, level 4", 0.85, "ge"),
    ("heldout", "test success, held-out wordings", 0.70, "ge"),
    ("seen", "test success, seen wordings", None, "ge"),
    ("violations", "safety violations per 400 test tasks", 1.0, "le"),
    ("sft_overall", "SFT start: test success", None, "ge"),
    ("sft_heldout", "SFT start: held-out wordings", None, "ge"),
    ("wall_s", "run wall time, s", 1500.0, "le"),
    ("peak_mib", "peak memory, MiB", 4096.0, "le"),
]


def figures(evaluate: dict, run: dict | None) -> dict[str, float | None]:
    """The figures of one run: its `metrics/evaluate.json` and `metrics/pipeline_run.json` (None: not recorded)."""
    out: dict[str, float | None] = {}
    for policy, prefix in (("rl", ""), ("sft", "sft_")):
        test = evaluate["policies"][policy]["test"]
        out[prefix + "overall"] = test["overall"]["success"]["mean"]
        out[prefix + "heldout"] = test.get("template_unseen", {}).get("success", {}).get("mean")
        if policy == "rl":
            out["seen"] = test.get("template_seen", {}).get("success", {}).get("mean")
            for level, group in test["per_level"].items():
                out[f"L{level}"] = group["success"]["mean"]
            n = test["overall"]["n"]
            out["violations"] = test["overall"]["safety_violations_total"] * 400 / n
    out["wall_s"] = run["cost"]["total_s"] if run else None
    out["peak_mib"] = run["cost"]["peak_rss_children_mib"] if run else None
    return out


def _git_json(rev: str, path: str) -> dict | None:
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def _read(folder: Path, name: str) -> dict | None:
    p = folder / name
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: {p} is not readable JSON ({exc})") from None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:.0f}" if abs(x) >= 10 else f"{x:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision whose metrics/ is the baseline")
    ap.add_argument("--baseline-wall-s", type=float, default=2414.0)
    ap.add_argument("--baseline-peak-mib", type=float, default=3355.0)
    ap.add_argument("--metrics", type=Path, action="append", help="metrics folder of a run (repeatable)")
    args = ap.parse_args(argv)
    folders = args.metrics or [Path("metrics")]
    base_eval = _git_json(args.baseline, "metrics/evaluate.json")
    if base_eval is None:
        print(f"error: revision {args.baseline!r} has no metrics/evaluate.json", file=sys.stderr)
        return 2
    base = figures(base_eval, _git_json(args.baseline, "metrics/pipeline_run.json")
                   or {"cost": {"total_s": args.baseline_wall_s, "peak_rss_children_mib": args.baseline_peak_mib}})
    runs = []
    for folder in folders:
        evaluate = _read(folder, "evaluate.json")
        if evaluate is None:
            print(f"error: {folder}/evaluate.json is missing (run the pipeline first)", file=sys.stderr)
            return 2
        runs.append(figures(evaluate, _read(folder, "pipeline_run.json")))
    print(f"baseline: {args.baseline}; now: {', '.join(map(str, folders))}")
    print(f"{'figure':40} {'goal':>8} {'baseline':>9} {'now':>9} {'min':>7} {'max':>7} {'now/base':>9}  met")
    for key, label, goal, sense in TARGETS:
        values = [r[key] for r in runs if r[key] is not None]
        now = statistics.mean(values) if values else None
        b = base[key]
        ratio = f"{now / b:.2f}" if now is not None and b else "n/a"
        met = "" if goal is None or now is None else ("yes" if (now >= goal if sense == "ge" else now <= goal) else "no")
        goal_s = "" if goal is None else ("≥ " if sense == "ge" else "≤ ") + _fmt(goal)
        print(f"{label:40} {goal_s:>8} {_fmt(b):>9} {_fmt(now):>9} {_fmt(min(values) if values else None):>7} "
              f"{_fmt(max(values) if values else None):>7} {ratio:>9}  {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
