"""The `evaluate` stage: bootstrap intervals (known answers, looped-vs-vectorised), the three overfitting flags on
scripted records and on real expert/random episodes, and the phase end to end on a tiny world with two tiny policies
(files, pairing with an independent evaluation, MLflow, GX validation, bad input, the CLI). Seconds each."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.core.config import load_section, read_params
from pipeline.envs.config import EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.core.errors import AgentRLError
from pipeline.evaluate.report import EPISODE_METRICS, behaviour_diversity, bootstrap_gap, bootstrap_means, build_report, cosine, episode_values, flat_metrics, markdown_report, overfitting, paired_counts, split_report, success_rows, tool_calls_on_common_solved, trajectory_features, unseen_templates
from pipeline.evaluate.config import EvaluateConfig

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def episode(task_id: str, success: bool, *, level: int = 1, family: str = "lookup", seen: bool = True,
            calls: list | None = None, violations: int = 0, ret: float | None = None) -> dict:
    """A minimal episode record with the fields the report reads."""
    calls = calls if calls is not None else [{"tool": "lookup", "params": {"name": task_id}, "outcome": "ok"},
                                             {"tool": "answer", "params": {"value": "1"}, "outcome": "answer"}]
    return {"task_id": task_id, "level": level, "family": family, "template_seen": seen, "success": success,
            "return": float(success) if ret is None else ret, "truncated": False, "n_calls": len(calls),
            "n_violations": violations, "calls": calls,
            "components": {"correctness": float(success), "efficiency": 0.0, "safety": -float(violations > 0),
                           "user_experience": 0.5}}


def cfg(**over) -> EvaluateConfig:
    return EvaluateConfig(**{"bootstrap_samples": 400, **over})


# ---------------------------------------------------------------------------------------------------- bootstrap
def test_bootstrap_of_a_constant_is_that_constant_and_intervals_cover_the_mean():
    out = bootstrap_means({"c": np.full(100, 0.7), "x": np.r_[np.zeros(20), np.ones(80)]}, 500, 0.95,
                          np.random.default_rng(0))
    assert out["c"] == {"mean": pytest.approx(0.7), "ci_low": pytest.approx(0.7), "ci_high": pytest.approx(0.7)}
    with pytest.raises(ValueError, match="one value per episode"):
        bootstrap_means({"a": np.ones(3), "b": np.ones(4)}, 100, 0.95, np.random.default_rng(0))
    assert out["x"]["mean"] == 0.8 and out["x"]["ci_low"] < 0.8 < out["x"]["ci_high"]
    # a binomial proportion's 95 % interval at n=100, p=0.8 is about ±0.08
    assert 0.05 < out["x"]["ci_high"] - out["x"]["mean"] < 0.11


def test_vectorised_bootstrap_equals_a_plain_loop_over_the_same_resamples():
    values = np.random.default_rng(3).normal(size=37)
    got = bootstrap_means({"v": values}, 300, 0.9, np.random.default_rng(11))["v"]
    idx = np.random.default_rng(11).integers(0, 37, size=(300, 37))
    means = [float(np.mean([values[i] for i in row])) for row in idx]
    assert got["ci_low"] == pytest.approx(np.percentile(means, 5)) and got["ci_high"] == pytest.approx(
        np.percentile(means, 95))


def test_bootstrap_is_seeded_and_narrows_with_more_episodes():
    small = np.tile([0.0, 1.0], 10)
    large = np.tile([0.0, 1.0], 500)
    a = bootstrap_means({"v": small}, 400, 0.95, np.random.default_rng(1))["v"]
    assert a == bootstrap_means({"v": small}, 400, 0.95, np.random.default_rng(1))["v"]
    b = bootstrap_means({"v": large}, 400, 0.95, np.random.default_rng(1))["v"]
    assert b["ci_high"] - b["ci_low"] < (a["ci_high"] - a["ci_low"]) / 3
    gap = bootstrap_gap(np.ones(50), np.zeros(50), 200, 0.95, np.random.default_rng(0))
    assert gap == {"gap": 1.0, "ci_low": 1.0, "ci_high": 1.0}


def test_split_report_covers_every_metric_per_level_and_template():
    records = [episode(f"t{i}", i % 2 == 0, level=1 + i % 2, seen=i < 6, violations=int(i == 3)) for i in range(8)]
    rep = split_report(records, cfg(), np.random.default_rng(0))
    assert set(rep["per_level"]) == {"1", "2"} and {"template_seen", "template_unseen"} <= set(rep)
    for name in ("success", "return", "correctness", "efficiency", "safety", "user_experience", "tool_calls",
                 "safety_violations", "violation_episode_rate", "truncated"):
        m = rep["overall"][name]
        assert m["ci_low"] <= m["mean"] <= m["ci_high"], name
    assert rep["per_level"]["1"]["success"]["mean"] == 1.0 and rep["per_level"]["2"]["success"]["mean"] == 0.0
    assert rep["overall"]["safety_violations_total"] == 1 and rep["overall"]["violation_episode_rate"]["mean"] == 1 / 8
    assert set(episode_values(records)) == set(EPISODE_METRICS)


def test_split_report_groups_success_by_held_out_slice():
    records = [{**episode(f"t{i}", i < 3), "slices": ["city"] * (i < 4) + ["month"] * (i >= 2)} for i in range(6)]
    rep = split_report(records, cfg(), np.random.default_rng(0))
    assert set(rep["per_slice"]) == {"city", "month"}
    assert rep["per_slice"]["city"]["n"] == 4 and rep["per_slice"]["city"]["success"]["mean"] == 0.75
    assert rep["per_slice"]["month"]["n"] == 4 and rep["per_slice"]["month"]["success"]["mean"] == 0.25
    assert "per_slice" not in split_report([episode("a", True)], cfg(), np.random.default_rng(0))


# --------------------------------------------------------------------------------------------------------- flags
def test_overfitting_is_flagged_above_the_threshold_only():
    train = [episode(f"a{i}", i < 9) for i in range(10)]          # 0.9
    val = [episode(f"b{i}", i < 5) for i in range(10)]            # 0.5
    out = overfitting(train, val, cfg(overfit_metric="success", overfit_threshold=0.2), np.random.default_rng(0))
    assert out["gap"] == pytest.approx(0.4) and out["flagged"] and out["ci_low"] <= 0.4 <= out["ci_high"]
    out = overfitting(train, val, cfg(overfit_metric="success", overfit_threshold=0.5), np.random.default_rng(0))
    assert not out["flagged"]
    ret = overfitting([episode("a", True, ret=0.3)], [episode("b", True, ret=0.25)], cfg(overfit_metric="return"),
                      np.random.default_rng(0))
    assert ret["gap"] == pytest.approx(0.05) and not ret["flagged"] and ret["metric"] == "return"


def test_failure_on_unseen_templates_is_flagged_per_family():
    test = ([episode(f"s{i}", i < 8, family="lookup") for i in range(10)]
            + [episode(f"u{i}", i < 1, family="lookup", seen=False) for i in range(5)]
            + [episode(f"v{i}", True, family="update", level=3, seen=False) for i in range(2)])
    out = unseen_templates(test, cfg(), np.random.default_rng(0))
    assert out["seen_success"] == 0.8 and out["unseen_success"] == pytest.approx(3 / 7) and out["flagged"]
    assert out["per_family"]["lookup"] == {"n_seen": 10, "n_unseen": 5, "seen_success": 0.8, "unseen_success": 0.2}
    assert out["per_family"]["update"]["seen_success"] is None
    # per level: level 1 holds the lookups, level 3 only the held-out update wording
    assert out["per_level"]["1"] == {"n_seen": 10, "n_unseen": 5, "seen_success": 0.8, "unseen_success": 0.2}
    assert out["per_level"]["3"] == {"n_seen": 0, "n_unseen": 2, "seen_success": None, "unseen_success": 1.0}
    fine = unseen_templates([episode("s", True), episode("u", True, seen=False)], cfg(), np.random.default_rng(0))
    assert fine["gap"] == 0.0 and not fine["flagged"]
    only_seen = unseen_templates([episode("s", True)], cfg(), np.random.default_rng(0))
    assert only_seen["flagged"] is None and "needs both" in only_seen["reason"]


def test_trajectory_features_and_cosine_known_answers():
    a = trajectory_features(episode("t", True))
    assert a["tool:lookup"] == 1 and a["bigram:lookup>answer"] == 1 and a["param:lookup.name=t"] == 1
    assert cosine(a, a) == pytest.approx(1.0)
    invalid = trajectory_features({"calls": [{"tool": None, "params": None, "outcome": "invalid_action"}]})
    assert cosine(a, invalid) == 0.0  # nothing in common
    from collections import Counter

    assert cosine(Counter({"x": 1}), Counter({"x": 1, "y": 1})) == pytest.approx(1 / np.sqrt(2))
    assert cosine(Counter(), Counter()) == 1.0 and cosine(Counter(), Counter({"x": 1})) == 0.0


def test_rigid_behaviour_flags_identical_episodes_and_not_varied_ones():
    same = [episode("t1", True) for _ in range(4)] + [episode("t2", True) for _ in range(4)]
    out = behaviour_diversity(same, cfg())
    assert out["behavior_diversity"] == 0.0 and out["distinct_solutions"] == 1.0 and out["identical_share"] == 1.0
    assert out["flagged"]
    varied = [episode("t1", True, calls=[{"tool": "lookup", "params": {"name": f"x{k}"}, "outcome": "ok"},
                                         {"tool": "answer", "params": {"value": str(k)}, "outcome": "answer"}])
              for k in range(4)]
    out = behaviour_diversity(varied, cfg())
    assert out["distinct_solutions"] == 4.0 and out["distinct_successful_solutions"] == 4.0
    # each ϕ has 6 features in common (tools, bigrams, outcomes) and 2 of its own (parameter values): cos = 6/8
    assert out["behavior_diversity"] == pytest.approx(0.25) and not out["flagged"]
    with pytest.raises(ValueError, match="at least two episodes"):
        behaviour_diversity([episode("t", True)], cfg())
    # two different malformed attempts are two solutions, though their tool features are the same
    garbled = [dict(episode("t", False, calls=[{"tool": None, "params": None, "outcome": "invalid_action"}]),
                    steps=[{"action": text, "observation": "invalid"}]) for text in ("<call>x", "<call>y", "<call>x")]
    out = behaviour_diversity(garbled, cfg())
    assert out["behavior_diversity"] == 0.0 and out["distinct_solutions"] == 2.0 and not out["flagged"]


@pytest.fixture(scope="module")
def world_and_tasks(tmp_path_factory):
    from pipeline.build_env.main import build
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.taskfile import load_task_file

    root = tmp_path_factory.mktemp("evaluate")
    build(BuildEnvConfig(options={"n_products": 40, "n_suppliers": 10},
                         tasks_per_split={"train": 24, "validation": 8, "test": 16}),
          EnvConfig(), root / "data", root / "metrics" / "build_env.json")
    world = ShopWorld.load(root / "data" / "env")
    try:
        tasks = {s: load_task_file(root / "data" / "tasks" / f"{s}.jsonl", world, validate=False)
                 for s in ("train", "validation", "test")}
    finally:
        world.close()
    return root, tasks


def test_flags_on_real_episodes_expert_against_random(world_and_tasks):
    """Real run_episode records: an 'overfit' pair (the expert on train, the random policy on validation) is flagged,
    the expert is rigid (deterministic: the same solution for every seed) and the random policy is not."""
    from pipeline.envs.shop import ShopWorld
    from pipeline.policy.episodes import evaluate

    root, tasks = world_and_tasks
    runtime = ShopWorld.load(root / "data" / "env")
    try:
        _, expert_train = evaluate("expert", tasks["train"][:8], runtime, EnvConfig())
        _, random_val = evaluate("random", tasks["validation"], runtime, EnvConfig())
        expert_seeds = [r for s in range(3) for r in evaluate("expert", tasks["validation"][:4], runtime, EnvConfig(),
                                                               seed=s)[1]]
        random_seeds = [r for s in range(3) for r in evaluate("random", tasks["validation"][:4], runtime, EnvConfig(),
                                                               seed=s)[1]]
    finally:
        runtime.close()
    out = overfitting(expert_train, random_val, cfg(), np.random.default_rng(0))
    assert out["train"] > 0.9 and out["flagged"] and out["ci_low"] > 0.1
    assert behaviour_diversity(expert_seeds, cfg())["flagged"]
    rnd = behaviour_diversity(random_seeds, cfg())
    assert not rnd["flagged"] and rnd["distinct_solutions"] > 2


def test_report_pairs_policies_by_task_and_tabulates_success():
    def split(prefix, wins):
        return [episode(f"{prefix}{i}", w, level=1 + i % 2, seen=i != 0) for i, w in enumerate(wins)]

    greedy = {"sft": {"train": split("a", [1, 1, 0, 0]), "validation": split("b", [1, 0, 0, 0]),
                      "test": split("c", [1, 1, 0, 0])},
              "rl": {"train": split("a", [1, 1, 1, 1]), "validation": split("b", [1, 1, 0, 0]),
                     "test": split("c", [0, 1, 1, 1])}}
    sampled = {p: [episode("b0", True) for _ in range(2)] for p in greedy}
    report = build_report(greedy, sampled, cfg())
    assert report["per_task_test_success"]["rl"] == {"c0": False, "c1": True, "c2": True, "c3": True}
    assert report["paired_test"] == {"tasks": 4, "both": 1, "neither": 0, "rl_only": 2, "sft_only": 1}
    assert paired_counts({"rl": {}}) is None
    assert report["tool_calls_both_solved"]["overall"]["n"] == 1  # c1: the one test task both solve
    assert "sft: rigid_behavior" in report["flagged"] and "rl: rigid_behavior" in report["flagged"]
    rows = success_rows(report["policies"])
    assert len(rows) == 2 * 3 * 3  # policies × splits × (levels 1, 2 and all)
    row = next(r for r in rows if r["series"] == "rl test L2")
    assert row["success"] == 1.0 and row["n"] == 2 and row["level"] == "2"
    # test success per level on seen and held-out wordings (c0, level 1, is the held-out one): in the report's
    # table and as MLflow metrics; level 2 has no held-out task, so it has no held-out metric
    md = markdown_report(report)
    assert "| 1 | 1 / 1 | 0.000 | 1.000 | 1.000 | 0.000 |" in md and "| 2 | 2 / 0 | 0.500 | – | 1.000 | – |" in md
    flat = flat_metrics(report)
    assert flat["eval/rl/test/success_L1_seen_template"] == 1.0
    assert flat["eval/sft/test/success_L1_unseen_template"] == 1.0
    assert flat["eval/sft/test/success_L2_seen_template"] == 0.5
    assert "eval/rl/test/success_L2_unseen_template" not in flat
    # the same seed gives the same report, whatever the order in which the policies are listed
    again = build_report({"rl": greedy["rl"], "sft": greedy["sft"]}, sampled, cfg())
    assert again["policies"]["sft"] == report["policies"]["sft"] and again["flags"] == report["flags"]


def test_tool_calls_are_compared_on_the_tasks_both_policies_solve():
    def calls(n):  # n − 1 lookups, then the answer
        return [{"tool": "lookup", "params": {}, "outcome": "ok"}] * (n - 1) + [{"tool": "answer", "params": {},
                                                                               "outcome": "answer"}]

    # level 1: both solve t0 (SFT 2 calls, RL 2) and t1 (SFT 4, RL 3); level 2: both solve t2 (3, 3); only RL solves
    # t3 (6 calls, a recovery) and t4 (level 1, 5 calls); only SFT solves t5
    spec = {"t0": (1, (True, 2), (True, 2)), "t1": (1, (True, 4), (True, 3)), "t2": (2, (True, 3), (True, 3)),
            "t3": (2, (False, 2), (True, 6)), "t4": (1, (False, 1), (True, 5)), "t5": (2, (True, 2), (False, 8))}
    sft = [episode(t, ok, level=lv, calls=calls(n)) for t, (lv, (ok, n), _) in spec.items()]
    rl = [episode(t, ok, level=lv, calls=calls(n)) for t, (lv, _, (ok, n)) in spec.items()]
    tc = tool_calls_on_common_solved(sft, rl, cfg(), np.random.default_rng(0))
    o = tc["overall"]
    assert (o["n"], o["sft"], o["rl"], o["rl_minus_sft"]) == (3, 3.0, pytest.approx(8 / 3), pytest.approx(-1 / 3))
    assert o["ci_low"] <= o["rl_minus_sft"] <= o["ci_high"] <= 0.0 and o["ci_low"] >= -1.0
    assert (o["n_rl_only"], o["rl_only_rl"]) == (2, 5.5)
    l1, l2 = tc["per_level"]["1"], tc["per_level"]["2"]
    assert (l1["n"], l1["sft"], l1["rl"], l1["n_rl_only"], l1["rl_only_rl"]) == (2, 3.0, 2.5, 1, 5.0)
    assert (l2["n"], l2["rl_minus_sft"], l2["ci_low"], l2["ci_high"], l2["rl_only_rl"]) == (1, 0.0, 0.0, 0.0, 6.0)
    # the per-policy mean over each one's own solved tasks tells another story: RL's solved tasks cost more calls
    mean_solved = lambda recs: np.mean([r["n_calls"] for r in recs if r["success"]])  # noqa: E731
    assert mean_solved(rl) > mean_solved(sft)
    none = tool_calls_on_common_solved(sft[5:], rl[5:], cfg(), np.random.default_rng(0))["overall"]
    assert none["n"] == 0 and none["rl_minus_sft"] is None and none["rl_only_rl"] is None


# ----------------------------------------------------------------------------------------------- the phase itself
TINY_PARAMS = {
    "env": {"max_steps": 3},
    "rollout": {"max_new_tokens": 10, "batch_size": 16},
    "evaluate": {"train_tasks": 6, "max_tasks": None, "bootstrap_samples": 200, "diversity_tasks": 3,
                 "diversity_seeds": 2},
}


@pytest.fixture(scope="module")
def project(world_and_tasks):
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy, save_policy
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer

    from pipeline.envs.shop import ShopWorld

    root, _ = world_and_tasks
    world = ShopWorld.load(root / "data" / "env")
    signatures = [s.signature() for s in world.tools()]
    world.close()
    tok = train_tokenizer(corpus_texts(root / "data", signatures), vocab_size=400)
    for seed, folder in ((0, "adapted"), (1, "policy")):
        model = build_policy(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_positions=512, seed=seed), tok)
        save_policy(model, tok, root / "models" / folder, {"note": f"tiny random policy {seed}"})
    (root / "params.yaml").write_text(yaml.safe_dump(TINY_PARAMS))
    return root


def _load_cfgs(params: Path):
    from pipeline.policy.config import RolloutConfig

    return (load_section(EvaluateConfig, "evaluate", params), load_section(EnvConfig, "env", params),
            load_section(RolloutConfig, "rollout", params))


@pytest.fixture(scope="module")
def phase_run(project):
    """The phase once, in the project folder, with the real tracker (the test run's temporary MLflow store)."""
    import os

    from pipeline.evaluate.main import main

    cwd = os.getcwd()
    os.chdir(project)
    try:
        result = main("params.yaml")
    finally:
        os.chdir(cwd)
    return result


@pytest.mark.slow
def test_phase_writes_metrics_plots_and_pairs_with_an_independent_evaluation(project, phase_run):
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.episodes import evaluate_model

    written = json.loads((project / "metrics/evaluate.json").read_text())
    assert written["tasks"] == {"train": 6, "validation": 8, "test": 16}
    for policy in ("sft", "rl"):
        for split in ("train", "validation", "test"):
            rep = written["policies"][policy][split]
            assert rep["overall"]["n"] == written["tasks"][split]
            for m in rep["overall"].values():
                if isinstance(m, dict):
                    assert m["ci_low"] - 1e-12 <= m["mean"] <= m["ci_high"] + 1e-12
        assert set(written["flags"][policy]) == {"overfitting", "unseen_templates", "rigid_behavior"}
        assert written["flags"][policy]["rigid_behavior"]["tasks"] == 3
    assert {v["success"] for v in written["validation"].values()} == {1.0} and len(written["validation"]) == 8
    # per-task test successes are keyed by task id and equal an independent greedy evaluation with the same seeds
    cfg_, env_cfg, rollout_cfg = _load_cfgs(project / "params.yaml")
    runtime = ShopWorld.load(project / "data/env")
    test_tasks = load_task_file(project / "data/tasks/test.jsonl", runtime, validate=False)
    try:
        _, records = evaluate_model(project / "models/policy", test_tasks, runtime, env_cfg, rollout_cfg,
                                    seed=cfg_.seed)
    finally:
        runtime.close()
    assert written["per_task_test_success"]["rl"] == {r["task_id"]: r["success"] for r in records}
    assert written["policies"]["rl"]["test"]["overall"]["return"]["mean"] == pytest.approx(
        np.mean([r["return"] for r in records]))
    # the plot table: one row per policy, split and level plus each split's overall row, matching the JSON
    rows = list(csv.DictReader((project / "metrics/evaluate_success.csv").open()))
    expected = sum(len(written["policies"][p][s]["per_level"]) + 1 for p in ("sft", "rl")
                   for s in ("train", "validation", "test"))
    assert len(rows) == expected
    for r in rows:
        rep = written["policies"][r["policy"]][r["split"]]
        group = rep["overall"] if r["level"] == "all" else rep["per_level"][r["level"]]
        assert float(r["success"]) == pytest.approx(group["success"]["mean"], abs=1e-6)


def test_phase_logs_the_report_to_mlflow(phase_run):
    from mlflow.tracking import MlflowClient

    from pipeline.core.tracking import Tracker

    client = MlflowClient(tracking_uri=Tracker().tracking_uri)
    exp = client.get_experiment_by_name("agentrl")
    (run,) = client.search_runs([exp.experiment_id], "tags.`agentrl.phase` = 'evaluate'", max_results=1)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval/rl/test/success"] == phase_run["policies"]["rl"]["test"]["overall"]["success"]["mean"]
    assert "flags/rl/overfitting" in run.data.metrics and "evaluate.flagged" in run.data.tags
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"evaluate.json", "evaluate_success.csv", "evaluation_report.md"} <= names


def test_episodes_that_break_the_evaluation_suite_are_refused(project):
    from pipeline.envs.shop import ShopWorld
    from pipeline.evaluate.main import validate_episodes

    good = episode("t", True)
    good.update(steps=[{"action": "x", "observation": "y"}] * 2, answer="1", ground_truth="1", n_failed=0)
    bad = dict(good, **{"return": 7.5})  # outside the reward's range
    world = ShopWorld.load(project / "data/env")
    try:
        with pytest.raises(AgentRLError, match=r"(?s)rl/test episodes fail the 'evaluation' suite.*return"):
            validate_episodes({"rl": {"test": [bad]}}, {}, EnvConfig(), world)
    finally:
        world.close()


@pytest.mark.parametrize("breakage, message", [
    (lambda root: root / "models/policy", r"RL policy folder .*models/nope does not exist; run the `train` stage"),
    (lambda root: root / "data/tasks/test.jsonl", r"task file .*test\.jsonl not found"),
])
def test_missing_inputs_are_refused_and_leave_no_metrics_file(project, tmp_path, monkeypatch, breakage, message):
    import shutil

    from pipeline.evaluate.main import evaluate

    # a copy of the project with one input missing, and a stale metrics file from an earlier run
    copy = tmp_path / "p"
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("metrics", "mlruns"))
    target = breakage(copy)
    params = yaml.safe_load((copy / "params.yaml").read_text())
    if target.name == "policy":
        params["evaluate"]["rl_policy"] = "models/nope"
    else:
        target.unlink()
    (copy / "params.yaml").write_text(yaml.safe_dump(params))
    (copy / "metrics").mkdir()
    (copy / "metrics/evaluate.json").write_text('{"stale": true}\n')
    monkeypatch.chdir(copy)
    with pytest.raises(AgentRLError, match=message):
        evaluate(*_load_cfgs(Path("params.yaml")))
    assert not (copy / "metrics/evaluate.json").exists()


def test_schema_breaking_task_file_and_cli_error(project, tmp_path, monkeypatch, capsys):
    import shutil

    from flows.cli import main

    copy = tmp_path / "p"
    shutil.copytree(project, copy, ignore=shutil.ignore_patterns("metrics"))
    lines = (copy / "data/tasks/validation.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    record["level"] = 9
    (copy / "data/tasks/validation.jsonl").write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    monkeypatch.chdir(copy)
    assert main(["evaluate", "--params", "params.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "validation.jsonl" in err and "level" in err
    assert not (copy / "metrics/evaluate.json").exists()


# ---------------------------------------------------------------------------------------- params.yaml and dvc.yaml
def test_params_yaml_mirrors_the_evaluate_defaults_and_dvc_declares_the_stage():
    assert read_params(ROOT / "params.yaml")["evaluate"] == EvaluateConfig().model_dump()
    from pipeline.train.config import TrainConfig

    assert read_params(ROOT / "params.yaml")["train"] == TrainConfig().model_dump()
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]
    assert stage["cmd"] == "agentrl evaluate"
    assert {"models/adapted", "models/policy", "data/tasks", "data/env", "pipeline/evaluate", "pipeline/policy",
            "pipeline/envs", "pipeline/core"} <= set(stage["deps"])
    assert set(stage["params"]) == {"evaluate", "env", "rollout"}
    assert stage["metrics"] == [{"metrics/evaluate.json": {"cache": False}}]
    (plot,) = stage["plots"]
    opts = plot["metrics/evaluate_success.csv"]
    assert opts["cache"] is False
    from pipeline.evaluate.main import PLOT_COLUMNS

    assert {opts["x"], opts["y"]} <= set(PLOT_COLUMNS)


def test_doctests():
    import doctest

    import pipeline.evaluate.report as report

    assert doctest.testmod(report).failed == 0
