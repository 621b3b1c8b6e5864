"""The composite reward R = α·correctness + β·efficiency + γ·safety + δ·user_experience (docs/design.md
§1.3, §3.6).

Each component is a small pure function with a documented range:

- correctness ∈ {0, 1}: the answer matches the ground truth;
- efficiency ∈ [−1, 0]: −(calls beyond the task's minimum) / max_steps — wasted calls (invalid ones included) cost;
- safety ∈ [−1, 0]: −1 per refused unsafe call (a write the task does not allow), capped at −1;
- user_experience ∈ [0, 1]: the user got an answer, discounted by the share of calls that failed
  (invalid actions, schema errors, tool errors); 0 when the episode ends without an answer.

With ``reward.shaping: on_success`` (the default) β·efficiency and δ·user_experience count only in an episode whose
answer is correct (see :class:`pipeline.envs.config.RewardWeights` for the measured reason). The environment pays the
reward per step as the change of R, so the step rewards of an episode sum to R and a wasted or unsafe call is charged
at the step it happens (per-turn credit for RL, docs/design.md §2.2).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.envs.config import RewardWeights


@dataclass(frozen=True)
class RewardComponents:
    correctness: float = 0.0
    efficiency: float = 0.0
    safety: float = 0.0
    user_experience: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def correctness(answered_correctly: bool) -> float:
    """
    >>> correctness(True), correctness(False)
    (1.0, 0.0)
    """
    return 1.0 if answered_correctly else 0.0


def efficiency(n_calls: int, min_calls: int, max_steps: int) -> float:
    """
    >>> efficiency(4, 4, 8), efficiency(6, 4, 8), efficiency(20, 2, 8)
    (0.0, -0.25, -1.0)
    """
    return 0.0 - min(1.0, max(0, n_calls - min_calls) / max_steps)


def safety(n_violations: int) -> float:
    """
    >>> safety(0), safety(3)
    (0.0, -1.0)
    """
    return 0.0 - min(1.0, float(n_violations))


def user_experience(answered: bool, n_failed: int, n_calls: int) -> float:
    """
    >>> user_experience(True, 0, 3), user_experience(True, 1, 4), user_experience(False, 0, 2)
    (1.0, 0.75, 0.0)
    """
    if not answered or n_calls <= 0:
        return 0.0
    return 1.0 - min(n_failed, n_calls) / n_calls


def composite(c: RewardComponents, w: RewardWeights) -> float:
    """
    >>> composite(RewardComponents(1, -0.25, 0, 1), RewardWeights(correctness=1, efficiency=0.4, safety=1, user_experience=0.1))
    1.0
    >>> composite(RewardComponents(0, -0.5, 0, 1), RewardWeights(efficiency=0.4, user_experience=0.1))
    0.0
    >>> round(composite(RewardComponents(0, -0.5, 0, 1), RewardWeights(efficiency=0.4, user_experience=0.1, shaping="always")), 3)
    -0.1
    """
    shaped = w.shaping == "always" or c.correctness > 0  # see RewardWeights.shaping for why
    return (w.correctness * c.correctness + w.safety * c.safety
            + (w.efficiency * c.efficiency + w.user_experience * c.user_experience if shaped else 0.0))
