"""The drift verdict's family-wise rule: Holm across the statistical checks at one level (known p-values give a known
verdict), the calibration's binomial test, split-sized fresh draws, one hidden-state observation per episode, and the
whole verdict quiet on drift-free data across seeds while it still fires on a shift.

Runs on a shop world of build_env's default size with small samples; the false-alarm rate and power at full size are
measured by bench/drift_calibration.py (docs/reliability.md).
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from scipy import stats

from pipeline.check_drift import checks as C
from pipeline.check_drift import verdict as V
from pipeline.check_drift.config import DriftConfig
from pipeline.check_drift.features import observation_contexts
from pipeline.check_drift.main import run_checks
from pipeline.envs.config import EnvConfig
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.environment import ShopOptions
from pipeline.envs.shop.world import generate_world

MIX = {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25}
SIGS = [s.signature() for s in ShopWorld.default().tools()]


@pytest.fixture(scope="module")
def world():
    return ShopWorld(generate_world(0, n_products=400, n_suppliers=80, heldout_fraction=0.3))  # build_env's defaults


def test_doctests():
    assert doctest.testmod(V).failed == 0


# ------------------------------------------------------------------------------------------- the family-wise rule
@pytest.mark.parametrize("p, rejected", [
    ({"a": 0.004, "b": 0.03, "c": 0.5}, set()),           # 3 x 0.004 > 0.01: alone, a would have failed
    ({"a": 0.003, "b": 0.006, "c": 0.5}, {"a"}),          # 3 x 0.003 = 0.009, then 2 x 0.006 = 0.012 > 0.01
    ({"a": 0.002, "b": 0.004, "c": 0.5}, {"a", "b"}),     # 0.006, 0.008, then 0.5 > 0.01
    ({"a": 0.001, "b": 0.001, "c": 0.001}, {"a", "b", "c"}),
    ({"a": 0.01, "b": 0.01}, set()),                      # 2 x 0.01 > 0.01
    ({"a": 0.01}, {"a"}),                                 # one check: its own level, p <= alpha
])
def test_holm_known_p_values_give_the_known_verdict(p, rejected):
    decisions = V.holm(p, 0.01)
    assert {k for k, d in decisions.items() if d.rejected} == rejected
    for d in decisions.values():
        assert d.rejected == (d.p_holm <= 0.01) == (d.p_value <= d.level)  # one rule, three readings
        assert d.family_size == len(p) and d.p_holm >= d.p_value


def test_holm_controls_the_family_wise_rate_on_uniform_p_values_and_rejects_all_bonferroni_does():
    rng = np.random.default_rng(0)
    k, alpha = 5, 0.05
    p = rng.uniform(size=(4000, k))  # five valid checks on drift-free data, independent (the hardest case for Holm)
    fired = sum(any(d.rejected for d in V.holm(dict(enumerate(row)), alpha).values()) for row in p)
    per_check = float((p <= alpha).any(axis=1).mean())  # each check at alpha on its own
    assert fired / 4000 <= alpha + 3 * np.sqrt(alpha * (1 - alpha) / 4000)
    assert per_check > 3 * alpha  # what the verdict did before: about 1 - 0.95^5 = 0.23
    for row in rng.uniform(0, 0.03, size=(200, k)):
        holm = {i for i, d in V.holm(dict(enumerate(row)), alpha).items() if d.rejected}
        assert {i for i, x in enumerate(row) if x * k <= alpha} <= holm


def test_holm_refuses_bad_p_values_and_levels():
    with pytest.raises(ValueError, match="p-values must lie in"):
        V.holm({"a": 1.5}, 0.01)
    with pytest.raises(ValueError, match="alpha must be in"):
        V.holm({"a": 0.5}, 0.0)
    with pytest.raises(ValueError, match="not statistical checks"):
        V.combine({"consistency": C.MMDResult(0.0, 0.5, 1.0, 2, 2, 99, 0.01)}, 0.01)


def _report(name: str, p_adjusted: dict[str, float], effect: float = 0.5) -> C.DriftReport:
    tests = [C.FeatureTest(f, "continuous", "ks", 400, 400, effect, effect, p, p, floor=0.1)
             for f, p in p_adjusted.items()]
    return C.DriftReport(name, 0.01, "bonferroni", tests)


def test_the_verdict_applies_the_rule_to_real_check_results():
    """Run 18's case: a hidden-state p-value of 0.008 failed the verdict at 0.01 on its own. Judged in a family of
    four it passes; a p-value that clears the family's first step still fails, and names its check."""
    from pipeline.check_drift.main import _judge

    def verdict(mmd_p: float) -> dict:
        statistical = {"task_drift": _report("task_drift", {"level": 0.3, "family": 0.02}),
                       "trajectory_drift": _report("trajectory_drift", {"n_calls": 0.6}),
                       "calibration": C.FalseAlarmRate(20, 0, {}, 0.01),
                       "state_drift": C.MMDResult(0.01, mmd_p, 1.0, 200, 200, 2000, 0.01)}
        return _judge(statistical, {}, {"consistency": {"status": "pass"}}, 0.01)

    quiet = verdict(0.008)
    assert V.overall(quiet) == (True, [])
    assert quiet["state_drift"]["family"] == {"p_value": 0.008, "p_holm": 0.032, "level": 0.0025, "rejected": False,
                                              "family_size": 4}
    assert quiet["task_drift"]["family"]["p_value"] == 0.02 and quiet["task_drift"]["drifted_features"] == []
    loud = verdict(0.002)
    assert V.overall(loud) == (False, ["state_drift"])
    assert loud["state_drift"]["status"] == "fail" and loud["state_drift"]["alpha"] == 0.0025
    assert list(loud) == ["consistency", "task_drift", "calibration", "trajectory_drift", "state_drift"]


def test_a_failed_check_lists_the_features_that_carried_it_at_its_level():
    report = _report("task_drift", {"level": 0.0001, "family": 0.004, "template": 0.2})
    assert report.p_value == 0.0001
    assert report.at_level(0.005).drifted_features == ["level", "family"]
    assert report.at_level(0.0025).drifted_features == ["level"]
    tiny = _report("task_drift", {"level": 0.0001}, effect=0.05)  # significant, under the floor: never gates
    assert tiny.p_value == 1.0 and not tiny.at_level(0.01).drifted_features
    assert "effect 0.050 < floor 0.1" in tiny.at_level(0.01).tests[0].decision


def test_calibration_p_value_is_the_binomial_tail_and_gates_only_through_the_rule():
    fa = C.FalseAlarmRate(20, 2, {"family": 2}, nominal=0.01)
    assert fa.p_value == pytest.approx(stats.binom.sf(1, 20, 0.01))  # P(X >= 2) = 0.0169
    assert C.FalseAlarmRate(20, 0, {}, 0.01).p_value == 1.0
    assert fa.passed and not fa.at_level(0.02).passed and fa.at_level(0.01).passed
    six = C.FalseAlarmRate(20, 6, {"family": 6}, 0.01)  # the SQL analyst's 0.30: far more than its level allows
    assert six.p_value < 1e-6 and not six.at_level(0.0025).passed


def test_per_environment_group_is_bonferroni_across_environments():
    group = V.PerEnvironment({"a": _report("task_drift", {"level": 0.002}), "b": _report("task_drift", {"x": 0.5})},
                             {"c": "no current tasks of c"})
    assert group.p_value == pytest.approx(0.004)
    judged = group.at_level(0.005)  # each environment at 0.0025
    assert judged.to_dict()["drifted"] == ["a"] and judged.to_dict()["environments"]["c"]["status"] == "skipped"
    assert group.at_level(0.003).to_dict()["drifted"] == []


# -------------------------------------------------------------------------------- samples and observations
def test_split_sized_draws_keep_a_uniform_subsample_of_the_split_sized_draw(world):
    whole = C.make_reference_sample(world, 300, seed=41, level_mix=MIX).tasks
    part = C.make_reference_sample(world, 60, seed=41, level_mix=MIX, drawn_as=300)
    assert len(part.tasks) == 60 and "of 300" in part.description
    ids = [t["task_id"] for t in whole]
    assert [ids.index(t["task_id"]) for t in part.tasks] == sorted(ids.index(t["task_id"]) for t in part.tasks)
    assert all(t in whole for t in part.tasks)
    assert max(ids.index(t["task_id"]) for t in part.tasks) >= 60  # drawn from the whole draw, not its head


def test_hidden_state_observations_are_one_step_per_episode():
    tasks = [{"task_id": f"t{i}", "question": f"question {i}?"} for i in range(5)]
    episodes = [{"task_id": f"t{i}", "steps": [{"action": f"a{i}{j}", "observation": f"o{i}{j}"} for j in range(3)]}
                for i in range(5)] + [{"task_id": "unknown", "steps": [{"action": "a", "observation": "o"}]}]
    every = observation_contexts(tasks, episodes, 6, SIGS)
    one = observation_contexts(tasks, episodes, 6, SIGS, np.random.default_rng(0))
    assert len(every) == 15 and len(one) == 5
    assert all(c in every[3 * i: 3 * i + 3] for i, c in enumerate(one))  # each from its own episode


# ---------------------------------------------------------------------------------------------- the whole verdict
def test_the_verdict_stays_quiet_on_drift_free_data_across_seeds_and_fires_on_a_shift(world):
    """Five seeds of drift-free current data (tiny samples) and one shifted: the family rule's verdict passes all five
    and fails the shift on the task check. Each statistical check carries its family decision."""
    opts = ShopOptions()
    reference = C.make_reference_sample(world, 400, seed=0, level_mix=MIX, options=opts).tasks
    for seed in range(5):
        cfg = DriftConfig(seed=seed, false_alarm_repeats=2, false_alarm_sample_size=80)
        current = C.make_reference_sample(world, 80, 500 + seed, MIX, options=opts, drawn_as=400)
        v = run_checks(cfg, EnvConfig(), MIX, opts, reference, current.tasks, world, world)
        assert v["passed"], (seed, {k: c.get("family") for k, c in v["checks"].items()})
        assert v["family_rule"] == {"alpha": 0.01, "rule": "holm", "checks": ["calibration", "task_drift"]}
        assert v["checks"]["task_drift"]["family"]["family_size"] == 2
        assert v["checks"]["calibration"]["drawn_as"] == 400
    shifted = C.make_drifted_tasks(world, 80, "level_shift", 600, MIX, options=opts)
    v = run_checks(DriftConfig(false_alarm_repeats=2, false_alarm_sample_size=80), EnvConfig(), MIX, opts, reference,
                   shifted.tasks, world, world)
    assert not v["passed"] and v["failed_checks"] == ["task_drift"]
    assert "level" in v["checks"]["task_drift"]["drifted_features"]
    assert v["checks"]["task_drift"]["family"]["rejected"] is True


def test_a_calibration_the_generator_cannot_draw_is_one_clear_error(world):
    """The calibration draws as many fresh tasks as the reference split holds; a generator that cannot (here: a level
    mix it has no tasks for) stops the phase with one message that says what to set, not a traceback."""
    from pipeline.core.errors import AgentRLError

    reference = C.make_reference_sample(world, 100, seed=0, level_mix=MIX).tasks
    with pytest.raises(AgentRLError, match=r"cannot draw 100 fresh tasks as the reference split .*; set "
                                           r"check_drift.false_alarm_repeats: 0"):
        run_checks(DriftConfig(false_alarm_repeats=1), EnvConfig(), {9: 1.0}, ShopOptions(), reference,
                   reference[:40], world, world)
