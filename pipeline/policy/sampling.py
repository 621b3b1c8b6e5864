"""The sampling maths of the rollout engine: the distribution an action token is drawn from, and the draw.

- **Recorded log-probabilities are those of the distribution actually sampled from**: ``log_softmax(logits / T)``,
  restricted to the top-p nucleus and renormalised (:func:`filtered_logprobs`, shared with the learner's
  :func:`pipeline.policy.scoring.sequence_logprobs`). Greedy decoding records the model's own ``log_softmax(logits)``
  (T = 1, no top-p) of the argmax token, for diagnostics (a point mass would record 0 everywhere). In fp32 they equal
  a fp32 forward's to ~1e-6; bf16 rollouts (bf16 prefills) move them by ~1e-2, so RL that needs exact old
  log-probabilities recomputes them or rolls out in fp32.
- **Sampling** is inverse-CDF with one pre-drawn uniform per sampled token (:func:`sample_tokens`); the engine draws
  the uniforms from a ``torch.Generator`` seeded with the episode's seed, so an episode's randomness depends only on
  its own seed, not on its batch neighbours or its slot, and the same seeds give the same episodes on CPU.

Pure functions of tensors; what draws the uniforms and which rows are sampled is the engine's
(:mod:`pipeline.policy.rollout`).
"""

from __future__ import annotations

import torch


def filtered_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the sampling distribution, shape of `logits` (..., vocab), float32.

    ``log_softmax(logits / temperature)``; with ``top_p < 1`` only the nucleus (the smallest set of most probable
    tokens whose mass reaches `top_p`) keeps finite values, renormalised; the rest are ``-inf``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    p = sorted_lp.exp()
    drop_sorted = (p.cumsum(-1) - p) >= top_p  # mass before this token already reaches top_p
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float,
                  greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` (n, vocab) by inverse CDF with `uniforms` (n,) in [0, 1).

    Returns (tokens (n,), log-probabilities (n,)) -- see the module docstring for what the log-probabilities are."""
    if greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logp = filtered_logprobs(logits, temperature, top_p)
    cdf = logp.double().exp().cumsum(dim=-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    tok = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
    lp = logp.gather(-1, tok[:, None])[:, 0]
    bad = ~torch.isfinite(lp)  # only reachable by rounding at the very end of the CDF
    if bool(bad.any()):
        tok[bad] = logp[bad].argmax(dim=-1)
        lp[bad] = logp[bad].gather(-1, tok[bad][:, None])[:, 0]
    return tok, lp
