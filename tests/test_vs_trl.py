"""bench/vs_trl.py's pure parts: bad input is one ``error:`` line (a missing TRL names the extra to install), the
order of the sweep's runs, the evaluation marks, kept runs and their settings, the intervals, the summary per arm and
learning rate and the goal's verdict; bench/vs_trl_throughput.py: bad input, the figures and ratios it prints. Marked
slow and skipped where TRL is not installed (CI does not install the ``bench`` extra): each bench run whole on a tiny
project, where the TRL arm driven by the project's rollout engine must generate exactly what the project's learner
generates at the first step. The comparisons themselves are run by hand (docs/peers.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import vs_trl  # noqa: E402
import vs_trl_arms  # noqa: E402
import vs_trl_shared  # noqa: E402


def fake_project(root: Path) -> Path:
    """A folder with every path the benches check for (their contents are never read before TRL is imported)."""
    for name in vs_trl.NEEDED:
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir(exist_ok=True) if name == "data/env" else p.write_text("")
    return root


def run_script(module: str, *args: str, hide_trl: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    """A bench's ``main`` in a fresh interpreter, TRL hidden when asked."""
    code = ("import sys\n" + ("sys.modules['trl'] = None\n" if hide_trl else "") +
            f"sys.path.insert(0, {str(BENCH)!r})\nimport {module} as b\nsys.exit(b.main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def run_bench(*args: str, **kw) -> subprocess.CompletedProcess:
    return run_script("vs_trl", *args, **kw)


@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--steps", "soon"], "--steps: invalid int value"),
    (["--evals", "0"], "--evals must be between 1 and --steps (30), got 0"),
    (["--steps", "4", "--evals", "5"], "--evals must be between 1 and --steps (4), got 5"),
    (["--eval-tasks", "-3"], "--eval-tasks must be at least 1"),
    (["--lrs", "0"], "--lrs: every learning rate must be positive, got [0.0]"),
    (["--lrs", "1e-4,nan"], "--lrs: every learning rate must be positive"),
    (["--lrs", "fast"], "--lrs: 'fast' is not a comma-separated list of floats"),
    (["--lrs", "1e-4,1e-4"], "--lrs: a value named twice in '1e-4,1e-4'"),
    (["--seeds", "0,-1"], "--seeds: seeds are non-negative, got [0, -1]"),
    (["--seeds", ","], "--seeds: nothing named in ','"),
    (["--arms", "project-rl,ppo"], "--arms: unknown arm 'ppo' (a comma-separated list of project-rl, trl, "
                                   "project-default)"),
    (["--project", "/nonexistent/folder"], "--project /nonexistent/folder: params.yaml not found"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, args, words):
    out, png = tmp_path / "out.json", tmp_path / "p.png"
    proc = run_bench("--project", str(fake_project(tmp_path / "p")), *args, "--json", str(out), "--plot", str(png))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists() and not png.exists()


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


def test_marks_are_equal_shares_of_the_steps_ending_at_the_last():
    assert vs_trl.marks(30, 3) == [10, 20, 30]
    assert vs_trl.marks(4, 4) == [1, 2, 3, 4]
    assert vs_trl.marks(7, 1) == [7]
    assert vs_trl.marks(10, 4) == [2, 5, 8, 10]


def test_schedule_runs_each_rates_pure_rl_arms_side_by_side_then_the_recipe():
    runs = vs_trl.schedule(["trl", "project-rl", "project-default"], [1e-4, 2e-4], [0, 1], 3e-4)
    assert runs == [("project-rl", 1e-4, 0), ("trl", 1e-4, 0), ("project-rl", 2e-4, 0), ("trl", 2e-4, 0),
                    ("project-default", 3e-4, 0),
                    ("project-rl", 1e-4, 1), ("trl", 1e-4, 1), ("project-rl", 2e-4, 1), ("trl", 2e-4, 1),
                    ("project-default", 3e-4, 1)]
    assert vs_trl.schedule(["trl"], [1e-4], [5], 3e-4) == [("trl", 1e-4, 5)]
    assert vs_trl.run_key("trl", 2e-05, 1) == "trl lr=2e-05 seed=1"


def test_the_recipes_rate_is_the_projects_train_lr(tmp_path):
    (tmp_path / "params.yaml").write_text("train:\n  lr: 3.0e-4\n")
    assert vs_trl.default_lr(tmp_path) == 3e-4
    (tmp_path / "params.yaml").write_text("train:\n  lr: -1\n")
    with pytest.raises(vs_trl.BenchError, match=f"--project {tmp_path}: .*lr"):
        vs_trl.default_lr(tmp_path)


SETTINGS = {"steps": 30, "evals": 3, "eval_tasks": 400, "project": "/p", "inputs": "0123abcd"}


@pytest.mark.parametrize("content, words", [
    ({"settings": {**SETTINGS, "steps": 20}, "runs": {}}, "holds runs with other settings (steps 20 here 30)"),
    ({"settings": {**SETTINGS, "inputs": "ffff0000"}, "runs": {}},
     "holds runs with other settings (inputs ffff0000 here 0123abcd)"),
    ({"settings": {k: v for k, v in SETTINGS.items() if k != "inputs"}, "runs": {}},
     "holds runs with other settings (inputs None here 0123abcd)"),
    ({"runs": {}}, "exists and is not a result of this bench (KeyError"),
    ("{not json", "exists and is not a result of this bench (JSONDecodeError"),
])
def test_kept_runs_need_the_same_settings(tmp_path, content, words):
    f = tmp_path / "r.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(vs_trl.BenchError) as err:
        vs_trl.load_kept(f, SETTINGS)
    assert words in str(err.value) and str(f) in str(err.value)


def test_kept_runs_come_back_and_a_missing_file_keeps_none(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"settings": SETTINGS, "runs": {"trl lr=0.0001 seed=0": {"arm": "trl"}}}))
    assert vs_trl.load_kept(f, SETTINGS) == {"trl lr=0.0001 seed=0": {"arm": "trl"}}
    assert vs_trl.load_kept(tmp_path / "none.json", SETTINGS) == {} and vs_trl.load_kept(None, SETTINGS) == {}


def test_inputs_digest_changes_with_the_adapted_weights_and_the_tasks(tmp_path):
    project = fake_project(tmp_path / "p")
    empty = vs_trl.inputs_digest(project)
    weights = project / "models" / "adapted" / "model.safetensors"
    weights.write_bytes(b"\0" * 10)
    first = vs_trl.inputs_digest(project)
    assert first != empty and vs_trl.inputs_digest(project) == first
    weights.write_bytes(b"\0" * 9 + b"\1")
    assert vs_trl.inputs_digest(project) != first
    second = vs_trl.inputs_digest(project)
    (project / "data" / "tasks" / "test.jsonl").write_text("{}\n")
    third = vs_trl.inputs_digest(project)
    assert third != second
    (project / "params.yaml").write_text("train:\n  lr: 1.0\n")  # settings are not inputs: the runs record them
    assert vs_trl.inputs_digest(project) == third


def test_sampled_digest_reads_the_action_tokens_in_episode_order():
    a, b = ([5, 6, 7, 8], [0, 1, 1, 0]), ([9, 10], [1, 1])
    assert vs_trl_shared.sampled_digest([a, b]) == vs_trl_shared.sampled_digest([([1, 6, 7, 2], [0, 1, 1, 0]),
                                                                               ([9, 10], [1, 1])])
    assert vs_trl_shared.sampled_digest([a, b]) != vs_trl_shared.sampled_digest([b, a])
    assert vs_trl_shared.sampled_digest([a, b]) != vs_trl_shared.sampled_digest([a, ([9, 11], [1, 1])])
    # the same tokens split differently between episodes are other episodes
    assert vs_trl_shared.sampled_digest([([6, 7], [1, 1]), ([9, 10], [1, 1])]) != vs_trl_shared.sampled_digest(
        [([6], [1]), ([7, 9, 10], [1, 1, 1])])


def test_bootstrap_interval_brackets_the_mean_and_collapses_without_spread():
    assert vs_trl.bootstrap_interval([[1] * 50, [1] * 50]) == (1.0, 1.0)
    lo, hi = vs_trl.bootstrap_interval([[1, 0] * 100, [1, 1, 0, 0] * 50])
    assert lo < 0.5 < hi and hi - lo < 2 * 1.96 * (0.25 / 200) ** 0.5 + 0.02  # about the binomial interval
    assert vs_trl.bootstrap_interval([[1, 0] * 100]) == vs_trl.bootstrap_interval([[1, 0] * 100])


def run(arm, lr, seed, curve, n=10):
    """A run whose points are (t, raw, wise) after steps 10, 20, ...; its final outcomes give the last point's
    rates on n tasks."""
    points = [{"step": 10 * (i + 1), "t": t, "episodes": 640 * (i + 1), "raw": r, "wise": w}
              for i, (t, r, w) in enumerate(curve)]
    last = points[-1]
    final = {s: [1] * round(last[s] * n) + [0] * (n - round(last[s] * n)) for s in ("raw", "wise")}
    return {"arm": arm, "lr": lr, "seed": seed, "points": points, "final": final, "config": {"lr": lr}}


START = {"points": [{"step": 0, "t": 0.0, "raw": 0.5, "wise": 0.5}], "final": {"raw": [1, 0] * 50, "wise": [1, 0] * 50}}
NARROW = (0.45, 0.55)  # a start interval for the goal


def test_summary_averages_seeds_per_arm_and_rate():
    runs = {"a": run("trl", 1e-4, 0, [(100, 0.6, 0.5), (200, 0.8, 0.6)]),
            "b": run("trl", 1e-4, 1, [(120, 0.6, 0.5), (220, 0.6, 0.6)]),
            "c": run("project-rl", 1e-4, 0, [(50, 0.7, 0.6), (100, 0.9, 0.7)])}
    s = vs_trl.summarize(runs, START)
    assert list(s) == ["project-rl lr=0.0001", "trl lr=0.0001"]  # project first, then TRL, by rate
    g = s["trl lr=0.0001"]
    assert g["seeds"] == [0, 1] and g["raw"]["seeds"] == [0.8, 0.6] and g["raw"]["final"] == pytest.approx(0.7)
    assert g["curve"][0] == {"step": 0, "t": 0.0, "raw": 0.5, "wise": 0.5}
    assert g["curve"][1] == {"step": 10, "t": 110.0, "raw": pytest.approx(0.6), "wise": pytest.approx(0.5)}
    assert g["train_s"] == 210.0 and g["episodes_per_s"] == pytest.approx((1280 / 200 + 1280 / 220) / 2)
    lo, hi = g["raw"]["interval"]
    assert lo <= 0.7 <= hi


def test_goal_times_the_best_trl_final_for_each_scoring():
    runs = {"t1": run("trl", 1e-4, 0, [(100, 0.6, 0.7), (200, 0.7, 0.7), (300, 0.8, 0.7)]),
            "t2": run("trl", 2e-4, 0, [(100, 0.7, 0.55), (200, 0.7, 0.55), (300, 0.7, 0.55)]),
            "p1": run("project-rl", 1e-4, 0, [(40, 0.6, 0.5), (80, 0.8, 0.5), (120, 0.9, 0.5)]),
            "p2": run("project-rl", 2e-4, 0, [(40, 0.7, 0.5), (80, 0.75, 0.5), (120, 0.8, 0.5)])}
    s = vs_trl.summarize(runs, START)
    raw = vs_trl.goal(s, "raw", NARROW)
    assert raw["target"] == pytest.approx(0.8) and raw["best_trl"] == "trl lr=0.0001" and raw["trl_s"] == 300
    assert raw["project_s"] == 80 and raw["project_group"] == "project-rl lr=0.0001"  # the earliest over rates
    assert raw["ratio"] == pytest.approx(80 / 300) and raw["met"] and raw["verdict"].startswith("met: 0.27x")
    wise = vs_trl.goal(s, "wise", NARROW)  # TRL reaches 0.7 at 100 s; no project rate does
    assert wise["target"] == pytest.approx(0.7) and wise["trl_s"] == 100 and wise["met"] is False
    assert wise["verdict"] == "not met: no project-rl learning rate reached 0.700 within the steps"
    # a target inside the start's interval times noise: not measurable, whoever reaches it first
    noisy = vs_trl.goal(s, "raw", (0.4, 0.85))
    assert noisy["met"] is None and noisy["ratio"] is None and noisy["verdict"] == (
        "not measurable: TRL's best final 0.800 is inside the start's 95 % interval [0.400, 0.850]: no TRL rate "
        "learned measurably")
    assert vs_trl.goal(vs_trl.summarize({"t": runs["t1"]}, START), "raw", NARROW) is None  # no project arm
    lines = vs_trl.table(s, [raw, wise])
    assert lines[1].split()[:4] == ["project-rl", "lr=0.0001", "1", "0.900"]
    assert lines[-2].startswith("goal (raw): target 0.800 (trl lr=0.0001's final); TRL reaches it at 300 s, "
                                "project-rl at 80 s (project-rl lr=0.0001): met: 0.27x")


def test_report_prints_the_kept_runs_and_runs_nothing(tmp_path, capsys, monkeypatch):
    """``--report`` reads --json alone (no TRL needed): the table of the named runs it holds, the others listed as
    not run; without a --json file it is one error line."""
    project = fake_project(tmp_path / "p")
    (project / "params.yaml").write_text("train:\n  lr: 2.0e-4\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"  # the plot's default place: beside --json
    settings = {"steps": 30, "evals": 3, "eval_tasks": 10, "project": str(project.resolve()),
                "inputs": vs_trl.inputs_digest(project)}
    runs = {"start": START, "trl lr=0.0001 seed=0": run("trl", 1e-4, 0, [(100, 0.6, 0.6), (200, 0.7, 0.7),
                                                                          (300, 0.8, 0.6)]),
            "project-rl lr=0.0001 seed=0": run("project-rl", 1e-4, 0, [(40, 0.8, 0.5), (80, 0.8, 0.5),
                                                                        (120, 0.9, 0.6)])}
    out.write_text(json.dumps({"settings": settings, "trl": "1.16.0", "runs": runs}))
    args = ["--project", str(project), "--eval-tasks", "10", "--lrs", "1e-4", "--seeds", "0,1", "--json", str(out),
            "--report"]
    monkeypatch.setitem(sys.modules, "trl", None)  # a report imports no TRL
    assert vs_trl.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("not run yet (4): project-default lr=0.0002 seed=0, project-rl lr=0.0001 seed=1, "
                        "trl lr=0.0001 seed=1, project-default lr=0.0002 seed=1")
    assert any(ln.startswith("goal (raw): target 0.800 (trl lr=0.0001's final); TRL reaches it at 300 s, project-rl "
                             "at 40 s") for ln in lines)
    assert set(json.loads(out.read_text())["runs"]) == set(runs) and png.stat().st_size > 0
    out.unlink()
    assert vs_trl.main(args) == 2
    assert capsys.readouterr().err.strip() == f"error: --report reads the runs of --json, and {out} is not a file"


@pytest.mark.slow
def test_trl_is_set_to_the_projects_estimator(tmp_path):
    """Where TRL is installed (the bench extra): TRL's own config class takes the arguments, with the estimator that
    matches the project's (mean-centred advantages, token-mean loss) and the shared work."""
    trl = pytest.importorskip("trl")
    from types import SimpleNamespace

    cfg = SimpleNamespace(lr=5e-5, seed=3, group_size=8, tasks_per_update=8, micro_batches=4, lr_warmup_steps=10,
                          max_grad_norm=1.0)
    rl = SimpleNamespace(max_new_tokens=48, temperature=0.7)
    c = trl.GRPOConfig(**vs_trl_shared.grpo_args({"tmp": str(tmp_path)}, cfg, rl, 30, **vs_trl_arms.TRL_ESTIMATOR))
    assert (c.scale_rewards, c.loss_type, c.learning_rate, c.warmup_steps, c.temperature) == ("none", "dapo", 5e-5,
                                                                                             10, 0.7)
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.num_generations) == (16, 4, 8)
    assert c.gradient_checkpointing is False and c.beta == 0.0 and c.max_steps == 30


@pytest.mark.slow
def test_learning_bench_runs_every_arm_on_a_tiny_project(tmp_path):
    """The whole bench at a tiny size: every arm's curve and final outcomes, the pure-RL arms' first batch the same
    episodes (same start, plan, seeds and engine), and a second invocation keeps every run."""
    pytest.importorskip("trl")
    from test_train import make_project

    project = make_project(tmp_path / "p")
    out, png = tmp_path / "l.json", tmp_path / "l.png"
    args = ["--project", str(project), "--steps", "2", "--evals", "2", "--eval-tasks", "6", "--lrs", "1e-3",
            "--seeds", "0", "--json", str(out), "--plot", str(png)]
    proc = run_bench(*args, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert set(runs) == {"start", "project-rl lr=0.001 seed=0", "trl lr=0.001 seed=0",
                         "project-default lr=0.01 seed=0"}
    for key, r in runs.items():
        if key != "start":
            assert [p["step"] for p in r["points"]] == [1, 2] and len(r["final"]["raw"]) == 6
            assert 0 < r["points"][0]["t"] <= r["points"][1]["t"] and len(r["rollout_success"]) == 2
    assert runs["trl lr=0.001 seed=0"]["first_batch"] == runs["project-rl lr=0.001 seed=0"]["first_batch"]
    assert runs["trl lr=0.001 seed=0"]["rollout_success"][0] == runs["project-rl lr=0.001 seed=0"][
        "rollout_success"][0]
    assert runs["trl lr=0.001 seed=0"]["config"]["loss_type"] == "dapo"
    assert runs["project-rl lr=0.001 seed=0"]["config"]["skip_zero_variance_groups"] is False
    assert [g["arm"] for g in result["summary"].values()] == ["project-rl", "trl", "project-default"]
    assert png.stat().st_size > 0
    again = run_bench(*args, timeout=300)
    assert again.returncode == 0 and "(3 kept from" in again.stdout
    assert json.loads(out.read_text())["summary"] == result["summary"]


# ------------------------------------------------------------------------------- bench/vs_trl_throughput.py
import vs_trl_throughput  # noqa: E402


def run_throughput(*args: str, **kw) -> subprocess.CompletedProcess:
    return run_script("vs_trl_throughput", *args, **kw)


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
