"""Credit rules, kept in a registry by name as the advantage estimators are (:mod:`pipeline.train.estimators`):
`train.reward.credit` names one, and the kernel (:mod:`pipeline.train.advantages`) asks whatever that name gives for
the returns an estimator reads, without a branch on the name.

A rule is a function ``fn(inputs: CreditInputs) -> Credit`` of one of two kinds (:class:`CreditRule`, ``per_turn``):

- **per episode** (``per_turn=False``): one column per episode. A group baseline's advantage of that column goes on
  every action token of the episode; a critic's reward, the column of :attr:`Credit.rewards`, on the episode's last
  action token (of its last row, when the episode spans several).
- **per turn** (``per_turn=True``): one column per turn (a sampled action) of each episode. Turn t's advantage goes on
  turn t's tokens; a critic's reward for turn t on turn t's last action token, and :attr:`Credit.gammas` (the
  discount after each turn; None: `train.gamma`) on the same token, inside GAE.

Both speak in the reward normaliser's units (`train.reward_norm_window`; the identity when it is off): a return G
becomes (G − shift) / scale, and a reward paid per turn carries the shift on the episode's last turn only.

Built in: ``episode`` (the episode's return: :attr:`CreditInputs.scores`), ``turn`` (the discounted return from each
turn on, R_t = Σ γ^(t'−t) r_t', from the environment's ``step_rewards``) and ``event``, the same per-turn rule whose
discounts the extension :mod:`pipeline.train.extensions.event_credit` gives (it turns itself on with this name and
marks the turns with a key event). Any per-turn rule reads the discounts extensions give through
:attr:`CreditInputs.discounts`. A user adds a rule the way an estimator is added: `train.reward.credit` set to
``module:function`` (per turn, unless the module registered it with :func:`register_credit` and ``per_turn=False``),
or to the name of an entry point of the group :data:`GROUP` whose value is ``module:function``.
``docs/rl-options.md`` shows how.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from pipeline.core.errors import AgentRLError
from pipeline.train.named_functions import installed, resolve
from pipeline.train import core_algos as A

if TYPE_CHECKING:  # the config imports this module to validate `train.reward.credit`
    import numpy as np

GROUP = "agentrl.credit"


@dataclass(frozen=True)
class CreditInputs:
    """What a credit rule may read of one update's episodes (the records' order everywhere)."""

    records: list[dict]  # the episode records, each with ``return`` (an extension may have recomputed it),
    #                      ``step_rewards`` (one per sampled action), ``action_mask``, ``actions``, ``group``
    scores: torch.Tensor  # (episodes,) each episode's return R, normalised: (R − shift) / scale
    delta: "np.ndarray | None"  # (episodes,) R − the recorded R, where extensions recomputed the returns (None: none)
    gamma: float  # train.gamma
    shift: float  # the reward normaliser's affine map before this update: r' = (r − shift) / scale
    scale: float
    discounts: Callable[[torch.Tensor], tuple[torch.Tensor | None, dict]]  # (episodes, turns) mask -> the
    #                      extensions' discount after each turn (None: none gives any) and their metrics
    cfg: Any = None  # the run's TrainConfig, for a rule's own settings


@dataclass
class Credit:
    """What a credit rule gives the estimator: (episodes, columns) tensors, one column per turn for a per-turn rule
    and one per episode otherwise."""

    returns: torch.Tensor  # G from each column on, normalised, 0 off `mask`: what a group baseline reads
    mask: torch.Tensor  # 1 on real columns
    rewards: torch.Tensor  # the reward paid at each column's end, normalised: what a critic's GAE reads
    gammas: torch.Tensor | None = None  # the discount after each column (None: train.gamma)
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CreditRule:
    """One registered credit rule: its name, its function and its kind (see the module docstring)."""

    name: str
    fn: Callable[[CreditInputs], Credit]
    per_turn: bool = True


CREDIT_RULES: dict[str, CreditRule] = {}


def register_credit(name: str, *, per_turn: bool = True) -> Callable:
    """Decorator: registers the function under `name` (a later registration of the same name replaces it)."""
    def wrap(fn: Callable) -> Callable:
        CREDIT_RULES[name] = CreditRule(name, fn, per_turn)
        return fn
    return wrap


def credit_names() -> list[str]:
    """The names `train.reward.credit` accepts besides ``module:function``: registered ones and entry points."""
    return sorted({*CREDIT_RULES, *installed(GROUP)})


def get_credit(spec: str) -> CreditRule:
    """The credit rule `spec` names: a registered name, ``module:function``, or an entry point of :data:`GROUP`.
    Anything else raises one :class:`AgentRLError` that lists the known names."""
    if spec in CREDIT_RULES:
        return CREDIT_RULES[spec]
    fn, registered = resolve(spec, "train.reward.credit", "credit rule", CREDIT_RULES, GROUP)
    return CreditRule(spec, fn, registered.per_turn if registered else True)  # keeps a registered `per_turn`


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


@register_credit("episode", per_turn=False)
def episode_credit(inputs: CreditInputs) -> Credit:
    """The episode's (normalised) return, for all its tokens alike: the default."""
    n = len(inputs.records)
    return Credit(returns=inputs.scores[:, None], mask=torch.ones(n, 1), rewards=inputs.scores[:, None])


@register_credit("turn")
@register_credit("event")  # the same rule: the event_credit extension gives its discounts
def turn_credit(inputs: CreditInputs) -> Credit:
    """G_t = r_t + γ_t·G_{t+1} over the environment's per-turn rewards, γ_t the discounts the extensions give
    (:attr:`CreditInputs.discounts`; none: `train.gamma` after every turn). Returns recomputed by an extension pay
    their difference R' − R on each episode's last turn (the components are only known at the episode's end)."""
    t_rewards, t_mask = turn_rewards(inputs.records)
    if inputs.delta is not None:
        final = t_mask.sum(1).long() - 1
        t_rewards[torch.arange(len(inputs.records)), final] += torch.tensor(inputs.delta, dtype=t_rewards.dtype)
    gammas, metrics = inputs.discounts(t_mask)
    t_returns = (A.stepwise_discounted_returns(t_rewards, gammas) if gammas is not None
                 else A.discounted_returns(t_rewards, inputs.gamma))
    shift, scale = inputs.shift, inputs.scale
    last = (t_mask.cumsum(1) == t_mask.sum(1, keepdim=True)) & (t_mask > 0)
    return Credit(returns=(t_returns - shift) / scale * t_mask, mask=t_mask,
                  rewards=(t_rewards - shift * last.float()) / scale, gammas=gammas, metrics=metrics)
