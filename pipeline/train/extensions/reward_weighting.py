"""Extension `reward_weighting` (``train.reward.weighting`` other than 'fixed'; docs/design.md §3.6.1): how
an episode's reward components become the return RL maximises. Config: `train.reward`
(:class:`pipeline.train.config.RewardConfig`); the credit of that return to turns is the kernel's per-turn credit, with
the discounts of :mod:`pipeline.train.extensions.event_credit` under ``credit: event``.

The environment pays R = Σ_i α_i·x_i over the components x = (correctness, efficiency, safety, user_experience) with
the fixed weights α of `env.reward` (efficiency and user experience only count in a correct episode under
`env.reward.shaping: on_success`, see :mod:`pipeline.envs.reward`). Episode records carry the components, so the
learner can recompute the return with other weights. Three modes (`train.reward.weighting`):

- ``fixed`` (default): the environment's return, untouched (no state, no metric, the run is byte-identical).
- ``softmax`` (dynamic weighting): w_i = α_i · n · softmax(Q/τ)_i, n = 4 components. Q_i is component i's *shortfall*
  over the last `window` episodes where it counts: Q_i = best_i − mean_i, best = (1, 0, 0, 1), the top of each
  component's documented range (every range spans 1, so the shortfalls are comparable). The weight goes to where the
  policy is weakest. The multipliers n·softmax average 1, so the total scale stays the fixed weights' and equal
  shortfalls (the first update, before any episode is in the window) give exactly α.
- ``lagrange`` (constrained optimisation): maximise α_correctness·correctness subject to mean x_j ≥ b_j for every
  component j in `thresholds` (e.g. safety ≥ −0.01, efficiency ≥ −0.25). The return is
  α_c·correctness + Σ_j λ_j·(x_j − b_j), and after each update projected dual ascent moves
  λ_j ← clip(λ_j − η·(mean_j − b_j), 0, λ_max): λ rises while the batch violates the constraint and falls while it
  holds. λ starts at the environment's weight α_j. Components without a threshold (user experience by default) do
  not enter the return.

In both dynamic modes a term counts only where the environment's shaping rule counts it (so a failed episode is not
paid for giving up early), the statistics (Q's window, the constraint means) are taken over the same counted values,
and only over the policy's own episodes of every rank (expert demonstrations that replace failed rollouts are left
out), so every rank keeps the same state. The weights an update uses come from the episodes before it; the update's
episodes then enter the state. A record's `extra_reward` (another reward source, the learned verifier, adds it to
`return`) is added to the recomputed return unchanged.

**With per-turn credit** (`credit: turn|event`) the components are only known at the episode's end, so the step
rewards keep the environment's timing and amounts, and the difference R' − R between the recomputed and the recorded
return is paid on the episode's last turn: the first turn's return (γ = 1) is R' exactly, and a violation is still
charged when it happens.

The maths are pure functions (numpy in, numpy out) with hand-computed tests; :class:`RewardWeighting` holds the state
(`state_dict` / `load_state_dict`, checkpointed as the extension's state); :class:`ReturnWeighting` joins it to the
learner's scoring (:meth:`pipeline.train.extensions.base.Extension.reweight`).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.core.errors import AgentRLError
from pipeline.train.config import COMPONENTS, RewardConfig
from pipeline.train.extensions.base import Extension

BEST = np.array([1.0, 0.0, 0.0, 1.0])  # top of each component's range (pipeline.envs.reward)
SHAPED = np.array([False, True, False, True])  # terms that `env.reward.shaping: on_success` counts only on success
# what an update reports into metrics/train_curve.csv when a mode is on (pipeline.train.worker)
REWARD_CURVE_KEYS = (*(f"reward/w_{c}" for c in COMPONENTS), *(f"reward/lambda_{c}" for c in COMPONENTS[1:]),
                     *(f"reward/constraint_{c}" for c in COMPONENTS[1:]), "reward/return_mean")


# ----------------------------------------------------------------------------------------------------- pure maths
def component_matrix(records: list[dict], shaping: str) -> tuple[np.ndarray, np.ndarray]:
    """(episodes, 4) component values in :data:`COMPONENTS` order and the (episodes, 4) mask of the terms that count
    (all, or under 'on_success' efficiency and user experience only where correctness > 0, as the environment)."""
    try:
        x = np.array([[float(r["components"][c]) for c in COMPONENTS] for r in records], dtype=np.float64)
    except (KeyError, TypeError) as exc:
        raise AgentRLError(f"train.reward.weighting recomputes returns from the records' reward components, and a "
                           f"record lacks {exc} (records carry `components`: {list(COMPONENTS)})") from None
    x = x.reshape(len(records), len(COMPONENTS))
    counted = np.ones_like(x, dtype=bool)
    if shaping != "always":
        counted[:, SHAPED] = (x[:, 0] > 0)[:, None]
    return x, counted


def shortfalls(means: np.ndarray, best: np.ndarray = BEST) -> np.ndarray:
    """Q_i = best_i − mean_i: how far each component's recent mean is below its best.

    >>> shortfalls(np.array([0.25, -0.1, 0.0, 0.5])).tolist()
    [0.75, 0.1, 0.0, 0.5]
    """
    return best - means


def softmax_weights(q: np.ndarray, base: np.ndarray, tau: float) -> np.ndarray:
    """w_i = base_i · n · softmax(q/τ)_i: the fixed weights reweighted towards large shortfalls q; the multipliers
    average 1 and equal q give `base` exactly.

    >>> softmax_weights(np.array([np.log(3.0), 0, 0, 0]), np.array([1.0, 0.5, 1.0, 0.1]), 1.0).round(4).tolist()
    [2.0, 0.3333, 0.6667, 0.0667]
    """
    z = q / tau
    e = np.exp(z - z.max())
    return base * len(q) * e / e.sum()


def weighted_returns(x: np.ndarray, counted: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """R_e = Σ_i w_i·x_{e,i} over the counted terms: (episodes, n), (episodes, n), (n,) -> (episodes,)."""
    return (x * counted * weights).sum(1)


def lagrangian_returns(correctness: np.ndarray, w_c: float, g: np.ndarray, counted: np.ndarray,
                       lambdas: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """R_e = w_c·correctness_e + Σ_j λ_j·(g_{e,j} − b_j) over the counted constrained terms.

    >>> lagrangian_returns(np.array([1.0, 0.0]), 1.0, np.array([[0.0, -0.5], [-1.0, 0.0]]),
    ...                    np.array([[True, True], [True, False]]), np.array([2.0, 1.0]), np.array([-0.01, -0.25])).tolist()
    [0.77, -1.98]
    """
    return w_c * correctness + ((g - thresholds) * counted * lambdas).sum(1)


def dual_ascent(lambdas: np.ndarray, means: np.ndarray, thresholds: np.ndarray, lr: float,
                lambda_max: float) -> np.ndarray:
    """Projected dual step λ ← clip(λ − η·(mean − b), 0, λ_max) for constraints mean ≥ b; a NaN mean (no counted
    value this update) leaves its λ unchanged.

    >>> dual_ascent(np.array([1.0, 0.5, 2.0]), np.array([-0.21, 0.0, np.nan]), np.array([-0.01, -0.25, -0.1]),
    ...             1.0, 10.0).round(6).tolist()
    [1.2, 0.25, 2.0]
    """
    step = np.where(np.isnan(means), 0.0, means - thresholds)
    return np.clip(lambdas - lr * step, 0.0, lambda_max)


# ----------------------------------------------------------------------------------------------------------- state
class RewardWeighting:
    """The state of a dynamic weighting mode (`softmax` or `lagrange`) and the returns it gives."""

    def __init__(self, cfg: RewardConfig, base):
        """`base`: the environment's RewardWeights (α and the shaping rule)."""
        if cfg.weighting == "fixed":
            raise ValueError("RewardWeighting is for the 'softmax' and 'lagrange' modes; 'fixed' needs no state")
        self.cfg, self.shaping = cfg, base.shaping
        self.base = np.array([float(getattr(base, c)) for c in COMPONENTS])
        self.windows = [deque(maxlen=cfg.window) for _ in COMPONENTS]
        self.constrained = [c for c in COMPONENTS[1:] if c in cfg.thresholds]
        self.b = np.array([cfg.thresholds[c] for c in self.constrained])
        self.idx = [COMPONENTS.index(c) for c in self.constrained]
        self.lambdas = self.base[self.idx].copy()

    def weights(self) -> np.ndarray:
        """softmax: the current w (equal shortfalls, i.e. α, while a window is empty)."""
        means = np.array([np.mean(w) if w else b for w, b in zip(self.windows, BEST)])
        return softmax_weights(shortfalls(means), self.base, self.cfg.temperature)

    def returns(self, records: list[dict]) -> tuple[np.ndarray, dict]:
        """(episodes,) recomputed returns of `records` (their `extra_reward` added) with the current state, and the
        state as metrics (``reward/w_*`` or ``reward/lambda_*``, and their mean return)."""
        x, counted = component_matrix(records, self.shaping)
        extra = np.array([float(r.get("extra_reward") or 0.0) for r in records])
        if self.cfg.weighting == "softmax":
            w = self.weights()
            out = weighted_returns(x, counted, w)
            mets = {f"reward/w_{c}": float(v) for c, v in zip(COMPONENTS, w)}
            mets.update({f"reward/q_{c}": float(q) for c, q in
                         zip(COMPONENTS, shortfalls(np.array([np.mean(d) if d else b
                                                              for d, b in zip(self.windows, BEST)])))})
        else:
            out = lagrangian_returns(x[:, 0], self.base[0], x[:, self.idx], counted[:, self.idx], self.lambdas, self.b)
            mets = {f"reward/lambda_{c}": float(v) for c, v in zip(self.constrained, self.lambdas)}
        out = out + extra
        mets["reward/return_mean"] = float(out.mean()) if len(out) else 0.0
        return out, mets

    def update(self, parts: list[tuple[list, list]]) -> dict:
        """Takes one update's policy episodes of every rank, ``[(values, counted), ...]`` (one pair per rank, from
        :func:`component_matrix` as lists), into the state; returns the batch's constraint means (lagrange)."""
        x = np.array([row for vals, _ in parts for row in vals], dtype=np.float64).reshape(-1, len(COMPONENTS))
        m = np.array([row for _, cnt in parts for row in cnt], dtype=bool).reshape(-1, len(COMPONENTS))
        if self.cfg.weighting == "softmax":
            for i, window in enumerate(self.windows):
                window.extend(x[m[:, i], i].tolist())
            return {}
        means = np.array([x[m[:, i], i].mean() if m[:, i].any() else np.nan for i in self.idx])
        self.lambdas = dual_ascent(self.lambdas, means, self.b, self.cfg.lambda_lr, self.cfg.lambda_max)
        return {f"reward/constraint_{c}": float(v) for c, v in zip(self.constrained, means) if not np.isnan(v)}

    def state_dict(self) -> dict:
        return {"weighting": self.cfg.weighting, "windows": [list(w) for w in self.windows],
                "lambdas": self.lambdas.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if state["weighting"] != self.cfg.weighting:
            raise AgentRLError(f"the checkpoint's reward weighting is {state['weighting']!r}, this run's "
                               f"{self.cfg.weighting!r}; delete the checkpoint folder to start over")
        self.windows = [deque(w, maxlen=self.cfg.window) for w in state["windows"]]
        self.lambdas = np.array(state["lambdas"], dtype=np.float64)


def make_reward_weighting(cfg: RewardConfig, base) -> RewardWeighting | None:
    """The state of `cfg.weighting` against the environment's weights `base` (None for 'fixed')."""
    return None if cfg.weighting == "fixed" else RewardWeighting(cfg, base)


def policy_components(records: list[dict], shaping: str) -> tuple[list, list]:
    """The component values and counted-term mask of the policy's own episodes (demonstrations left out), as lists
    for an all-gather."""
    own = [r for r in records if not r.get("demonstrated")]
    if not own:
        return [], []
    x, counted = component_matrix(own, shaping)
    return x.tolist(), counted.tolist()


class ReturnWeighting(Extension):
    """On when ``train.reward.weighting`` is 'softmax' or 'lagrange'."""

    name = "reward_weighting"
    curve_keys = REWARD_CURVE_KEYS

    def __init__(self, state: RewardWeighting):
        self.state = state

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return None if cfg.reward.weighting == "fixed" else cls(RewardWeighting(cfg.reward, env_cfg.reward))

    def reweight(self, records: list[dict], gather=None) -> tuple[list[dict], np.ndarray, dict]:
        """Copies of `records` whose ``return`` is recomputed from their reward components with the weighting's
        current state, which then takes the policy episodes of every rank (`gather`, e.g. ``Dist.all_gather``; None:
        this process only); also R' − R per episode and the metrics."""
        return reweight_returns(records, self.state, gather)

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict, loop) -> None:
        self.state.load_state_dict(state)


def reweight_returns(records: list[dict], rw: RewardWeighting, gather=None) -> tuple[list[dict], np.ndarray, dict]:
    """See :meth:`ReturnWeighting.reweight`."""
    returns, mets = rw.returns(records)
    mets.update(rw.update((gather or (lambda x: [x]))(policy_components(records, rw.shaping))))
    delta = returns - np.array([float(r["return"]) for r in records], dtype=np.float64)
    return [{**r, "return": float(x)} for r, x in zip(records, returns)], delta, mets
