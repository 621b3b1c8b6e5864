"""bench/vs_trl.py's pure parts: bad input is one ``error:`` line (a missing TRL names the extra to install), and
the figures it prints from two validation curves (time to reach TRL's final success, the ratio against the goal),
the evaluation schedule and the clock that leaves evaluations out. TRL itself is not run here: CI does not install
the ``bench`` extra, and a run takes minutes (the bench is run by hand, docs/peers.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import vs_trl  # noqa: E402
import vs_trl_arms  # noqa: E402


def curve(*pairs):
    return {"points": [{"t": t, "success": s} for t, s in pairs]}


def fake_project(root: Path) -> Path:
    """A folder with every path the bench checks for (their contents are never read before TRL is imported)."""
    for name in vs_trl.NEEDED:
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir() if name == "data/env" else p.write_text("")
    return root


def run_bench(*args: str, hide_trl: bool = False) -> subprocess.CompletedProcess:
    code = ("import sys\n" + ("sys.modules['trl'] = None\n" if hide_trl else "") +
            f"sys.path.insert(0, {str(BENCH)!r})\nimport vs_trl\nsys.exit(vs_trl.main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, words", [
    (["--budget", "0"], "--budget must be a positive number of seconds"),
    (["--budget", "soon"], "--budget: invalid float value"),
    (["--evals", "0"], "--evals must be at least 1"),
    (["--eval-tasks", "-3"], "--eval-tasks must be at least 1"),
    (["--project", "/nonexistent/folder"], "params.yaml not found"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, args, words):
    out = tmp_path / "out.json"
    proc = run_bench(*args, "--json", str(out), "--plot", str(tmp_path / "p.png"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists() and not (tmp_path / "p.png").exists()


def test_project_folder_without_the_adapted_model_names_it(tmp_path):
    root = fake_project(tmp_path / "p")
    (root / "models" / "adapted" / "config.json").unlink()
    proc = run_bench("--project", str(root))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --project {root}: models/adapted/config.json not found (the bench needs params.yaml, models/adapted "
        f"and data/; run `dvc repro adapt` there first)"]


def test_missing_trl_is_one_line_naming_the_extra(tmp_path):
    proc = run_bench("--project", str(fake_project(tmp_path / "p")), hide_trl=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: TRL is not installed")
    assert lines[0].endswith("pip install -e '.[bench]'")


def test_time_to_reach_is_the_first_point_at_or_above_the_target():
    pts = curve((0, 0.80), (60, 0.84), (120, 0.83), (180, 0.86))["points"]
    assert vs_trl.time_to_reach(pts, 0.84) == 60  # the first, not a later one
    assert vs_trl.time_to_reach(pts, 0.85) == 180
    assert vs_trl.time_to_reach(pts, 0.80) == 0
    assert vs_trl.time_to_reach(pts, 0.9) is None


def test_compare_ratio_and_goal():
    trl = curve((0, 0.80), (200, 0.82), (600, 0.85))
    met = vs_trl.compare(curve((0, 0.80), (100, 0.83), (190, 0.86), (600, 0.9)), trl)
    assert met["target"] == 0.85 and met["time_to_target_s"] == {"project": 190, "trl": 600}
    assert met["ratio"] == pytest.approx(190 / 600) and met["goal_met"] is True
    assert "met" in met["verdict"] and "not met" not in met["verdict"]
    late = vs_trl.compare(curve((0, 0.80), (300, 0.85)), trl)
    assert late["ratio"] == pytest.approx(0.5) and late["goal_met"] is False and "not met" in late["verdict"]
    never = vs_trl.compare(curve((0, 0.80), (600, 0.84)), trl)
    assert never["ratio"] is None and never["goal_met"] is False and "did not reach" in never["verdict"]
    # TRL's best point, a second reading
    assert met["trl_best"] == 0.85 and met["time_to_trl_best_s"] == {"project": 190, "trl": 600}


def test_compare_is_not_measurable_when_trl_ends_at_or_below_the_start():
    out = vs_trl.compare(curve((0, 0.85), (100, 0.9)), curve((0, 0.85), (300, 0.88), (600, 0.84)))
    assert out["goal_met"] is None and out["ratio"] is None and out["verdict"].startswith("not measurable")
    assert out["verdict"].endswith("lowest point after the start: project 0.900, TRL 0.840")
    assert out["trl_best"] == 0.88 and out["time_to_trl_best_s"] == {"project": 100, "trl": 300}


def test_schedule_marks_end_at_the_budget_and_fire_once_each():
    assert vs_trl.marks(600, 4) == [150, 300, 450, 600]
    s = vs_trl_arms.Schedule([10, 20, 30])
    assert [s.due(t) for t in (5, 12, 15)] == [False, True, False]
    assert s.due(31) and not s.due(32)  # one update past two marks: one evaluation
    assert s.over(30) and not s.over(29.9)


def test_clock_leaves_paused_time_out(monkeypatch):
    now = iter([100.0, 110.0, 110.0, 150.0, 150.0, 165.0])
    monkeypatch.setattr(vs_trl_arms.time, "perf_counter", lambda: next(now))
    c = vs_trl_arms.Clock()  # starts at 100
    assert c.elapsed() == 10.0  # 110
    c.pause()  # 110
    c.resume()  # 150: 40 s of evaluation
    assert c.elapsed() == 10.0  # 150
    assert c.elapsed() == 25.0  # 165
