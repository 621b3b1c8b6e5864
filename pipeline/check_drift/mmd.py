"""The multivariate check of :mod:`pipeline.check_drift.checks`: a kernel two-sample (MMD) permutation test, and
:func:`state_drift`, that test on the policy's hidden states of two sets of observations."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.check_drift.config import DriftConfig

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
    """Permutation test of H0: `x` (n, d) and `y` (m, d) come from one distribution.

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
