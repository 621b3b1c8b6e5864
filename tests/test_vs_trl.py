"""bench/vs_trl.py's pure parts: bad input is one ``error:`` line (a missing TRL names the extra to install), and
the figures it prints from two validation curves (time to reach TRL's final success, the ratio against the goal),
the evaluation schedule and the clock that leaves evaluations out. bench/vs_trl_throughput.py: bad input, the figures
and ratios it prints, and (marked slow, skipped where TRL is not installed: CI does not install the ``bench``
extra) one whole run of every arm on a tiny project, whose TRL arm with the project's rollout engine must generate
exactly what the project's learner generates. The learning comparison itself is run by hand (docs/peers.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
        p.mkdir(exist_ok=True) if name == "data/env" else p.write_text("")
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
    (["--arms", "project,ppo"], "--arms: unknown arm 'ppo' (a comma-separated list of project, trl)"),
    (["--arms", ","], "--arms: no arm named"),
    (["--trl-lr", "0"], "--trl-lr must be a positive learning rate, got 0"),
    (["--trl-lr", "nan"], "--trl-lr must be a positive learning rate, got nan"),
    (["--trl-lr", "fast"], "--trl-lr: invalid float value"),
    (["--arms", "project", "--trl-lr", "1e-6"], "--trl-lr sets the trl arm's learning rate, but --arms leaves"),
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


# ------------------------------------------------------------------------------------- --arms, --trl-lr, --reuse-json
def test_arms_selects_what_runs_in_a_fixed_order(tmp_path):
    root = str(fake_project(tmp_path / "p"))
    assert vs_trl.parse_args(["--project", root]).arms == ["project", "trl"]
    assert vs_trl.parse_args(["--project", root, "--arms", "trl"]).arms == ["trl"]
    assert vs_trl.parse_args(["--project", root, "--arms", " trl, project "]).arms == ["project", "trl"]
    assert vs_trl.parse_args(["--project", root, "--arms", "project"]).arms == ["project"]


TRAIN = SimpleNamespace(lr=2e-4, seed=3, group_size=8, tasks_per_update=8)


def test_trl_lr_reaches_the_grpo_config_arguments(tmp_path):
    args = vs_trl.parse_args(["--project", str(fake_project(tmp_path / "p")), "--arms", "trl", "--trl-lr", "1e-6"])
    spec = vs_trl.make_spec(args, args.trl_lr) | {"tmp": str(tmp_path)}
    kw = vs_trl_arms.grpo_kwargs(spec, TRAIN, 48, False)
    assert kw["learning_rate"] == 1e-6
    # the shared values stay as they were
    assert (kw["num_generations"], kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"],
            kw["max_completion_length"], kw["seed"]) == (8, 8, 8, 48, 3)
    # a spec without one (written before the flag existed) falls back to the shared train.lr
    assert vs_trl_arms.grpo_kwargs({**spec, "trl_lr": None}, TRAIN, 48, False)["learning_rate"] == 2e-4


def test_grpo_config_takes_the_arguments(tmp_path):
    """Where TRL is installed (the bench extra): TRL's own config class accepts the arguments and keeps the rate."""
    trl = pytest.importorskip("trl")
    spec = {"tmp": str(tmp_path), "max_steps": 10, "trl_lr": 2e-5}
    assert trl.GRPOConfig(**vs_trl_arms.grpo_kwargs(spec, TRAIN, 48, False)).learning_rate == 2e-5


def test_default_trl_lr_is_the_projects_train_lr(tmp_path):
    (tmp_path / "params.yaml").write_text("train:\n  lr: 3.0e-4\n")
    assert vs_trl.shared_lr(tmp_path) == 3e-4
    (tmp_path / "params.yaml").write_text("train:\n  lr: -1\n")
    with pytest.raises(vs_trl.BenchError, match=f"--project {tmp_path}: .*lr"):
        vs_trl.shared_lr(tmp_path)


def arm(lr=None, *points):
    a = {"points": [{"t": t, "update": u, "success": s} for t, u, s in points], "episodes": 64 * points[-1][1],
         "train_s": points[-1][0], "peak_mib": 1000.0, "config": {} if lr is None else {"learning_rate": lr}}
    return a


def result_file(path: Path, arms: dict, budget=540.0) -> Path:
    path.write_text(json.dumps({"budget_s": budget, "evals": 6, "eval_tasks": 200, "arms": arms}))
    return path


def bench_args(tmp_path, *extra):
    return vs_trl.parse_args(["--project", str(fake_project(tmp_path / "p")), *extra])


def test_reused_arms_are_named_by_learning_rate_and_marked(tmp_path):
    old = result_file(tmp_path / "old.json", {"project": arm(None, (0, 0, 0.9), (500, 50, 0.93)),
                                              "trl": arm(2e-4, (0, 0, 0.9), (500, 20, 0.85))})
    reused = vs_trl.load_reused([old], bench_args(tmp_path, "--arms", "trl"), ["trl lr=1e-06"])
    assert list(reused) == ["project", "trl lr=0.0002"]  # a result from before --trl-lr names its TRL arm "trl"
    assert {a["reused_from"] for a in reused.values()} == {str(old)}
    # reused again from a result that already reused it: the first source is kept
    newer = result_file(tmp_path / "newer.json", {**reused, "trl lr=1e-06": arm(1e-6, (0, 0, 0.9), (500, 20, 0.9))})
    again = vs_trl.load_reused([newer], bench_args(tmp_path), ["trl lr=2e-05"])
    assert again["project"]["reused_from"] == str(old) and again["trl lr=1e-06"]["reused_from"] == str(newer)


@pytest.mark.parametrize("case, words", [
    ("runs", "arm 'trl lr=0.0002' is also run here"),
    ("twice", "arm 'project' is also in"),
    ("budget", "budget 300 s, 6 evaluations on 200 tasks, this run 540 s, 6 on 200: the curves would not be "
               "comparable"),
    ("garbage", "not a result of this bench (JSONDecodeError"),
    ("missing", "not a result of this bench (FileNotFoundError"),
])
def test_reuse_json_conflicts_and_bad_files_are_errors(tmp_path, case, words):
    arms = {"project": arm(None, (0, 0, 0.9), (500, 50, 0.93)), "trl": arm(2e-4, (0, 0, 0.9), (500, 20, 0.85))}
    f = result_file(tmp_path / "r.json", arms, budget=300.0 if case == "budget" else 540.0)
    paths = {"twice": [f, result_file(tmp_path / "r2.json", {"project": arms["project"]})],
             "garbage": [tmp_path / "g.json"], "missing": [tmp_path / "none.json"]}.get(case, [f])
    (tmp_path / "g.json").write_text("{not json")
    running = ["trl lr=0.0002"] if case == "runs" else []
    with pytest.raises(vs_trl.BenchError) as err:
        vs_trl.load_reused(paths, bench_args(tmp_path), running)
    assert words in str(err.value) and str(paths[-1] if case != "runs" else f) in str(err.value)


def test_table_lists_every_arm_and_compares_each_trl_arm(tmp_path):
    arms = {"project": arm(None, (0, 0, 0.9), (100, 10, 0.92), (500, 50, 0.93)) | {"reused_from": "old.json"},
            "trl lr=0.0002": arm(2e-4, (0, 0, 0.9), (100, 4, 0.82), (500, 20, 0.85)) | {"reused_from": "old.json"},
            "trl lr=1e-06": arm(1e-6, (0, 0, 0.9), (100, 4, 0.9), (500, 20, 0.91))}
    arms = dict(sorted(arms.items(), key=lambda kv: vs_trl.arm_order(kv[0])))
    assert list(arms) == ["project", "trl lr=0.0002", "trl lr=1e-06"]
    result = {"arms": arms, "comparison": {k: vs_trl.compare(arms["project"], a) for k, a in arms.items()
                                           if k != "project"}}
    lines = vs_trl.table(result)
    assert [ln[:16].strip() for ln in lines[1:4]] == ["project*", "trl lr=0.0002*", "trl lr=1e-06"]
    assert lines[3].split()[2:6] == ["0.900", "0.910", "0.900", "0.910"]  # start, final, lowest, best
    assert "* reused from an earlier run (old.json)" in lines
    assert any(ln.startswith("project vs trl lr=1e-06:") and "time to TRL's final 0.910: project 100 s, TRL 500 s"
               in ln for ln in lines)
    assert "  project / TRL time to 0.910: 0.20x (goal <= 0.33x: met)" in lines


def test_table_without_a_project_arm_says_so():
    result = {"arms": {"trl lr=1e-06": arm(1e-6, (0, 0, 0.9), (500, 20, 0.91))}, "comparison": {}}
    assert vs_trl.table(result)[-1].startswith("no project arm")


# ------------------------------------------------------------------------------- bench/vs_trl_throughput.py
import vs_trl_throughput  # noqa: E402


def run_throughput(*args: str, hide_trl: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    code = ("import sys\n" + ("sys.modules['trl'] = None\n" if hide_trl else "") +
            f"sys.path.insert(0, {str(BENCH)!r})\nimport vs_trl_throughput as b\nsys.exit(b.main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [
    (["--reps", "0"], "--reps must be at least 1, got 0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--arms", "project,ppo"], "--arms: unknown arm 'ppo'"),
    (["--arms", "project,project"], "--arms: an arm named twice"),
    (["--project", "/nonexistent/folder"], "--project /nonexistent/folder: params.yaml not found"),
    (["--steps", "many"], "--steps: invalid int value"),
])
def test_throughput_bad_input_is_one_error_line(tmp_path, args, words):
    out = tmp_path / "out.json"
    proc = run_throughput("--project", str(fake_project(tmp_path / "p")), *args, "--json", str(out))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists()


def test_throughput_without_trl_names_the_extra(tmp_path):
    proc = run_throughput("--project", str(fake_project(tmp_path / "p")), hide_trl=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: TRL is not installed") and proc.stderr.strip().endswith(
        "pip install -e '.[bench]'") and len(proc.stderr.strip().splitlines()) == 1


def step(step_s, rollout_s, episodes=64, tokens=640, rows=64, success=0.5):
    return {"step_s": step_s, "rollout_s": rollout_s, "episodes": episodes, "sampled_tokens": tokens,
            "rows_learned": rows, "success": success, "step_cpu_s": 2 * step_s, "rollout_cpu_s": 2 * rollout_s}


def test_throughput_figures_spread_ratios_and_goal():
    f = vs_trl_throughput.rep_figures([step(4.0, 3.0, rows=32), step(4.0, 1.0)])
    assert f["episodes_per_s"] == 16 and f["tokens_per_s"] == 160 and f["step_s"] == 4
    assert f["rollout_s"] == 2 and f["learn_s"] == 2 and f["tokens_per_episode"] == 10 and f["rows_learned"] == 48
    assert f["learn_tokens_per_s"] == pytest.approx((320 + 640) / 4)
    assert f["episodes_per_cpu_s"] == 8 and f["learn_cpu_s"] == 4 and f["rollout_cpu_s"] == 4
    reps = lambda *times: [{"steps": [step(s, r)], "peak_mib": 100.0} for s, r in times]  # noqa: E731
    summary = vs_trl_throughput.summarize({"project": reps((2, 1), (4, 1), (3, 1)),
                                           "trl-engine": reps((6, 1), (5, 1), (8, 1))})
    assert summary["project"]["episodes_per_s"] == {"min": 16, "median": 64 / 3, "max": 32}
    rat = vs_trl_throughput.ratios(summary)
    assert list(rat) == ["project / trl-engine"]
    assert rat["project / trl-engine"]["episodes_per_s"] == pytest.approx(6 / 3)
    assert rat["project / trl-engine"]["learn_speed"] == pytest.approx(5 / 2)
    assert rat["project / trl-engine"]["episodes_per_cpu_s"] == pytest.approx(6 / 3)
    assert vs_trl_throughput.goal(rat) == "goal: project / trl-engine episodes/s >= 1.5x: 2.00x, met"
    slow = vs_trl_throughput.ratios(vs_trl_throughput.summarize({"project": reps((5, 1)), "trl-engine": reps((6, 1))}))
    assert vs_trl_throughput.goal(slow).endswith("1.20x, not met (short by 1.25x)")
    lines = vs_trl_throughput.table(summary, rat)
    assert lines[1].split()[:3] == ["project", "16.00/21.33/32.00", "160/213/320"] and lines[-1].startswith("goal:")


@pytest.mark.slow
def test_throughput_bench_runs_every_arm_on_a_tiny_project(tmp_path):
    """The whole bench at a tiny size: every arm plays the same plan, the engine arm generates exactly what the
    project's learner generates at the first step (same weights, tasks, seeds, temperature: generation held equal),
    and the table, the JSON and the profiles come out."""
    pytest.importorskip("trl")
    from test_train import make_project

    project = make_project(tmp_path / "p")
    out = tmp_path / "tp.json"
    arms = ["project-all", "trl-engine", "trl-naive"]
    proc = run_throughput("--project", str(project), "--reps", "1", "--steps", "2", "--warmup", "0", "--arms",
                          ",".join(arms), "--profile", "--json", str(out), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["summary"]) == arms and list(result["ratios"]) == ["project-all / trl-engine",
                                                                         "project-all / trl-naive"]
    for arm in arms:
        (steps,) = result["runs"][arm]
        assert len(steps) == 2 and all(s["episodes"] == 4 and 0 < s["rollout_s"] < s["step_s"] for s in steps)
        assert all(0 < s["rollout_cpu_s"] < s["step_cpu_s"] for s in steps)
        assert result["summary"][arm]["episodes_per_s"]["min"] > 0 and result["profiles"][arm]
    first = {arm: result["runs"][arm][0][0] for arm in arms}
    assert first["trl-engine"]["sampled_tokens"] == first["project-all"]["sampled_tokens"]
    assert first["trl-engine"]["success"] == first["project-all"]["success"]
    assert result["config"]["trl-engine"]["gradient_checkpointing"] is False
    assert result["config"]["trl-engine"]["temperature"] == result["config"]["project-all"]["rollout_temperature"]
    assert result["config"]["trl-engine"]["gradient_accumulation_steps"] == result["config"]["project-all"][
        "micro_batches"]
    assert result["goal"].startswith("goal: project-all / trl-engine episodes/s >= 1.5x: ")
    assert 0 <= result["summary"]["trl-engine"]["optimizer_s"]["median"] < result["summary"]["trl-engine"][
        "learn_s"]["median"] and "prepare_s" not in result["summary"]["project-all"]
    assert any(line.startswith("trl-naive learning per step: ") for line in proc.stdout.splitlines())
    assert any(line.startswith("project-all / trl-naive: episodes/s ") for line in proc.stdout.splitlines())
    assert "profile of trl-engine" in proc.stdout
