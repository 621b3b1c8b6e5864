"""Drift tests (per feature and multivariate), and the samples that show they fire on drift and stay quiet without it.

Per-feature tests (scipy.stats, :func:`compare_features`):

- categorical features (family, level, template, tool sequence, success): Pearson's chi-square test of homogeneity on
  the 2 x K table of counts (``scipy.stats.chi2_contingency``, no continuity correction). Categories whose *expected*
  count is below ``min_expected_count`` in either sample are pooled into one ``(other)`` column first (Cochran's rule:
  the chi-square approximation is unreliable below 5); a pool that is still too small joins the smallest remaining
  category; with fewer than two categories left the test is skipped and says so. Categories the reference never saw
  are listed in the result whatever their count;
- continuous features (lengths, values, returns, counts): the two-sample Kolmogorov-Smirnov test
  (``scipy.stats.ks_2samp``; exact for small samples, asymptotic for large). On discrete features (counts) it is
  conservative, which errs on the side of fewer false alarms.

Multiple testing: one check runs m feature tests, so its p-values are adjusted with Bonferroni (p * m) or Holm (the
step-down version: the same family-wise error guarantee, never less powerful), valid under any dependence between
the features, which matters here: return, success and correctness move together. A feature counts as drifted only if
its adjusted p-value is at most the check's level *and* its effect size reaches a floor (KS statistic D; Cohen's w =
sqrt(chi2 / n) for chi-square): with 100k samples a difference of no practical consequence is still significant. The
check's own p-value (:attr:`DriftReport.p_value`) is its smallest adjusted p-value among the features at or above
their floor; the phase judges it with the verdict's other checks at one family level
(:mod:`pipeline.check_drift.verdict`), and a report judged alone uses ``alpha``.

Outcome features of the behaviour check (success, return, correctness; ``check_drift.trajectory_outcomes``): by
default they are tested as a family of their own and reported, but do not fail the check. The reference episodes are
the policy's rollouts on its own training tasks, where a policy that fits its training set always does better than on
new tasks, so an outcome test measures the generalisation gap, not drift; whether the policy is good enough on new
data is the promotion gate's held-out comparison with the champion. The behaviour features (what the policy does:
tool sequences, calls, failed calls, lengths) stay gated; ``'test'`` gates the outcomes too.

Multivariate test on the policy's hidden states (:func:`mmd_test`): a kernel two-sample test, the maximum mean
discrepancy with a Gaussian (RBF) kernel whose bandwidth is the median pairwise distance of the pooled sample (the
median heuristic; Gretton et al., "A Kernel Two-Sample Test", JMLR 2012), with its p-value from a permutation test
with a fixed seed, ``p = (1 + #{permuted >= observed}) / (1 + permutations)`` (never 0, exact at any sample size).
Its level holds only for independent observations: the phase gives it one random step per episode
(:func:`pipeline.check_drift.features.observation_contexts`), and 2,000 permutations by default, so that the smallest
p-value (0.0005) lies well below the level the verdict's family rule gives the check. Chosen over a classifier
two-sample test because it needs no training, no train/test split of
already small samples and no classifier hyper-parameters; the permutation p-value is exact at any sample size (the
test's level is alpha by construction), and all permutations are evaluated together as one matrix multiplication with the
kernel matrix, so 500 permutations of 200 + 200 observations take tens of milliseconds. Both sides are subsampled to
``max_hidden_samples`` before embedding, because the forward passes are the expensive part.

Samples (:func:`make_reference_sample`, :func:`make_drifted_tasks`): fresh samples of the reference distribution come
from the environment's own generator (:meth:`Environment.sample_tasks`) with a new seed; the documented drifted
datasets are a shifted level mix (``level_shift``) and shifted values (``value_shift``: the environment's
:meth:`Environment.value_shifted` copy of the world; the default world redraws one numeric attribute of every entity
from the upper half of its allowed range; answers recomputed on that copy).
:func:`false_alarm_rate` runs a check on repeated drift-free pairs and tests its alarms against the check's level
(binomial); the calibration's fresh samples are subsamples of split-sized draws (``drawn_as``), exchangeable with the
reference split even where the generator draws distinct tasks from a bounded space.

Deliberately left out: sequential monitoring (each run is one batch comparison) and per-level conditional tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from pipeline.check_drift.config import DriftConfig
from pipeline.core.errors import AgentRLError
from pipeline.check_drift.features import (OUTCOME_FEATURES, TRAJECTORY_FEATURES, Feature, task_feature_specs,
                                           task_features, trajectory_features)

OTHER = "(other)"
SHOWN_CATEGORIES = 8  # categories listed per chi-square result (largest share changes first)


# =================================================================================================== results
@dataclass(frozen=True)
class FeatureTest:
    """The outcome of one feature's test; `p_adjusted` and `drifted` are set by :func:`compare_features`."""

    feature: str
    kind: str
    test: str  # "chi2", "ks" or "skipped"
    n_reference: int
    n_current: int
    statistic: float | None = None
    effect: float | None = None  # KS: D; chi-square: Cohen's w
    p_value: float | None = None
    p_adjusted: float | None = None
    floor: float | None = None  # the effect size a drifted feature must reach (ks_min_statistic or chi2_min_effect)
    drifted: bool = False
    note: str = ""
    decision: str = ""  # why a significant feature did not count as drifted (set by :meth:`decided`)
    details: dict = field(default_factory=dict)

    @property
    def gating_p(self) -> float:
        """The adjusted p-value when the effect reaches its floor, else 1: a feature below the floor can never count
        as drifted, so it takes no part in the check's p-value (which stays valid: it can only grow)."""
        if self.test == "skipped" or self.p_adjusted is None:
            return 1.0
        return self.p_adjusted if self.effect >= (self.floor or 0.0) else 1.0

    def decided(self, level: float) -> "FeatureTest":
        """This test judged at `level`: drifted when its adjusted p-value is at most `level` and its effect reaches
        the floor."""
        if self.test == "skipped":
            return self
        significant = self.p_adjusted <= level
        drifted = bool(significant and self.effect >= (self.floor or 0.0))
        why = (f"significant but effect {self.effect:.3f} < floor {self.floor}" if significant and not drifted
               else "")
        return dataclasses.replace(self, drifted=drifted, decision=why)

    def describe(self) -> str:
        if self.test == "skipped":
            return f"{self.feature}: skipped ({self.note})"
        flag = "DRIFT" if self.drifted else "ok"
        note = "".join(f"; {x}" for x in (self.note, self.decision) if x)
        return (f"{self.feature}: {flag} ({self.test}, effect {self.effect:.3f}, p {self.p_value:.2e}, adjusted "
                f"{self.p_adjusted:.2e}, n {self.n_reference}/{self.n_current}){note}")


@dataclass(frozen=True)
class DriftReport:
    """One check's per-feature results and verdict (it passes when no feature drifted)."""

    check: str
    alpha: float
    correction: str
    tests: list[FeatureTest]
    reported: list[FeatureTest] = field(default_factory=list)  # tested as their own family; never fail the check
    reported_why: str = ""

    @property
    def tested(self) -> list[FeatureTest]:
        return [t for t in self.tests if t.test != "skipped"]

    @property
    def drifted_features(self) -> list[str]:
        return [t.feature for t in self.tests if t.drifted]

    @property
    def passed(self) -> bool:
        return not self.drifted_features

    @property
    def status(self) -> str:
        """'fail' when a feature drifted, 'skipped' when no feature could be tested, else 'pass'."""
        return "fail" if not self.passed else "pass" if self.tested else "skipped"

    @property
    def p_value(self) -> float:
        """The check's p-value for "no gated feature drifted": the smallest gating adjusted p-value of its features
        (:attr:`FeatureTest.gating_p`; 1 when none is tested). Bonferroni's and Holm's smallest adjusted p-values are
        both ``m`` times the smallest raw one, a valid p-value under any dependence between the features, so the
        check can join the verdict's family-wise rule (:mod:`pipeline.check_drift.verdict`)."""
        return min((t.gating_p for t in self.tested), default=1.0)

    def at_level(self, level: float) -> "DriftReport":
        """The same tests judged at `level` (the level the verdict's family-wise rule gives this check)."""
        return dataclasses.replace(self, alpha=level, tests=[t.decided(level) for t in self.tests])

    def to_dict(self) -> dict:
        return {
            "status": self.status, "alpha": self.alpha, "correction": self.correction, "p_value": self.p_value,
            "n_tests": len(self.tested), "drifted_features": self.drifted_features,
            "skipped_features": {t.feature: t.note for t in self.tests if t.test == "skipped"},
            "features": {t.feature: {k: v for k, v in dataclasses.asdict(t).items() if k != "feature"}
                         for t in self.tests},
            **({"outcomes": {
                "gated": False, "why": self.reported_why,
                "drifted_features": [t.feature for t in self.reported if t.drifted],
                "features": {t.feature: {k: v for k, v in dataclasses.asdict(t).items() if k != "feature"}
                             for t in self.reported}}} if self.reported else {}),
        }

    def describe(self) -> str:
        head = (f"{self.check}: {self.status.upper()} ({len(self.tested)} tests, {self.correction}, "
                f"alpha {self.alpha})")
        lines = [head, *(f"  {t.describe()}" for t in self.tests)]
        if self.reported:
            lines += [f"  reported, not gated ({self.reported_why}):", *(f"    {t.describe()}" for t in self.reported)]
        return "\n".join(lines)


# ============================================================================================ per-feature tests
def _skipped(feature: Feature, n_ref: int, n_cur: int, why: str) -> FeatureTest:
    return FeatureTest(feature.name, feature.kind, "skipped", n_ref, n_cur, note=why)


def chi2_test(feature: Feature, reference: pd.Series, current: pd.Series, min_expected: float = 5.0) -> FeatureTest:
    """Chi-square test of homogeneity of a categorical feature, with rare categories pooled (module docstring)."""
    ref = reference.dropna().astype(str).value_counts()
    cur = current.dropna().astype(str).value_counts()
    n_ref, n_cur = int(ref.sum()), int(cur.sum())
    if n_ref == 0 or n_cur == 0:
        return _skipped(feature, n_ref, n_cur, "no values on one side")
    cats = ref.index.union(cur.index)
    table = pd.DataFrame({"reference": ref.reindex(cats, fill_value=0), "current": cur.reindex(cats, fill_value=0)})
    new = sorted(c for c in cats if ref.get(c, 0) == 0)
    share = table / table.sum()
    top = (share["current"] - share["reference"]).abs().sort_values(ascending=False).index[:SHOWN_CATEGORIES]
    details = {"reference_share": {c: round(float(share.at[c, "reference"]), 4) for c in top},
               "current_share": {c: round(float(share.at[c, "current"]), 4) for c in top},
               "new_categories": new[:SHOWN_CATEGORIES], "n_new_categories": len(new)}
    # Expected count of a category in the smaller sample: its pooled share times that sample's size.
    totals = table.sum(axis=1)
    expected_min = totals * min(n_ref, n_cur) / (n_ref + n_cur)
    small = expected_min < min_expected
    pooled = table[~small]
    note = ""
    if small.any():
        other = table[small].sum()
        note = f"{int(small.sum())} rare categories pooled"
        if other.sum() * min(n_ref, n_cur) / (n_ref + n_cur) >= min_expected or pooled.empty:
            pooled = pd.concat([pooled, other.to_frame(OTHER).T])
        else:  # the pool itself is too small: fold it into the smallest remaining category
            smallest = pooled.sum(axis=1).idxmin()
            pooled = pooled.copy()
            pooled.loc[smallest] += other
            note += f" (and merged into '{smallest}')"
    if len(pooled) < 2:
        return _skipped(feature, n_ref, n_cur, "fewer than two categories with enough expected count"
                        + (f"; {note}" if note else ""))
    chi2, p, dof, _ = stats.chi2_contingency(pooled.to_numpy().T, correction=False)
    effect = float(np.sqrt(chi2 / (n_ref + n_cur)))
    details["dof"] = int(dof)
    return FeatureTest(feature.name, feature.kind, "chi2", n_ref, n_cur, float(chi2), effect, float(p), note=note,
                       details=details)


def ks_test(feature: Feature, reference: pd.Series, current: pd.Series) -> FeatureTest:
    """Two-sample Kolmogorov-Smirnov test of a continuous feature (missing values dropped)."""
    ref = reference.dropna().to_numpy(dtype=float)
    cur = current.dropna().to_numpy(dtype=float)
    res = stats.ks_2samp(ref, cur)
    details = {side: {"mean": round(float(v.mean()), 4), "median": round(float(np.median(v)), 4),
                      "min": float(v.min()), "max": float(v.max())}
               for side, v in (("reference", ref), ("current", cur))}
    return FeatureTest(feature.name, feature.kind, "ks", len(ref), len(cur), float(res.statistic),
                       float(res.statistic), float(res.pvalue), details=details)


def adjust_p_values(p: Sequence[float], method: str) -> np.ndarray:
    """Family-wise adjusted p-values: 'bonferroni' min(1, p m); 'holm' the step-down adjustment.

    >>> adjust_p_values([0.01, 0.04, 0.03], "bonferroni").round(3).tolist()
    [0.03, 0.12, 0.09]
    >>> adjust_p_values([0.01, 0.04, 0.03], "holm").round(3).tolist()
    [0.03, 0.06, 0.06]
    """
    p = np.asarray(p, dtype=float)
    m = len(p)
    if m == 0:
        return p
    if method == "bonferroni":
        return np.minimum(1.0, p * m)
    if method == "holm":
        order = np.argsort(p, kind="stable")
        stepped = np.maximum.accumulate(p[order] * (m - np.arange(m)))
        out = np.empty(m)
        out[order] = np.minimum(1.0, stepped)
        return out
    raise ValueError(f"unknown correction {method!r}; corrections are bonferroni, holm")


def compare_features(reference: Mapping[str, pd.Series], current: Mapping[str, pd.Series],
                     features: Mapping[str, Feature], cfg: DriftConfig, check: str) -> DriftReport:
    """Test every feature in `features` (chi-square or KS by kind), adjust for multiple testing, decide drift."""
    results = []
    for name, feat in features.items():
        ref, cur = reference[name], current[name]
        n_ref, n_cur = int(ref.notna().sum()), int(cur.notna().sum())
        if min(n_ref, n_cur) < cfg.min_samples:
            results.append(_skipped(feat, n_ref, n_cur, f"fewer than min_samples={cfg.min_samples} values on one side"))
        elif feat.kind == "categorical":
            results.append(chi2_test(feat, ref, cur, cfg.min_expected_count))
        else:
            results.append(ks_test(feat, ref, cur))
    tested = [i for i, r in enumerate(results) if r.test != "skipped"]
    adjusted = adjust_p_values([results[i].p_value for i in tested], cfg.correction)
    for i, p_adj in zip(tested, adjusted):
        r = results[i]
        floor = cfg.chi2_min_effect if r.test == "chi2" else cfg.ks_min_statistic
        results[i] = dataclasses.replace(r, p_adjusted=float(p_adj), floor=floor)
    return DriftReport(check, cfg.alpha, cfg.correction, results).at_level(cfg.alpha)


def _selected(registry: Mapping[str, Feature], cfg: DriftConfig) -> dict[str, Feature]:
    return {k: f for k, f in registry.items() if k not in cfg.skip_features}


def task_drift(reference_tasks: Sequence[dict], current_tasks: Sequence[dict], reference_world=None,
               current_world=None, cfg: DriftConfig | None = None) -> DriftReport:
    """Per-feature drift between two sets of task records. Entity values are read from `reference_world` and
    `current_world` (default: the reference world); without a world the entity features are skipped."""
    cfg = cfg or DriftConfig()
    specs = task_feature_specs(reference_world)  # the entity features: the reference world's numeric columns
    fields = [k.removeprefix("entity_") for k, f in specs.items() if f.unit == "entity"]
    ref = task_features(reference_tasks, reference_world, fields)
    cur = task_features(current_tasks, current_world if current_world is not None else reference_world, fields)
    return compare_features(ref, cur, _selected(specs, cfg), cfg, "task_drift")


def _episode_features(episodes) -> dict[str, pd.Series]:
    """The trajectory features of a list of records, or those an episode file computed on load."""
    own = getattr(episodes, "trajectory_features", None)
    return own() if callable(own) else trajectory_features(episodes)


def trajectory_drift(reference: Sequence[dict], current: Sequence[dict], cfg: DriftConfig | None = None) -> DriftReport:
    """Per-feature drift between two sets of episode records (behaviour drift). Either set may be an
    :class:`~pipeline.check_drift.episodes.EpisodeFile`, whose features were extracted chunk by chunk on load."""
    cfg = cfg or DriftConfig()
    ref, cur = _episode_features(reference), _episode_features(current)
    selected = _selected(TRAJECTORY_FEATURES, cfg)
    if cfg.trajectory_outcomes == "test":
        return compare_features(ref, cur, selected, cfg, "trajectory_drift")
    behaviour = {k: f for k, f in selected.items() if k not in OUTCOME_FEATURES}
    outcomes = {k: f for k, f in selected.items() if k in OUTCOME_FEATURES}
    report = compare_features(ref, cur, behaviour, cfg, "trajectory_drift")
    if not outcomes:
        return report
    return dataclasses.replace(report, reported=compare_features(ref, cur, outcomes, cfg, "trajectory_outcomes").tests,
                               reported_why="check_drift.trajectory_outcomes is 'report': an outcome gap between "
                                            "training tasks and new tasks is the policy's generalisation gap, gated "
                                            "by deploy's vs-champion test on held-out data")


# ================================================================================================ multivariate
@dataclass(frozen=True)
class MMDResult:
    """Kernel two-sample test result; `statistic` is the (biased) squared MMD with the RBF kernel."""

    statistic: float
    p_value: float
    bandwidth: float
    n_reference: int
    n_current: int
    permutations: int
    alpha: float

    @property
    def drifted(self) -> bool:
        return self.p_value <= self.alpha

    @property
    def passed(self) -> bool:
        return not self.drifted

    def at_level(self, level: float) -> "MMDResult":
        """The same test judged at `level` (the level the verdict's family-wise rule gives this check)."""
        return dataclasses.replace(self, alpha=level)

    def to_dict(self) -> dict:
        return {"status": "pass" if self.passed else "fail", **dataclasses.asdict(self), "drifted": self.drifted,
                "min_p_value": 1 / (1 + self.permutations)}


def _subsample(x: np.ndarray, k: int | None, rng: np.random.Generator) -> np.ndarray:
    if k is None or len(x) <= k:
        return x
    return x[np.sort(rng.choice(len(x), size=k, replace=False))]


def mmd_test(x: np.ndarray, y: np.ndarray, permutations: int = 500, seed: int = 0, alpha: float = 0.01,
             max_samples: int | None = None, block: int = 256) -> MMDResult:
    """Permutation test of H0: `x` (n, d) and `y` (m, d) come from one distribution; see the module docstring.

    The statistic is ``w^T K w`` with ``w = 1/n`` on the first group and ``-1/m`` on the second (the biased squared
    MMD); each permutation relabels the pooled sample, and all permutations of a block are one matrix multiplication ``K @ W``.
    p = (1 + #{permuted >= observed}) / (1 + permutations)."""
    rng = np.random.default_rng([seed, 5])
    x = _subsample(np.asarray(x, dtype=np.float64), max_samples, rng)
    y = _subsample(np.asarray(y, dtype=np.float64), max_samples, rng)
    n, m = len(x), len(y)
    if n < 2 or m < 2:
        raise ValueError(f"the MMD test needs at least 2 observations per side, got {n} and {m}")
    z = np.vstack([x, y])
    sq = np.einsum("ij,ij->i", z, z)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * z @ z.T, 0.0)
    off = d2[np.triu_indices(len(z), k=1)]
    positive = off[off > 0]
    bandwidth = float(np.sqrt(np.median(positive))) if len(positive) else 1.0
    k = np.exp(-d2 / (2.0 * bandwidth**2))
    N = n + m
    w0 = np.concatenate([np.full(n, 1.0 / n), np.full(m, -1.0 / m)])
    observed = float(w0 @ k @ w0)
    exceed, done = 0, 0
    while done < permutations:
        b = min(block, permutations - done)
        perms = rng.random((b, N)).argsort(axis=1)
        w = np.full((b, N), -1.0 / m)
        np.put_along_axis(w, perms[:, :n], 1.0 / n, axis=1)
        permuted = np.einsum("bi,bi->b", w, w @ k)
        exceed += int(np.sum(permuted >= observed - 1e-12))
        done += b
    return MMDResult(observed, (1 + exceed) / (1 + permutations), bandwidth, n, m, permutations, alpha)


def state_drift(model, tokenizer, reference_contexts: Sequence[str], current_contexts: Sequence[str],
                cfg: DriftConfig | None = None, encode: Callable | None = None) -> MMDResult:
    """MMD test on the policy's mean-pooled last hidden states of two sets of observations (contexts); each side is
    subsampled to ``cfg.max_hidden_samples`` (fixed seed) before embedding."""
    from pipeline.check_drift.features import hidden_state_features

    cfg = cfg or DriftConfig()
    rng = np.random.default_rng([cfg.seed, 6])
    picks = [_subsample(np.arange(len(c)), cfg.max_hidden_samples, rng) for c in (reference_contexts, current_contexts)]
    ref = [reference_contexts[i] for i in picks[0]]
    cur = [current_contexts[i] for i in picks[1]]
    embed = lambda ctx: hidden_state_features(model, tokenizer, ctx, cfg.hidden_batch_size,  # noqa: E731
                                              cfg.hidden_max_tokens, encode, cfg.hidden_dtype)
    return mmd_test(embed(ref), embed(cur), cfg.mmd_permutations, cfg.seed, cfg.alpha)


# ================================================================================================ calibration
@dataclass(frozen=True)
class FalseAlarmRate:
    """How often a check fired on pairs of drift-free samples, and whether that is more than its level allows.

    With `nominal` (the level the check was run at on each pair), :attr:`p_value` is the binomial test of "the
    check's false-alarm rate is at most `nominal`": ``P(Binomial(repeats, nominal) >= alarms)``. Under that
    hypothesis it is a valid p-value (the repeats are independent draws), so the calibration joins the verdict's
    family-wise rule like any other check, instead of failing above a hand-set rate."""

    repeats: int
    alarms: int
    alarms_by_feature: dict[str, int]
    nominal: float | None = None
    level: float | None = None  # the level the verdict's family-wise rule judged p_value at (None: not judged)

    @property
    def rate(self) -> float:
        return self.alarms / self.repeats if self.repeats else float("nan")

    @property
    def p_value(self) -> float:
        if self.nominal is None or not self.alarms:
            return 1.0
        return float(stats.binom.sf(self.alarms - 1, self.repeats, self.nominal))

    @property
    def passed(self) -> bool:
        return self.level is None or self.p_value > self.level

    def at_level(self, level: float) -> "FalseAlarmRate":
        return dataclasses.replace(self, level=level)

    def to_dict(self) -> dict:
        return {"status": "pass" if self.passed else "fail", "repeats": self.repeats, "alarms": self.alarms,
                "rate": self.rate, "nominal": self.nominal, "p_value": self.p_value, "alpha": self.level,
                "alarms_by_feature": self.alarms_by_feature}


def false_alarm_rate(pairs: Iterable[tuple[Any, Any]], check: Callable[[Any, Any], Any],
                     nominal: float | None = None) -> FalseAlarmRate:
    """Run `check(reference, current)` (returning a :class:`DriftReport` or :class:`MMDResult`) on each drift-free
    pair and count the alarms; `nominal`: the level `check` runs at (for :attr:`FalseAlarmRate.p_value`)."""
    repeats = alarms = 0
    by_feature: dict[str, int] = {}
    for ref, cur in pairs:
        result = check(ref, cur)
        repeats += 1
        alarms += int(not result.passed)
        for f in getattr(result, "drifted_features", []):
            by_feature[f] = by_feature.get(f, 0) + 1
    return FalseAlarmRate(repeats, alarms, by_feature, nominal)


# ==================================================================================================== samples
@dataclass(frozen=True)
class Sample:
    """Task records together with the world they were generated on (which the entity features read)."""

    tasks: list[dict]
    world: Any
    kind: str
    description: str


SHIFTED_LEVEL_MIX = {1: 0.1, 2: 0.1, 3: 0.4, 4: 0.4}
"""`level_shift`: most tasks from the two hard levels (the build's default mix is uniform over the four levels)."""

def _build_default(key: str):
    """build_env's default value of `key` (``level_mix``): what a sample is drawn with when the caller does not say,
    so a fresh sample is generated as the default build generates its tasks."""
    from pipeline.build_env.config import BuildEnvConfig

    value = getattr(BuildEnvConfig(), key)
    return dict(value) if isinstance(value, Mapping) else value


def _generate(world, n: int, seed: int, level_mix: Mapping[int, float], split: str, options=None) -> list[dict]:
    """`n` fresh task records from the environment `world` (:meth:`Environment.sample_tasks`); `options`: its build
    options (None: its defaults)."""
    options = options if options is not None else type(world).Options()
    tasks = world.sample_tasks(split, n, dict(level_mix), seed, options)
    if tasks is None:
        raise AgentRLError(f"environment {world.name!r} cannot draw fresh tasks (Environment.sample_tasks), which "
                           f"this drift check needs; set check_drift.false_alarm_repeats: 0 to skip calibration")
    return [t.to_dict() for t in tasks]


def make_reference_sample(world, n: int, seed: int, level_mix: Mapping[int, float] | None = None,
                          split: str = "train", options=None, drawn_as: int | None = None) -> Sample:
    """A fresh sample of `n` tasks from the reference generator: `split`'s entities, the build's level mix
    (`level_mix`, default build_env's default) and options (`options`, default the environment's defaults), a new
    `seed` (use one the build did not: the build uses ``build_env.seed``).

    `drawn_as`: draw that many tasks, as many as the reference split holds, and keep a uniform subsample of `n`.
    A generator that draws distinct tasks from a bounded space (one built-in environment's hardest level holds
    about 1,800 distinct training questions) shifts its mix as a large split uses up the small families, so `n`
    tasks drawn on their own are not exchangeable with a split of 4,000; `n` taken from a split-sized draw are. The calibration
    draws this way (:mod:`pipeline.check_drift.main`); None draws `n` on their own."""
    mix = dict(level_mix or _build_default("level_mix"))
    if drawn_as is None or drawn_as <= n:
        return Sample(_generate(world, n, seed, mix, split, options), world, "reference",
                      f"{n} {split} tasks, level mix {mix}, seed {seed}")
    tasks = _generate(world, drawn_as, seed, mix, split, options)
    keep = np.sort(np.random.default_rng([seed, 9]).choice(drawn_as, size=n, replace=False))
    return Sample([tasks[i] for i in keep], world, "reference",
                  f"{n} of {drawn_as} {split} tasks drawn as the split is, level mix {mix}, seed {seed}")


def _level_shift(world, n: int, seed: int, level_mix: Mapping[int, float], split: str, options=None) -> Sample:
    return Sample(_generate(world, n, seed, SHIFTED_LEVEL_MIX, split, options), world, "level_shift",
                  f"{n} {split} tasks with level mix {SHIFTED_LEVEL_MIX} instead of {dict(level_mix)}")


def _value_shift(world, n: int, seed: int, level_mix: Mapping[int, float], split: str, options=None) -> Sample:
    shifted = world.value_shifted(seed)
    if shifted is None:
        raise ValueError(f"environment {world.name!r} has no value shift (Environment.value_shifted)")
    return Sample(_generate(shifted, n, seed, level_mix, split, options), shifted, "value_shift",
                  f"{n} {split} tasks on a copy of the world whose values shifted (Environment.value_shifted)")


DRIFT_KINDS: dict[str, Callable[..., Sample]] = {"level_shift": _level_shift, "value_shift": _value_shift}


def make_drifted_tasks(world, n: int, kind: str, seed: int, level_mix: Mapping[int, float] | None = None,
                       split: str = "train", options=None) -> Sample:
    """A documented drifted current dataset from the environment's generator (see :data:`DRIFT_KINDS`):

    - ``level_shift``: the level mix :data:`SHIFTED_LEVEL_MIX`, everything else as the reference;
    - ``value_shift``: the reference level mix on the environment's :meth:`value_shifted` copy of the world (the default
      world: one numeric attribute of every entity redrawn from the upper half of its range); the answers are computed on that copy, and the returned
      sample carries it (its entity features must be read from it, as a production check would read the production
      database).
    """
    try:
        make = DRIFT_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown drift kind {kind!r}; kinds are {sorted(DRIFT_KINDS)}") from None
    return make(world, n, seed, dict(level_mix or _build_default("level_mix")), split, options)
