"""Advantage estimators, kept in a registry by name as verl's ``core_algos`` keeps its own: `train.algorithm` names
one, and the kernel (:mod:`pipeline.train.advantages`) calls whatever that name gives without a branch on it.

An estimator is a pure function of tensors of one of two kinds (:class:`Estimator`, ``critic``):

- **group baseline** (critic-free; ``critic=False``): ``fn(returns, mask, group_ids) -> (advantages,
  zero_variance)``. `returns` (episodes, turns) is G_{e,t}, the (normalised) return from turn t on, padded after each
  episode's last turn, `mask` (episodes, turns) 1 on real turns, `group_ids` (episodes,) the group (task) of each
  episode. It returns the (episodes, turns) advantages, zero off `mask`, and a (episodes,) bool: the episode's group
  carries no signal (all-equal returns, or a group of one), so the learner may leave it out of the loss
  (`train.skip_zero_variance_groups`). With episode credit (the default) `returns` has one column, the episode's
  score; with per-turn credit the later columns are the returns from each later turn.
- **critic** (``critic=True``: the policy gets a value head): ``fn(rewards, values, mask, episode, gamma, lam) ->
  (advantages, returns)`` over the learner's token rows, (rows, T) each: `rewards` on action tokens (the episode's
  score on its last action, or each turn's reward on the turn's last token), `values` the value head's V_old,
  `mask` the action mask, `episode` (rows,) the episode of each row (an episode may span several rows), `gamma` a
  float or a (rows, T) discount per token, `lam` GAE's λ. `returns` are what the value loss regresses on.

Built in: ``ppo`` (GAE over action tokens with a value head, whitened; Schulman et al. 2016), ``grpo`` (group mean
and std; Shao et al. 2024) and ``rloo`` (leave-one-out mean; Ahmadian et al. 2024). A user adds one the way an
environment or an extension is added: `train.algorithm` set to ``module:function`` (a group baseline, unless the
module registered it with :func:`register_estimator` and ``critic=True``), or to the name of an entry point of the
group :data:`GROUP` whose value is ``module:function``. ``docs/rl-options.md`` shows how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.train.named_functions import installed, resolve
from pipeline.train import core_algos as A

GROUP = "agentrl.estimators"


@dataclass(frozen=True)
class Estimator:
    """One registered advantage estimator: its name, its function and its kind (see the module docstring)."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    critic: bool = False  # True: the policy has a value head and `fn` takes GAE's arguments


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, *, critic: bool = False) -> Callable:
    """Decorator: registers the function under `name` (a later registration of the same name replaces it)."""
    def wrap(fn: Callable) -> Callable:
        ESTIMATORS[name] = Estimator(name, fn, critic)
        return fn
    return wrap


def estimator_names() -> list[str]:
    """The names `train.algorithm` accepts besides ``module:function``: registered ones and installed entry points."""
    return sorted({*ESTIMATORS, *installed(GROUP)})


def get_estimator(spec: str) -> Estimator:
    """The estimator `spec` names: a registered name, ``module:function``, or an entry point of :data:`GROUP`.
    Anything else raises one :class:`AgentRLError` that lists the known names."""
    if spec in ESTIMATORS:
        return ESTIMATORS[spec]
    fn, registered = resolve(spec, "train.algorithm", "advantage estimator", ESTIMATORS, GROUP)
    return Estimator(spec, fn, registered.critic if registered else False)  # keeps a registered `critic`


def _per_turn(episode_adv: torch.Tensor, scale: torch.Tensor, returns: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """A_{e,t} = A_e + (G_{e,t} − G_{e,0}) / scale_e on real turns: the first turn's advantage is the episode's
    (exactly: with one column this is A_e), a later turn's differs from it by what was earned (or lost) before that
    turn, in the baseline's scale."""
    later = episode_adv[:, None] + (returns[:, 1:] - returns[:, :1]) / scale[:, None]
    return torch.cat([episode_adv[:, None], later], dim=1) * mask


def _group_baseline(returns: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                    centre: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A group estimator from `centre(scores of one group) -> (advantages, scale)`, applied to G_{·,0} group by
    group. A group of one gets advantage 0 (nothing to compare with) and is marked zero-variance, as is a group
    whose scores are all equal."""
    scores = returns[:, 0]
    adv = torch.zeros_like(scores)
    scale = torch.ones_like(scores)
    zero_var = torch.zeros_like(scores, dtype=torch.bool)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        s = scores[idx]
        if s.numel() < 2:
            zero_var[idx] = True
            continue
        adv[idx], scale[idx] = centre(s)
        zero_var[idx] = bool((s.max() - s.min()).abs() < 1e-9)
    return _per_turn(adv, scale, returns, mask), zero_var


@register_estimator("grpo")
def grpo(returns: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (G − group mean) / (group std + eps), the std unbiased; later turns in the same scale.

    >>> grpo(torch.tensor([[1.0], [0.0], [0.0], [3.0]]), torch.ones(4, 1), torch.tensor([0, 0, 1, 1]))[0].flatten()
    tensor([ 0.7071, -0.7071, -0.7071,  0.7071])
    """
    def centre(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sd = s.std(unbiased=True) + eps
        return (s - s.mean()) / sd, sd
    return _group_baseline(returns, mask, group_ids, centre)


@register_estimator("rloo")
def rloo(returns: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: G − the mean of the *other* members of the group (leave-one-out), unscaled.

    >>> rloo(torch.tensor([[1.0], [0.0], [0.0], [0.0]]), torch.ones(4, 1), torch.tensor([0, 0, 0, 0]))[0].flatten()
    tensor([ 1.0000, -0.3333, -0.3333, -0.3333])
    """
    def centre(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return s - (s.sum() - s) / (s.numel() - 1), torch.tensor(1.0)
    return _group_baseline(returns, mask, group_ids, centre)


@register_estimator("ppo", critic=True)
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, episode: torch.Tensor,
        gamma: float | torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's advantages: GAE(γ, λ) over each episode's action tokens across its rows
    (:func:`pipeline.train.core_algos.compute_gae_over_segments`), whitened over the batch's action tokens; the
    returns are the unwhitened A + V."""
    adv, returns = A.compute_gae_over_segments(rewards, values, mask, episode, gamma, lam)
    return A.masked_whiten(adv, mask), returns
