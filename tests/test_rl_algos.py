"""Known-answer and invariance tests of the RL maths (pure tensor functions, milliseconds each)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.train import core_algos as A
from pipeline.train.sampling import AdaptiveEntropyCoef, Curriculum, GoalSampler, RewardNormalizer


def test_gae_matches_a_hand_computed_case():
    # Two action tokens at t=0 and t=2 with an observation token at t=1 in between (skipped).
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.9, 0.8]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    gamma, lam = 0.9, 0.8
    # t=2: delta = 1 + 0 - 0.8 = 0.2 ; A2 = 0.2
    # t=0: delta = 0 + 0.9*0.8 - 0.5 = 0.22 ; A0 = 0.22 + 0.9*0.8*0.2 = 0.364
    adv, ret = A.compute_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, torch.tensor([[0.364, 0.0, 0.2]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.864, 0.0, 1.0]]), atol=1e-6)


def test_gae_with_lambda_one_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.5, 0.0, 2.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    mask = torch.ones(1, 4)
    adv, ret = A.compute_gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(ret, torch.tensor([[2.5, 2.5, 2.0, 2.0]]), atol=1e-6)
    assert torch.allclose(adv, ret - values, atol=1e-6)


def test_values_under_the_mask_change_nothing():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g)
    mask = (torch.rand(4, 12, generator=g) > 0.4).float()
    logp, old = torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g)
    adv, ret = A.compute_gae(rewards * mask, values, mask, 0.99, 0.95)
    noise = torch.randn(4, 12, generator=g) * 100 * (1 - mask)
    adv2, ret2 = A.compute_gae(rewards * mask, values + noise, mask, 0.99, 0.95)
    assert torch.allclose(adv, adv2) and torch.allclose(ret, ret2)
    l1, _ = A.ppo_policy_loss(logp, old, adv, mask, 0.2)
    l2, _ = A.ppo_policy_loss(logp + noise, old - noise, adv + noise, mask, 0.2)
    assert torch.allclose(l1, l2)
    v1, _ = A.value_loss(values, values * 0.9, ret, mask, 0.2)
    v2, _ = A.value_loss(values + noise, values * 0.9 - noise, ret + noise, mask, 0.2)
    assert torch.allclose(v1, v2)


def test_gae_looped_equals_per_episode():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    mask = (torch.rand(3, 9, generator=g) > 0.3).float()
    adv, _ = A.compute_gae(rewards, values, mask, 0.97, 0.9)
    for b in range(3):
        idx = mask[b].nonzero().flatten().tolist()
        a_ref, last, nv = {}, 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[b, t]) + 0.97 * nv - float(values[b, t])
            last = delta + 0.97 * 0.9 * last
            a_ref[t], nv = last, float(values[b, t])
        for t in idx:
            assert abs(float(adv[b, t]) - a_ref[t]) < 1e-5


def test_clipped_surrogate_on_hand_made_tensors():
    mask = torch.ones(1, 3)
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, m = A.ppo_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    # token 0: r=1.5, A=1  -> max(-1.5, -1.2) = -1.2 (clipped)
    # token 1: r=0.5, A=1  -> max(-0.5, -0.8) = -0.5
    # token 2: r=1.1, A=-1 -> max(1.1, 1.1) = 1.1
    assert float(loss) == pytest.approx((-1.2 - 0.5 + 1.1) / 3, abs=1e-6)
    assert m["losses/clipfrac"] == pytest.approx(2 / 3)
    assert m["losses/approx_kl"] > 0


def test_value_clipping_on_hand_made_tensors():
    mask = torch.ones(1, 2)
    loss, _ = A.value_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]]), mask, 0.5)
    # token 0: max((1-0)^2, (0.5-0)^2) = 1 ; token 1: max(1, 1) = 1 ; 0.5 * mean = 0.5
    assert float(loss) == pytest.approx(0.5)


def test_truncated_importance_weights():
    logp_train = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    logp_sample = torch.log(torch.tensor([[0.25, 0.3, 0.2]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, s = A.truncated_importance_weights(logp_train, logp_sample, mask, c=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 0.0]]))  # ratios 2, 3 -> truncated to 2; masked token 0
    assert s["offpolicy/is_truncated_frac"] == pytest.approx(0.5)
    w, _ = A.truncated_importance_weights(logp_train, logp_sample, mask, c=10.0)
    assert torch.allclose(w, torch.tensor([[2.0, 3.0, 0.0]]), atol=1e-5)


def test_loss_weights_token_mean_and_sequence_mean_on_hand_made_tensors():
    # rows 0 and 1 are two segments of episode 0 (1 + 1 action tokens), row 2 is episode 1 (4 action tokens);
    # the masked position of row 2 holds a value that must not count
    per_token = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0], [10.0, 10.0, 10.0, 10.0, 99.0]])
    mask = torch.tensor([[1.0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0], [1.0, 1, 1, 1, 0]])
    episode = torch.tensor([0, 0, 1])
    tok = A.loss_weights(mask, episode, 2, "token-mean")
    assert torch.equal(tok, mask)
    assert A.masked_mean(per_token, tok).item() == pytest.approx((1 + 3 + 40) / 6)
    seq = A.loss_weights(mask, episode, 2, "seq-mean-token-mean")
    assert A.masked_mean(per_token, seq).item() == pytest.approx(((1 + 3) / 2 + 10) / 2)  # each episode once
    assert seq.sum().item() == pytest.approx(2.0) and seq[:, 4].abs().sum() == 0
    empty = A.loss_weights(torch.zeros(2, 3), torch.tensor([0, 1]), 2, "seq-mean-token-mean")
    assert torch.equal(empty, torch.zeros(2, 3))  # an episode left out of the loss stays out, no division by zero
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean"):
        A.loss_weights(mask, episode, 2, "seq-sum")
    from typing import get_args

    from pipeline.train.config import TrainConfig
    assert get_args(TrainConfig.model_fields["loss_agg"].annotation) == A.LOSS_AGGREGATIONS  # config offers each mode
    # the importance correction ignores the weights' values (only where they are non-zero)
    w, _ = A.truncated_importance_weights(torch.zeros(3, 5), torch.zeros(3, 5), seq, 2.0)
    assert torch.equal(w, (mask > 0).float())


def test_gae_over_segments_continues_an_episode_across_its_rows():
    """An episode folded into two rows (token segments) gets the advantages of the same episode in one row: the end of
    its first segment bootstraps from the second instead of ending the episode. One row per episode is plain GAE."""
    g = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)
    mask = (torch.rand(3, 10, generator=g) > 0.3).float()
    one = torch.tensor([0, 1, 2])
    for got, want in zip(A.compute_gae_over_segments(rewards, values, mask, one, 0.97, 0.9),
                         A.compute_gae(rewards, values, mask, 0.97, 0.9)):
        assert torch.allclose(got, want)
    # row 0 cut after position 4: rows (first half, second half) of episode 0, rows 1 and 2 as before, out of order
    cut = 5
    rows_r, rows_v, rows_m = [], [], []
    for x, out in ((rewards, rows_r), (values, rows_v), (mask, rows_m)):
        a, b = torch.zeros(10), torch.zeros(10)
        a[:cut], b[: 10 - cut] = x[0, :cut], x[0, cut:]
        out.extend([a, x[1], b, x[2]])
    r, v, m = torch.stack(rows_r), torch.stack(rows_v), torch.stack(rows_m)
    episode = torch.tensor([0, 1, 0, 2])
    adv, ret = A.compute_gae_over_segments(r, v, m, episode, 0.97, 0.9)
    full_adv, full_ret = A.compute_gae(rewards, values, mask, 0.97, 0.9)
    assert torch.allclose(torch.cat([adv[0, :cut], adv[2, : 10 - cut]]), full_adv[0], atol=1e-6)
    assert torch.allclose(torch.cat([ret[0, :cut], ret[2, : 10 - cut]]), full_ret[0], atol=1e-6)
    assert torch.allclose(adv[1], full_adv[1]) and torch.allclose(adv[3], full_adv[2])
    # row-wise GAE would end episode 0 at its first segment: different advantages there
    assert not torch.allclose(A.compute_gae(r, v, m, 0.97, 0.9)[0][0, :cut], full_adv[0, :cut])
    assert A.last_rows(episode).tolist() == [False, True, True, True]


def test_discounted_returns_and_token_rewards():
    r = torch.tensor([[1.0, 0.0, 2.0]])
    assert torch.allclose(A.discounted_returns(r, 0.5), torch.tensor([[1.5, 1.0, 2.0]]))
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]])
    tr = A.token_rewards(torch.tensor([3.0, 5.0]), mask)
    assert tr.tolist() == [[0, 0, 0, 0, 3.0, 0], [0] * 6]


def test_turn_ids_and_turn_token_rewards_known_answers():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1], [1, 0, 0, 1, 1, 0, 0, 0]])
    turn = A.turn_ids(mask)
    assert turn.tolist() == [[-1, 0, 0, -1, 1, -1, 2, 2], [0, -1, -1, 1, 1, -1, -1, -1]]
    # episode 0 spans rows 0 and 2: its second row continues with turns 3 and 4 (indices from the whole episode)
    rows_turn = torch.cat([turn, torch.tensor([[-1, 3, -1, 4, 4, -1, -1, -1]])])
    rows_mask = torch.cat([mask, torch.tensor([[0, 1, 0, 1, 1, 0, 0, 0]])])
    r = torch.tensor([[0.0, -1.0, 0.0, 0.5, 2.0], [0.25, 3.0, 0.0, 0.0, 0.0]])
    out = A.turn_token_rewards(r, torch.tensor([0, 1, 0]), rows_turn, rows_mask)
    assert out.tolist() == [[0, 0, 0.0, 0, -1.0, 0, 0, 0.0], [0.25, 0, 0, 0, 3.0, 0, 0, 0],
                            [0, 0.5, 0, 0, 2.0, 0, 0, 0]]
    assert float(out.sum()) == pytest.approx(float(r.sum()))  # every turn's reward lands exactly once


def test_loss_with_gradient_accumulation_equals_the_full_batch():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 5)
    x = torch.randn(8, 6, 8)
    actions = torch.randint(0, 5, (8, 6))
    old = torch.randn(8, 6) * 0.1 - 1.6
    adv = torch.randn(8, 6)
    mask = torch.ones(8, 6)

    def loss_of(xb, ab, ob, advb, mb):
        logp = torch.log_softmax(lin(xb), -1).gather(-1, ab[..., None])[..., 0]
        return A.ppo_policy_loss(logp, ob, advb, mb, 0.2)[0]

    lin.zero_grad()
    loss_of(x, actions, old, adv, mask).backward()
    full = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    for i in range(8):  # 8 micro-batches of 1, equal token counts, so the mean of means equals the mean
        (loss_of(x[i:i + 1], actions[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1]) / 8).backward()
    for g_full, p in zip(full, lin.parameters()):
        assert torch.allclose(g_full, p.grad, atol=1e-6)


def _toy_policy_logp(seed: int = 0):
    torch.manual_seed(seed)
    w = torch.randn(6, 5, requires_grad=True)
    x = torch.randn(4, 3, 6)  # 4 rows, 3 positions, features
    ids = torch.randint(0, 5, (4, 3))
    logp = torch.log_softmax(x @ w, -1).gather(-1, ids[..., None]).squeeze(-1)
    return w, logp


def test_the_one_forward_on_policy_step_has_the_gradient_of_the_two_forward_step():
    # pipeline.train.learner.learn: with one epoch and one minibatch, π_old is the training forward's own detached
    # log-probabilities instead of a separate no-grad forward's. Same values, so the same loss and gradient.
    adv = torch.tensor([[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0], [2.0, 0.0, 0.0], [0.3, 0.3, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    w1, logp1 = _toy_policy_logp()
    with torch.no_grad():
        _, separate = _toy_policy_logp()  # the separate no-grad forward of the same weights
    loss1, _ = A.ppo_policy_loss(logp1, separate, adv, mask, 0.2)
    loss1.backward()
    w2, logp2 = _toy_policy_logp()
    loss2, m2 = A.ppo_policy_loss(logp2, logp2.detach(), adv, mask, 0.2)
    loss2.backward()
    assert torch.allclose(loss1, loss2) and torch.allclose(w1.grad, w2.grad)
    assert m2["losses/clipfrac"] == 0.0 and abs(m2["losses/approx_kl"]) < 1e-7
    # ... and it is the REINFORCE gradient: −mean over action tokens of A·∇log π
    w3, logp3 = _toy_policy_logp()
    (-(adv * logp3 * mask).sum() / mask.sum()).backward()
    assert torch.allclose(w2.grad, w3.grad, atol=1e-6)


def test_rows_with_an_empty_loss_mask_change_neither_loss_nor_gradient():
    # pipeline.train.learner.learn drops zero-variance rows before the forward: they add 0 to the masked sum and 0 to
    # its token count, so the policy loss and its gradient are those of the kept rows alone.
    adv = torch.tensor([[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    w_all, logp_all = _toy_policy_logp()
    loss_all, _ = A.ppo_policy_loss(logp_all, logp_all.detach(), adv, mask, 0.2)
    loss_all.backward()
    keep = torch.tensor([0, 1, 3])
    w_kept, logp = _toy_policy_logp()
    loss_kept, _ = A.ppo_policy_loss(logp[keep], logp[keep].detach(), adv[keep], mask[keep], 0.2)
    loss_kept.backward()
    assert torch.allclose(loss_all, loss_kept) and torch.allclose(w_all.grad, w_kept.grad)


def test_kl_entropy_explained_variance():
    logits = torch.zeros(2, 3, 4)
    assert torch.allclose(A.entropy_from_logits(logits), torch.full((2, 3), float(np.log(4))))
    mask = torch.ones(2, 3)
    lp = torch.randn(2, 3)
    kl, _ = A.kl_penalty(lp, lp, mask)
    assert float(kl) == 0.0
    kl, _ = A.kl_penalty(lp, lp - 0.5, mask)
    assert float(kl) > 0
    ret = torch.randn(2, 3)
    assert A.explained_variance(ret, ret, mask) == pytest.approx(1.0)


def test_weight_interpolation_on_hand_made_state_dicts():
    """WiSE-FT: θ_start + α(θ − θ_start), in float32, returned in the current dtypes; integer tensors from current."""
    start = {"w": torch.tensor([0.0, 2.0, -4.0]), "b": torch.tensor([1.0], dtype=torch.bfloat16),
             "steps": torch.tensor([3])}
    current = {"w": torch.tensor([4.0, 2.0, 0.0]), "b": torch.tensor([3.0], dtype=torch.bfloat16),
               "steps": torch.tensor([7])}
    half = A.interpolate_weights(start, current, 0.5)
    assert torch.equal(half["w"], torch.tensor([2.0, 2.0, -2.0]))
    assert half["b"].dtype == torch.bfloat16 and float(half["b"]) == 2.0
    assert int(half["steps"]) == 7
    assert all(torch.equal(A.interpolate_weights(start, current, 1.0)[k], current[k]) for k in current)
    assert torch.equal(A.interpolate_weights(start, current, 0.0)["w"], start["w"])
    assert half["w"] is not current["w"] and torch.equal(current["w"], torch.tensor([4.0, 2.0, 0.0]))  # no aliasing
    with pytest.raises(ValueError, match="differ in keys"):
        A.interpolate_weights({"w": start["w"]}, current, 0.5)
    with pytest.raises(ValueError, match="shape"):
        A.interpolate_weights({**start, "w": torch.zeros(2)}, current, 0.5)


def test_reward_normalizer_window():
    n = RewardNormalizer(window=4)
    n.update([0, 0, 10, 10, 2, 4])  # window keeps 10, 10, 2, 4
    h = np.array([10, 10, 2, 4.0])
    assert n.normalize([4.0])[0] == pytest.approx((4 - h.mean()) / (h.std() + 1e-6))
    m = RewardNormalizer(window=4)
    m.load_state_dict(n.state_dict())
    assert m.normalize([1.0]) == pytest.approx(n.normalize([1.0]))
    with pytest.raises(ValueError):
        RewardNormalizer(window=1)


def test_adaptive_entropy_rises_when_entropy_collapses():
    c = AdaptiveEntropyCoef(init=0.01, target=1.0, rate=2.0, max_coef=0.1)
    assert c.update(0.2) == pytest.approx(0.02) and c.update(0.2) == pytest.approx(0.04)
    for _ in range(5):
        c.update(0.1)
    assert c.value == pytest.approx(0.1)
    for _ in range(20):
        c.update(2.0)
    assert c.value == pytest.approx(0.01, rel=1e-3)


def test_curriculum_opens_levels_and_follows_failure():
    cur = Curriculum([1, 2, 3, 4], start_level=2, threshold=0.8, floor=0.1, window=20)
    assert cur.open_levels == [1, 2]
    cur.update([1] * 20 + [2] * 20, [1] * 20 + [1] * 17 + [0] * 3)
    assert cur.open_levels == [1, 2, 3]
    w = cur.weights()
    assert w[3] > w[2] > w[1] and sum(w.values()) == pytest.approx(1.0)
    levels = cur.sample_levels(40, np.random.default_rng(0))
    assert len(levels) == 40 and set(levels) <= {1, 2, 3}
    assert levels.count(3) == round(40 * w[3]) or abs(levels.count(3) - 40 * w[3]) <= 1
    other = Curriculum([1, 2, 3, 4], 1, 0.8, window=20)
    other.load_state_dict(cur.state_dict())
    assert other.weights() == w


def test_goal_sampler_prefers_rare_goals():
    gs = GoalSampler()
    rng = np.random.default_rng(0)
    gs.counts = {"a": 9, "b": 0}
    p = gs.probabilities(["a", "b"])
    assert p[1] / p[0] == pytest.approx(10.0)
    picks = gs.sample(["a", "b", "c"], 300, rng)
    assert picks.count("a") < picks.count("b")
