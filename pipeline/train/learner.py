"""One update's learning: advantages from the records (:mod:`pipeline.train.advantages`), π_old, V_old and the
reference's log-probabilities, then the optimizer steps of the clipped surrogate with truncated importance weights,
value loss (PPO), entropy bonus, KL to the reference and behaviour cloning on demonstrations, inside a DeepSpeed
engine, which averages gradients over ranks and clips them. :func:`learn` returns the update's metrics.

**Gradient accumulation.** Each optimizer step (one per minibatch) forwards its rows in `train.micro_batches` chunks
of similar length, each padded to its own longest row, and DeepSpeed accumulates their gradients
(``gradient_accumulation_steps``) before it clips, reduces over ranks and steps. Every term is weighted by its chunk's
share of the minibatch's tokens, so the accumulated gradient equals the one-forward gradient of the whole minibatch;
the learner's activation memory (dominated by the attention scores and the logits) is that of one chunk. The no-grad
forwards for π_old, V_old and the reference go chunk by chunk too.

Two savings that change no gradient:

- **One forward when the update is one on-policy step** (:func:`one_forward`: group baselines, one epoch, one
  minibatch): π_old is then the learner's own π_θ before its only step, so π_old = π_θ.detach() from the training
  forward itself (the ratio is exactly 1, as it would be after a separate no-grad forward) and that forward is
  skipped. PPO needs V_old and π_old before its first step, so it keeps the separate forward. Rows sampled from
  another distribution than π_θ (a stale snapshot, or an extension's change of the sampling distribution) are
  still corrected: in both paths the behaviour is the rollout's recorded log-probabilities, through w = min(c, π_old/μ).
- **Only rows that carry signal are forwarded**: rows whose loss mask is empty (zero-variance groups left out of the
  loss) contribute no policy gradient, so they are dropped before the learner's forwards unless the KL term is on
  (behaviour cloning reads demonstrations, not these rows); the entropy bonus is then estimated on the rows that are
  trained on. A rank left with no such row (or a chunk left empty) still forwards one row with its loss multiplied
  by 0, so every rank joins every collective step.

A chunk whose loss is not finite on any rank contributes nothing, and the step it belongs to is applied with a
learning rate of 0 (the weights stay as they were; counted in ``train/skipped_steps_nonfinite``).

Rollouts, sampling and evaluation are the loop's (:mod:`pipeline.train.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from pipeline.train import core_algos as A
from pipeline.train.actor import bc_loss, no_grad_logp, step_engine
from pipeline.train.advantages import score_episodes, token_advantages
from pipeline.train.batch import Batch, collate_records, length_chunks
from pipeline.train.config import TrainConfig
from pipeline.train.diagnostics import params_without_grad
from pipeline.train.estimators import get_estimator
from pipeline.train.sampling import LearnerState


@dataclass
class Learner:
    """What learning needs besides one update's records; built once per run."""

    cfg: TrainConfig
    engine: Any  # DeepSpeed engine around an ActorCritic
    ref: torch.nn.Module | None  # reference policy of the KL term (None: `kl_coef` 0)
    pad_id: int
    temperature: float  # the rollouts' sampling temperature: the learner's log-probabilities are of softmax(z / T)
    dist: Any  # pipeline.train.distributed.Dist
    autocast_context: Callable  # (dtype, device) -> context manager, pipeline.policy.model.autocast_context
    demo_examples: list | None = None  # behaviour-cloning demonstrations (pipeline.policy.demos.Example)
    bc_rng: np.random.Generator | None = None  # which demonstrations behaviour cloning draws (one per rank)
    extensions: list = field(default_factory=list)  # the run's extensions (pipeline.train.extensions), in order


@dataclass
class Targets:
    """One update's rows to train on and everything their loss reads: (rows, T) tensors unless noted."""

    batch: Batch
    lengths: torch.Tensor  # (rows,) tokens per row
    loss_mask: torch.Tensor  # policy-loss weight of each token (`train.loss_agg`), 0 where no signal
    adv: torch.Tensor
    returns: torch.Tensor | None  # GAE returns (PPO)
    old_logp: torch.Tensor | None  # π_old; None for a one-forward step (taken from the training forward)
    old_values: torch.Tensor | None  # V_old (PPO)
    ref_logp: torch.Tensor | None  # the reference's log-probabilities (KL term)
    is_w: torch.Tensor | None  # truncated importance weights, from old_logp
    demo_rows: torch.Tensor  # (rows,) bool: a demonstrated episode's row (importance weight 1)


def one_forward(cfg: TrainConfig) -> bool:
    """Whether an update is one on-policy optimizer step, so π_old is the training forward's own π_θ.detach()."""
    return not get_estimator(cfg.algorithm).critic and cfg.epochs == 1 and cfg.minibatches == 1


def learn(lr: Learner, records: list[dict], state: LearnerState, u: int) -> dict:
    """Advantages and the optimisation steps of update `u` (0-based) on `records` (each with its ``group``)."""
    cfg, engine = lr.cfg, lr.engine
    device, group = engine.device, not get_estimator(cfg.algorithm).critic
    batch = collate_records(records, lr.pad_id, max((e.slice_turns for e in lr.extensions), default=0))
    sc = scorer(lr, state)(records)
    loss_mask = batch.mask.clone()
    if cfg.skip_zero_variance_groups and group:
        loss_mask = loss_mask * (~sc.zero_var[batch.episode]).float()[:, None]
    loss_mask = A.loss_weights(loss_mask, batch.episode, len(records), cfg.loss_agg)  # weights: see train.loss_agg
    for ext in lr.extensions:
        loss_mask = ext.row_weights(loss_mask, records, batch)
    if group and lr.ref is None:  # behaviour cloning reads demonstrations, not these rows
        keep = torch.nonzero(loss_mask.sum(1) > 0).flatten()
        if keep.numel() == 0:
            batch, loss_mask = batch.select(torch.tensor([0])), loss_mask[:1] * 0
        else:
            batch, loss_mask = batch.select(keep), loss_mask[keep]
    # demonstrated episodes (train.guide_failed_groups) have no sampling distribution: importance weight 1
    demo_rows = torch.tensor([bool(r.get("demonstrated")) for r in records])[batch.episode]
    lengths = batch.attn.sum(1)
    all_rows = torch.arange(batch.n_rows)
    k = cfg.micro_batches
    old_logp = old_values = ref_logp = None
    if not one_forward(cfg):
        old_logp, old_values = no_grad_logp(lambda i, a: engine.module(i, a), batch,
                                            length_chunks(lengths, all_rows, k), lr.temperature, device,
                                            lr.autocast_context)
    if lr.ref is not None:
        ref_logp, _ = no_grad_logp(lambda i, a: (lr.ref(input_ids=i, attention_mask=a).logits, None), batch,
                                   length_chunks(lengths, all_rows, k), lr.temperature, device, lr.autocast_context)
    adv, returns = token_advantages(cfg, sc, batch, old_values)
    ext_out = {}
    for ext in lr.extensions:
        ext_out.update(ext.after_advantages(u, records, sc, batch, adv, lr.dist))
    is_w = is_stats = None
    if old_logp is not None:
        sample_logp = torch.where(demo_rows[:, None], old_logp * batch.mask, batch.sample_logp)
        is_w, is_stats = A.truncated_importance_weights(old_logp, sample_logp, loss_mask, cfg.is_clip)
    t = Targets(batch, lengths, loss_mask, adv, returns, old_logp, old_values, ref_logp, is_w, demo_rows)

    ent_coef = state.entropy.value
    agg, is_stats, skipped = _optimize(lr, t, ent_coef, is_stats, u)
    out = {key: float(np.mean(v)) for key, v in agg.items()}
    if cfg.entropy_target is not None and "policy/entropy" in out:
        out["policy/entropy_coef"] = state.entropy.update(out["policy/entropy"])
    else:
        out["policy/entropy_coef"] = ent_coef
    masked = adv[loss_mask > 0]
    out.update({
        "policy/advantage_var": float(masked.var()) if masked.numel() > 1 else 0.0,
        "rollout/zero_variance_group_share": float(sc.zero_var.float().mean()) if group else 0.0,
        "train/skipped_steps_nonfinite": skipped,
        "train/batch_tokens": int(batch.attn.sum()),
        "train/rows_forwarded": int(batch.n_rows),
        **(is_stats or {}),
        **sc.metrics,
        **ext_out,
    })
    if returns is not None and old_values is not None:
        out["losses/explained_variance"] = A.explained_variance(old_values * batch.mask, returns, batch.mask)
    return out


def scorer(lr: Learner, state: LearnerState) -> Callable[[list[dict]], Any]:
    """records -> :class:`pipeline.train.advantages.Scores`: the kernel's scoring, wrapped by each extension's
    :meth:`~pipeline.train.extensions.base.Extension.score` in order (the last one outermost)."""
    def kernel(records: list[dict]):
        return score_episodes(records, lr.cfg, state, lr.dist.all_gather, lr.extensions)

    score = kernel
    for ext in lr.extensions:
        score = (lambda e, inner: lambda records: e.score(records, inner))(ext, score)
    return score


def _optimize(lr: Learner, t: Targets, ent_coef: float, is_stats: dict | None,
              u: int) -> tuple[dict[str, list[float]], dict | None, int]:
    """`train.epochs` passes over shuffled `train.minibatches`, one optimizer step each: every step's metrics, the
    importance-weight statistics and the number of steps skipped for a non-finite loss."""
    cfg = lr.cfg
    rng = np.random.default_rng([cfg.seed, u, lr.dist.rank])
    agg: dict[str, list[float]] = {}
    skipped = 0
    for _ in range(cfg.epochs):
        order = torch.from_numpy(rng.permutation(t.batch.n_rows))
        for rows in torch.tensor_split(order, cfg.minibatches):
            step, finite_everywhere, is_stats = _minibatch_step(lr, t, rows, ent_coef, is_stats)
            skipped += not finite_everywhere
            gn = lr.engine.get_global_grad_norm()
            step["losses/grad_norm"] = float(gn) if gn is not None else float("nan")
            for key, v in step.items():
                agg.setdefault(key, []).append(v)
    return agg, is_stats, skipped


def _minibatch_step(lr: Learner, t: Targets, rows: torch.Tensor, ent_coef: float,
                    is_stats: dict | None) -> tuple[dict[str, float], bool, dict | None]:
    """One optimizer step over `rows`, accumulated over their length chunks: the step's token-weighted metrics,
    whether its loss was finite on every rank, and the updated importance-weight statistics."""
    cfg, engine = lr.cfg, lr.engine
    k = cfg.micro_batches
    n_pg = float(t.loss_mask[rows].sum())
    n_act = float(t.batch.mask[rows].sum())
    step: dict[str, float] = {}
    finite_everywhere = True
    for c, chunk in enumerate(length_chunks(t.lengths, rows, k)):
        loss, mets, w_pg, chunk_stats = _chunk_loss(lr, t, chunk, n_pg, n_act, ent_coef)
        if chunk_stats is not None:
            is_stats = merge_stats(is_stats, chunk_stats, w_pg, c == 0)
        if cfg.bc_coef > 0 and lr.demo_examples and c == 0:  # once per optimizer step, with or without RL signal
            bc = bc_loss(engine, lr.demo_examples, cfg.bc_batch, lr.bc_rng, lr.pad_id, engine.device,
                         lr.autocast_context)
            loss = loss + cfg.bc_coef * bc
            mets["losses/bc"] = (float(bc.detach()), 1.0)
        if not all(lr.dist.all_gather(bool(torch.isfinite(loss.detach())))):
            finite_everywhere = False  # a NaN/inf loss on any rank: this chunk contributes nothing anywhere
            loss = sum(p.sum() for p in engine.module.parameters() if p.requires_grad) * 0.0
            mets = {}
        mets["losses/total"] = (float(loss.detach()), 1.0)
        for key, (v, w) in mets.items():
            step[key] = step.get(key, 0.0) + v * w
        engine.backward(loss, scale_wrt_gas=False)  # the chunk weights already sum to the minibatch mean
        if c == k - 1:
            step["diag/params_without_grad"] = params_without_grad(engine.module.policy)
            step["train/lr"] = float(engine.get_lr()[0])  # the rate this step applies
            step_engine(engine, apply=finite_everywhere)
        else:
            engine.step()  # a no-op inside the accumulation, kept so DeepSpeed counts its micro-steps
    return step, finite_everywhere, is_stats


def _chunk_loss(lr: Learner, t: Targets, chunk: torch.Tensor, n_pg: float, n_act: float,
                ent_coef: float) -> tuple[torch.Tensor, dict, float, dict | None]:
    """The RL loss of one chunk's rows, weighted by their share of the minibatch's tokens: the loss, its metrics as
    (value, weight) pairs, the policy-term weight, and (one-forward step) the chunk's importance-weight statistics."""
    cfg, device = lr.cfg, lr.engine.device
    dummy = chunk.numel() == 0  # fewer rows than chunks: forward one row, contribute nothing
    chunk = torch.tensor([0]) if dummy else chunk
    T = int(t.lengths[chunk].max())
    cut = lambda x: x[chunk][:, :T]  # noqa: E731 - this chunk's rows, trimmed to its longest
    ids, attn, mask, m = cut(t.batch.ids), cut(t.batch.attn), cut(t.batch.mask), cut(t.loss_mask)
    w_pg = float(m.sum()) / max(n_pg, 1.0) if not dummy else 0.0
    w_act = float(mask.sum()) / max(n_act, 1.0) if not dummy else 0.0
    with lr.autocast_context("auto", device):
        logits, values = lr.engine(ids.to(device), attn.to(device))
    logp = A.token_logprobs(logits, ids.to(device), lr.temperature).cpu()
    chunk_stats = None
    if t.old_logp is None:  # one-forward step: π_old = π_θ before this, the only step (see the module docstring)
        old_c = logp.detach() * mask
        sample_c = torch.where(t.demo_rows[chunk][:, None], old_c, cut(t.batch.sample_logp))
        is_c, chunk_stats = A.truncated_importance_weights(old_c, sample_c, m, cfg.is_clip)
    else:
        old_c, is_c = cut(t.old_logp), cut(t.is_w)
    pg, pg_m = A.ppo_policy_loss(logp, old_c, cut(t.adv), m, cfg.clip_eps, is_c)
    ent = A.masked_mean(A.token_entropy(logits, lr.temperature).cpu(), mask)
    loss = w_pg * pg - w_act * ent_coef * ent
    mets = {**{key: (v, w_pg) for key, v in pg_m.items()}, "policy/entropy": (float(ent.detach()), w_act)}
    if values is not None:
        vl, vm = A.value_loss(values.cpu(), cut(t.old_values), cut(t.returns), mask, cfg.value_clip)
        loss = loss + w_act * cfg.vf_coef * vl
        mets.update({key: (v, w_act) for key, v in vm.items()})
    if t.ref_logp is not None:
        kl, km = A.kl_penalty(logp, cut(t.ref_logp), mask)
        loss = loss + w_act * cfg.kl_coef * kl
        mets.update({key: (v, w_act) for key, v in km.items()})
    if dummy or n_pg == 0:  # nothing to learn here: keep the collective step, contribute zero
        loss = loss * 0.0
    return loss, mets, w_pg, chunk_stats


def merge_stats(acc: dict | None, new: dict, weight: float, first: bool) -> dict:
    """Token-weighted sum of per-chunk statistics (``offpolicy/*``); max-type entries keep the maximum."""
    if first or acc is None:
        acc = {}
    for key, v in new.items():
        acc[key] = max(acc.get(key, v), v) if key.endswith("_max") else acc.get(key, 0.0) + v * weight
    return acc
