"""The reward-hacking guard: an alarm when the learned reward climbs while the rule reward falls.

Statistic: over the last ``window`` updates, the least-squares slope (per update) of the mean learned score and of the
mean rule reward (the environment's return without ``extra_reward``). The alarm fires when the first is above
``learned_slope`` and the second below ``rule_slope`` (e.g. +0.005 and −0.005): the policy is being paid more by the
learned verifier for episodes the rules judge worse -- the signature of a policy exploiting the model. Slopes over a
window rather than two points, so one noisy update neither fires nor hides it; both thresholds are configurable so a
run can demand a larger effect. Pure functions: a constructed series tests them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of `values` against 0, 1, 2, ... (per step); 0 for fewer than two values.

    >>> slope([1.0, 3.0, 5.0]), slope([2.0, 2.0]), slope([1.0, 0.0, 2.0])
    (2.0, 0.0, 0.5)
    """
    y = np.asarray(values, dtype=float)
    if len(y) < 2:
        return 0.0
    x = np.arange(len(y), dtype=float)
    x -= x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def hacking_alarm(learned: Sequence[float], rule: Sequence[float], window: int, learned_slope: float,
                  rule_slope: float) -> tuple[bool, float | None, float | None]:
    """``(fired, learned slope, rule slope)`` over the last `window` values of the two per-update series (aligned,
    oldest first); never fires before `window` updates (slopes None then)."""
    if window < 2:
        raise ValueError(f"the guard's window must be at least 2 updates, got {window}")
    if len(learned) != len(rule):
        raise ValueError(f"the learned and rule series differ in length ({len(learned)} vs {len(rule)})")
    if len(learned) < window:
        return False, None, None
    s_learned, s_rule = slope(learned[-window:]), slope(rule[-window:])
    return (s_learned > learned_slope and s_rule < rule_slope), s_learned, s_rule
