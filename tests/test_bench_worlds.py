"""bench/worlds.py: each world's figures from its metrics, held-out slices, targets, and one error line on bad input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_worlds", ROOT / "bench" / "worlds.py")
worlds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(worlds)


def group(success: float, n: int = 200, violations: int = 0) -> dict:
    return {"n": n, "success": {"mean": success}, "safety_violations_total": violations}


def evaluate_json(rl: float, sft: float) -> dict:
    test = {"overall": group(rl, violations=1), "per_level": {"1": group(0.9, 100), "2": group(0.5, 100)},
            "template_unseen": group(0.7, 40), "per_slice": {"city": group(0.6, 80), "month": group(0.8, 90)}}
    return {"policies": {"rl": {"test": test}, "sft": {"test": {"overall": group(sft)}}}}


def test_figures_take_the_worst_level_and_the_worst_held_out_slice():
    got = worlds.figures(evaluate_json(0.75, 0.5), {"cost": {"total_s": 1800.0}})
    assert got["overall"] == 0.75 and got["worst_level"] == 0.5 and got["heldout"] == 0.6
    assert got["slices"] == {"wording": 0.7, "city": 0.6, "month": 0.8}
    assert got["violations"] == 2.0 and got["sft_overall"] == 0.5 and got["wall_min"] == 30.0
    assert worlds.figures(evaluate_json(0.75, 0.5), None)["wall_min"] is None


def test_a_world_is_reported_against_its_goals_with_every_slice(tmp_path, capsys):
    (tmp_path / "evaluate.json").write_text(json.dumps(evaluate_json(0.75, 0.5)))
    assert worlds.main(["--worlds", "sql", "--metrics", f"sql={tmp_path}", "--baseline", "HEAD"]) == 0
    out = capsys.readouterr().out
    assert "sql (projects/sql-analyst): 1 run(s)" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("test success"))
    assert "0.700" in line and "0.750" in line and line.rstrip().endswith("yes")
    assert next(x for x in out.splitlines() if "safety violations" in x).rstrip().endswith("no")  # goal 0, seen 2
    assert all(f"held out: {name}" in out for name in ("wording", "city", "month"))


def test_a_malformed_metrics_argument_is_one_error_line(capsys):
    assert worlds.main(["--metrics", "nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --metrics 'nowhere': expected WORLD=DIR with WORLD one of ['calendar', 'shop', 'sql']"]
