"""From episode records to advantages: each episode's score (its return, normalised over recent episodes when
`train.reward_norm_window` is on), the group baselines of GRPO/RLOO at episode or, with `train.turn_credit`, turn
level (:func:`score_episodes`), and the per-token advantages the policy loss reads, through GAE over action tokens
for PPO (:func:`token_advantages`).

The maths itself is in :mod:`pipeline.train.core_algos`; this module only arranges records into its inputs. It does
no forward pass: PPO's values come from the learner (:mod:`pipeline.train.learner`).
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
from pipeline.train.sampling import SamplerState


def turn_rewards(records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each episode's per-turn rewards (the environment's ``step_rewards``), (episodes, turns), with an (episodes,
    turns) mask of real turns. An episode whose rewards do not match its sampled actions (one per turn of the action
    mask) is refused: its credit would land on the wrong tokens."""
    per_ep = []
    for r in records:
        rewards = r.get("step_rewards")
        n_turns = int(A.turn_ids(torch.tensor(r["action_mask"])).max()) + 1
        if rewards is None or len(rewards) != n_turns:
            raise AgentRLError(f"train.turn_credit: episode of task {r.get('task_id')!r} has "
                               f"{'no step_rewards' if rewards is None else f'{len(rewards)} step rewards'} for "
                               f"{n_turns} sampled actions (rollout records carry one reward per action)")
        per_ep.append([float(x) for x in rewards])
    width = max(len(x) for x in per_ep)
    out, mask = torch.zeros(len(per_ep), width), torch.zeros(len(per_ep), width)
    for i, x in enumerate(per_ep):
        out[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1.0
    return out, mask


def episode_scores(records: list[dict], state: SamplerState) -> torch.Tensor:
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
    episode_adv: torch.Tensor | None = None  # (episodes,) group baseline advantage (grpo/rloo without turn credit)
    turn_adv: torch.Tensor | None = None  # (episodes, turns) group baseline per turn (grpo/rloo with turn credit)
    turn_rewards: torch.Tensor | None = None  # (episodes, turns) environment rewards (ppo with turn credit)
    turn_mask: torch.Tensor | None = None  # (episodes, turns) 1 on real turns
    shift: float = 0.0  # the reward normaliser's affine map before this batch: r' = (r − shift) / scale
    scale: float = 1.0
    metrics: dict = field(default_factory=dict)  # turn_credit/* figures


def score_episodes(records: list[dict], cfg: TrainConfig, state: SamplerState) -> Scores:
    """Scores and, for group baselines, episode- or turn-level advantages of one update's records (with ``group``)."""
    if cfg.turn_credit:  # before episode_scores, which updates the normaliser after using it
        t_rewards, t_mask = turn_rewards(records)
        shift, scale = state.normalizer.affine() if state.normalizer is not None else (0.0, 1.0)
        t_returns = A.discounted_returns(t_rewards, cfg.gamma)
    out = Scores(scores=episode_scores(records, state), zero_var=torch.zeros(len(records), dtype=torch.bool))
    groups = group_ids_of(records)
    if cfg.turn_credit:
        out.turn_rewards, out.turn_mask, out.shift, out.scale = t_rewards, t_mask, shift, scale
    if cfg.algorithm in ("grpo", "rloo") and cfg.turn_credit:
        out.turn_adv, out.zero_var = A.turn_advantages((t_returns - shift) / scale * t_mask, t_mask, groups,
                                                       cfg.algorithm)
        spread = (out.turn_adv.masked_fill(t_mask == 0, -math.inf).amax(1)
                  - out.turn_adv.masked_fill(t_mask == 0, math.inf).amin(1))
        out.metrics = {"turn_credit/turns_per_episode": float(t_mask.sum(1).mean()),
                       "turn_credit/adv_spread_within_episode": float(spread.mean())}
    elif cfg.algorithm in ("grpo", "rloo"):
        out.episode_adv, out.zero_var = A.group_advantages(out.scores, groups, cfg.algorithm)
    elif cfg.turn_credit:  # ppo
        out.metrics = {"turn_credit/turns_per_episode": float(t_mask.sum(1).mean())}
    return out


def token_advantages(cfg: TrainConfig, sc: Scores, batch: Batch,
                     old_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, T) advantages of every action token of `batch` and, for PPO, the (rows, T) GAE returns its value loss
    regresses on (None for group baselines). PPO needs `old_values`, the value head's (rows, T) estimates."""
    if cfg.algorithm in ("grpo", "rloo") and cfg.turn_credit:
        return sc.turn_adv[batch.episode[:, None], batch.turn.clamp(min=0)] * batch.mask, None
    if cfg.algorithm in ("grpo", "rloo"):
        return sc.episode_adv[batch.episode][:, None] * batch.mask, None
    if cfg.turn_credit:  # each turn's reward on its last token; the normaliser's shift on the episode's last turn
        t_mask = sc.turn_mask
        last = (t_mask.cumsum(1) == t_mask.sum(1, keepdim=True)) & (t_mask > 0)
        rewards = A.turn_token_rewards((sc.turn_rewards - sc.shift * last.float()) / sc.scale, batch.episode,
                                       batch.turn, batch.mask)
    else:
        # on the episode's last action token only: an episode folded into several rows (segments) is paid once
        rewards = A.token_rewards(sc.scores[batch.episode] * A.last_rows(batch.episode), batch.mask)
    adv, returns = A.compute_gae_over_segments(rewards, old_values * batch.mask, batch.mask, batch.episode,
                                               cfg.gamma, cfg.lam)
    return A.masked_whiten(adv, batch.mask), returns
