"""From episode records to advantages: each episode's score (its return, normalised over recent episodes when
`train.reward_norm_window` is on), the returns the credit rule `train.reward.credit` forms from them (per episode, or
per turn from the environment's ``step_rewards``), the group baselines of those returns (:func:`score_episodes`),
and the per-token advantages the policy loss reads (:func:`token_advantages`). The credit rule is the one the
registry of :mod:`pipeline.train.credit` gives, the advantage estimator the one `train.algorithm` names in the
registry of :mod:`pipeline.train.estimators`; this module knows only their kinds (a rule per episode or per turn; a
group baseline, or a critic whose value head the learner trains) and never their names. An extension may recompute
the returns and set the per-turn discounts; see :mod:`pipeline.train.extensions.base`.

The maths itself is in :mod:`pipeline.train.core_algos`, the estimators and the credit rules; this module only
arranges records into their inputs. It does no forward pass: a critic's values come from the learner
(:mod:`pipeline.train.learner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.train import core_algos as A
from pipeline.train.batch import Batch, group_ids_of
from pipeline.train.config import TrainConfig
from pipeline.train.credit import CreditInputs, get_credit
from pipeline.train.estimators import get_estimator
from pipeline.train.sampling import LearnerState


def episode_scores(records: list[dict], state: LearnerState) -> torch.Tensor:
    """(episodes,) the score each episode's advantage starts from: its return R, normalised when reward
    normalisation is on (with the window before this update: :func:`score_episodes` takes these returns into it once
    the credit rule has read the normaliser)."""
    returns = np.array([r["return"] for r in records], dtype=np.float64)
    scores = state.normalizer.normalize(returns) if state.normalizer is not None else returns
    return torch.tensor(scores, dtype=torch.float32)


@dataclass
class Scores:
    """The episode-level outcome of :func:`score_episodes`; tensors are indexed by episode (the records' order)."""

    scores: torch.Tensor  # (episodes,) the score: with a per-episode credit rule its one column (the normalised
    #                       return for `episode`), else the normalised return
    zero_var: torch.Tensor  # (episodes,) bool: the episode's group has all-equal scores (group baselines only)
    episode_adv: torch.Tensor | None = None  # (episodes,) group baseline advantage (per-episode credit)
    turn_adv: torch.Tensor | None = None  # (episodes, turns) group baseline per turn (per-turn credit)
    turn_rewards: torch.Tensor | None = None  # (episodes, turns) normalised reward at each turn's end (per turn)
    turn_mask: torch.Tensor | None = None  # (episodes, turns) 1 on real turns
    turn_gammas: torch.Tensor | None = None  # (episodes, turns) discount after each turn (None: train.gamma)
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
    """Scores and, for group baselines, episode- or turn-level advantages of one update's records (with ``group``),
    from the returns of the credit rule `train.reward.credit`. `extensions` may recompute the returns and set
    per-turn discounts; `gather` collects their statistics over ranks."""
    rule = get_credit(cfg.credit)
    records, delta, metrics = reweight(records, extensions, gather)
    shift, scale = state.normalizer.affine() if state.normalizer is not None else (0.0, 1.0)
    scores = episode_scores(records, state)
    credit = rule.fn(CreditInputs(records, scores, delta, cfg.gamma, shift, scale,
                                  lambda t_mask: turn_discounts(records, t_mask, extensions), cfg))
    if state.normalizer is not None:  # after the rule, which reads the window before this update
        state.normalizer.update(r["return"] for r in records)
    metrics.update(credit.metrics)
    out = Scores(scores=scores, zero_var=torch.zeros(len(records), dtype=torch.bool))
    if rule.per_turn:
        out.turn_rewards, out.turn_mask, out.turn_gammas = credit.rewards, credit.mask, credit.gammas
        metrics["turn_credit/turns_per_episode"] = float(credit.mask.sum(1).mean())
    else:
        out.scores = credit.rewards[:, 0]
    est = get_estimator(cfg.algorithm)
    if not est.critic:
        adv, out.zero_var = est.fn(credit.returns, credit.mask, group_ids_of(records))
        if rule.per_turn:
            out.turn_adv = adv
            spread = (adv.masked_fill(credit.mask == 0, -math.inf).amax(1)
                      - adv.masked_fill(credit.mask == 0, math.inf).amin(1))
            metrics["turn_credit/adv_spread_within_episode"] = float(spread.mean())
        else:
            out.episode_adv = adv[:, 0]
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
    if sc.turn_rewards is not None:  # per-turn credit: each turn's reward on its last token
        rewards = A.turn_token_rewards(sc.turn_rewards, batch.episode, batch.turn, batch.mask)
        if sc.turn_gammas is not None:  # per-turn discounts: each turn's on its last action token
            gamma = A.turn_end_discounts(sc.turn_gammas, batch.episode, batch.turn, batch.mask, cfg.gamma)
    else:
        # on the episode's last action token only: an episode folded into several rows (segments) is paid once
        rewards = A.token_rewards(sc.scores[batch.episode] * A.last_rows(batch.episode), batch.mask)
    return est.fn(rewards, old_values * batch.mask, batch.mask, batch.episode, gamma, cfg.lam)
