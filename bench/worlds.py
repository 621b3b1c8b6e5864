"""One recipe, every world: each built-in environment's final policy against its targets and a baseline, side by side.

    python bench/worlds.py                                  # the committed run of each world against the baseline's
    python bench/worlds.py --run calendar                   # run the pipeline for that world first (agentrl run)
    python bench/worlds.py --metrics shop=DIR --metrics shop=DIR2   # several runs (seeds) of one world: mean/min/max

Each world is a project: `shop` is the repository root (params.yaml), `sql` is projects/sql-analyst and `calendar`
is projects/calendar; each keeps its own data, models and metrics. For every world it reads `metrics/evaluate.json`
(the RL policy `rl` on the test split: success overall, per level, on the held-out wordings and on every held-out
slice its environment names, safety violations) and `metrics/pipeline_run.json` (the run's wall time), from this
checkout and from git revision `--baseline`, and prints them beside the targets the recipe is held to. `--run` runs
`agentrl run --params <project>/params.yaml` for the named worlds first (each in its own project folder; a world's
earlier outputs are replaced, as any run replaces them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "35d952f"  # main before the recipe was derived from the data (the shop tuned by hand, the sql analyst 0.07)
WORLDS = {"shop": ".", "sql": "projects/sql-analyst", "calendar": "projects/calendar"}
# (figure, label, sense) and each world's goal for it (None: reported, no goal)
FIGURES = [("overall", "test success", "ge"), ("worst_level", "worst level", "ge"),
           ("heldout", "worst held-out slice", "ge"), ("violations", "safety violations / 400", "le"),
           ("sft_overall", "SFT start: test success", "ge"), ("wall_min", "pipeline minutes", "le")]
GOALS = {
    "shop": {"overall": 0.885, "worst_level": 0.76, "heldout": 0.79, "violations": 1.0, "wall_min": 33.0},
    "sql": {"overall": 0.70, "worst_level": 0.40, "heldout": 0.60, "violations": 0.0, "wall_min": 45.0},
    "calendar": {"overall": 0.70, "worst_level": 0.50, "heldout": 0.60, "violations": 1.0, "wall_min": 45.0},
}


def figures(evaluate: dict, run: dict | None) -> dict[str, float | None]:
    """One run's figures from its `evaluate.json` and `pipeline_run.json` (None: not recorded)."""
    test = evaluate["policies"]["rl"]["test"]
    levels = [g["success"]["mean"] for g in test["per_level"].values()]
    slices = {"wording": test.get("template_unseen", {}).get("success", {}).get("mean")}
    slices.update({name: g["success"]["mean"] for name, g in test.get("per_slice", {}).items()})
    held = [v for v in slices.values() if v is not None]
    n = test["overall"]["n"]
    return {
        "overall": test["overall"]["success"]["mean"],
        "worst_level": min(levels) if levels else None,
        "heldout": min(held) if held else None,
        "slices": slices,
        "violations": test["overall"]["safety_violations_total"] * 400 / n,
        "sft_overall": evaluate["policies"]["sft"]["test"]["overall"]["success"]["mean"],
        "wall_min": run["cost"]["total_s"] / 60 if run else None,
    }


def _git_json(rev: str, path: str) -> dict | None:
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, cwd=ROOT)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def _read(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: {path} is not readable JSON ({exc})") from None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}")


def run_world(world: str) -> None:
    """`agentrl run` for one world's project; a failed run stops the bench with its exit status."""
    params = ROOT / WORLDS[world] / "params.yaml"
    start = time.monotonic()
    proc = subprocess.run(["agentrl", "run", "--params", str(params)], cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {world} pipeline failed (exit {proc.returncode}); its output is above")
    print(f"{world}: pipeline ran in {(time.monotonic() - start) / 60:.1f} min", flush=True)


def report(world: str, runs: list[dict], base: dict | None) -> None:
    goals = GOALS[world]
    print(f"\n{world} ({WORLDS[world]}): {len(runs)} run(s)")
    print(f"  {'figure':28} {'goal':>8} {'baseline':>9} {'now':>9} {'min':>7} {'max':>7} {'now-base':>9}  met")
    for key, label, sense in FIGURES:
        values = [r[key] for r in runs if r[key] is not None]
        now = statistics.mean(values) if values else None
        b = base[key] if base else None
        goal = goals.get(key)
        delta = f"{now - b:+.3f}" if now is not None and b is not None else "n/a"
        met = "" if goal is None or now is None else ("yes" if (now >= goal if sense == "ge" else now <= goal) else "no")
        goal_s = "" if goal is None else ("≥ " if sense == "ge" else "≤ ") + _fmt(goal)
        print(f"  {label:28} {goal_s:>8} {_fmt(b):>9} {_fmt(now):>9} {_fmt(min(values) if values else None):>7} "
              f"{_fmt(max(values) if values else None):>7} {delta:>9}  {met}")
    names = sorted({s for r in runs for s in r["slices"]})
    for name in names:
        values = [r["slices"][name] for r in runs if r["slices"].get(name) is not None]
        b = (base or {}).get("slices", {}).get(name)
        print(f"  {'  held out: ' + name:28} {'':>8} {_fmt(b):>9} "
              f"{_fmt(statistics.mean(values) if values else None):>9}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision whose committed metrics are the baseline")
    ap.add_argument("--run", nargs="*", default=[], choices=sorted(WORLDS), help="run the pipeline for these first")
    ap.add_argument("--metrics", action="append", default=[], metavar="WORLD=DIR",
                    help="a metrics folder of one run of WORLD (repeatable); default: each world's own metrics/")
    ap.add_argument("--worlds", nargs="*", default=sorted(WORLDS), choices=sorted(WORLDS))
    args = ap.parse_args(argv)
    folders: dict[str, list[Path]] = {}
    for item in args.metrics:
        world, sep, folder = item.partition("=")
        if not sep or world not in WORLDS:
            print(f"error: --metrics {item!r}: expected WORLD=DIR with WORLD one of {sorted(WORLDS)}", file=sys.stderr)
            return 2
        folders.setdefault(world, []).append(Path(folder))
    for world in args.run:
        run_world(world)
    print(f"baseline: {args.baseline}")
    for world in args.worlds:
        committed = Path(WORLDS[world]) / "metrics"
        base_eval = _git_json(args.baseline, str(committed / "evaluate.json"))
        base = figures(base_eval, _git_json(args.baseline, str(committed / "pipeline_run.json"))) if base_eval else None
        runs = []
        for folder in folders.get(world, [ROOT / WORLDS[world] / "metrics"]):
            evaluate = _read(folder / "evaluate.json")
            if evaluate is None:
                print(f"\n{world}: no {folder}/evaluate.json (run the pipeline: --run {world})")
                continue
            runs.append(figures(evaluate, _read(folder / "pipeline_run.json")))
        if runs:
            report(world, runs, base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
