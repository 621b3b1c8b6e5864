"""Quantised variants of a policy, their size, and their side-by-side measurement on test tasks.

- ``fp32``: the policy as trained (weights fp32).
- ``bf16``: every weight cast to bfloat16 (half the bytes); the rollout engine then keeps its KV cache in bf16.
- ``int8``: every ``nn.Linear`` (the output projection included) as int8, by ``QuantizationConfig.linear``:
  ``dynamic`` is ``torch.ao.quantization.quantize_dynamic`` (int8 weights, activations quantised per batch, int8
  matmuls; measured 2.5x faster than fp32 on a 16M Llama on CPU), ``weight_only`` keeps one scale per output
  row and dequantises in each forward (:class:`WeightOnlyInt8Linear`). With ``embeddings`` the token embedding is also
  int8 with a scale per row (:class:`Int8Embedding`): the built-in model ties a 1k x 256 embedding to its output
  projection, a quarter of its weights, and a tied fp32 embedding alone would keep int8 near 0.32 of fp32.

Size is the byte length of ``torch.save(state_dict)`` (tied tensors stored once, quantised modules with their packed
weights and scales): what a deployment would ship for that variant. Quantisation is symmetric per row
(scale = max|w| / 127), deterministic, and made from the fp32 weights at load time, so one registered artefact (the
Hugging Face folder) serves every precision.

Deliberately left out: static (calibrated) activation quantisation and int4; torchao (measured slower than
``quantize_dynamic`` here, and it prints GPU-extension warnings on every transformers import).
"""

from __future__ import annotations

import copy
import io
import time
import warnings

import torch
from torch import nn

from pipeline.deploy.config import PRECISIONS, QuantizationConfig
from pipeline.core.errors import AgentRLError


def _row_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 scale per row: max|w| / 127 (1 for an all-zero row, so it dequantises to zeros)."""
    amax = weight.detach().float().abs().amax(dim=1)
    return torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale per row) with ``weight ≈ q * scale[:, None]``, error at most scale/2 per entry.

    >>> q, s = quantize_rows(torch.tensor([[1.0, -0.5], [0.0, 0.0]]))
    >>> q.tolist(), [round(v, 5) for v in s.tolist()]
    ([[127, -64], [0, 0]], [0.00787, 1.0])
    """
    scale = _row_scales(weight)
    q = torch.clamp(torch.round(weight.detach().float() / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


class Int8Embedding(nn.Module):
    """A token embedding stored as int8 rows with one fp32 scale each; a lookup dequantises only the rows it reads."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        q, scale = quantize_rows(embedding.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[input_ids].float() * self.scale[input_ids].unsqueeze(-1)


class WeightOnlyInt8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and a scale per output row, dequantised to the input's dtype in each forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def _replace_linears(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, WeightOnlyInt8Linear(child))
        else:
            _replace_linears(child)


def make_variant(model, precision: str, qcfg: QuantizationConfig | None = None):
    """A copy of `model` (a transformers causal LM, fp32) in `precision` ('fp32', 'bf16', 'int8'), in eval mode.

    The original is left untouched."""
    if precision not in PRECISIONS:
        raise AgentRLError(f"unknown precision {precision!r}; precisions are {', '.join(PRECISIONS)}")
    qcfg = qcfg or QuantizationConfig()
    variant = copy.deepcopy(model).eval()
    for p in variant.parameters():
        p.requires_grad_(False)
    if precision == "fp32":
        return variant.float()
    if precision == "bf16":
        return variant.to(torch.bfloat16)
    variant = variant.float()
    if qcfg.embeddings:
        variant.set_input_embeddings(Int8Embedding(variant.get_input_embeddings()))
    if qcfg.linear == "dynamic":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated in favour of torchao (module docstring)
            # one scale per output row, like the weight-only path (per-tensor is the default; coarser for no gain)
            spec = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
            variant = torch.ao.quantization.quantize_dynamic(variant, spec, dtype=torch.qint8, inplace=True)
    else:
        _replace_linears(variant)
    return variant.eval()


def state_size_bytes(model) -> int:
    """Bytes of ``torch.save(model.state_dict())`` (tied tensors once, quantised weights packed)."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


def measure_variant(model, tokenizer, runtime, tasks, env_cfg, rollout_cfg, seed: int, repeats: int = 1,
                    latency_tasks: int = 16) -> dict:
    """Greedy episodes of `model` on `tasks` (task i with seed ``seed + i``) through the batched rollout engine.

    Returns ``records`` (the episode records) and ``timing``: throughput of the batched pass (the fastest of
    `repeats`: episodes and actions per second), and the latency of one action when episodes run one at a time
    (``latency_per_action_ms``, over the first `latency_tasks` tasks, batch size 1: what one user waits per tool
    call). The records of every pass are identical (greedy, same seeds), so only the last pass's are kept."""
    from pipeline.policy.rollout import RolloutEngine

    engine = RolloutEngine(model, tokenizer, runtime, env_cfg, rollout_cfg)
    seeds = [seed + i for i in range(len(tasks))]
    best, records = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        records = engine.run(tasks, seeds, greedy=True)
        best = min(best, time.perf_counter() - t0)
    actions = sum(r["n_calls"] for r in records)
    timing = {"seconds": best, "episodes": len(records), "actions": actions,
              "episodes_per_s": len(records) / best, "actions_per_s": actions / best}
    k = min(latency_tasks, len(tasks))
    if k:
        single = RolloutEngine(model, tokenizer, runtime, env_cfg, rollout_cfg.model_copy(update={"batch_size": 1}))
        t0 = time.perf_counter()
        one = single.run(tasks[:k], seeds[:k], greedy=True)
        n = sum(r["n_calls"] for r in one)
        timing.update(latency_per_action_ms=1000.0 * (time.perf_counter() - t0) / max(n, 1), latency_actions=n)
    return {"records": records, "timing": timing}


__all__ = ["Int8Embedding", "WeightOnlyInt8Linear", "make_variant", "measure_variant", "quantize_rows",
           "state_size_bytes"]
