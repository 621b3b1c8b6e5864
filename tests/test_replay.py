"""Sampling of the RL phase (`train.sampling`): the maths of prioritised replay, the mixing ratio, trajectory slicing
and adversarial task weights with hand-computed answers, and each switch on inside a real run of the tiny training
loop (replayed rows trained with their stored advantage, recorded log-probabilities and priority weights; slices;
adversarial task weights), plus a run stopped and resumed from its checkpoint that continues identically."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pipeline.train.batch import collate_records, slice_rows
from pipeline.train.config import SamplingConfig, TrainConfig
from pipeline.train.extensions.replay import (ReplayStore, episode_deltas, mix_count, priorities,
                                   priority_weights, replay_scores, weigh_rows)
from pipeline.train.advantages import score_episodes
from pipeline.train.extensions.adversarial import TaskFailures, failure_weights
from pipeline.train.sampling import make_learner_state

from tests.test_train import make_project


# ------------------------------------------------------------------------------------------------- known answers
def test_priorities_and_their_importance_weights():
    # |δ|^α + ε with α = 0.5, ε = 1: [0, 4, 16] -> [1, 3, 5] / 9
    p = priorities([0.0, -4.0, 16.0], 0.5, 1.0)
    assert p.tolist() == pytest.approx([1 / 9, 3 / 9, 5 / 9])
    # w_i = (N p_i)^-β / max: N p = [1/3, 1, 5/3]; β = 1 -> [3, 1, 0.6] / 3
    assert priority_weights(p, np.array([0, 1, 2]), 1.0).tolist() == pytest.approx([1.0, 1 / 3, 0.2])
    # max over the drawn ones only: drawing items 1 and 2 -> [1, 0.6] / 1
    assert priority_weights(p, np.array([1, 2]), 1.0).tolist() == pytest.approx([1.0, 0.6])
    assert priority_weights(p, np.array([0, 2]), 0.0).tolist() == [1.0, 1.0]  # β_is 0: no correction


def test_mixing_ratio_and_replayed_count():
    assert mix_count(16, 0, 0.5, 1.0) == (1.0, 0)  # empty store: only new episodes
    assert mix_count(16, 16, 0.5, 1.0) == (0.5, 16)  # 16/32 = 0.5: as many replayed as new
    assert mix_count(16, 48, 0.25, 1.0) == (0.25, 48)  # 16/64 = 0.25 -> 16·0.75/0.25 = 48
    assert mix_count(16, 1000, 0.8, 1.0) == (0.8, 4)  # clipped at β_min = 0.8 -> 16·0.2/0.8 = 4
    assert mix_count(16, 4, 0.5, 0.5) == (0.5, 4)  # β_max = 0.5 wants 16, the store has 4
    with pytest.raises(ValidationError, match="beta_min"):
        SamplingConfig(beta_min=0.8, beta_max=0.6)


def test_ppo_replay_with_a_dynamic_reward_weighting_is_refused():
    from pipeline.train.config import TrainConfig

    with pytest.raises(ValidationError, match="recorded return"):
        TrainConfig(algorithm="ppo", sampling={"replay": True}, reward={"weighting": "softmax"})
    TrainConfig(algorithm="rloo", sampling={"replay": True}, reward={"weighting": "softmax"})  # keeps its advantages
    TrainConfig(algorithm="ppo", sampling={"replay": True})  # fixed weights: the recorded return is the return


def test_episode_deltas_average_absolute_advantage_over_all_rows_of_an_episode():
    adv = torch.tensor([[0.5, -1.5, 9.0], [2.0, 0.0, 0.0], [-4.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    # episode 0: rows 0 and 1 -> (0.5 + 1.5 + 2) / 3; episode 2: row 2 -> 4; episode 1: no row -> 0
    assert episode_deltas(adv, mask, torch.tensor([0, 0, 2]), 3).tolist() == pytest.approx([4 / 3, 0.0, 4.0])


def test_a_slice_holds_the_prompt_and_at_most_k_turns():
    # prompt [0, 1]; turns: action 2 | obs 3, action 4 5 | obs 6, action 7 | obs 8
    mask = [0, 0, 1, 0, 1, 1, 0, 1, 0]
    assert slice_rows(mask, 0, 9, 0) == [list(range(9))]
    assert slice_rows(mask, 0, 9, 3) == [list(range(9))]
    assert slice_rows(mask, 0, 9, 2) == [[0, 1, 2, 3, 4, 5], [0, 1, 6, 7, 8]]
    # a later segment [3, 9): prompt [3]; turns 4-5 and 7
    assert slice_rows(mask, 3, 9, 1) == [[3, 4, 5], [3, 6, 7, 8]]
    rec = {"token_ids": list(range(10, 19)), "action_mask": mask, "logprobs": [-0.1 * i for i in range(9)]}
    b = collate_records([rec], pad_id=0, slice_turns=1)
    assert b.n_rows == 3 and b.sliced == 2 and b.episode.tolist() == [0, 0, 0]
    assert b.ids[1, :5].tolist() == [10, 11, 13, 14, 15] and b.attn[1].sum() == 5
    assert b.mask.sum().item() == sum(mask)  # every action token trained once
    assert b.turn[2, :5].tolist() == [-1, -1, -1, 2, -1]  # the episode's own turn numbers
    assert b.sample_logp[2, 3].item() == pytest.approx(-0.7)  # the recorded log-probability of token 7
    whole = collate_records([rec], pad_id=0)
    assert whole.n_rows == 1 and whole.sliced == 0


def test_failure_weights_and_task_outcomes():
    assert failure_weights([0.0, 0.75, 1.0, math.nan], 0.1, 1.0).tolist() == pytest.approx([1.0, 0.25, 0.1, 1.0])
    assert failure_weights([0.5, 1.0], 0.1, 0.0).tolist() == [1.0, 1.0]  # power 0: uniform
    tf = TaskFailures(floor=0.2, power=2.0, window=2)
    tf.update(["a", "a", "a", "b"], [0, 1, 1, 0])  # a's window keeps its last 2: [1, 1]
    assert tf.weights(["a", "b", "c"]).tolist() == pytest.approx([0.04, 1.0, 1.0])
    other = TaskFailures(0.2, 2.0, 2)
    other.load_state_dict(tf.state_dict())
    assert other.weights(["a", "b"]).tolist() == pytest.approx([0.04, 1.0])


def _record(task: str, version: int, ret: float, n_tokens: int = 4) -> dict:
    return {"task_id": task, "policy_version": version, "return": ret, "success": ret > 0, "level": 1,
            "token_ids": list(range(1, n_tokens + 1)), "action_mask": [0, 1, 1, 0][:n_tokens],
            "logprobs": [0.0, -0.5, -0.25, 0.0][:n_tokens]}


def test_the_store_evicts_by_age_and_draws_by_priority_reproducibly():
    store = ReplayStore(capacity=3, seed=0)
    store.add([{"record": _record(t, v, 1.0), "delta": d, "adv": d, "turn_adv": None, "stored": v}
               for t, v, d in [("a", 0, 0.1), ("b", 1, 2.0), ("c", 2, 0.0), ("d", 3, 5.0)]])
    assert [e["record"]["task_id"] for e in store.entries] == ["b", "c", "d"]  # capacity 3: first in, first out
    assert store.evict_stale(4, max_age=2) == 1  # b is 3 versions old
    twin = ReplayStore(3, 0)
    twin.load_state_dict(store.state_dict())
    picked, w = store.draw(2, alpha=1.0, eps=0.01, beta_is=1.0)
    assert sorted(picked.tolist()) == [0, 1] and max(w) == 1.0
    # p = [0.01, 5.01] / 5.02; the rare one gets the largest weight: w = (N p)^-1 / max
    assert w[picked.tolist().index(1)] == pytest.approx((0.01 / 5.02) / (5.01 / 5.02))
    p2, w2 = twin.draw(2, 1.0, 0.01, 1.0)
    assert p2.tolist() == picked.tolist() and w2.tolist() == w.tolist()


def test_replayed_episodes_keep_their_stored_advantage_and_their_weight_in_the_loss():
    cfg = TrainConfig(algorithm="rloo", sampling={"replay": True})
    state = make_learner_state(cfg)
    new = [dict(_record("t", 5, r), group=0) for r in (1.0, 0.0)]
    rep = dict(_record("old", 2, 0.0), replayed=True, replay_weight=0.25, replay_adv=-0.75, replay_turn_adv=None,
               group="replay-0")
    records = new + [rep]
    sc = replay_scores(records, lambda recs: score_episodes(recs, cfg, state), state.normalizer)
    assert sc.episode_adv.tolist() == pytest.approx([1.0, -1.0, -0.75])  # rloo: 1 − 0, 0 − 1; then the stored one
    assert sc.zero_var.tolist() == [False, False, False]
    batch = collate_records(records, 0)
    w = weigh_rows(batch.mask.clone(), records, batch)
    assert w[:, 1].tolist() == [1.0, 1.0, 0.25]
    assert weigh_rows(batch.mask[:2], new, collate_records(new, 0)) is not None  # no replayed record: unchanged
    with pytest.raises(ValidationError, match="episode credit"):  # the config refuses it, before any state exists
        TrainConfig(algorithm="ppo", turn_credit=True, sampling={"replay": True})
    with pytest.raises(ValidationError, match="episode credit"):
        TrainConfig(algorithm="ppo", reward={"credit": "event"}, sampling={"replay": True})


def test_replayed_turn_advantages_and_ppo_scores():
    # grpo with turn credit: the stored per-turn advantages, padded to the batch's widest episode
    cfg = TrainConfig(algorithm="grpo", turn_credit=True, sampling={"replay": True})
    new = [dict(_record("t", 5, r), group=0, step_rewards=[r]) for r in (1.0, 0.0)]  # one turn each
    rep = dict(_record("old", 2, 1.0), replayed=True, replay_weight=1.0, replay_adv=None,
               replay_turn_adv=[0.5, -0.25, 0.125], group="replay-0")
    state = make_learner_state(cfg)
    sc = replay_scores(new + [rep], lambda recs: score_episodes(recs, cfg, state), state.normalizer)
    assert sc.turn_adv.shape == (3, 3) and sc.turn_adv[2].tolist() == [0.5, -0.25, 0.125]
    assert sc.turn_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 1]]
    assert sc.turn_adv[0, 0] > 0 > sc.turn_adv[1, 0]
    # ppo: a replayed episode's score is its return under the normaliser's window before this batch, which the
    # replayed return does not enter: window [0, 2] -> shift 1, scale 1 (+1e-6)
    cfg = TrainConfig(algorithm="ppo", reward_norm_window=4, sampling={"replay": True})
    state = make_learner_state(cfg)
    state.normalizer.update([0.0, 2.0])
    sc = replay_scores([dict(_record("t", 5, 1.0), group=0), dict(_record("o", 4, 3.0), replayed=True, group="r")],
                       lambda recs: score_episodes(recs, cfg, state), state.normalizer)
    assert sc.scores.tolist() == pytest.approx([0.0, 2.0], abs=1e-5) and sc.episode_adv is None
    assert list(state.normalizer.history) == [0.0, 2.0, 1.0]


# ------------------------------------------------------------------------------------------------ the real loop
def _params(name: str, **sampling) -> str:
    """The tiny project's params.yaml with a `train.sampling` section (appended to `train`, the file's last)."""
    text = Path("params.yaml").read_text().rstrip("\n") + "\n  sampling:\n"
    text += "".join(f"    {k}: {v}\n" for k, v in sampling.items())
    Path(name).write_text(text)
    return name


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("replay"))


@pytest.fixture()
def in_project(project, monkeypatch):
    monkeypatch.chdir(project)
    return project


@pytest.mark.slow
def test_replayed_rows_are_trained_with_their_stored_advantage_behaviour_logprobs_and_weights(in_project,
                                                                                              monkeypatch):
    from pipeline.train import learner
    from pipeline.train.extensions import replay
    from pipeline.train.worker import run_worker

    seen, targets = [], []
    real_remember, real_optimize = replay.remember, learner._optimize

    def spy_remember(state, records, sc, batch, adv, u, dist):
        seen.append((u, records, sc))
        return real_remember(state, records, sc, batch, adv, u, dist)

    def spy_optimize(lr, t, *args):
        targets.append(t)
        return real_optimize(lr, t, *args)

    monkeypatch.setattr(replay, "remember", spy_remember)
    monkeypatch.setattr(learner, "_optimize", spy_optimize)
    params = _params("params-replay.yaml", replay="true", beta_min=0.5, max_age=2, alpha=1.0, beta_is=1.0)
    # the tiny policy's failures all score alike: reward normalisation (its window changes every update) makes the
    # stored advantages, so priorities and weights, differ between updates
    Path(params).write_text(Path(params).read_text().replace("  algorithm: rloo", "  algorithm: rloo\n"
                                                             "  reward_norm_window: 16"))
    h = run_worker(params, ckpt="ckpt-replay", out="models/policy-replay", stop_after=3)["history"]
    assert h[0]["replay/replayed"] == 0 and h[0]["replay/stored"] > 0
    assert all(x["replay/replayed"] > 0 and x["replay/rows_trained"] > 0 for x in h[1:])
    assert all(0.5 <= x["replay/share_new"] < 1 and 0 < x["replay/priority_weight_mean"] <= 1 for x in h[1:])
    assert h[2]["replay/mean_age"] >= 1 and all(np.isfinite(x["losses/grad_norm"]) for x in h)
    originals = {(r["task_id"], r["seed"], r["policy_version"]): (u, e, r) for u, recs, _ in seen
                 for e, r in enumerate(recs) if not r.get("replayed")}
    checked, weights = 0, set()
    for (u, records, sc), t in zip(seen, targets):
        for row in range(t.batch.n_rows):
            r = records[int(t.batch.episode[row])]
            if not r.get("replayed"):
                continue
            u0, e0, orig = originals[(r["task_id"], r["seed"], r["policy_version"])]
            assert u0 < u and not orig.get("demonstrated")
            assert r["replay_adv"] == pytest.approx(float(seen[u0][2].episode_adv[e0]))  # advantage when new
            m = t.batch.mask[row]
            n = int(t.batch.attn[row].sum())
            # trained on: its tokens, the recorded behaviour log-probabilities, the stored advantage, weight w_i
            assert t.batch.ids[row, :n].tolist() == orig["token_ids"][:n]
            assert torch.allclose(t.batch.sample_logp[row], torch.tensor(orig["logprobs"][:n] + [0.0] * (
                t.batch.ids.shape[1] - n)) * m)
            assert torch.allclose(t.adv[row], r["replay_adv"] * m)
            assert torch.allclose(t.loss_mask[row], m * r["replay_weight"]) and m.sum() > 0
            checked += 1
            weights.add(r["replay_weight"])
    assert checked > 0 and min(weights) < 1.0


def test_slicing_and_adversarial_sampling_in_the_loop(in_project, monkeypatch):
    from pipeline.train import learner, sampling
    from pipeline.train.extensions import adversarial
    from pipeline.train.worker import run_worker

    rows = []
    real_collate = learner.collate_records
    monkeypatch.setattr(learner, "collate_records", lambda *a: rows.append(real_collate(*a)) or rows[-1])
    # the tiny random policy fails every task, so all would weigh 1: one task is reported solved (its weight must
    # fall to floor^power = 0.01) and the goal sampler must multiply the weights into its probabilities
    solved, probs = [], []
    real_update, real_probs = adversarial.TaskFailures.update, sampling.GoalSampler.probabilities

    def update(self, ids, successes):
        solved.append(solved[0] if solved else ids[0])
        real_update(self, ids, [1.0 if t == solved[0] else s for t, s in zip(ids, successes)])

    def probabilities(self, ids, weights=None):
        p = real_probs(self, ids, weights)
        probs.append((list(ids), None if weights is None else weights.copy(), real_probs(self, ids), p))
        return p

    monkeypatch.setattr(adversarial.TaskFailures, "update", update)
    monkeypatch.setattr(sampling.GoalSampler, "probabilities", probabilities)
    params = _params("params-slices.yaml", slice_turns=1, adversarial="true", adversarial_power=2.0)
    h = run_worker(params, ckpt="ckpt-slices", out="models/policy-slices", stop_after=3)["history"]
    assert len(h) == 3 and all(np.isfinite(x["losses/grad_norm"]) for x in h)
    # episodes of several turns were trained as one row per turn
    assert sum(b.sliced for b in rows) > 0 and any(x.get("sampling/slice_rows", 0) > 0 for x in h)
    for b in rows:
        turns_per_row = [len(set(t for t in b.turn[i].tolist() if t >= 0)) for i in range(b.n_rows)]
        assert max(turns_per_row) <= 1
    # adversarial weights: nothing seen before the first plan (all weigh 1); later the solved task weighs 0.01
    assert all(x["sampling/adversarial_tasks_seen"] > 0 for x in h)
    assert h[0]["sampling/adversarial_planned_weight"] == 1.0
    assert all(w is not None for _, w, _, _ in probs)
    later = [(ids, w, plain, p) for ids, w, plain, p in probs[2:] if solved[0] in ids]
    assert later
    for ids, w, plain, p in later:
        i = ids.index(solved[0])
        assert w[i] == pytest.approx(0.01) and all(x == 1.0 for j, x in enumerate(w) if j != i)
        assert p[i] / plain[i] == pytest.approx(0.01 * p[i - 1] / plain[i - 1])  # 100× less likely than before


@pytest.mark.slow
def test_a_run_with_replay_and_adversarial_sampling_resumes_as_if_it_had_not_stopped(tmp_path, monkeypatch):
    from pipeline.train.worker import run_worker

    keys = dict(replay="true", adversarial="true", max_age=3)
    ref = make_project(tmp_path / "ref")
    monkeypatch.chdir(ref)
    a = run_worker(_params("params-r.yaml", **keys), ckpt="ckpt", out="models/policy-r")
    proj = make_project(tmp_path / "stopped")
    monkeypatch.chdir(proj)
    params = _params("params-r.yaml", **keys)
    run_worker(params, ckpt="ckpt", out="models/policy-r", stop_after=3)  # checkpoint of update 2 on disk
    b = run_worker(params, ckpt="ckpt", out="models/policy-r")
    assert len(a["history"]) == len(b["history"]) == 4
    assert any(h["replay/replayed"] > 0 for h in b["history"][2:])
    skip = ("sys/", "charts/")
    for x, y in zip(a["history"], b["history"]):
        assert {k: v for k, v in x.items() if not k.startswith(skip)} == \
            pytest.approx({k: v for k, v in y.items() if not k.startswith(skip)}, nan_ok=True)
    assert a["evals"] == b["evals"]


def test_ppo_trains_replayed_rows_with_fresh_gae(in_project):
    from pipeline.train.worker import run_worker

    params = _params("params-replay-ppo.yaml", replay="true")
    text = Path(params).read_text().replace("  algorithm: rloo", "  algorithm: ppo")
    Path(params).write_text(text)
    h = run_worker(params, ckpt="ckpt-replay-ppo", out="models/policy-replay-ppo", stop_after=2)["history"]
    assert h[0]["replay/stored"] > 0 and h[1]["replay/rows_trained"] > 0
    assert all(np.isfinite(x["losses/grad_norm"]) and "losses/value_loss" in x for x in h)


@pytest.mark.slow
def test_two_deepspeed_ranks_share_one_store_and_checkpoint_it(tmp_path):
    """With 2 ranks every rank stores every rank's episodes (gathered), so rank 0's checkpoint holds the whole store
    and the task outcomes; each rank trains its share of the replayed episodes."""
    from tests.test_train import _worker

    proj = make_project(tmp_path / "p", ranks=2)
    text = (proj / "params.yaml").read_text().rstrip("\n")
    (proj / "params.yaml").write_text(text + "\n  sampling:\n    replay: true\n    slice_turns: 1\n"
                                      "    adversarial: true\n")
    out = _worker(proj, ranks=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (state,) = (proj / "checkpoints/train").glob("*/update-4/mp_rank_00_model_states.pt")
    client = torch.load(state, weights_only=False)
    h, states = client["history"], client["extensions"]  # each extension's state under its name
    # what an update stores (every rank's episodes) is what its store grew by, on rank 0 too
    assert [x["replay/stored"] for x in h] == [x["replay/size_after"] - x["replay/size"] for x in h]
    assert len(states["replay"]["entries"]) == h[-1]["replay/size_after"] > 2
    assert {e["record"]["policy_version"] for e in states["replay"]["entries"]} >= {0, 1}
    assert h[0]["replay/replayed"] == 0 and all(x["replay/replayed"] > 0 for x in h[1:])
    assert len(states["adversarial"]["outcomes"]) == h[-1]["sampling/adversarial_tasks_seen"] > 0
