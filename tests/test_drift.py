"""The drift and state-representation checks: statistics with known answers, quiet on fresh reference samples and loud
on the documented drifted samples (with the false-alarm rate printed), train/serve consistency down to one changed
character, the GX episode suites, and the `check_drift` phase end to end (bad input refused, verdict file written,
and each input or failure switch of its config turned on).

Everything runs on a world of build_env's default size and a tiny randomly initialised Llama with a tokenizer trained
here; no test takes more than a few seconds.
"""

from __future__ import annotations

import copy
import doctest
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from pipeline.check_drift import checks as C
from pipeline.check_drift.config import DriftConfig
from pipeline.check_drift.consistency import check_consistency, probes_from_episodes
from pipeline.check_drift.features import (TASK_FEATURES, task_feature_specs, TRAJECTORY_FEATURES, Feature, hidden_state_features,
                                     observation_contexts, task_features, trajectory_features)
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.environment import ShopOptions
from pipeline.envs.shop import episode_suites as S
from pipeline.envs.config import EnvConfig
from pipeline.envs.prompt import SYSTEM_TEMPLATE, render_context, render_header
from pipeline.envs.shop.tasks import Task
from pipeline.envs.taskfile import write_tasks
from pipeline.envs.shop.world import generate_world, write_world
from pipeline.core.errors import AgentRLError
from pipeline.policy.episodes import evaluate
from pipeline.core.validation import validate_records

ALPHA = 0.01
FA_REPEATS = 20
FA_BOUND = 0.2  # bound on the false-alarm rate over 20 repeats at alpha=0.01 with Bonferroni (expected: <= 0.01)
N = 200  # tasks per sample
SIGS = [s.signature() for s in ShopWorld.default().tools()]  # the shop's tool list, as the prompt shows it


# ---------------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def world():
    return ShopWorld(generate_world(0, n_products=400, n_suppliers=80, heldout_fraction=0.3))  # build_env's defaults


@pytest.fixture(scope="module")
def reference(world):
    return C.make_reference_sample(world, N, seed=101)


@pytest.fixture(scope="module")
def episodes(world):
    """Expert and random episodes (run_episode records) on a few reference tasks."""
    sample = C.make_reference_sample(world, 30, seed=7)
    runtime = ShopWorld(world.world)
    tasks = [Task.from_dict(t) for t in sample.tasks]
    _, expert = evaluate("expert", tasks, runtime, EnvConfig())
    _, rand = evaluate("random", tasks, runtime, EnvConfig())
    runtime.close()
    return sample.tasks, expert, rand


@pytest.fixture(scope="module")
def tiny_lm(reference):
    """A tiny random Llama and a byte-level BPE tokenizer trained on the reference contexts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.policy.tokenizer import marker_ids, train_tokenizer

    tok = train_tokenizer(observation_contexts(reference.tasks, None, 6, SIGS), vocab_size=400)
    ids = marker_ids(tok)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    return model, tok


def test_doctests():
    from pipeline.check_drift import features
    for module in (C, S, features):
        assert doctest.testmod(module).failed == 0


# ---------------------------------------------------------------------------------------------------------- features
def test_task_features_one_series_per_declared_feature_and_entities_counted_once(reference, world):
    feats = task_features(reference.tasks, world)
    assert set(feats) == set(task_feature_specs(world))
    assert [k for k in task_feature_specs(world) if k.startswith("entity_")] == \
        ["entity_price", "entity_stock", "entity_weight_kg"]  # the shop's numeric entity columns, as before
    assert all(len(feats[f]) == len(reference.tasks) for f, spec in TASK_FEATURES.items() if spec.unit == "task")
    named = {e for t in reference.tasks for e in t["entities"]}
    products = {p["name"] for p in world.world.products}
    assert len(feats["entity_price"]) == len(named & products)  # one value per distinct product, not per task
    assert "entity_price" not in task_features(reference.tasks, None)  # no world: no entity features
    numeric = [t for t in reference.tasks if t["answer"].replace(".", "", 1).lstrip("-").isdigit()]
    assert feats["answer_value"].notna().sum() == len(numeric)


def test_trajectory_features_read_tools_from_calls_or_from_action_text(episodes):
    _, expert, rand = episodes
    feats = trajectory_features(expert + rand)
    assert set(feats) == set(TRAJECTORY_FEATURES)
    demos = [{k: v for k, v in r.items() if k not in ("calls", "components")} for r in expert]  # demo-shaped
    from_text = trajectory_features(demos)
    assert from_text["tool_sequence"].tolist() == feats["tool_sequence"][: len(expert)].tolist()
    assert from_text["correctness"].isna().all() and feats["correctness"].notna().all()
    assert feats["n_tokens"].isna().all()  # run_episode records carry no tokens


# ------------------------------------------------------------------------------------------ per-feature statistics
def test_chi2_pools_rare_categories_and_matches_scipy_on_the_pooled_table():
    from scipy.stats import chi2_contingency

    feat = Feature("x", "categorical", "task", "")
    ref = pd.Series(["a"] * 50 + ["b"] * 40 + ["c"] * 3 + ["d"] * 2)
    cur = pd.Series(["a"] * 30 + ["b"] * 60 + ["c"] * 1 + ["e"] * 4)
    r = C.chi2_test(feat, ref, cur, min_expected=5.0)
    # c, d, e have expected counts < 5: pooled into one column of (3+2, 1+4)
    expected = chi2_contingency(np.array([[50, 40, 5], [30, 60, 5]]), correction=False)
    assert r.test == "chi2" and "3 rare categories pooled" in r.note
    assert r.statistic == pytest.approx(expected.statistic) and r.p_value == pytest.approx(expected.pvalue)
    assert r.effect == pytest.approx(np.sqrt(expected.statistic / 190))
    assert r.details["new_categories"] == ["e"]
    one = C.chi2_test(feat, pd.Series(["a"] * 50), pd.Series(["a"] * 49 + ["z"]))
    assert one.test == "skipped" and "fewer than two categories" in one.note


def test_holm_never_adjusts_more_than_bonferroni():
    p = np.random.default_rng(0).uniform(0, 0.1, size=12)
    holm, bonf = C.adjust_p_values(p, "holm"), C.adjust_p_values(p, "bonferroni")
    assert np.all(holm <= bonf + 1e-12) and np.all(holm >= p)
    with pytest.raises(ValueError, match="corrections are bonferroni, holm"):
        C.adjust_p_values(p, "fdr")


def test_effect_floor_keeps_a_significant_but_tiny_difference_from_counting_as_drift():
    rng = np.random.default_rng(0)
    feat = {"v": Feature("v", "continuous", "task", "")}
    ref, cur = {"v": pd.Series(rng.normal(0, 1, 100_000))}, {"v": pd.Series(rng.normal(0.05, 1, 100_000))}
    floored = C.compare_features(ref, cur, feat, DriftConfig(), "t").tests[0]
    raw = C.compare_features(ref, cur, feat, DriftConfig(ks_min_statistic=0.0), "t").tests[0]
    assert floored.p_adjusted < ALPHA and not floored.drifted and "effect" in floored.decision
    assert raw.drifted


def _failed_copies(records: list[dict]) -> list[dict]:
    """The same episodes (same tools, calls, lengths) with the outcome turned to failure: only the answer key differs."""
    out = []
    for r in records:
        comps = {**r["components"], "correctness": 0.0}
        out.append({**r, "success": False, "components": comps, "return": r["return"] - r["components"]["correctness"]})
    return out


def test_behaviour_check_gates_on_what_the_policy_does_and_reports_outcomes(episodes):
    _, expert, rand = episodes
    reference, same_acts_failed = expert * 2, _failed_copies(expert) * 2
    report = C.trajectory_drift(reference, same_acts_failed, DriftConfig(alpha=ALPHA))
    d = report.to_dict()
    assert report.passed and d["status"] == "pass"  # nothing the policy did changed
    assert {"success", "correctness", "return"} <= set(d["outcomes"]["drifted_features"])  # ...but it is reported
    assert d["outcomes"]["gated"] is False and not {"success", "return", "correctness"} & set(d["features"])
    assert "reported, not gated" in report.describe()
    gated = C.trajectory_drift(reference, same_acts_failed, DriftConfig(alpha=ALPHA, trajectory_outcomes="test"))
    assert not gated.passed and "success" in gated.drifted_features and "outcomes" not in gated.to_dict()
    acted = C.trajectory_drift(reference, rand * 2, DriftConfig(alpha=ALPHA))  # random actions: behaviour drift
    assert not acted.passed and {"tool_sequence", "n_failed"} & set(acted.drifted_features), acted.describe()
    with pytest.raises(ValueError, match="trajectory_outcomes"):
        DriftConfig(trajectory_outcomes="ignore")


def test_config_rejects_unknown_features_and_bad_callables():
    with pytest.raises(ValueError, match="unknown features \\['levle'\\]"):
        DriftConfig(skip_features=["levle"])
    with pytest.raises(ValueError, match="module:function"):
        DriftConfig(serving_preprocess="render_context")
    assert DriftConfig(skip_features=["level"]).skip_features == ["level"]


# --------------------------------------------------------------------------------- fires on drift, quiet without it
def test_task_check_passes_on_two_fresh_reference_samples(reference, world):
    fresh = C.make_reference_sample(world, N, seed=102)
    report = C.task_drift(reference.tasks, fresh.tasks, world, fresh.world)
    assert report.passed, report.describe()
    assert len(report.tested) == len(task_feature_specs(world))


@pytest.mark.parametrize("kind, expected", [("level_shift", {"level", "family"}), ("value_shift", {"entity_price"})])
def test_task_check_fails_on_the_documented_drifted_datasets(reference, world, kind, expected):
    drifted = C.make_drifted_tasks(world, N, kind, seed=103)
    report = C.task_drift(reference.tasks, drifted.tasks, world, drifted.world)
    assert not report.passed
    assert expected <= set(report.drifted_features), report.describe()


def test_false_alarm_rate_over_repeated_fresh_samples(world, capsys):
    fresh = lambda seed: C.make_reference_sample(world, N, seed).tasks  # noqa: E731
    pairs = ((fresh(1000 + 2 * k), fresh(1001 + 2 * k)) for k in range(FA_REPEATS))
    fa = C.false_alarm_rate(pairs, lambda a, b: C.task_drift(a, b, world, world, DriftConfig(alpha=ALPHA)))
    with capsys.disabled():
        print(f"\n[drift] task check false-alarm rate: {fa.alarms}/{fa.repeats} = {fa.rate:.2f} "
              f"(alpha {ALPHA}, Bonferroni, {N} vs {N} tasks; bound {FA_BOUND}); by feature {fa.alarms_by_feature}")
    assert fa.repeats == FA_REPEATS and fa.rate <= FA_BOUND


@pytest.mark.parametrize("built, other", [
    (ShopOptions(train_wordings=8, wordings="templates"), ShopOptions(train_wordings=4, wordings="templates")),
    (ShopOptions(wordings="grammar"), ShopOptions(wordings="templates")),
])
def test_calibration_samples_use_the_builds_wordings(world, built, other):
    """With eight fixed wordings, or the grammar's, the reference tasks use them; the false-alarm calibration must draw
    its fresh samples the same way, or the `template` feature alarms on every repeat."""
    from pipeline.check_drift.main import run_checks

    mix = {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}
    ref = C.make_reference_sample(world, N, 101, mix, options=built).tasks
    cur = C.make_reference_sample(world, N, 102, mix, options=built).tasks
    assert {t["template_id"].split("/")[1] for t in ref} >= ({"5", "6", "7", "8"} if built.train_wordings == 8
                                                             else {"9", "10", "11"})
    right = run_checks(DriftConfig(alpha=ALPHA), EnvConfig(), mix, built, ref, cur, world, world)
    assert right["checks"]["task_drift"]["status"] == "pass"
    assert right["checks"]["calibration"]["status"] == "pass", right["checks"]["calibration"]
    wrong = run_checks(DriftConfig(alpha=ALPHA), EnvConfig(), mix, other, ref, cur, world, world)["checks"]["calibration"]
    assert wrong["status"] == "fail" and "template" in wrong["alarms_by_feature"]


def test_unknown_drift_kind_lists_the_kinds(world):
    with pytest.raises(ValueError, match="kinds are \\['level_shift', 'value_shift'\\]"):
        C.make_drifted_tasks(world, 10, "price_shift", seed=0)


# ------------------------------------------------------------------------------------------------------- MMD test
def test_mmd_statistic_matches_the_kernel_block_means_and_is_deterministic():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 4)), rng.normal(size=(20, 4))
    r = C.mmd_test(x, y, permutations=99, seed=3)
    z = np.vstack([x, y])
    d2 = ((z[:, None] - z[None]) ** 2).sum(-1)
    k = np.exp(-d2 / (2 * np.median(np.sqrt(d2[np.triu_indices(50, 1)])) ** 2))
    looped = k[:30, :30].mean() + k[30:, 30:].mean() - 2 * k[:30, 30:].mean()
    assert r.statistic == pytest.approx(looped, rel=1e-9)
    assert r == C.mmd_test(x, y, permutations=99, seed=3)
    assert 1 / 100 <= r.p_value <= 1


def test_mmd_detects_a_mean_shift_and_not_a_fresh_draw():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 8))
    assert C.mmd_test(x, rng.normal(size=(200, 8)), permutations=200).passed
    shifted = C.mmd_test(x, rng.normal(0.5, 1, size=(200, 8)), permutations=200)
    assert shifted.drifted and shifted.p_value == pytest.approx(1 / 201)


def test_hidden_states_batched_equal_one_at_a_time(tiny_lm, reference):
    model, tok = tiny_lm
    contexts = observation_contexts(reference.tasks[:6], None, 6, SIGS)
    batched = hidden_state_features(model, tok, contexts, batch_size=4)
    single = np.stack([hidden_state_features(model, tok, [c], share_prefix=False)[0] for c in contexts])
    assert batched.shape == (6, 32)
    np.testing.assert_allclose(batched, single, atol=1e-5)


def test_shared_prefix_path_equals_the_plain_forward(tiny_lm, episodes):
    from pipeline.check_drift.features import default_encode, hidden_states_from_ids, shared_prefix_length

    model, tok = tiny_lm
    tasks, expert, rand = episodes
    contexts = observation_contexts(tasks, expert[:5] + rand[:5], 6, SIGS)  # every step: different lengths and histories
    ids = [default_encode(tok, c) for c in contexts]
    assert shared_prefix_length(ids) >= 16  # the system prompt and tool list
    shared = hidden_states_from_ids(model, ids, batch_size=8, share_prefix=True)
    plain = hidden_states_from_ids(model, ids, batch_size=8, share_prefix=False)
    np.testing.assert_allclose(shared, plain, atol=1e-5)


def test_state_check_false_alarm_rate_over_repeated_fresh_samples(tiny_lm, reference, world, capsys):
    model, tok = tiny_lm
    ref = hidden_state_features(model, tok, observation_contexts(reference.tasks, None, 6, SIGS))
    fresh = [C.make_reference_sample(world, 40, 2000 + k) for k in range(FA_REPEATS)]
    embedded = [hidden_state_features(model, tok, observation_contexts(f.tasks, None, 6, SIGS)) for f in fresh]
    fa = C.false_alarm_rate(((ref, x) for x in embedded), lambda a, b: C.mmd_test(a, b, permutations=200, seed=1))
    with capsys.disabled():
        print(f"\n[drift] hidden-state MMD false-alarm rate: {fa.alarms}/{fa.repeats} = {fa.rate:.2f} "
              f"(alpha {ALPHA}, {len(ref)} vs 40 observations; bound {FA_BOUND})")
    assert fa.rate <= FA_BOUND


def test_state_check_quiet_on_fresh_samples_fires_on_level_shift(tiny_lm, reference, world, capsys):
    model, tok = tiny_lm
    cfg = DriftConfig(max_hidden_samples=N, mmd_permutations=200)
    ctx = lambda s: observation_contexts(s.tasks, None, 6, SIGS)  # noqa: E731
    fresh = C.state_drift(model, tok, ctx(reference), ctx(C.make_reference_sample(world, N, 102)), cfg)
    drifted = C.state_drift(model, tok, ctx(reference), ctx(C.make_drifted_tasks(world, N, "level_shift", 103)), cfg)
    with capsys.disabled():
        print(f"\n[drift] hidden-state MMD: fresh p={fresh.p_value:.3f}, level_shift p={drifted.p_value:.4f}")
    assert fresh.passed and drifted.drifted


# ---------------------------------------------------------------------------------------------------- consistency
ALTERED = SYSTEM_TEMPLATE.replace("tools.", "tools;", 1)  # one character changed


def altered_serving(question, signatures, history, window):
    """A serving path with its own copy of the template, one character different."""
    text = render_context(question, signatures, history, window)
    header = render_header(question, signatures)
    return ALTERED.format(tool_list=" ".join(signatures)) + f"\nTask: {question}\n" + text[len(header):]


@pytest.fixture(scope="module")
def probes(episodes):
    tasks, expert, _ = episodes
    return probes_from_episodes(tasks, expert, window=2, n=24, seed=0, signatures=SIGS)


def test_probes_include_folded_histories(probes):
    assert len(probes) == 28
    assert any("State: earlier calls" in render_context(*p.args()) for p in probes)


def test_identical_paths_pass(probes, tiny_lm):
    model, tok = tiny_lm
    report = check_consistency(probes, render_context, render_context, model, tok, mse_threshold=1e-8)
    assert report.passed and report.tokens_identical and report.hidden_mse_max == 0.0, report.describe()


def test_one_changed_character_in_the_serving_template_fails(probes, tiny_lm):
    model, tok = tiny_lm
    report = check_consistency(probes, render_context, altered_serving, model, tok, mse_threshold=1e-6)
    assert not report.passed and not report.prompts_identical
    m = report.mismatch
    assert (m.index, m.stage, m.position) == (0, "prompt", SYSTEM_TEMPLATE.index("tools.") + 5)
    assert "use tools. Available" in m.train and "use tools; Available" in m.serve
    assert "probe 0: prompt differ at character 35" in report.describe()
    with pytest.raises(AgentRLError, match="train/serve paths differ"):
        report.raise_if_failed()
    assert not check_consistency(probes, render_context, altered_serving).passed  # prompts alone catch it too


def test_different_tokenization_or_serving_weights_fail_at_their_stage(probes, tiny_lm):
    model, tok = tiny_lm
    no_bos = lambda t, text: t.encode(text, add_special_tokens=False)  # noqa: E731
    report = check_consistency(probes, model=model, tokenizer=tok, serve_encode=no_bos)
    assert report.prompts_identical and report.mismatch.stage == "tokens" and report.mismatch.position == 0
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    report = check_consistency(probes, model=model, tokenizer=tok, serve_model=noisy, mse_threshold=1e-6)
    assert report.tokens_identical and report.mismatch.stage == "hidden" and report.hidden_mse_max > 1e-6


def test_probe_from_a_mapping():
    probe = {"question": "What is the price of 'Blue Lamp'?", "history": [], "window": 6, "tool_signatures": SIGS}
    assert check_consistency([probe]).passed


# --------------------------------------------------------------------------------------------------- GX suites
@pytest.fixture(scope="module")
def rollout_like(episodes, tiny_lm):
    """Expert episodes with the token fields a rollout adds (ids, mask, log-probabilities, segments)."""
    from pipeline.policy.tokenizer import encode_turns

    tasks, expert, _ = episodes
    _, tok = tiny_lm
    questions = {t["task_id"]: t["question"] for t in tasks}
    out = []
    for r in expert[:8]:
        context = render_context(questions[r["task_id"]], SIGS, [], 6)
        ids, mask = encode_turns(tok, context, [(s["action"], s["observation"]) for s in r["steps"]])
        out.append({**copy.deepcopy(r), "token_ids": ids, "action_mask": mask,
                    "logprobs": [-0.5 * m for m in mask], "segments": [0]})
    return out


@pytest.fixture(autouse=True, scope="module")
def _episode_suites_registered():
    from pipeline.envs.shop.suites import register_suites

    register_suites()


def _failed(report) -> dict[str, list]:
    return {r["kwargs"].get("column"): r["unexpected_rows"] for r in report.failures}


def test_valid_rollouts_and_evaluation_records_pass(rollout_like, episodes):
    _, expert, rand = episodes
    assert validate_records(rollout_like, "trajectories", "rollouts", require_tokens=True).success
    report = validate_records(expert + rand, "evaluation", "eval")
    assert report.success, report.describe()


def test_trajectory_suite_catches_mask_and_tool_call_defects(rollout_like):
    bad = copy.deepcopy(rollout_like)
    bad[1]["action_mask"] = bad[1]["action_mask"][:-1]  # one entry short
    bad[2]["action_mask"] = [2 if m else 0 for m in bad[2]["action_mask"]]  # not 0/1
    bad[3]["action_mask"] = [0] * len(bad[3]["action_mask"])  # no sampled token
    bad[4]["steps"][0]["action"] = bad[4]["steps"][0]["action"].replace("}", "", 1)  # JSON broken, outcome ok
    bad[5]["calls"][0]["params"] = {"name": "Another Product", "field": "price"}  # log disagrees with the text
    bad[6]["answer"] = " "  # answered, but blank
    bad[7]["return"] = 9.0
    report = validate_records(bad, "trajectories", "rollouts")
    failed = _failed(report)
    tokens = {row["row"]: row["token_problem"] for row in failed["token_problem"]}
    assert tokens[1] == f"len(action_mask)={len(bad[1]['token_ids']) - 1} != len(token_ids)={len(bad[1]['token_ids'])}"
    assert "other than 0 and 1" in tokens[2] and "no 1" in tokens[3]
    calls = {row["row"]: row["call_problem"] for row in failed["call_problem"]}
    assert set(calls) == {4, 5} and "not a valid call" in calls[4] and "call log records" in calls[5]
    assert [row["row"] for row in failed["answer_problem"]] == [6]
    assert [row["row"] for row in failed["return"]] == [7]
    assert "token_problem" in report.describe()


def test_require_tokens_refuses_records_without_them(episodes):
    _, expert, _ = episodes
    report = validate_records(expert[:3], "trajectories", "rollouts", require_tokens=True)
    assert _failed(report).keys() == {"has_tokens"}


# ----------------------------------------------------------------------------------------------------- the phase
@pytest.fixture
def project(tmp_path, monkeypatch, world):
    """A project folder with build_env-shaped data (world, train/validation tasks) and a params.yaml."""
    write_world(world.world, tmp_path / "data" / "env")
    runtime = ShopWorld(world.world)
    from pipeline.envs.shop.tasks import generate_tasks

    mix = {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}
    for split, n in (("train", 400), ("validation", 120)):
        tasks = generate_tasks(world.world, split, n, mix, 0, solver=lambda p, a: runtime.solve(p, a),
                               train_wordings=ShopOptions().train_wordings, grammar=ShopOptions().wordings == "grammar")
        write_tasks(tasks, tmp_path / "data" / "tasks" / f"{split}.jsonl")
    runtime.close()
    params = {"check_drift": {"false_alarm_repeats": 5, "false_alarm_sample_size": 100}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _verdict(root: Path) -> dict:
    return json.loads((root / "metrics" / "drift.json").read_text())


def test_phase_passes_on_the_validation_split_and_writes_the_verdict(project):
    from pipeline.check_drift.main import main

    verdict = main()
    assert verdict == _verdict(project)
    c = verdict["checks"]
    assert verdict["passed"] and c["task_drift"]["status"] == "pass" and c["consistency"]["status"] == "pass"
    assert c["calibration"]["repeats"] == 5 and c["calibration"]["rate"] <= FA_BOUND
    assert c["state_drift"]["status"] == "skipped" and "no policy" in c["state_drift"]["reason"]
    assert verdict["inputs"]["current"] == ["data/tasks/validation.jsonl"]


def test_phase_fails_on_drifted_incoming_tasks(project, world):
    from pipeline.check_drift.main import main

    drifted = C.make_drifted_tasks(world, 150, "level_shift", seed=5, split="validation")
    (project / "data" / "incoming").mkdir()
    write_tasks([Task.from_dict(t) for t in drifted.tasks], project / "data" / "incoming" / "batch-001.jsonl")
    verdict = main()
    assert not verdict["passed"] and "task_drift" in verdict["failed_checks"]
    assert "level" in verdict["checks"]["task_drift"]["drifted_features"]
    assert verdict["inputs"]["current"] == ["data/incoming/batch-001.jsonl"]


@pytest.mark.parametrize("content, message", [
    ("", "no tasks in file"),
    ("five", "too few to test"),  # five valid tasks
    ('{"task_id": "x"}\n', "missing keys"),
    (None, "expect_column_values_to_be_in_set"),  # a schema break: level 9
])
def test_phase_refuses_bad_current_data_and_does_not_leave_a_pass(project, content, message):
    from pipeline.check_drift.main import main

    path = project / "data" / "incoming" / "bad.jsonl"
    path.parent.mkdir()
    rows = [json.loads(line) for line in (project / "data/tasks/validation.jsonl").read_text().splitlines()]
    if content is None:
        rows[2]["level"] = 9
        content = "".join(json.dumps(r) + "\n" for r in rows)
    elif content == "five":
        content = "".join(json.dumps(r) + "\n" for r in rows[:5])
    path.write_text(content)
    (project / "metrics").mkdir()
    (project / "metrics" / "drift.json").write_text('{"passed": true, "verdict": "pass"}')  # a stale pass
    with pytest.raises(AgentRLError, match=message):
        main()
    verdict = _verdict(project)
    assert verdict["passed"] is False and verdict["verdict"] == "error" and message.split()[0] in verdict["error"]


def test_phase_with_a_policy_runs_every_check(project, tiny_lm):
    from pipeline.check_drift.main import main
    from pipeline.policy.model import save_policy

    model, tok = tiny_lm
    save_policy(model, tok, project / "models" / "policy", meta={"phase": "test"})
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["env"] = {"max_steps": 3}
    params["rollout"] = {"max_new_tokens": 12, "batch_size": 8}
    params["check_drift"].update({"max_rollout_episodes": 8, "max_hidden_samples": 40, "mmd_permutations": 99,
                                  "consistency_probes": 8, "min_samples": 4})
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    verdict = main()
    c = verdict["checks"]
    assert verdict["inputs"]["n_reference_episodes"] == 8 and verdict["inputs"]["n_current_episodes"] == 8
    assert c["trajectory_suite"]["status"] == "pass", c["trajectory_suite"]["message"]
    assert c["consistency"]["status"] == "pass" and c["consistency"]["tokens_identical"]
    # the fp32 policy against itself is no hidden-state check: the served model's is deploy's (served_check)
    assert c["consistency"]["hidden_mse_max"] is None and "deploy" in c["consistency"]["served_model"]
    assert c["state_drift"]["status"] in ("pass", "fail") and c["state_drift"]["n_reference"] <= 40
    assert c["trajectory_drift"]["status"] in ("pass", "fail") and c["trajectory_drift"]["n_tests"] >= 5


# ------------------------------------------------------------------------------------------- the phase's switches
def _set_params(root: Path, **check_drift) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["check_drift"].update(check_drift)
    (root / "params.yaml").write_text(yaml.safe_dump(params))


def test_fail_on_drift_fails_the_phase_after_writing_the_verdict_and_passes_without_drift(project, world):
    """`check_drift.fail_on_drift`: a failed check makes the phase a user error (AgentRLError: exit 2 at the CLI)
    naming the failed checks, and metrics/drift.json still holds the full verdict; a verdict that passes does not."""
    from pipeline.check_drift.main import main

    _set_params(project, fail_on_drift=True, false_alarm_repeats=0)
    assert main()["passed"]  # the validation split: no drift, no error
    drifted = C.make_drifted_tasks(world, 150, "level_shift", seed=5, split="validation")
    (project / "data" / "incoming").mkdir()
    write_tasks([Task.from_dict(t) for t in drifted.tasks], project / "data" / "incoming" / "batch-001.jsonl")
    with pytest.raises(AgentRLError, match=r"check_drift: checks failed: .*task_drift.* \(see metrics/drift.json\)"):
        main()
    verdict = _verdict(project)  # written before the phase failed: the verdict, not an error record
    assert verdict["verdict"] == "fail" and verdict["passed"] is False and "task_drift" in verdict["failed_checks"]
    assert "level" in verdict["checks"]["task_drift"]["drifted_features"]


@pytest.fixture
def expert_and_random_episodes(project, world):
    """Expert episodes on 60 training tasks (the reference behaviour, written as the demonstrations file) and expert
    and random episodes on 40 validation tasks (for current-episode files)."""
    from pipeline.envs.taskfile import load_task_file

    runtime = ShopWorld(world.world)
    tasks = {s: load_task_file(project / "data" / "tasks" / f"{s}.jsonl", runtime, validate=False)
             for s in ("train", "validation")}
    try:
        _, reference = evaluate("expert", tasks["train"][:60], runtime, EnvConfig())
        _, expert = evaluate("expert", tasks["validation"][:40], runtime, EnvConfig())
        _, rand = evaluate("random", tasks["validation"][:40], runtime, EnvConfig())
    finally:
        runtime.close()
    demos = project / "data" / "demos" / "train.jsonl"
    demos.parent.mkdir(parents=True)
    demos.write_text("".join(json.dumps(r) + "\n" for r in reference))
    return expert, rand


def _write_episodes(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_current_trajectories_are_read_from_the_file(project, expert_and_random_episodes):
    """`check_drift.current_trajectories`: with no policy to roll out, the behaviour check compares the reference
    episodes with the file's episodes (all of them), fires when the file holds other behaviour, and refuses a file
    that breaks the "trajectories" suite."""
    from pipeline.check_drift.main import main

    expert, rand = expert_and_random_episodes
    same = _write_episodes(project / "expert.jsonl", expert[:30])
    other = _write_episodes(project / "random.jsonl", rand)
    _set_params(project, current_trajectories=same, false_alarm_repeats=0)
    verdict = main()
    traj = verdict["checks"]["trajectory_drift"]
    assert verdict["inputs"]["current_episodes"] == same and verdict["inputs"]["n_current_episodes"] == 30
    assert verdict["inputs"]["n_reference_episodes"] == 60 and traj["reference"] == "data/demos/train.jsonl"
    assert traj["status"] == "pass" and traj["current"] == same and traj["n_tests"] >= 2
    tested = {k: f for k, f in traj["features"].items() if f["test"] != "skipped"}
    assert "tool_sequence" in tested and {(f["n_reference"], f["n_current"]) for f in tested.values()} == {(60, 30)}

    _set_params(project, current_trajectories=other)
    traj = main()["checks"]["trajectory_drift"]
    assert traj["status"] == "fail" and traj["current"] == other
    assert {"tool_sequence", "n_failed"} & set(traj["drifted_features"]), traj["drifted_features"]

    bad = copy.deepcopy(expert[:30])
    bad[4]["return"] = 9.0
    _set_params(project, current_trajectories=_write_episodes(project / "bad.jsonl", bad))
    with pytest.raises(AgentRLError, match="bad.jsonl") as err:
        main()
    assert "return" in str(err.value) and _verdict(project)["verdict"] == "error"


def test_current_world_dir_gives_the_current_tasks_entity_values(project, world):
    """`check_drift.current_world_dir`: the current tasks' entity features are read from that world. Tasks on a copy of
    the world with every price redrawn show price drift only when the check reads the copy; a missing world is
    refused."""
    from pipeline.check_drift.main import main

    shifted = C.make_drifted_tasks(world, 150, "value_shift", seed=5, split="validation")
    write_world(shifted.world.world, project / "data" / "env-current")
    (project / "data" / "incoming").mkdir()
    write_tasks([Task.from_dict(t) for t in shifted.tasks], project / "data" / "incoming" / "batch-001.jsonl")
    _set_params(project, false_alarm_repeats=0)

    price = lambda v: v["checks"]["task_drift"]["features"]["entity_price"]  # noqa: E731
    same_world = main()
    assert price(same_world)["test"] == "ks" and not price(same_world)["drifted"]  # reference prices, same entities
    _set_params(project, current_world_dir="data/env-current")
    other_world = main()
    assert price(other_world)["drifted"] and "entity_price" in other_world["checks"]["task_drift"]["drifted_features"]
    assert price(other_world)["n_current"] == price(same_world)["n_current"]  # the same entities, other values
    assert other_world["inputs"]["unknown_current_entities"] == 0

    _set_params(project, current_world_dir="data/no-such-world")
    with pytest.raises(AgentRLError, match="no-such-world"):
        main()


def test_the_entity_features_are_the_numeric_columns_of_any_environments_table():
    import pandas as pd

    class Rooms:
        def entity_table(self):
            return pd.DataFrame({"seats": [10, 40, 25], "floor": [1.0, 2.0, 3.0], "wing": ["a", "b", "a"],
                                 "open": [True, False, True]}, index=["Blue Hall", "Red Annex", "Loft"])

    specs = task_feature_specs(Rooms())
    assert [k for k, f in specs.items() if f.unit == "entity"] == ["entity_seats", "entity_floor"]
    tasks = [{"family": "f", "level": 1, "question": "q", "answer": "1", "entities": ["Blue Hall", "Loft"]},
             {"family": "f", "level": 1, "question": "q", "answer": "2", "entities": ["Blue Hall"]}]
    feats = task_features(tasks, Rooms())
    assert sorted(feats["entity_seats"].tolist()) == [10.0, 25.0]  # each distinct entity once
