"""The model the learner trains and the forwards it runs outside the policy-gradient step: :class:`ActorCritic` (the
policy LM plus, for PPO, a value head), no-grad log-probabilities of a batch chunk by chunk (π_old, V_old, the
reference), the behaviour-cloning loss on demonstrations, and an optimizer step that can be skipped.

The policy-gradient step itself, which calls these, is :func:`pipeline.train.learner.learn`.
"""

from __future__ import annotations

import torch

from pipeline.train import core_algos as A
from pipeline.train.batch import Batch


class ActorCritic(torch.nn.Module):
    """The policy LM plus (for PPO) a scalar value head on the last hidden state."""

    def __init__(self, policy: torch.nn.Module, with_value: bool):
        super().__init__()
        self.policy = policy
        hidden = policy.config.get_text_config(decoder=True).hidden_size
        self.value_head = torch.nn.Linear(hidden, 1) if with_value else None
        if self.value_head is not None:
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Logits (B, T, V) and values (B, T) float32, or None without a value head."""
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          output_hidden_states=self.value_head is not None, use_cache=False)
        values = None
        if self.value_head is not None:
            values = self.value_head(out.hidden_states[-1]).squeeze(-1).float()
        return out.logits, values


def no_grad_logp(forward, batch: Batch, chunks: list[torch.Tensor], temperature: float, device, autocast_context):
    """Log-probabilities (and values, when `forward` returns them) of every row of `batch` under `forward`, chunk by
    chunk, masked to the action tokens: (rows, T) tensors on the CPU."""
    logp = torch.zeros(batch.ids.shape)
    values = None
    with torch.no_grad():
        for chunk in chunks:
            if chunk.numel() == 0:
                continue
            T = int(batch.attn[chunk].sum(1).max())
            ids, attn = batch.ids[chunk][:, :T].to(device), batch.attn[chunk][:, :T].to(device)
            with autocast_context("auto", device):
                logits, v = forward(ids, attn)
            logp[chunk, :T] = A.token_logprobs(logits, ids, temperature).float().cpu()
            if v is not None:
                values = torch.zeros(batch.ids.shape) if values is None else values
                values[chunk, :T] = v.float().cpu()
            del logits
    return logp * batch.mask, values


def bc_loss(engine, examples, n, rng, pad_id, device, autocast_context) -> torch.Tensor:
    """Negative log-likelihood of the action tokens of `n` demonstrations drawn from `examples` (docs/design.md
    §2.1: a behaviour-cloning anchor)."""
    pick = [examples[i] for i in rng.choice(len(examples), size=min(n, len(examples)), replace=False)]
    T = max(len(e.input_ids) for e in pick)
    ids = torch.full((len(pick), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(pick), T, dtype=torch.long)
    mask = torch.zeros(len(pick), T)
    for i, e in enumerate(pick):
        ids[i, : len(e)] = torch.tensor(e.input_ids)
        attn[i, : len(e)] = 1
        mask[i, : len(e)] = torch.tensor(e.loss_mask, dtype=torch.float32)
    with autocast_context("auto", device):
        logits, _ = engine(ids.to(device), attn.to(device))
    logp = A.token_logprobs(logits, ids.to(device), 1.0).cpu()
    return -A.masked_mean(logp, mask)


def step_engine(engine, apply: bool) -> None:
    """The optimizer step that ends an accumulation; ``apply=False`` runs it at a learning rate of 0, so DeepSpeed's
    counters and schedule advance but no weight moves (AdamW's decoupled weight decay is scaled by the rate too).

    What a skipped step still changes: AdamW's moment estimates and step count take in the gradient that was
    accumulated (the finite chunks' part; a non-finite chunk contributes exactly zero), so the next applied step's
    bias correction and momentum carry it. The moments stay finite; restoring them would need a copy of the
    optimizer state every step, which this rare path does not justify."""
    groups = engine.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    if not apply:
        for g in groups:
            g["lr"] = 0.0
    engine.step()
    if not apply:
        for g, lr in zip(groups, saved):
            if g["lr"] == 0.0:  # no scheduler set the next rate
                g["lr"] = lr
