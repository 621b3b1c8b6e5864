"""Learner-side scoring of rollouts: the sampling log-probabilities of recorded episodes, recomputed in one forward.

An episode record's ``segments`` (see :mod:`pipeline.policy.rollout`) cut it into self-contained token sequences
(a folded history or a segment that outgrew the model's positions starts a new one); each segment is scored as its
own row of the batch. With the rollout's temperature and top-p (:func:`pipeline.policy.sampling.filtered_logprobs`)
and the same dtype, the result equals the ``logprobs`` the engine recorded.

Left out: autocast (the caller's) and any loss: this module only computes log-probabilities, differentiably.
"""

from __future__ import annotations

import torch

from pipeline.policy.kv_cache import attention_impl, positions_from_valid, prefill_mask
from pipeline.policy.sampling import filtered_logprobs


def split_segments(token_ids: list[int], values: list, segments: list[int] | None) -> list[list]:
    """Cut a per-token list of an episode into its segments (see :mod:`pipeline.policy.rollout`)."""
    starts = list(segments or [0]) + [len(token_ids)]
    return [values[a:b] for a, b in zip(starts[:-1], starts[1:])]


def sequence_logprobs(model, token_ids, action_mask, temperature: float = 1.0, top_p: float = 1.0,
                      segments: list[int] | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Recompute the sampling log-probabilities of a rollout with one forward pass (differentiable).

    `token_ids`, `action_mask`: one episode (lists or 1-D tensors; `segments` its segment starts, each segment its own
    row of the batch) or a batch (B, T) with `attention_mask` (B, T) marking real tokens (left or right padding).
    Returns float32 log-probabilities shaped like `token_ids`: at position t, log p(token_t | tokens before t in its
    segment) under :func:`filtered_logprobs` (temperature, top_p); 0 where `action_mask` is 0. With temperature 1 and
    top_p 1 (and the same dtype) they equal the ``logprobs`` the engine recorded. Autocast is up to the caller."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    amask = torch.as_tensor(action_mask, dtype=torch.long)
    if ids.dim() == 1:
        starts = list(segments or [0]) + [len(ids)]
        pieces = [(a, b) for a, b in zip(starts[:-1], starts[1:]) if b > a]
        T = max(b - a for a, b in pieces)
        batch = torch.full((len(pieces), T), 0, dtype=torch.long)
        valid = torch.zeros(len(pieces), T, dtype=torch.bool)
        for i, (a, b) in enumerate(pieces):
            batch[i, : b - a] = ids[a:b]
            valid[i, : b - a] = True
        lp = _batch_logprobs(model, batch.to(device), valid.to(device), temperature, top_p)
        flat = torch.cat([lp[i, : b - a] for i, (a, b) in enumerate(pieces)])
        return torch.where(amask.to(flat.device).bool(), flat, torch.zeros_like(flat))
    if ids.dim() != 2:
        raise ValueError(f"token_ids must be 1-D (one episode) or 2-D (a batch), got shape {tuple(ids.shape)}")
    valid = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    lp = _batch_logprobs(model, ids.to(device), valid.to(device), temperature, top_p)
    return torch.where(amask.to(lp.device).bool(), lp, torch.zeros_like(lp))


def _batch_logprobs(model, ids: torch.Tensor, valid: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    impl = attention_impl(model)
    logits = model(input_ids=ids, attention_mask=prefill_mask(valid.cpu(), impl).to(ids.device),
                   position_ids=positions_from_valid(valid), use_cache=False).logits
    logp = filtered_logprobs(logits[:, :-1], temperature, top_p)
    picked = logp.gather(-1, ids[:, 1:, None])[..., 0]
    picked = torch.where(valid[:, 1:], picked, torch.zeros_like(picked))
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
