"""Reward engineering in the learner (`train.reward.weighting`, pipeline/train/extensions/reward_weighting.py): the maths against
hand-computed values, the state through a checkpoint, bad config, and both dynamic modes inside the real tiny
training loop (weights and multipliers reported and moving, the learner's returns recomputed with them, a resumed run
continuing the state)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.core.config import ConfigError, parse_section
from pipeline.core.errors import AgentRLError
from pipeline.envs.config import EnvConfig, RewardWeights
from pipeline.train.extensions import reward_weighting as W
from pipeline.train.config import TrainConfig


def rec(c, e, s, u, ret=None, extra=None, demonstrated=False) -> dict:
    r = {"components": {"correctness": c, "efficiency": e, "safety": s, "user_experience": u},
         "return": ret if ret is not None else 0.0}
    if extra is not None:
        r["extra_reward"] = extra
    if demonstrated:
        r["demonstrated"] = True
    return r


# ------------------------------------------------------------------------------------------------- known answers
def test_shortfalls_and_softmax_weights_by_hand():
    assert W.shortfalls(np.array([0.25, -0.1, 0.0, 0.5])).tolist() == pytest.approx([0.75, 0.1, 0.0, 0.5])
    # softmax([ln 3, 0, 0, 0]) = [1/2, 1/6, 1/6, 1/6]; ×4 = [2, 2/3, 2/3, 2/3]; × α = [2, 1/3, 2/3, 1/15]
    w = W.softmax_weights(np.array([np.log(3.0), 0, 0, 0]), np.array([1.0, 0.5, 1.0, 0.1]), 1.0)
    assert w.tolist() == pytest.approx([2.0, 1 / 3, 2 / 3, 1 / 15])
    # τ = 0.5 halves nothing but doubles the exponent: softmax([2 ln 3, 0, 0, 0]) = [9/12, 1/12, 1/12, 1/12]
    w = W.softmax_weights(np.array([np.log(3.0), 0, 0, 0]), np.array([1.0, 0.5, 1.0, 0.1]), 0.5)
    assert w.tolist() == pytest.approx([3.0, 1 / 6, 1 / 3, 1 / 30])
    # equal shortfalls: the fixed weights exactly
    assert W.softmax_weights(np.full(4, 0.3), np.array([1.0, 0.5, 1.0, 0.1]), 0.1).tolist() == \
        pytest.approx([1.0, 0.5, 1.0, 0.1])


def test_weighted_and_lagrangian_returns_and_dual_ascent_by_hand():
    x = np.array([[1.0, -0.25, 0.0, 1.0], [0.0, -0.5, -1.0, 0.0]])
    counted = np.array([[True] * 4, [True, False, True, False]])  # on_success: the failed episode's shaped terms out
    # 1·1 + 0.5·(−0.25) + 0 + 0.1·1 = 0.975 ; 0 + 1·(−1) = −1
    assert W.weighted_returns(x, counted, np.array([1.0, 0.5, 1.0, 0.1])).tolist() == pytest.approx([0.975, -1.0])
    # λ = (2, 1) on (safety, efficiency) with b = (−0.01, −0.25):
    # episode 0: 1 + 2·(0 + 0.01) + 1·(−0.25 + 0.25) = 1.02 ; episode 1: 0 + 2·(−1 + 0.01) = −1.98 (efficiency out)
    g, cg = x[:, [2, 1]], counted[:, [2, 1]]
    out = W.lagrangian_returns(x[:, 0], 1.0, g, cg, np.array([2.0, 1.0]), np.array([-0.01, -0.25]))
    assert out.tolist() == pytest.approx([1.02, -1.98])
    # violated (−0.21 < −0.01): λ rises by 0.2; held (0 ≥ −0.25): λ falls by 0.25; nothing counted: unchanged;
    # projection at 0 and at λ_max
    lam = W.dual_ascent(np.array([1.0, 0.5, 2.0]), np.array([-0.21, 0.0, np.nan]), np.array([-0.01, -0.25, -0.1]),
                        1.0, 10.0)
    assert lam.tolist() == pytest.approx([1.2, 0.25, 2.0])
    assert W.dual_ascent(np.array([0.1, 9.9]), np.array([0.0, -1.0]), np.array([-0.5, 0.0]), 1.0, 10.0).tolist() \
        == pytest.approx([0.0, 10.0])


def test_component_matrix_follows_the_environments_shaping_rule():
    records = [rec(1, -0.25, 0, 1), rec(0, -0.5, -1, 0.5)]
    _, counted = W.component_matrix(records, "on_success")
    assert counted.tolist() == [[True] * 4, [True, False, True, False]]
    _, counted = W.component_matrix(records, "always")
    assert counted.all()
    with pytest.raises(AgentRLError, match="components"):
        W.component_matrix([{"return": 1.0}], "on_success")


# ----------------------------------------------------------------------------------------------------------- state
def test_softmax_state_moves_weight_to_the_weakest_component_and_adds_extra_reward():
    cfg = W.RewardConfig(weighting="softmax", temperature=1.0, window=4)
    rw = W.RewardWeighting(cfg, RewardWeights())  # α = (1, 0.5, 1, 0.1), on_success
    batch = [rec(1, 0.0, 0.0, 1.0, extra=0.5), rec(0, -0.5, -1.0, 0.0)]
    out, mets = rw.returns(batch)  # empty windows: α itself
    assert out.tolist() == pytest.approx([1 + 0.1 + 0.5, -1.0])
    assert mets["reward/w_correctness"] == 1.0 and mets["reward/w_user_experience"] == pytest.approx(0.1)
    rw.update([W.policy_components(batch + [rec(1, 0, 0, 1, demonstrated=True)], "on_success")])
    # windows: correctness [1, 0] -> Q 0.5; efficiency [0] -> 0; safety [0, −1] -> 0.5; user_experience [1] -> 0
    # (the demonstration is left out). softmax([.5, 0, .5, 0]) = [e^.5, 1, e^.5, 1] / (2e^.5 + 2)
    m = 4 * np.array([np.exp(0.5), 1, np.exp(0.5), 1]) / (2 * np.exp(0.5) + 2)
    assert rw.weights() == pytest.approx(np.array([1.0, 0.5, 1.0, 0.1]) * m)
    _, mets = rw.returns(batch)
    assert mets["reward/q_correctness"] == pytest.approx(0.5) and mets["reward/q_safety"] == pytest.approx(0.5)
    assert mets["reward/w_safety"] > 1.0 > mets["reward/w_efficiency"] / 0.5  # weight went to the weak components


def test_lagrange_state_and_its_checkpoint_round_trip():
    cfg = W.RewardConfig(weighting="lagrange", thresholds={"safety": -0.01}, lambda_lr=2.0)
    rw = W.RewardWeighting(cfg, RewardWeights(safety=1.0))
    batch = [rec(1, -0.5, 0.0, 1.0), rec(0, 0.0, -1.0, 0.0, extra=0.25)]
    out, mets = rw.returns(batch)  # λ_safety starts at α_safety = 1; user experience and efficiency not in it
    assert out.tolist() == pytest.approx([1 + 0.01, -0.99 + 0.25]) and mets["reward/lambda_safety"] == 1.0
    assert rw.update([W.policy_components(batch, "on_success")]) == {"reward/constraint_safety": -0.5}
    assert rw.lambdas.tolist() == pytest.approx([1.0 - 2.0 * (-0.5 + 0.01)])  # violated: rises to 1.98
    restored = W.RewardWeighting(cfg, RewardWeights(safety=1.0))
    restored.load_state_dict(json.loads(json.dumps(rw.state_dict())))
    assert restored.returns(batch)[0].tolist() == rw.returns(batch)[0].tolist()
    other = W.RewardWeighting(W.RewardConfig(weighting="softmax"), RewardWeights())
    with pytest.raises(AgentRLError, match="reward weighting is 'lagrange'"):
        other.load_state_dict(rw.state_dict())
    assert W.make_reward_weighting(W.RewardConfig(), RewardWeights()) is None  # fixed: no state at all


def test_with_turn_credit_the_reweighting_difference_is_paid_on_the_last_turn():
    """R' − R goes on the episode's last turn; the environment's step rewards keep their timing (γ = 1: the first
    turn's return is R')."""
    from pipeline.train.advantages import score_episodes
    from pipeline.train.sampling import make_learner_state

    cfg = parse_section(TrainConfig, {"algorithm": "rloo", "group_size": 2, "tasks_per_update": 1, "num_ranks": 1,
                                      "reward": {"weighting": "lagrange", "thresholds": {"safety": -0.01},
                                                 "credit": "turn"}}, "p:train")
    state = make_learner_state(cfg)
    weighting = W.ReturnWeighting.create(cfg, EnvConfig(reward=RewardWeights()), None)
    mask = [0, 1, 0, 1, 0, 1]
    # a refused write at turn 0 (safety −1 charged there), then a correct answer: R = 1 − 1 + 0.5·(−0.125) + 0.1·1
    a = {**rec(1, -0.125, -1.0, 1.0, ret=0.0375), "step_rewards": [-1.0, 0.0, 1.0375], "action_mask": mask,
         "group": 0}
    b = {**rec(0, 0.0, 0.0, 0.0, ret=0.0), "step_rewards": [0.0, 0.0, 0.0], "action_mask": mask, "group": 0}
    sc = score_episodes([a, b], cfg, state, extensions=[weighting])
    # λ_safety = 1: R'(a) = 1 + 1·(−1 + 0.01) = 0.01, R'(b) = 0 + 0.01 = 0.01; R' − R = −0.0275 and 0.01
    assert sc.scores.tolist() == pytest.approx([0.01, 0.01])
    assert sc.turn_rewards.flatten().tolist() == pytest.approx([-1.0, 0.0, 1.0375 - 0.0275, 0.0, 0.0, 0.01])
    assert sc.metrics["reward/lambda_safety"] == 1.0 and sc.metrics["reward/constraint_safety"] == -0.5
    assert weighting.state.lambdas.tolist() == pytest.approx([1.49])  # violated: 1 − (−0.5 + 0.01)


def test_bad_reward_config_is_refused():
    with pytest.raises(ConfigError, match="not a constrainable component"):
        parse_section(TrainConfig, {"reward": {"weighting": "lagrange", "thresholds": {"correctness": 0.5}}}, "p:train")
    with pytest.raises(ConfigError, match="outside the component's range"):
        parse_section(TrainConfig, {"reward": {"thresholds": {"safety": 0.5}}}, "p:train")
    with pytest.raises(ConfigError, match="weighting"):
        parse_section(TrainConfig, {"reward": {"weighting": "dynamic"}}, "p:train")
    with pytest.raises(ConfigError, match="temperature"):
        parse_section(TrainConfig, {"reward": {"temperature": 0}}, "p:train")


# ---------------------------------------------------------------------------------------- in the real training loop
@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from test_train import make_project

    return make_project(tmp_path_factory.mktemp("rw"))


def params_with(project: Path, name: str, train: dict) -> str:
    p = yaml.safe_load((project / "params.yaml").read_text())
    p["train"].update(train)
    (project / name).write_text(yaml.safe_dump(p))
    return name


def test_softmax_weighting_reports_moving_weights_and_the_learner_uses_them(project, monkeypatch):
    from pipeline.train import advantages
    from pipeline.train.worker import run_worker

    monkeypatch.chdir(project)
    seen = []
    real = advantages.episode_scores
    monkeypatch.setattr(advantages, "episode_scores", lambda records, state: seen.append(records) or real(records,
                                                                                                        state))
    params = params_with(project, "params-softmax.yaml", {"reward": {"weighting": "softmax", "temperature": 0.5}})
    h = run_worker(params, ckpt="ckpt-softmax", out="models/policy-softmax", stop_after=2)["history"]
    keys = [f"reward/w_{c}" for c in W.COMPONENTS]
    assert all(k in x for x in h for k in keys)
    assert [h[0][k] for k in keys] == pytest.approx([1.0, 0.5, 1.0, 0.1])  # update 1: empty windows, α
    assert [h[0][k] for k in keys] != pytest.approx([h[1][k] for k in keys])  # the weights moved
    # the tiny random policy never answers right: correctness has the largest shortfall and gets the weight
    assert h[1]["reward/q_correctness"] == 1.0 and h[1]["reward/w_correctness"] > 1.0
    # the learner's returns are the components under the update's weights (expert demonstrations included)
    w = np.array([h[1][k] for k in keys])
    x, counted = W.component_matrix(seen[1], "on_success")
    assert [r["return"] for r in seen[1]] == pytest.approx(W.weighted_returns(x, counted, w).tolist())
    assert any(r.get("demonstrated") and r["return"] > 1.1 for r in seen[1])  # a solved demo pays w_c > α_c


def test_lagrange_multipliers_follow_dual_ascent_in_the_loop_and_resume_from_the_checkpoint(project, monkeypatch):
    from pipeline.train.worker import run_worker

    monkeypatch.chdir(project)
    train = {"reward": {"weighting": "lagrange", "thresholds": {"safety": -0.01, "user_experience": 0.5},
                        "lambda_lr": 0.5}, "checkpoint_every": 1}
    params = params_with(project, "params-lagrange.yaml", train)
    h = run_worker(params, ckpt="ckpt-lagrange-ref", out="models/policy-lagrange-ref", stop_after=3)["history"]
    for c, b in (("safety", -0.01), ("user_experience", 0.5)):
        lam = [x[f"reward/lambda_{c}"] for x in h]
        assert lam[0] == pytest.approx({"safety": 1.0, "user_experience": 0.1}[c])  # starts at α
        for u in range(2):  # λ ← clip(λ − η·(mean − b), 0, λ_max) with the update's reported constraint mean
            mean = h[u].get(f"reward/constraint_{c}")
            expected = lam[u] if mean is None else float(np.clip(lam[u] - 0.5 * (mean - b), 0, 10))
            assert lam[u + 1] == pytest.approx(expected)
    # the random policy never answers, so user experience (counted only in correct episodes) has no mean, while
    # safety holds: its λ falls
    assert h[1]["reward/lambda_safety"] < h[0]["reward/lambda_safety"]
    # stopped after 2 updates (checkpoint of update 2), resumed to the end: update 3 continues the multipliers
    # exactly, and the learning curve carries them
    run_worker(params, ckpt="ckpt-lagrange", out="models/policy-lagrange", stop_after=2)
    h2 = run_worker(params, ckpt="ckpt-lagrange", out="models/policy-lagrange", metrics_path="metrics/lagrange.json",
                    curve_path="metrics/lagrange.csv")["history"]
    assert len(h2) == 4
    assert h2[2]["reward/lambda_safety"] == pytest.approx(h[2]["reward/lambda_safety"], abs=0)
    rows = list(csv.DictReader(Path("metrics/lagrange.csv").open()))
    assert [float(r["reward_lambda_safety"]) for r in rows] == pytest.approx([x["reward/lambda_safety"] for x in h2])
