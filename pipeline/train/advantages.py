"""From episode records to advantages: each episode's score (its return, normalised over recent episodes when
`train.reward_norm_window` is on), the group baselines at episode or, with per-turn credit (`train.reward.credit:
turn|event`, or `train.turn_credit`), turn level (:func:`score_episodes`), and the per-token advantages the policy
loss reads (:func:`token_advantages`). The advantage estimator is the one `train.algorithm` names in the registry of
:mod:`pipeline.train.estimators`; this module knows only its kind (a group baseline, or a critic whose value head
the learner trains) and never its name. An extension may recompute the returns and set the per-turn discounts; see
:mod:`pipeline.train.extensions.base`.

The maths itself is in :mod:`pipeline.train.core_algos` and the estimators; this module only arranges records into
their inputs. It does no forward pass: a critic's values come from the learner (:mod:`pipeline.train.learner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.core.errors import AgentRLError
from pipeline.train import core_algos as A
from pipeline.train.batch import Batch, group_ids_of
from pipeline.train.config import TrainConfig
from pipeline.train.estimators import get_estimator
from pipeline.train.sampling import LearnerState


def turn_rewards(records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each episode's per-turn rewards (the environment's ``step_rewards``), (episodes, turns), with an (episodes,
    turns) mask of real turns. An episode whose rewards do not match its sampled actions (one per turn of the action
    mask) is refused: its credit would land on the wrong tokens."""
    per_ep = []
    for r in records:
        rewards = r.get("step_rewards")
        n_turns = int(A.turn_ids(torch.tensor(r["action_mask"])).max()) + 1
        if rewards is None or len(rewards) != n_turns:
            raise AgentRLError(f"per-turn credit: episode of task {r.get('task_id')!r} has "
                               f"{'no step_rewards' if rewards is None else f'{len(rewards)} step rewards'} for "
                               f"{n_turns} sampled actions (rollout records carry one reward per action)")
        per_ep.append([float(x) for x in rewards])
    width = max(len(x) for x in per_ep)
    out, mask = torch.zeros(len(per_ep), width), torch.zeros(len(per_ep), width)
    for i, x in enumerate(per_ep):
        out[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1.0
    return out, mask


def episode_scores(records: list[dict], state: LearnerState) -> torch.Tensor:
    """(episodes,) the score each episode's advantage starts from: its return R, normalised when reward
    normalisation is on (which then takes these returns into its window)."""
    returns = np.array([r["return"] for r in records], dtype=np.float64)
    if state.normalizer is not None:
        scores = state.normalizer.normalize(returns)
        state.normalizer.update(returns)
    else:
        scores = returns
    return torch.tensor(scores, dtype=torch.float32)


@dataclass
class Scores:
    """The episode-level outcome of :func:`score_episodes`; tensors are indexed by episode (the records' order)."""

    scores: torch.Tensor  # (episodes,) return or normalised return
    zero_var: torch.Tensor  # (episodes,) bool: the episode's group has all-equal scores (group baselines only)
    episode_adv: torch.Tensor | None = None  # (episodes,) group baseline advantage (without turn credit)
    turn_adv: torch.Tensor | None = None  # (episodes, turns) group baseline per turn (with turn credit)
    turn_rewards: torch.Tensor | None = None  # (episodes, turns) environment rewards (a critic with turn credit)
    turn_mask: torch.Tensor | None = None  # (episodes, turns) 1 on real turns
    turn_gammas: torch.Tensor | None = None  # (episodes, turns) discount after each turn (an extension's)
    shift: float = 0.0  # the reward normaliser's affine map before this batch: r' = (r − shift) / scale
    scale: float = 1.0
    metrics: dict = field(default_factory=dict)  # turn_credit/*, credit/* and reward/* figures


def reweight(records: list[dict], extensions, gather=None) -> tuple[list[dict], np.ndarray | None, dict]:
    """The records with the returns the extensions recompute (:meth:`~pipeline.train.extensions.base.Extension.reweight`,
    in order), the summed R' − R per episode (None when none changed them) and their metrics."""
    delta, metrics = None, {}
    for ext in extensions:
        records, d, m = ext.reweight(records, gather)
        metrics.update(m)
        if d is not None:
            delta = d if delta is None else delta + d
    return records, delta, metrics


def turn_discounts(records: list[dict], t_mask: torch.Tensor, extensions) -> tuple[torch.Tensor | None, dict]:
    """The per-turn discounts the first extension that gives any gives (None: `train.gamma` after every turn)."""
    for ext in extensions:
        gammas, metrics = ext.turn_discounts(records, t_mask)
        if gammas is not None:
            return gammas, metrics
    return None, {}


def score_episodes(records: list[dict], cfg: TrainConfig, state: LearnerState, gather=None, extensions=()) -> Scores:
    """Scores and, for group baselines, episode- or turn-level advantages of one update's records (with ``group``).
    `extensions` may recompute the returns and set per-turn discounts; `gather` collects their statistics over
    ranks."""
    credit = cfg.credit
    records, delta, metrics = reweight(records, extensions, gather)
    if credit != "episode":  # before episode_scores, which updates the normaliser after using it
        t_rewards, t_mask = turn_rewards(records)
        if delta is not None:  # the recomputed return's difference goes on each episode's last turn
            last = t_mask.sum(1).long() - 1
            t_rewards[torch.arange(len(records)), last] += torch.tensor(delta, dtype=t_rewards.dtype)
        shift, scale = state.normalizer.affine() if state.normalizer is not None else (0.0, 1.0)
        t_gammas, credit_metrics = turn_discounts(records, t_mask, extensions)
        metrics.update(credit_metrics)
        t_returns = (A.stepwise_discounted_returns(t_rewards, t_gammas) if t_gammas is not None
                     else A.discounted_returns(t_rewards, cfg.gamma))
    out = Scores(scores=episode_scores(records, state), zero_var=torch.zeros(len(records), dtype=torch.bool))
    groups = group_ids_of(records)
    if credit != "episode":
        out.turn_rewards, out.turn_mask, out.shift, out.scale = t_rewards, t_mask, shift, scale
        out.turn_gammas = t_gammas
    est = get_estimator(cfg.algorithm)
    if not est.critic and credit != "episode":
        out.turn_adv, out.zero_var = est.fn((t_returns - shift) / scale * t_mask, t_mask, groups)
        spread = (out.turn_adv.masked_fill(t_mask == 0, -math.inf).amax(1)
                  - out.turn_adv.masked_fill(t_mask == 0, math.inf).amin(1))
        metrics.update({"turn_credit/turns_per_episode": float(t_mask.sum(1).mean()),
                        "turn_credit/adv_spread_within_episode": float(spread.mean())})
    elif not est.critic:  # the episode's score is its one "turn"
        adv, out.zero_var = est.fn(out.scores[:, None], torch.ones(len(records), 1), groups)
        out.episode_adv = adv[:, 0]
    elif credit != "episode":  # a critic: GAE reads the turn rewards
        metrics["turn_credit/turns_per_episode"] = float(t_mask.sum(1).mean())
    out.metrics = metrics
    return out


def token_advantages(cfg: TrainConfig, sc: Scores, batch: Batch,
                     old_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, T) advantages of every action token of `batch` and, for a critic, the (rows, T) returns its value loss
    regresses on (None for group baselines). A critic needs `old_values`, the value head's (rows, T) estimates."""
    gamma, est = cfg.gamma, get_estimator(cfg.algorithm)
    if not est.critic and sc.turn_adv is not None:
        return sc.turn_adv[batch.episode[:, None], batch.turn.clamp(min=0)] * batch.mask, None
    if not est.critic:
        return sc.episode_adv[batch.episode][:, None] * batch.mask, None
    if sc.turn_rewards is not None:  # each turn's reward on its last token; the normaliser's shift on the last turn
        t_mask = sc.turn_mask
        last = (t_mask.cumsum(1) == t_mask.sum(1, keepdim=True)) & (t_mask > 0)
        rewards = A.turn_token_rewards((sc.turn_rewards - sc.shift * last.float()) / sc.scale, batch.episode,
                                       batch.turn, batch.mask)
        if sc.turn_gammas is not None:  # per-turn discounts: each turn's on its last action token
            gamma = A.turn_end_discounts(sc.turn_gammas, batch.episode, batch.turn, batch.mask, cfg.gamma)
    else:
        # on the episode's last action token only: an episode folded into several rows (segments) is paid once
        rewards = A.token_rewards(sc.scores[batch.episode] * A.last_rows(batch.episode), batch.mask)
    return est.fn(rewards, old_values * batch.mask, batch.mask, batch.episode, gamma, cfg.lam)
