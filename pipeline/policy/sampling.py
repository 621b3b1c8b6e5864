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

import numpy as np
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


# --------------------------------------------------------------------------------------------- tool-choice noise
# Exploration noise on the tool an action calls (docs/design.md §3.2, action noise). In token terms: right after a
# sampled ``<call>`` token, the action's tool name is drawn from the mixture
#
#     (1 − ε) · π  +  ε · (1/K) Σ_k  [write tool k's name tokens, then continue with π]
#
# over K branches "tool k" (the episode's tools, each name's plain-text tokens as
# :func:`pipeline.policy.tokenizer.encode_continuation` gives them) plus the policy branch. The engine draws the branch
# once per action (probability ε for a uniformly chosen tool) and then writes the forced name tokens (or samples π as
# usual). What it records for each token is the
# log-probability of the *marginal* mixture's conditional q(t | prefix) (:func:`mixture_logprobs`), tracked by the
# posterior weight of every branch given the tokens written so far (:func:`mixture_posterior`): multiplied together, these
# conditionals is exactly the probability of the action under the mixture, so the learner's truncated importance
# weight min(c, π_θ/q) corrects for the noise. Once no live branch still forces a token, q = π and the action goes on
# as an ordinary one. A policy that writes another tokenization of a name is covered by the policy branch.


def mixture_logprobs(logp: torch.Tensor, weights: torch.Tensor, forced: list[int | None]) -> torch.Tensor:
    """log q over the vocabulary (V,) at one position: q = Σ_b weights[b] · P_b, where branch b either forces the
    token ``forced[b]`` (a point mass) or, when ``forced[b]`` is None, follows the policy's ``exp(logp)``.

    `weights` (B,) are the branches' posterior weights (summing to 1); `logp` (V,) the policy's log-probabilities."""
    follow = float(sum(float(w) for w, f in zip(weights, forced) if f is None))
    q = logp.double().exp() * follow
    for w, f in zip(weights.tolist(), forced):
        if f is not None and w > 0:
            q[f] += w
    return q.log().float()


def mixture_posterior(weights: torch.Tensor, logp: torch.Tensor, forced: list[int | None], token: int) -> torch.Tensor:
    """The branches' posterior weights after `token` was written: w_b ∝ w_b · P_b(token) (0 for a branch that forced
    another token), normalised; float64."""
    w = weights.double().clone()
    p_tok = float(logp[token].double().exp())
    for b, f in enumerate(forced):
        w[b] *= p_tok if f is None else float(f == token)
    total = float(w.sum())
    return w / total if total > 0 else w


class ToolChoiceNoise:
    """The tool-choice noise of the rollout engine (see the comment above :func:`mixture_logprobs`).

    `epsilon` is set by the trainer before each batch of rollouts (the annealed ε_t); 0 samples as without noise.
    `stats` counts the actions that opened a tool-name choice (``actions``) and those whose tool the noise drew
    (``noised``) since the last :meth:`reset`. The branch draw uses a generator seeded with the episode's seed, so an
    episode still depends only on its own seed; the token uniforms are those of the engine, unchanged."""

    def __init__(self, call_open_id: int, encode_name):
        self.call_open_id, self.encode_name = call_open_id, encode_name
        self.epsilon = 0.0
        self._names: dict[tuple, list[list[int]]] = {}
        self._open: dict[int, dict] = {}  # id(stream) -> the open choice of that episode's current action
        self._rngs: dict[int, tuple] = {}  # id(stream) -> (stream, generator of the branch draws)
        self.stats = {"actions": 0, "noised": 0}

    def reset(self, epsilon: float) -> None:
        self.epsilon = float(epsilon)
        self._open.clear()
        self._rngs.clear()
        self.stats = {"actions": 0, "noised": 0}

    def _name_ids(self, names: tuple) -> list[list[int]]:
        if names not in self._names:
            self._names[names] = [list(self.encode_name(n)) for n in names]
        return self._names[names]

    def _choice(self, stream, episode) -> dict | None:
        """The open tool-name choice of this row (opening one right after a sampled ``<call>``), or None."""
        key = id(stream)
        ch = self._open.get(key)
        if ch is not None and ch["stream"] is stream and ch["at"] == len(stream.token_ids):
            return ch
        self._open.pop(key, None)
        names = getattr(episode, "tool_names", None)
        if (self.epsilon <= 0 or not names or not stream.token_ids or stream.token_ids[-1] != self.call_open_id
                or not stream.action_mask[-1]):
            return None
        rng_entry = self._rngs.get(key)
        if rng_entry is None or rng_entry[0] is not stream:
            rng_entry = self._rngs[key] = (stream, np.random.default_rng([int(getattr(episode, "seed", 0)), 0x7001]))
        v = float(rng_entry[1].random())
        seqs = self._name_ids(tuple(names))
        K, eps = len(seqs), self.epsilon
        branch = 1 + min(K - 1, int(v / eps * K)) if v < eps else 0
        self.stats["actions"] += 1
        self.stats["noised"] += int(branch > 0)
        ch = {"stream": stream, "at": len(stream.token_ids), "seqs": seqs, "pos": 0, "branch": branch,
              "weights": torch.tensor([1.0 - eps] + [eps / K] * K, dtype=torch.float64)}
        self._open[key] = ch
        return ch

    def sample(self, logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float, streams: list,
               episodes: list) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`sample_tokens` (not greedy) for rows `streams` / `episodes`, with the tool-choice noise applied to
        the rows whose action is choosing its tool."""
        toks, lps = sample_tokens(logits, uniforms, temperature, top_p, False)
        for i, (s, ep) in enumerate(zip(streams, episodes)):
            ch = self._choice(s, ep)
            if ch is None:
                continue
            pos = ch["pos"]
            forced = [None] + [q[pos] if pos < len(q) else None for q in ch["seqs"]]
            logp = filtered_logprobs(logits[i], temperature, top_p)
            tok = forced[ch["branch"]]
            tok = int(toks[i]) if tok is None else tok
            toks[i], lps[i] = tok, mixture_logprobs(logp, ch["weights"], forced)[tok]
            ch["weights"] = mixture_posterior(ch["weights"], logp, forced, tok)
            ch["pos"], ch["at"] = pos + 1, len(s.token_ids) + 1
            nxt = [q[pos + 1] if pos + 1 < len(q) else None for q in ch["seqs"]]
            if all(f is None or w == 0 for f, w in zip(nxt, ch["weights"][1:].tolist())):
                del self._open[id(s)]  # no live branch forces a token any more: q = π from here on
        return toks, lps
