"""The drift verdict's family-wise rule: one false-alarm level for the whole verdict, not one per check.

The verdict combines several statistical checks, each a test of "the current data come from the reference
distribution" (or, for the calibration, of "the task check fires no more often than its level"):

- ``task_drift``, ``trajectory_drift``: per-feature tests, adjusted across the features of the check (Bonferroni or
  Holm, ``check_drift.correction``); the check's p-value is its smallest adjusted p-value among the features whose
  effect reaches the floor (:attr:`pipeline.check_drift.checks.DriftReport.p_value`);
- ``task_drift_per_env`` (a run over several environments): each environment's task check, Bonferroni across them;
- ``calibration``: the binomial test of the task check's alarms on fresh drift-free samples against its level
  (:class:`pipeline.check_drift.checks.FalseAlarmRate`);
- ``state_drift``: the MMD permutation test's p-value on hidden states.

Were each judged at ``alpha`` on its own, a verdict of ``K`` checks would fail on drift-free data with probability up
to ``K * alpha`` (run 18 of the default project failed on a hidden-state p-value of 0.008 that other seeds put at
0.43 and 0.54). Instead the checks' p-values go through Holm's step-down rule at the family level ``alpha``
(:func:`holm`; Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Statistics 1979): sorted
ascending, the ``i``-th smallest (from 0) is compared with ``alpha / (K - i)`` and the rule stops at the first that
is larger. Whatever the dependence between the checks, the verdict then fails on drift-free data with probability
at most ``alpha`` (and Holm rejects everything Bonferroni's ``alpha / K`` would, and sometimes more). ``K`` counts
the checks that ran; a skipped check takes no share. A failed check's features are judged at the level the rule gave
it, so the drifted features it lists are the ones that carried the decision.

The other checks are exact, not statistical, and gate as they are: ``consistency`` (the training and serving
renderings are identical or they are not) and ``trajectory_suite`` (the phase's own rollouts break the data contract
or they do not). Neither can fire on drift-free data unless something is broken.

The rate this controls is measured, not only argued: ``bench/drift_calibration.py`` draws drift-free and shifted
samples per environment and prints the verdict's false-alarm rate and its power on each known shift
(docs/reliability.md records the figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

STATISTICAL_CHECKS = ("task_drift", "task_drift_per_env", "calibration", "trajectory_drift", "state_drift")
"""Checks with a p-value: judged together by :func:`holm` at the family level ``check_drift.alpha``."""
EXACT_CHECKS = ("consistency", "trajectory_suite")
"""Checks without a p-value: deterministic comparisons that cannot fire on drift-free data, gated as they are."""


@dataclass(frozen=True)
class FamilyDecision:
    """One check's place in the family: its p-value, Holm-adjusted p-value, the level it was judged at, the verdict."""

    p_value: float
    p_holm: float
    level: float
    rejected: bool
    family_size: int

    def to_dict(self) -> dict:
        return asdict(self)


def holm(p_values: Mapping[str, float], alpha: float) -> dict[str, FamilyDecision]:
    """Holm's step-down rule at family level `alpha` over named p-values.

    The ``i``-th smallest p-value (from 0) of ``K`` is rejected when it and every smaller one satisfy
    ``p_(j) <= alpha / (K - j)``; the adjusted p-value is ``max_{j <= i} min(1, (K - j) p_(j))`` and a check is
    rejected exactly when its adjusted p-value is at most `alpha`. `level` is ``alpha / (K - i)`` for a rejected check
    and, for the others, the level at which the rule stopped (so no p-value of a kept check is at most its level).
    Ties keep the order of `p_values`.

    >>> d = holm({"a": 0.004, "b": 0.03, "c": 0.5}, 0.01)    # 3 * 0.004 = 0.012 > 0.01: nothing rejected
    >>> [d[k].rejected for k in "abc"], round(d["a"].p_holm, 3)
    ([False, False, False], 0.012)
    >>> d = holm({"a": 0.002, "b": 0.004, "c": 0.5}, 0.01)   # 0.006 <= 0.01, 2 * 0.004 = 0.008 <= 0.01, 0.5 > 0.01
    >>> [d[k].rejected for k in "abc"], [round(d[k].level, 4) for k in "abc"]
    ([True, True, False], [0.0033, 0.005, 0.01])
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    names = list(p_values)
    p = np.array([float(p_values[k]) for k in names], dtype=float)
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"p-values must lie in [0, 1], got {dict(zip(names, p.tolist()))}")
    k = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (k - np.arange(k))))
    rejected = adjusted <= alpha
    stop = int(np.argmin(rejected)) if not rejected.all() else k  # rank of the first check kept
    out: dict[str, FamilyDecision] = {}
    for rank, i in enumerate(order):
        level = alpha / (k - rank) if rejected[rank] else alpha / (k - stop)
        out[names[i]] = FamilyDecision(float(p[i]), float(adjusted[rank]), float(level), bool(rejected[rank]), k)
    return out


def per_environment_p_value(p_values: Mapping[str, float]) -> float:
    """The p-value of "no environment's task check fired": Bonferroni across the environments' check p-values.

    >>> per_environment_p_value({"a": 0.002, "b": 0.4})
    0.004
    """
    return min(1.0, len(p_values) * min(p_values.values())) if p_values else 1.0


@dataclass(frozen=True)
class PerEnvironment:
    """The task check of each environment of a run over several, as one statistical check: its p-value is
    :func:`per_environment_p_value`, and at level ``l`` each environment is judged at ``l / (environments)``."""

    reports: dict  # environment -> DriftReport
    skipped: dict  # environment -> why it was not tested

    @property
    def p_value(self) -> float:
        return per_environment_p_value({env: r.p_value for env, r in self.reports.items()})

    @property
    def status(self) -> str:
        if not self.reports:
            return "skipped"
        return "fail" if any(r.status == "fail" for r in self.reports.values()) else "pass"

    def at_level(self, level: float) -> "PerEnvironment":
        n = max(1, len(self.reports))
        return PerEnvironment({env: r.at_level(level / n) for env, r in self.reports.items()}, dict(self.skipped))

    def to_dict(self) -> dict:
        envs = {env: r.to_dict() for env, r in self.reports.items()}
        envs.update({env: {"status": "skipped", "reason": why} for env, why in self.skipped.items()})
        return {"status": self.status, "p_value": self.p_value,
                "drifted": sorted(e for e, r in self.reports.items() if r.status == "fail"),
                "environments": dict(sorted(envs.items()))}


def combine(statistical: Mapping[str, object], alpha: float) -> dict[str, tuple[object, FamilyDecision]]:
    """Judge every statistical check at the level :func:`holm` gives it: `statistical` maps a check's name to an
    object with ``p_value`` and ``at_level(level)`` (a report, an MMD result, a false-alarm rate, or a per-environment
    group); returns each judged object with its family decision."""
    unknown = sorted(set(statistical) - set(STATISTICAL_CHECKS))
    if unknown:
        raise ValueError(f"{unknown} are not statistical checks; they are {list(STATISTICAL_CHECKS)}")
    decisions = holm({name: obj.p_value for name, obj in statistical.items()}, alpha)
    return {name: (obj.at_level(decisions[name].level), decisions[name]) for name, obj in statistical.items()}


def overall(checks: Mapping[str, dict]) -> tuple[bool, list[str]]:
    """Whether the verdict passes and the failed checks (sorted): a statistical check fails when the family rule
    rejected it, an exact check when it failed."""
    failed = sorted(name for name, c in checks.items() if c.get("status") == "fail")
    return not failed, failed


__all__ = ["EXACT_CHECKS", "STATISTICAL_CHECKS", "FamilyDecision", "PerEnvironment", "combine", "holm", "overall",
           "per_environment_p_value"]
