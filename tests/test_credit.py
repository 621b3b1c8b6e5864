"""Credit assignment (`train.reward.credit`: episode | turn | event; pipeline/train/core_algos.py and
pipeline/train/advantages.py): event-discounted returns, the per-token discounts GAE reads, the events read from
records, and event credit inside the real tiny training loop for a group baseline and for PPO."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.core.config import parse_section
from pipeline.core.errors import AgentRLError
from pipeline.train import core_algos as A
from pipeline.train.advantages import score_episodes
from pipeline.train.config import TrainConfig
from pipeline.train.extensions.event_credit import EventCredit, turn_events
from pipeline.train.sampling import make_learner_state


# ------------------------------------------------------------------------------------------------- known answers
def test_stepwise_discounted_returns_by_hand():
    r = torch.tensor([[1.0, 0.0, 2.0, 3.0], [0.0, 0.0, 0.0, 4.0]])
    g = torch.tensor([[1.0, 0.5, 1.0, 1.0], [0.5, 1.0, 0.5, 1.0]])
    # row 0: G3 = 3, G2 = 2 + 3 = 5, G1 = 0 + 0.5·5 = 2.5, G0 = 1 + 2.5 = 3.5
    # row 1: G3 = 4, G2 = 0.5·4 = 2, G1 = 2, G0 = 0.5·2 = 1
    assert A.stepwise_discounted_returns(r, g).tolist() == [[3.5, 2.5, 5.0, 3.0], [1.0, 2.0, 2.0, 4.0]]
    # a constant discount is discounted_returns
    assert torch.allclose(A.stepwise_discounted_returns(r, torch.full_like(r, 0.9)), A.discounted_returns(r, 0.9))


def test_event_discounts_apply_only_at_events_times_gamma():
    ev = torch.tensor([[False, True, False], [True, True, False]])
    assert A.event_discounts(ev, 1.0, 0.5).tolist() == [[1.0, 0.5, 1.0], [0.5, 0.5, 1.0]]
    assert A.event_discounts(ev, 0.5, 0.5).tolist() == [[0.5, 0.25, 0.5], [0.25, 0.25, 0.5]]


def test_turn_end_discounts_and_gae_with_per_token_discounts_by_hand():
    # one row: prompt, turn 0 = tokens 1-2, observation, turn 1 = token 4
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    turn = A.turn_ids(mask)
    g = A.turn_end_discounts(torch.tensor([[0.5, 1.0]]), torch.tensor([0]), turn, mask, 1.0)
    assert g.tolist() == [[1.0, 1.0, 0.5, 1.0, 1.0]]
    # GAE, λ = 1, V = 0: the reward 4 on the last token; the turn-0 tokens see it through the 0.5 at token 2
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 4.0]])
    adv, ret = A.compute_gae(rewards, torch.zeros(1, 5), mask, g, 1.0)
    assert adv.tolist() == [[0.0, 2.0, 2.0, 0.0, 4.0]] and ret.tolist() == adv.tolist()
    # V = (·, 1, 1, ·, 1), λ = 0.5: token 4: δ = 4 − 1 = 3; token 2: δ = 0 + 0.5·1 − 1 = −0.5, A = −0.5 + 0.5·0.5·3
    # = 0.25; token 1: δ = 0 + 1·1 − 1 = 0, A = 0 + 1·0.5·0.25 = 0.125
    values = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
    adv, _ = A.compute_gae(rewards, values, mask, g, 0.5)
    assert adv[0].tolist() == pytest.approx([0.0, 0.125, 0.25, 0.0, 3.0])
    # a constant tensor discount is the float path; and across two rows (segments) as in one
    rng = torch.Generator().manual_seed(0)
    r, v = torch.rand(1, 5, generator=rng), torch.rand(1, 5, generator=rng)
    assert torch.allclose(A.compute_gae(r, v, mask, torch.full((1, 5), 0.9), 0.95)[0],
                          A.compute_gae(r, v, mask, 0.9, 0.95)[0])
    seg_mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 0, 0]])
    seg_g = torch.tensor([[1.0, 1.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    seg_r = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 4.0, 0.0, 0.0]])
    adv, _ = A.compute_gae_over_segments(seg_r, torch.zeros(2, 5), seg_mask, torch.tensor([0, 0]), seg_g, 1.0)
    assert adv.tolist() == [[0.0, 2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 4.0, 0.0, 0.0]]


def ep(step_rewards, tools, group, step_events=None, ret=None) -> dict:
    """A record with one action token per turn (observation tokens between), as the learner reads it."""
    mask = [0] + sum(([1, 0] for _ in step_rewards), [])
    r = {"task_id": "t", "step_rewards": step_rewards, "action_mask": mask, "group": group,
         "actions": [{"tool": t, "params": {}} for t in tools],
         "return": sum(step_rewards) if ret is None else ret}
    if step_events is not None:
        r["step_events"] = step_events
    return r


def test_turn_events_read_writes_and_step_events_and_refuse_misaligned_records():
    records = [ep([0, 0, 1], ["lookup", "update", "answer"], 0),
               ep([0, 1], ["plan", "answer"], 0, step_events=[["plan"], ["subgoal_done", "plan_complete"]])]
    events, mets = turn_events(records, ["write", "subgoal_done"], frozenset({"update"}), 3)
    assert events.tolist() == [[False, True, False], [False, True, False]]
    assert mets["credit/events_write_per_episode"] == 0.5 and mets["credit/events_subgoal_done_per_episode"] == 0.5
    assert mets["credit/event_turns_per_episode"] == 1.0
    events, _ = turn_events(records, ["plan"], frozenset({"update"}), 3)  # only the names asked for
    assert events.tolist() == [[False, False, False], [True, False, False]]
    bad = dict(records[1], step_events=[["plan"]])
    with pytest.raises(AgentRLError, match="1 step_events entries for 2 step rewards"):
        turn_events([bad], ["subgoal_done"], frozenset(), 2)
    with pytest.raises(AgentRLError, match="2 actions for 3 step rewards"):
        turn_events([dict(records[0], actions=records[0]["actions"][:2])], ["write"], frozenset({"update"}), 3)


def test_event_credit_turn_advantages_by_hand_and_the_old_turn_credit_key():
    cfg = parse_section(TrainConfig, {"algorithm": "rloo", "group_size": 2, "tasks_per_update": 1, "num_ranks": 1,
                                      "reward": {"credit": "event", "event_gamma": 0.5}}, "p:train")
    # episode 0 writes at turn 1 and earns 2 at turn 2; episode 1 earns 1 at its last turn, no event
    records = [ep([0.0, 0.0, 2.0], ["lookup", "update", "answer"], 0), ep([0.0, 1.0], ["lookup", "answer"], 0)]
    sc = score_episodes(records, cfg, make_learner_state(cfg), extensions=[EventCredit(cfg, frozenset({"update"}))])
    # G(ep0) = (1, 1, 2): the write's discount halves what comes after it for turns 0 and 1; G(ep1) = (1, 1)
    # RLOO baseline of the first-turn returns: ep0 1 − 1 = 0, ep1 1 − 1 = 0; later turns add G_t − G_0
    assert sc.turn_gammas.tolist() == [[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]]
    assert sc.turn_adv.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    assert sc.metrics["credit/events_write_per_episode"] == 0.5
    # turn credit (γ = 1): G(ep0) = (2, 2, 2) -> advantage 2 − 1 = 1 on every turn
    turn = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"credit": "turn"})})
    assert score_episodes(records, turn, make_learner_state(turn)).turn_adv.tolist() == [[1.0, 1.0, 1.0],
                                                                                        [-1.0, -1.0, 0.0]]
    # the older key: turn_credit: true is credit 'turn'; it does not undo 'event'
    old = parse_section(TrainConfig, {"turn_credit": True}, "p:train")
    assert old.credit == "turn" and cfg.credit == "event"
    assert cfg.model_copy(update={"turn_credit": True}).credit == "event"
    assert parse_section(TrainConfig, {}, "p:train").credit == "episode"


# ---------------------------------------------------------------------------------------- in the real training loop
@pytest.fixture(scope="module")
def write_project(tmp_path_factory):
    """The tiny project of tests/test_train.py with only its `update` (writing) tasks for training and room for
    their four calls, so the expert's demonstrations in failed groups carry a write event."""
    from test_train import make_project

    root = make_project(tmp_path_factory.mktemp("credit"))
    path = root / "data/tasks/train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["family"] == "update"]
    assert rows, "the tiny project has no update task"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, demos = {r["task_id"] for r in rows}, root / "data/demos/train.jsonl"  # behaviour cloning's, of those tasks
    lines = [line for line in demos.read_text().splitlines() if line.strip()]
    demos.write_text("".join(line + "\n" for line in lines if json.loads(line)["task_id"] in kept))
    p = yaml.safe_load((root / "params.yaml").read_text())
    p["env"]["max_steps"] = 6
    (root / "params.yaml").write_text(yaml.safe_dump(p))
    return root


@pytest.mark.parametrize("algorithm", ["rloo", "ppo"])
def test_event_credit_discounts_after_the_write_in_the_loop(write_project, monkeypatch, algorithm):
    from pipeline.train.worker import run_worker

    monkeypatch.chdir(write_project)
    seen, real = [], A.stepwise_discounted_returns
    monkeypatch.setattr(A, "stepwise_discounted_returns", lambda r, g: seen.append((r, g, real(r, g))) or seen[-1][2])
    ends, real_ends = [], A.turn_end_discounts
    monkeypatch.setattr(A, "turn_end_discounts", lambda *a: ends.append(real_ends(*a)) or ends[-1])
    p = yaml.safe_load(Path("params.yaml").read_text())
    p["train"].update(algorithm=algorithm, reward={"credit": "event", "event_gamma": 0.5})
    Path(f"params-event-{algorithm}.yaml").write_text(yaml.safe_dump(p))
    h = run_worker(f"params-event-{algorithm}.yaml", ckpt=f"ckpt-event-{algorithm}", out=f"models/event-{algorithm}",
                   stop_after=2)["history"]
    assert len(h) == 2 and all(np.isfinite(x["losses/grad_norm"]) for x in h)
    assert all("credit/event_turns_per_episode" in x and "turn_credit/turns_per_episode" in x for x in h)
    assert sum(x["credit/events_write_per_episode"] for x in h) > 0  # the expert's demonstrations write
    # an expert episode of an update task: lookup, calc, update (the write), answer; R = 1.1 paid at the answer.
    # Its turns before and at the write get 0.5·1.1, the answer 1.1 (turn credit would give 1.1 everywhere)
    demos = [(r[i], g[i], G[i]) for r, g, G in seen for i in range(len(r)) if g[i].min() < 1.0]
    assert demos
    for r, g, G in demos:
        n = int((r != 0).nonzero().max()) + 1 if r.any() else None
        if n == 4 and g[:4].tolist() == [1.0, 1.0, 0.5, 1.0]:
            assert G[:4].tolist() == pytest.approx([0.55, 0.55, 0.55, 1.1])
            break
    else:
        pytest.fail(f"no demonstration with one write at its third turn: {[g.tolist() for _, g, _ in demos]}")
    if algorithm == "ppo":  # GAE reads the event's discount on the write turn's last token
        assert ends and any(bool((e == 0.5).any()) for e in ends)
        assert all("losses/value_loss" in x for x in h)
    else:
        assert not ends


def test_doctests_of_the_maths_modules():
    import doctest

    from pipeline.train import estimators
    from pipeline.train.extensions import adversarial, replay, reward_weighting

    for module in (A, estimators, reward_weighting, replay, adversarial):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
