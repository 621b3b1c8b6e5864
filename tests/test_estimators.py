"""The registry of advantage estimators (pipeline/train/estimators.py): known answers, worked by hand, for every
registered estimator; one clear line for a name that is none; a user's estimator named as ``module:function`` or as
an entry point of the group agentrl.estimators, used by the kernel's scoring and by a real tiny training run."""

from __future__ import annotations


import pytest
import torch

from pipeline.core.config import ConfigError, parse_section
from pipeline.core.errors import AgentRLError
from pipeline.train import estimators as E
from pipeline.train.config import TrainConfig

HERE = __name__  # this module as pytest imported it, so that ``HERE:function`` is the same function object
CALLS: list[tuple[int, int]] = []  # (episodes, turns) of every call of `median_baseline`


def median_baseline(returns: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor):
    """A user's group baseline: G − the group's (lower) median, every turn the episode's advantage."""
    CALLS.append(tuple(returns.shape))
    adv = torch.zeros(returns.shape[0])
    for g in torch.unique(group_ids):
        idx = group_ids == g
        adv[idx] = returns[idx, 0] - returns[idx, 0].median()
    return adv[:, None] * mask, torch.zeros(returns.shape[0], dtype=torch.bool)


def td_zero(rewards, values, mask, episode, gamma, lam):
    """Registered as a critic by a test (a module registers it with ``register_estimator(..., critic=True)``)."""
    return rewards - values, rewards


NOT_A_FUNCTION = 3

# every built-in estimator has a known-answer test below
KNOWN_ANSWERS = {"grpo": "test_grpo_known_answers", "rloo": "test_rloo_known_answers",
                 "ppo": "test_ppo_gae_known_answers"}


def test_every_registered_estimator_has_known_answers():
    assert sorted(E.ESTIMATORS) == sorted(KNOWN_ANSWERS) == E.estimator_names()
    assert all(callable(globals()[name]) for name in KNOWN_ANSWERS.values())
    assert [n for n, e in sorted(E.ESTIMATORS.items()) if e.critic] == ["ppo"]


def test_rloo_known_answers():
    one = torch.ones(8, 1)
    scores = torch.tensor([[1.0], [0.0], [0.0], [0.0], [1.0], [1.0], [1.0], [1.0]])
    adv, zero = E.rloo(scores, one, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    # group 0: 1 − 0 = 1 and 0 − 1/3; group 1 all equal: zero advantages, marked zero-variance
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0]))
    assert zero.tolist() == [False] * 4 + [True] * 4
    # a group of one has nothing to compare with: advantage 0, zero-variance
    adv, zero = E.rloo(torch.tensor([[5.0], [1.0], [3.0]]), torch.ones(3, 1), torch.tensor([0, 1, 1]))
    assert adv[:, 0].tolist() == [0.0, -2.0, 2.0] and zero.tolist() == [True, False, False]
    # per turn, γ 1: G_t is the reward-to-go; baselines of G_0 = (0, 2, 0.5) are 1.25, 0.25 and 1.0
    G = torch.tensor([[0.0, 1.0, 1.0], [2.0, 2.0, 0.0], [0.5, 0.0, 0.0]])
    tmask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv, zero = E.rloo(G, tmask, torch.tensor([0, 0, 0]))
    assert torch.allclose(adv, torch.tensor([[-1.25, -0.25, -0.25], [1.75, 1.75, 0.0], [-0.5, 0.0, 0.0]]))
    assert not zero.any()
    # all reward on the last turn: every turn carries the episode's advantage
    a2, _ = E.rloo(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), torch.ones(2, 3), torch.tensor([0, 0]))
    assert a2.tolist() == [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]


def test_grpo_known_answers():
    # group 0: scores (1, 0): mean 0.5, unbiased std √0.5; group 1: (0, 3): mean 1.5, std √4.5
    adv, zero = E.grpo(torch.tensor([[1.0], [0.0], [0.0], [3.0]]), torch.ones(4, 1), torch.tensor([0, 0, 1, 1]))
    want = [0.5 / (0.5 ** 0.5 + 1e-6), -0.5 / (0.5 ** 0.5 + 1e-6), -1.5 / (4.5 ** 0.5 + 1e-6), 1.5 / (4.5 ** 0.5 + 1e-6)]
    assert adv[:, 0].tolist() == pytest.approx(want, rel=1e-6) and not zero.any()
    # four episodes, scores (1, 0, 0, 0): mean 0.25, std 0.5 -> 1.5 and −0.5
    adv, _ = E.grpo(torch.tensor([[1.0], [0.0], [0.0], [0.0]]), torch.ones(4, 1), torch.zeros(4, dtype=torch.long))
    assert adv[:, 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    # per turn: later turns move by (G_t − G_0) in units of the group's std of G_0 = (0, 2, 0.5): mean 5/6, std
    # √(13/12)
    G = torch.tensor([[0.0, 1.0, 1.0], [2.0, 2.0, 0.0], [0.5, 0.0, 0.0]])
    tmask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv, _ = E.grpo(G, tmask, torch.tensor([0, 0, 0]))
    std = (13 / 12) ** 0.5 + 1e-6
    assert adv[0].tolist() == pytest.approx([-5 / 6 / std, 1 / 6 / std, 1 / 6 / std], rel=1e-5)
    assert adv[1, 2] == 0.0 and adv[2, 1:].tolist() == [0.0, 0.0]
    # equal scores: zero advantages, zero-variance
    adv, zero = E.grpo(torch.tensor([[2.0], [2.0]]), torch.ones(2, 1), torch.tensor([0, 0]))
    assert adv.abs().sum() == 0 and zero.all()


def test_ppo_gae_known_answers():
    # one row: action tokens at positions 1, 2, 4 (3 is an observation), reward 1 on the last action
    mask = torch.tensor([[0.0, 1, 1, 0, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 1]])
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 0.6]]) * mask
    adv, ret = E.gae(rewards, values, mask, torch.tensor([0]), 1.0, 1.0)
    # γ = λ = 1: A_t = 1 − V_t = (0.8, 0.6, 0.4) and returns 1; whitened: mean 0.6, std √(0.08/3)
    assert ret[0].tolist() == pytest.approx([0, 1, 1, 0, 1], abs=1e-6)
    s = (0.08 / 3) ** 0.5
    assert adv[0].tolist() == pytest.approx([0, 0.2 / s, 0.0, 0, -0.2 / s], abs=1e-4)
    # λ = 0.5: δ = (0.2, 0.2, 0.4) (the observation neither discounts nor bootstraps), A = (0.4, 0.4, 0.4)
    adv, ret = E.gae(rewards, values, mask, torch.tensor([0]), 1.0, 0.5)
    assert ret[0].tolist() == pytest.approx([0, 0.6, 0.8, 0, 1.0], abs=1e-6)
    assert adv.abs().max() < 1e-3  # all equal: whitened to 0


def test_unknown_or_broken_estimators_are_refused_with_one_line():
    with pytest.raises(AgentRLError, match=r"unknown advantage estimator 'gae'; choose one of grpo, ppo, rloo, or "
                                           r"module:function"):
        E.get_estimator("gae")
    with pytest.raises(ConfigError, match=r"params.yaml:train.algorithm: .*unknown advantage estimator 'reinforce'"):
        parse_section(TrainConfig, {"algorithm": "reinforce"}, "params.yaml:train")
    with pytest.raises(AgentRLError, match="cannot import no_such_module"):
        E.get_estimator("no_such_module:advantage")
    with pytest.raises(AgentRLError, match="has no function 'missing'"):
        E.get_estimator(f"{HERE}:missing")
    with pytest.raises(AgentRLError, match="has no function 'NOT_A_FUNCTION'"):
        E.get_estimator(f"{HERE}:NOT_A_FUNCTION")
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        parse_section(TrainConfig, {"algorithm": "no_such_module:f"}, "params.yaml:train")
    # a user's critic-free estimator needs groups, as grpo and rloo do
    with pytest.raises(ConfigError, match="group_size must be at least 2"):
        parse_section(TrainConfig, {"algorithm": f"{HERE}:median_baseline", "group_size": 1}, "p:train")


def test_a_registered_function_named_as_module_function_keeps_its_kind(monkeypatch):
    assert E.get_estimator(f"{HERE}:td_zero").critic is False  # unregistered: a group baseline
    monkeypatch.setitem(E.ESTIMATORS, "td0", E.Estimator("td0", td_zero, critic=True))
    assert E.get_estimator(f"{HERE}:td_zero").critic is True
    assert E.get_estimator("td0").fn is td_zero and "td0" in E.estimator_names()
    # register_estimator is the decorator a module uses for the same
    monkeypatch.setitem(E.ESTIMATORS, "x", E.ESTIMATORS["rloo"])
    assert E.register_estimator("x", critic=True)(td_zero) is td_zero and E.ESTIMATORS["x"].critic


def test_a_user_estimator_scores_the_kernels_records():
    from pipeline.train.advantages import score_episodes
    from pipeline.train.sampling import make_learner_state

    cfg = parse_section(TrainConfig, {"algorithm": f"{HERE}:median_baseline", "group_size": 3,
                                      "tasks_per_update": 1, "num_ranks": 1}, "p:train")
    records = [{"return": r, "group": g, "task_id": f"t{g}"} for r, g in ((1.0, 0), (0.0, 0), (0.5, 0), (2.0, 1),
                                                                            (0.0, 1), (1.0, 1))]
    CALLS.clear()
    sc = score_episodes(records, cfg, make_learner_state(cfg))
    assert CALLS == [(6, 1)]  # one column: the episode score
    assert sc.episode_adv.tolist() == [0.5, -0.5, 0.0, 1.0, -1.0, 0.0] and sc.turn_adv is None


def test_an_estimator_of_an_installed_entry_point_is_found(installed_package):
    installed_package("agentrl_median", f"from {HERE} import median_baseline\n", "agentrl.estimators",
                      {"median": "agentrl_median:median_baseline"})
    assert "median" in E.estimator_names()
    assert E.get_estimator("median").fn is median_baseline
    assert parse_section(TrainConfig, {"algorithm": "median"}, "p:train").algorithm == "median"


@pytest.mark.slow
def test_a_user_estimator_trains_a_tiny_run(tmp_path, monkeypatch):
    """`train.algorithm: module:function` in a real run: the kernel calls the user's function on every update, and
    the run completes with a policy."""
    from pipeline.train.worker import run_worker
    from tests.test_train import make_project

    root = make_project(tmp_path / "est", updates=2)
    monkeypatch.chdir(root)
    text = (root / "params.yaml").read_text().replace("  algorithm: rloo", f"  algorithm: {HERE}:median_baseline")
    assert "median_baseline" in text
    (root / "params-est.yaml").write_text(text)
    CALLS.clear()
    result = run_worker("params-est.yaml", ckpt="ckpt", out="models/policy-est")
    assert [x["update"] for x in result["history"]] == [1, 2]
    assert len(CALLS) == 2 and all(turns == 1 for _, turns in CALLS)  # one scoring per update, episode credit
    assert result["completed"] and (root / "models/policy-est").is_dir()
