"""The rollout engine's KV cache and attention masks: preallocated per-slot buffers kept across turns.

- **The cache** (:class:`SlotCache`) is a ``transformers`` ``Cache`` whose layers keep preallocated ``[batch, heads,
  capacity, head_dim]`` buffers and a used column range ``[start, end)``: a decode step writes one column (no
  ``torch.cat`` of the whole cache per step, which ``DynamicLayer`` does: 3.5x slower at 800 tokens, batch 64);
  columns that no row needs any more are released by moving ``start``. Each row's current segment is always its
  *last* ``lens[row]`` columns, so the attention mask and the position ids follow from one length per row (left
  padding, correct positions), and no compaction of the sequence dimension is ever needed.
- **Masks** are passed as ready 4-D masks (boolean for ``sdpa``, additive for ``eager``, :func:`finish_mask`); every
  query may see itself, so padding never makes NaN (masked columns are always finite: a zero softmax weight times NaN
  is still NaN). Position ids count each row's own tokens (:func:`positions_from_valid`).
- **Shared prompt prefix** (:class:`SharedPrefix`): the keys and values of the token prefix that one engine call's
  first prompts share, copied in as a fresh prompt's history (see :mod:`pipeline.policy.rollout`).

The KV cache is stored in the model's dtype. Which rows feed what, and when columns are released, is the engine's
(:mod:`pipeline.policy.rollout`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from pipeline.core.errors import AgentRLError

SUPPORTED_ATTENTION = ("sdpa", "eager")


def attention_impl(model) -> str:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise AgentRLError(f"the rollout engine supports attn_implementation {SUPPORTED_ATTENTION}, the model uses "
                           f"{impl!r}; load it with attn_implementation='sdpa'")
    return impl


def finish_mask(allowed: torch.Tensor, impl: str) -> torch.Tensor:
    """A boolean 'may attend' mask (B, 1, Q, K) in the form the attention implementation expects."""
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, torch.finfo(torch.float32).min)


def prefill_mask(valid: torch.Tensor, impl: str = "sdpa") -> torch.Tensor:
    """Causal 4-D mask (B, 1, T, T) for a padded batch whose real tokens are `valid` (B, T, bool); a query always sees
    itself (padding rows stay finite)."""
    T = valid.shape[1]
    idx = torch.arange(T)
    causal = idx[None, :] <= idx[:, None]
    allowed = (causal[None] & valid[:, None, :]) | torch.eye(T, dtype=torch.bool)[None]
    return finish_mask(allowed[:, None], impl)


def positions_from_valid(valid: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens (left or right padding alike)."""
    return (valid.long().cumsum(-1) - 1).clamp_(min=0)



class SlotLayer(CacheLayerMixin):
    """One layer of :class:`SlotCache`: preallocated ``[batch, heads, capacity, head_dim]`` key/value buffers and the
    used column range ``[s, e)``. Columns left of ``s`` are zeros or stale finite values (a masked column must never
    hold NaN: softmax weight 0 times NaN is NaN); columns right of ``e`` are written before any view covers them."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    LEFT_SLACK = 64  # free columns kept left of the used range, so a row growing by a chunk rarely forces a copy

    def __init__(self, batch_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.batch_size, self.dtype = batch_size, dtype
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.s = self.e = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        H, Dk, Dv = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        self.kbuf = key_states.new_zeros(self.batch_size, H, 0, Dk, dtype=self.dtype or key_states.dtype)
        self.vbuf = value_states.new_zeros(self.batch_size, H, 0, Dv, dtype=self.dtype or value_states.dtype)
        self.device = key_states.device
        self.is_initialized = True

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int) -> None:
        """Take `kbuf`/`vbuf` as the buffers, their first `n` columns as the used range (the rest is written by the
        next updates)."""
        self.kbuf, self.vbuf, self.s, self.e = kbuf, vbuf, 0, n
        self.dtype, self.device, self.is_initialized = kbuf.dtype, kbuf.device, True
        self._views()

    def _views(self) -> None:
        self.keys = self.kbuf[:, :, self.s:self.e]
        self.values = self.vbuf[:, :, self.s:self.e]

    def _realloc(self, left: int, right: int, rows: torch.Tensor | None = None) -> None:
        """Move the used range (of `rows`, default all) into a fresh buffer: `left` zeroed columns, the used range,
        `right` unwritten columns."""
        L = self.e - self.s
        k_old, v_old = self.kbuf[:, :, self.s:self.e], self.vbuf[:, :, self.s:self.e]
        if rows is not None:
            k_old, v_old = k_old[rows], v_old[rows]
        B, H = k_old.shape[:2]
        new_k = self.kbuf.new_empty(B, H, left + L + right, self.kbuf.shape[3])
        new_v = self.vbuf.new_empty(B, H, left + L + right, self.vbuf.shape[3])
        new_k[:, :, :left] = 0
        new_v[:, :, :left] = 0
        new_k[:, :, left:left + L] = k_old
        new_v[:, :, left:left + L] = v_old
        self.kbuf, self.vbuf, self.s, self.e = new_k, new_v, left, left + L

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.e + q > self.kbuf.shape[2]:
            L = self.e - self.s
            self._realloc(min(self.s, self.LEFT_SLACK), max(L // 2, 64) + q)  # x1.5: amortised O(1)/column
        self.kbuf[:, :, self.e:self.e + q] = key_states
        self.vbuf[:, :, self.e:self.e + q] = value_states
        self.e += q
        self._views()
        return self.keys, self.values

    def ensure_length(self, n: int) -> None:
        """Make the used range at least `n` columns long by extending it to the left (no row's mask admits the new
        columns)."""
        need = n - (self.e - self.s)
        if need <= 0:
            return
        if self.s < need:  # room for half the used length again on the left: amortised O(1) per column, as on the right
            self._realloc(need + max(self.LEFT_SLACK, (self.e - self.s) // 2), max(64, (self.e - self.s) // 2))
        self.s -= need
        self._views()

    def release_left(self, n: int) -> None:
        self.s += n
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices`: copies only the used range (plus room to grow)."""
        if self.is_initialized:
            self._realloc(min(self.s, self.LEFT_SLACK), max(self.kbuf.shape[2] - self.e, 16), rows=indices)
            self._views()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.e - self.s + query_length, 0

    def get_seq_length(self) -> int:
        return self.e - self.s

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """The rollout engine's KV cache: a ``transformers`` ``Cache`` of :class:`SlotLayer`, one row per slot, in which
    each row's current segment is always its last ``lens[row]`` columns (see the module docstring)."""

    def __init__(self, num_layers: int, batch_size: int, dtype: torch.dtype | None = None):
        super().__init__(layers=[SlotLayer(batch_size, dtype) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        layer = self.layers[0]
        return layer.e - layer.s

    def history(self, rows: list[int], n: int, extra: int) -> "SlotCache":
        """A copy of the last `n` columns of `rows`, as a fresh cache to extend them in a side forward by `extra`
        columns: each row is copied once, straight into a buffer with room for the chunk, which the forward then
        writes in place (a ``DynamicCache`` would gather the rows into one tensor and concatenate the chunk to it:
        two more copies of every history)."""
        side = SlotCache(len(self.layers), len(rows))
        for layer, dst in zip(self.layers, side.layers):
            bufs = []
            for buf in (layer.kbuf, layer.vbuf):
                out = buf.new_empty(len(rows), buf.shape[1], n + extra, buf.shape[3])
                for i, r in enumerate(rows):
                    out[i, :, :n] = buf[r, :, layer.e - n:layer.e]
                bufs.append(out)
            dst.adopt(*bufs, n)
        return side

    def place(self, row: int, side: Cache, i: int, hist_end: int, kept: int, new_from: int, new: int) -> None:
        """Make `row`'s last columns: `kept` columns of side-cache row `i` ending at `hist_end` (its history), then
        its `new` columns starting at `new_from` (the chunk just computed). Grows to the left if needed."""
        for layer, src in zip(self.layers, side.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(src.keys, src.values)
            layer.ensure_length(kept + new)
            e = layer.e
            for buf, sbuf in ((layer.kbuf, src.keys), (layer.vbuf, src.values)):
                if kept:
                    buf[row, :, e - new - kept:e - new] = sbuf[i, :, hist_end - kept:hist_end]
                buf[row, :, e - new:e] = sbuf[i, :, new_from:new_from + new]
            layer._views()

    def release_left(self, n: int) -> None:
        if n > 0:
            for layer in self.layers:
                layer.release_left(n)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)


class SharedPrefix:
    """The keys and values of the token prefix that one engine call's first prompts share (:mod:`pipeline.policy.rollout`,
    "Shared prompt prefix"): ``ids`` and a one-row ``DynamicCache`` holding their columns, positions 0..len(ids)-1."""

    def __init__(self, ids: list[int], cache: DynamicCache):
        self.ids, self.cache = ids, cache

    def covers(self, ids: list[int]) -> int:
        """How many leading tokens of the fresh prompt `ids` the prefix's columns stand for: their common token-id
        prefix, short of the prompt's last token (its logits sample the first action token, so it must be
        prefilled). Keys and values at position j depend only on tokens 0..j, so any leading part of the prefix is
        as valid as the whole."""
        n, limit = 0, min(len(self.ids), len(ids) - 1)
        while n < limit and self.ids[n] == ids[n]:
            n += 1
        return n

    def history(self, hist: list[int], extra: int) -> SlotCache:
        """A side-forward history of ``len(hist)`` rows laid out as :meth:`SlotCache.history` lays out a row's, with
        room for `extra` more columns: row i's last ``hist[i]`` history columns are the prefix's first ``hist[i]``;
        the columns left of them are zeros (masked, finite)."""
        H = max(hist)
        side = SlotCache(len(self.cache.layers), len(hist))
        for layer, dst_layer in zip(self.cache.layers, side.layers):
            kv = []
            for src in (layer.keys, layer.values):
                dst = src.new_empty(len(hist), src.shape[1], H + extra, src.shape[3])
                dst[:, :, :H] = 0
                for i, h in enumerate(hist):
                    dst[i, :, H - h:H] = src[0, :, :h]
                kv.append(dst)
            dst_layer.adopt(kv[0], kv[1], H)
        return side


def n_cache_layers(model) -> int:
    cfg = model.config.get_text_config(decoder=True)
    return cfg.num_hidden_layers
