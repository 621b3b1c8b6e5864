"""Supervised adaptation's training loop: AdamW on a masked next-token loss, shared by SFT and continued pre-training.

:func:`train_lm` takes endless batches (:mod:`pipeline.adapt.batching`) and trains the model's trainable parameters
for a number of steps under a warm-up + cosine learning-rate schedule (:func:`lr_at`); the loss covers the tokens whose
label is not :data:`~pipeline.adapt.batching.IGNORE` (:func:`masked_lm_loss`): the action tokens in SFT, every token in
continued pre-training (:mod:`pipeline.adapt.pretrain`). Optionally compiled (``adapt.sft.compile``), in micro-batches,
with an early ``stop`` callback (checkpoint selection). Under bf16 autocast on the CPU the training forward's attention
runs in fp32 (:mod:`pipeline.adapt.fp32_attention`: the CPU's bf16 flash-attention backward alone took 42 % of a
compiled step).

Deliberately left out: sequence packing across documents (padding is kept small by length-bucketed batches instead, so
attention never crosses an episode boundary), gradient accumulation across steps, and distributed training (RL owns
DeepSpeed).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.adapt.batching import IGNORE
from pipeline.adapt.budget import StepBudget
from pipeline.adapt.fp32_attention import fp32_attention
from pipeline.core.errors import AgentRLError
from pipeline.policy.model import HeapTrimmer

MIN_SHARED_PREFIX = 8  # a shorter common prefix is not worth a second forward call
TRIM_HEADROOM_MIB = 1024  # train_lm trims the C heap once its resident size grew this much since the last trim


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over positions whose label is not :data:`IGNORE`.

    logits: (B, T, V); labels: (B, T), the token at t is predicted from positions < t. Returns (loss, n_tokens).
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    n = int((shift_labels != IGNORE).sum())
    loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss / max(n, 1), n


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warm-up to `peak`, then cosine decay to `final_frac · peak` at `total` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@dataclass
class TrainResult:
    losses: list[float]  # mean loss of every step
    tokens: int  # tokens processed (padding excluded)
    loss_tokens: int  # tokens inside the loss
    seconds: float
    steps: int
    shared_tokens: int = 0  # tokens not recomputed because the rows shared them (shared_prefix)

    def summary(self, tail: int = 20) -> dict:
        first = float(np.mean(self.losses[: min(tail, len(self.losses))])) if self.losses else float("nan")
        last = float(np.mean(self.losses[-tail:])) if self.losses else float("nan")
        return {"loss_first": first, "loss_final": last, "steps": self.steps, "tokens": self.tokens,
                "loss_tokens": self.loss_tokens, "seconds": self.seconds, "shared_prefix_tokens": self.shared_tokens,
                "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0}


def check_compile_available() -> None:
    """Raise a clear error when ``torch.compile`` cannot build CPU kernels here: Inductor needs a C++ compiler (``CXX``,
    or ``c++``/``g++``/``clang++`` on ``PATH``), and without one it fails only inside the first training step."""
    import os
    import shutil

    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        raise AgentRLError("adapt.sft.compile is true, but no C++ compiler was found (CXX, c++, g++ or clang++), which "
                           "torch.compile needs on the CPU: install one (e.g. `apt install g++`) or set "
                           "adapt.sft.compile: false in params.yaml")


def train_lm(model: torch.nn.Module, data: Iterator[dict], steps: int, lr: float, *, warmup: int = 0,
             weight_decay: float = 0.0, grad_clip: float = 1.0, autocast: Callable | None = None,
             log: Callable[[int, dict], None] | None = None, log_every: int = 10,
             stop: Callable[[int], bool] | None = None, stop_every: int = 100, micro_batches: int = 1,
             compile: bool = False, shared_prefix: bool = False, budget: StepBudget | None = None) -> TrainResult:
    """AdamW on the trainable parameters for `steps` batches of `data`; the loss is :func:`masked_lm_loss`.

    `micro_batches` > 1 forwards each batch in that many chunks of rows (each trimmed to its own longest row) and
    accumulates their gradients, each chunk's loss weighted by its share of the batch's loss tokens: the same step as
    one forward of the batch, with the activation memory of one chunk.

    `autocast` returns a context manager for the forward pass (bf16 autocast on a CPU that supports it);
    `log(step, metrics)` receives ``loss``, ``lr``, ``grad_norm`` and ``tokens_per_s`` every `log_every` steps;
    `stop(step)`, called every `stop_every` steps, ends training early when it returns True (the lr schedule still
    spans `steps`). The result's `steps` counts the steps taken.

    `budget` (:class:`pipeline.adapt.budget.StepBudget`) fits the run into wall-clock seconds: after its probe steps
    the schedule spans the steps it plans (at most `steps`), and the loop stops when its time is used up.

    `compile` runs the training forward (and so its backward) through ``torch.compile`` (Inductor: fused elementwise
    kernels around the matmuls; dynamic shapes after the first new sequence length). The first steps pay for the
    compilation (about 30 s on 2 cores for the default model, on a cold cache); the module itself is trained, so the
    weights, ``stop`` checks and everything after see the same parameters.

    `shared_prefix` computes the tokens every row of a chunk starts with once per chunk instead of once per row
    (:func:`prefix_once_forward`); in SFT every row starts with the same system line and tool list (67 of a
    demonstration's ~160 tokens on the shop), which is then paid once per batch.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise AgentRLError("the model has no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    model.train()
    if compile:
        check_compile_available()
    forward = torch.compile(model, dynamic=True) if compile else model
    with _deterministic(compile):
        return _train_loop(model, forward, opt, params, data, steps, lr, warmup, grad_clip, autocast, log, log_every,
                           stop, stop_every, micro_batches, shared_prefix, budget)


@contextlib.contextmanager
def _deterministic(on: bool):
    """``torch.use_deterministic_algorithms(True)`` for the duration (the previous setting is restored afterwards).

    Why, for the compiled loop: Inductor's CPU kernels are not run-to-run reproducible by default (two compiled runs
    of the same batches gave different losses from the first steps, FX graph cache on or off); under deterministic
    algorithms they are bit-identical. Eager runs are left as they are (their kernels are deterministic on the CPU
    already)."""
    if not on:
        yield
        return
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


def shared_prefix_len(ids: torch.Tensor, att: torch.Tensor, labels: torch.Tensor) -> int:
    """Tokens at the start that every row shares (at most each row's length − 1), when none of them but the last is
    in the loss; 0 otherwise (a single row, or a loss token inside the common prefix).

    >>> ids = torch.tensor([[1, 5, 6, 7, 9], [1, 5, 6, 8, 0]]); att = torch.tensor([[1] * 5, [1, 1, 1, 1, 0]])
    >>> shared_prefix_len(ids, att, torch.full_like(ids, IGNORE))
    3
    """
    if len(ids) < 2:
        return 0
    same = (ids == ids[:1]).all(0) & (att == 1).all(0)
    P = int(same.long().cumprod(0).sum())
    P = min(P, int(att.sum(1).min()) - 1)
    if P < 1 or bool((labels[:, 1:P] != IGNORE).any()):
        return 0
    return P


def prefix_once_forward(forward, ids: torch.Tensor, att: torch.Tensor, P: int) -> torch.Tensor:
    """Logits for the loss over ``labels[:, P-1:]``: the shared prefix ``ids[0, :P]`` runs once, its keys and values
    are repeated for every row, and the rows' suffixes attend to them. The same loss and gradients as one forward of
    the whole batch (up to float rounding), without computing the prefix once per row."""
    head = forward(input_ids=ids[:1, :P], attention_mask=att[:1, :P], use_cache=True)
    cache = head.cache
    cache.batch_repeat_interleave(len(ids))
    tail = forward(input_ids=ids[:, P:], attention_mask=att, cache=cache, use_cache=False).logits
    return torch.cat([head.logits[:, -1:].expand(len(ids), -1, -1), tail], dim=1)


def _train_loop(model, forward, opt, params, data, steps, lr, warmup, grad_clip, autocast, log, log_every, stop,
                stop_every, micro_batches, shared_prefix, budget) -> TrainResult:
    losses, tokens, loss_tokens, shared_tokens = [], 0, 0, 0
    t0 = tw = time.perf_counter()
    window_tokens, check_s, checks = 0, 0.0, 0
    trimmer = HeapTrimmer(TRIM_HEADROOM_MIB)
    step = 0
    while step < (budget.total if budget is not None else steps):  # a budget may plan fewer steps (never more)
        total = budget.total if budget is not None else steps
        batch = next(data)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, lr, warmup)
        opt.zero_grad(set_to_none=True)
        n = int((batch["labels"][:, 1:] != IGNORE).sum())
        loss = torch.zeros(())
        order = torch.arange(batch["input_ids"].shape[0])
        if micro_batches > 1:  # one chunk keeps the batch's own row order: its step is bit-identical to before chunks
            order = torch.argsort(batch["attention_mask"].sum(1), descending=True, stable=True)
        for rows in torch.tensor_split(order, micro_batches):
            if rows.numel() == 0:
                continue
            T = int(batch["attention_mask"][rows].sum(1).max())
            ids, att, labels = (batch[k][rows, :T] for k in ("input_ids", "attention_mask", "labels"))
            P = shared_prefix_len(ids, att, labels) if shared_prefix else 0
            with autocast() if autocast is not None else contextlib.nullcontext(), fp32_attention(model):
                if P >= MIN_SHARED_PREFIX:
                    logits, labels = prefix_once_forward(forward, ids, att, P), labels[:, P - 1:]
                    shared_tokens += P * (len(ids) - 1)
                else:
                    logits = forward(input_ids=ids, attention_mask=att).logits
            part, n_part = masked_lm_loss(logits, labels)
            part = part * (n_part / max(n, 1))
            part.backward()
            loss = loss + part.detach()
        gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(loss.item())
        trimmer.maybe()  # the heap's free pages back to the OS once it has grown (why: release_free_memory)
        ntok = int(batch["attention_mask"].sum())
        tokens += ntok
        window_tokens += ntok
        loss_tokens += n
        if log is not None and ((step + 1) % log_every == 0 or step == total - 1):
            now = time.perf_counter()
            log(step + 1, {"loss": float(np.mean(losses[-log_every:])), "lr": opt.param_groups[0]["lr"],
                           "grad_norm": float(gnorm), "tokens_per_s": window_tokens / max(now - tw, 1e-9)})
            tw, window_tokens = now, 0
        done = False
        if stop is not None and (step + 1) % stop_every == 0 and step + 1 < total:
            t_stop = time.perf_counter()
            done = stop(step + 1)
            model.train()
            t0 += time.perf_counter() - t_stop  # the check is not training time
            tw += time.perf_counter() - t_stop
            if budget is not None and step + 1 >= budget.check_from_step():  # a call before the window checks nothing
                check_s, checks = check_s + time.perf_counter() - t_stop, checks + 1
        step += 1
        if done or (budget is not None and budget.after_step(step, time.perf_counter() - t0, check_s, checks)):
            break
    model.eval()
    return TrainResult(losses, tokens, loss_tokens, time.perf_counter() - t0, len(losses), shared_tokens)
