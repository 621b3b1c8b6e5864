"""The multi-turn rollout engine: many episodes at once, batched decoding with a KV cache kept across turns.

How it works (``RolloutEngine._loop``):

- **Decode steps sample; known text is appended in chunks.** Each main forward feeds every live row the token it
  sampled last and samples the next one (``</call>`` is detected by token id, never by decoding). When a row's
  action ends, its environment steps at once and the row's known tokens -- ``</call>`` plus the observation, or a
  whole new prompt -- go into a *chunk*: all rows with a chunk at that step share one side forward (left-padded,
  against a copy of their histories), their new keys and values are written back as each row's last columns, and
  the row samples its next action token from the chunk's last logits. Fresh prompts and continuations use separate
  side forwards (padding one to the other's length would waste most of the work), rows of similar chunk length go
  together, and one side forward holds at most ``CHUNK_ATTENTION_BUDGET`` query-key pairs per head (its attention
  matrix bounds the engine's peak memory). Rows never wait for each other,
  and the main loop never spends a step on a known token (measured: a third fewer main forwards than feeding
  observations token by token).
- **Shared prompt prefix** (``rollout.prefix_cache``). Every first prompt starts with the same 71 tokens (the system
  line and the tool list, :func:`pipeline.env.prompt.render_header`; the default data's first prompts are 85-122 tokens,
  94 on average), and so does every re-based context. Each call of :meth:`RolloutEngine.run` /
  :meth:`~RolloutEngine.complete` takes the longest common *token-id* prefix (P tokens) of the prompts of the episodes
  it starts at once (the first ``batch_size``; ids, never text, so a BPE merge across the boundary just shortens it),
  and runs it through the model once. A fresh prompt then prefills only what follows the part of the prefix it starts
  with: those keys and values are copied in as the row's history and the rest of the prompt takes positions P, P+1, ...
  (positions count each row's own tokens, as everywhere here, so left padding changes nothing). The prefix is recomputed
  on every call, never kept: RL updates the weights in place between calls, and one batch-1 forward of P tokens is cheap
  next to the prefills it replaces. A call that starts one episode, or whose prompts share fewer than
  ``MIN_SHARED_PREFIX`` tokens, prefills whole prompts. Measured (bench/rollout.py, trained policy, 128 episodes at
  batch 32 and 64, 1 thread): prefilled tokens 0.54x, tokens/s 1.06-1.19x; observation prefills and decode steps are the
  rest of the time.
- **Continuous batching.** `batch_size` slots; when an episode ends, the next task takes its slot through the same
  chunk path. Once a quarter of the slots are idle and no task waits, the idle rows are dropped (one copy).
- **The cache** (:class:`SlotCache`) is a ``transformers`` ``Cache`` whose layers keep preallocated ``[batch, heads,
  capacity, head_dim]`` buffers and a used column range ``[start, end)``: a decode step writes one column (no
  ``torch.cat`` of the whole cache per step, which ``DynamicLayer`` does: 3.5x slower at 800 tokens, batch 64);
  columns that no row needs any more are released by moving ``start``. Each row's current segment is always its
  *last* ``lens[row]`` columns, so the attention mask and the position ids follow from one length per row (left
  padding, correct positions), and no compaction of the sequence dimension is ever needed. The mask is passed as a
  ready 4-D mask (boolean for ``sdpa``, additive for ``eager``); every query may see itself, so padding never makes
  NaN (masked columns are always finite: a zero softmax weight times NaN is still NaN).
- **transformers 5.24 API**: the forward takes ``cache=`` (``past_key_values`` is deprecated) and returns ``.cache``;
  ``logits_to_keep=1`` keeps the output projection to the last position.
- **dtype**: ``fp32`` runs everything in fp32. ``bf16`` (and ``auto`` where the CPU supports bf16) runs the chunk
  prefills under bf16 autocast -- compute-bound, 2.3x faster -- but keeps single-token decode steps in fp32, which
  bench/rollout.py measured faster here: one-query attention is memory-bound and this CPU's bf16 SDPA kernel is slower
  than its fp32 one (the prototype's "bf16 slowed decoding", ../shared/FINDINGS.md). The KV cache is stored in the
  model's dtype.

What an episode record holds (the :func:`pipeline.policy.episodes.run_episode` fields, so ``summarize`` works unchanged,
plus): ``token_ids`` (the whole episode as the model saw it, prompt included), ``logprobs`` (same length),
``action_mask`` (1 exactly on sampled tokens), ``segments`` (start offset of each token segment, see below),
``policy_version``, ``actions`` (each step's parsed call: ``{"tool", "params"}``, or ``{"tool": None, "params":
None, "error": reason}`` for text the protocol rejects), ``step_rewards`` (the reward the environment paid at each
step, the change of R, so they sum to ``return``; per-turn credit reads them) and ``seed``.

Decisions:

- **Recorded log-probabilities are those of the distribution actually sampled from**: ``log_softmax(logits / T)``,
  restricted to the top-p nucleus and renormalised (:func:`filtered_logprobs`, shared with
  :func:`sequence_logprobs`). Greedy decoding records the model's own ``log_softmax(logits)`` (T = 1, no top-p) of the
  argmax token, for diagnostics (a point mass would record 0 everywhere). In fp32 they equal a fp32 forward's to
  ~1e-6; bf16 rollouts (bf16 prefills) move them by ~1e-2, so RL that needs exact old log-probabilities recomputes
  them (:func:`sequence_logprobs`) or rolls out in fp32.
- **Sampling** is inverse-CDF with one pre-drawn uniform per sampled token from a ``torch.Generator`` seeded with the
  episode's seed: an episode's randomness depends only on its own seed, not on its batch neighbours or its slot, and
  the same seeds give the same episodes on CPU.
- **The token stream keeps what the policy wrote.** The environment strips whitespace around an action and replaces
  non-printable characters; the engine's token stream keeps the sampled tokens as they are (the policy conditions on its
  own output, and the recorded log-probabilities stay those of the stream). For a policy that writes the protocol, the
  decoded stream equals the environment's context exactly; a ``ModelPolicy`` (which re-encodes the context each turn)
  can differ from the engine only for actions the environment normalised.
- **Folded history re-bases the episode: a new token segment.** When the environment folds old turns into its
  summary line (``info["context_folded"]``), the cached prefix no longer equals the context. The engine then
  re-encodes ``obs["context"]`` and starts a new *segment*: the record's ``segments`` gets the offset where the new
  prompt (mask 0) begins; the previous segment ends with the sampled action, without its observation (which lives
  in the new context). A segment is a self-contained sequence: recompute log-probabilities per segment
  (:func:`sequence_logprobs` with ``segments=``, or :func:`split_segments`). The same happens when a segment would
  outgrow the model's ``max_position_embeddings`` (and a context longer than that keeps its last tokens after
  ``<bos>``).
- An action ends at ``</call>`` or ``<eos>`` (both sampled and recorded) or after ``max_new_tokens``; its decoded
  text, special tokens included, is what the environment parses.

Deliberately left out: speculative decoding; a tree of shared prefixes (a GRPO group's episodes share their whole
first prompt, but the task part beyond the common prefix is ~20 tokens); keeping the prefix across calls (see above);
and parking a row while its tool runs so that the others decode on (the layout keeps every row's segment at the
right end of the cache). What the engine does instead: the environment steps of all actions that ended in the same
decode step run side by side on ``rollout.tool_threads`` threads, and are handled in row order afterwards, so a decode
step waits for its slowest tool call rather than the sum of them (``env.tool_latency_s``; remote tools in production),
and episodes do not depend on which call returned first.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from pipeline.env.config import EnvConfig
from pipeline.env.core import ToolTasksEnv, WorldRuntime
from pipeline.env.protocol import InvalidAction, parse_action
from pipeline.env.tasks import Task
from pipeline.core.errors import AgentRLError
from pipeline.policy.config import RolloutConfig
from pipeline.policy.model import autocast_context, release_free_memory
from pipeline.policy.tokenizer import CALL_CLOSE, EOS, PAD, encode_context, encode_continuation, marker_ids

SUPPORTED_ATTENTION = ("sdpa", "eager")
DROP_IDLE_FRACTION = 0.25  # drop finished rows once this share of slots is idle (and no task waits)
CHUNK_ATTENTION_BUDGET = 1 << 22  # query-key pairs per row-batch of a chunk prefill (bounds its peak memory)
MIN_SHARED_PREFIX = 8  # tokens; a shorter common prefix (<bos> alone, unrelated prompts) is not worth a forward


# ========================================================================================================= sampling
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


# ============================================================================================================ masks
def attention_impl(model) -> str:
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise AgentRLError(f"the rollout engine supports attn_implementation {SUPPORTED_ATTENTION}, the model uses "
                           f"{impl!r}; load it with attn_implementation='sdpa'")
    return impl


def _finish_mask(allowed: torch.Tensor, impl: str) -> torch.Tensor:
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
    return _finish_mask(allowed[:, None], impl)


def positions_from_valid(valid: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens (left or right padding alike)."""
    return (valid.long().cumsum(-1) - 1).clamp_(min=0)


# ============================================================================================================ cache
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
        if self.s < need:
            self._realloc(need + self.LEFT_SLACK, max(64, (self.e - self.s) // 2))
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

    def history(self, rows: torch.Tensor, n: int) -> DynamicCache:
        """A copy of the last `n` columns of `rows`, as a fresh cache to extend them in a side forward."""
        cache = DynamicCache()
        for i, layer in enumerate(self.layers):
            cache.update(layer.kbuf[rows, :, layer.e - n:layer.e], layer.vbuf[rows, :, layer.e - n:layer.e], i)
        return cache

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
    """The keys and values of the token prefix that one engine call's first prompts share (module docstring, "Shared
    prompt prefix"): ``ids`` and a one-row ``DynamicCache`` holding their columns, positions 0..len(ids)-1."""

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

    def history(self, hist: list[int]) -> DynamicCache:
        """A side-forward history of ``len(hist)`` rows laid out as :meth:`SlotCache.history` lays out a row's: row
        i's last ``hist[i]`` columns are the prefix's first ``hist[i]``; the columns left of them are zeros (masked,
        finite)."""
        H = max(hist)
        side = DynamicCache()
        for li, layer in enumerate(self.cache.layers):
            kv = []
            for src in (layer.keys, layer.values):
                dst = src.new_zeros(len(hist), src.shape[1], H, src.shape[3])
                for i, h in enumerate(hist):
                    dst[i, :, H - h:] = src[0, :, :h]
                kv.append(dst)
            side.update(kv[0], kv[1], li)
        return side


def n_cache_layers(model) -> int:
    cfg = model.config.get_text_config(decoder=True)
    return cfg.num_hidden_layers


# ========================================================================================================= episodes
@dataclass
class _Stream:
    """Tokens of one episode as the model saw them."""

    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    action_mask: list = field(default_factory=list)
    segments: list = field(default_factory=list)

    def known(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.action_mask += [0] * len(ids)


class _EnvEpisode:
    """Drives one ToolTasksEnv episode for the engine (the same record fields as `evaluation.run_episode`)."""

    def __init__(self, runtime: WorldRuntime, env_cfg: EnvConfig, task: Task, seed: int, options: dict | None = None):
        self.task, self.seed = task, seed
        self.env = ToolTasksEnv(world=runtime, tasks=[task], config=env_cfg)
        obs, info = self.env.reset(seed=seed, options={**(options or {}), "task": task})
        self.context = obs["context"]
        self.obs, self.last_info = obs, info  # what a scripted policy acts on (RolloutEngine.demonstrate)
        self.tool_names, self.max_chars = runtime.tool_names, env_cfg.max_action_chars
        self.steps: list[dict] = []
        self.actions: list[dict] = []
        self.rewards: list[float] = []

    def step(self, text: str) -> tuple[bool, str, bool, str]:
        """Returns (done, observation text, folded, new context)."""
        obs, reward, terminated, truncated, info = self.env.step(text)
        self.obs, self.last_info = obs, info
        self.rewards.append(float(reward))
        self.steps.append({"action": info["action_text"], "observation": info["observation_text"]})
        parsed = parse_action(text, self.tool_names, self.max_chars)
        self.actions.append({"tool": None, "params": None, "error": parsed.reason} if isinstance(parsed, InvalidAction)
                            else {"tool": parsed.name, "params": parsed.params})
        done = terminated or truncated
        if done:
            self.info, self.truncated = info, truncated
            self.env.close()
        return done, info["observation_text"], bool(info["context_folded"]), obs["context"]

    def record(self) -> dict:
        task, info = self.task, self.info
        return {
            "task_id": task.task_id, "level": task.level, "family": task.family, "template_seen": task.template_seen,
            "success": bool(info["is_success"]), "return": float(info["return"]), "truncated": bool(self.truncated),
            "components": dict(info["reward_components"]), "n_calls": info["n_calls"],
            "n_violations": info["n_violations"], "n_failed": info["n_failed"], "verifier": info["verifier"],
            "answer": info["answer"], "ground_truth": info["ground_truth"], "steps": self.steps, "calls": info["calls"],
            "actions": self.actions, "step_rewards": self.rewards, "seed": self.seed,
        }


class _OneAction:
    """A 'episode' of one action from a given context (RolloutEngine.complete)."""

    def __init__(self, context: str, seed: int):
        self.context, self.seed, self.text = context, seed, None

    def step(self, text: str) -> tuple[bool, str, bool, str]:
        self.text = text
        return True, "", False, self.context

    def record(self) -> dict:
        return {"context": self.context, "text": self.text, "seed": self.seed}


# =========================================================================================================== engine
class RolloutEngine:
    """Batched multi-turn rollouts of a causal LM policy in `agentrl/ToolTasks-v0` (see the module docstring).

    Args:
        model: a transformers causal LM (sdpa or eager attention); put in eval mode during a run, mode restored after.
        tokenizer: its tokenizer, holding the protocol markers as single tokens.
        runtime: the shared :class:`WorldRuntime` (only needed by :meth:`run`).
        env_cfg: the environment config (only needed by :meth:`run`).
        cfg: the :class:`RolloutConfig`.
    """

    def __init__(self, model, tokenizer, runtime: WorldRuntime | None = None, env_cfg: EnvConfig | None = None,
                 cfg: RolloutConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.runtime, self.env_cfg = runtime, env_cfg or EnvConfig()
        self.cfg = cfg or RolloutConfig()
        self.impl = attention_impl(model)
        ids = marker_ids(tokenizer)
        self.pad_id = ids[PAD]
        self.stop_ids = frozenset({ids[CALL_CLOSE], ids[EOS]})
        self.n_layers = n_cache_layers(model)
        text_cfg = model.config.get_text_config(decoder=True)
        self.max_positions = int(getattr(text_cfg, "max_position_embeddings", None) or 1 << 30)
        if self.max_positions < self.cfg.max_new_tokens + 64:
            raise AgentRLError(f"the model's max_position_embeddings ({self.max_positions}) leaves no room for a "
                               f"prompt and rollout.max_new_tokens={self.cfg.max_new_tokens}")
        self.stats: dict = {}

    # ------------------------------------------------------------------------------------------------------ public
    def run(self, tasks: list[Task], seeds: list[int], greedy: bool | None = None,
            policy_version: int = 0, options: list[dict | None] | None = None) -> list[dict]:
        """Play one episode per (task, seed); returns the episode records in the order of `tasks`.

        `greedy` None means ``cfg.greedy``. `options`, one per episode, are extra reset options of the environment
        (e.g. ``rename``, :meth:`pipeline.env.core.ToolTasksEnv._rename`). The same tasks, seeds and options give the
        same records."""
        if self.runtime is None:
            raise AgentRLError("RolloutEngine.run needs a WorldRuntime (pass runtime=...)")
        if len(tasks) != len(seeds):
            raise AgentRLError(f"run() got {len(tasks)} tasks but {len(seeds)} seeds; give one seed per episode")
        if options is not None and len(options) != len(tasks):
            raise AgentRLError(f"run() got {len(tasks)} tasks but {len(options)} options; give one (or None) per "
                               f"episode")
        options = options or [None] * len(tasks)
        makers = [lambda t=t, s=s, o=o: _EnvEpisode(self.runtime, self.env_cfg, t, int(s), o)
                  for t, s, o in zip(tasks, seeds, options)]
        max_turns = self.env_cfg.max_steps
        records = self._generate(makers, [int(s) for s in seeds], self.cfg.greedy if greedy is None else greedy,
                                 max_turns, env_steps=True)
        for r in records:
            r["policy_version"] = policy_version
        release_free_memory()  # the run's freed KV cache and activations back to the OS (why: see the function)
        return records

    def demonstrate(self, tasks: list[Task], seeds: list[int], make_policy, policy_version: int = 0,
                    options: list[dict | None] | None = None) -> list[dict]:
        """Episodes played by a scripted policy (``make_policy()`` gives a fresh one with ``reset(task)`` and
        ``act(obs, info)``, e.g. :class:`pipeline.env.expert.ExpertPolicy`), recorded as :meth:`run` records the
        model's own: the same fields, the same token layout (prompt, each action's tokens with ``action_mask`` 1,
        each observation's with 0, a new segment where the environment folds the history or a segment would
        outgrow the model's positions), so the learner reads them like sampled episodes. Each action is tokenized
        as ``encode_continuation`` tokenizes it, the canonical tokens SFT trains on; ``logprobs`` are 0 (no
        sampling distribution produced them) and ``demonstrated`` is True. No model forward runs."""
        if self.runtime is None:
            raise AgentRLError("RolloutEngine.demonstrate needs a WorldRuntime (pass runtime=...)")
        options = options or [None] * len(tasks)
        if not (len(tasks) == len(seeds) == len(options)):
            raise AgentRLError(f"demonstrate() got {len(tasks)} tasks, {len(seeds)} seeds and {len(options)} "
                               f"options; give one of each per episode")
        records = []
        for task, seed, opt in zip(tasks, seeds, options):
            ep, policy, s = _EnvEpisode(self.runtime, self.env_cfg, task, int(seed), opt), make_policy(), _Stream()
            policy.reset(task)
            s.segments.append(0)
            s.known(self._prompt_ids(ep.context))
            while True:
                text = policy.act(ep.obs, ep.last_info)
                ids = encode_continuation(self.tokenizer, text)
                s.token_ids += ids
                s.logprobs += [0.0] * len(ids)
                s.action_mask += [1] * len(ids)
                done, obs_text, folded, context = ep.step(text)
                if done:
                    break
                obs_ids = encode_continuation(self.tokenizer, obs_text)
                if folded or self._outgrows(len(s.token_ids) - s.segments[-1], len(obs_ids)):
                    s.segments.append(len(s.token_ids))  # as run() re-bases: the environment's own context
                    s.known(self._prompt_ids(context))
                else:
                    s.known(obs_ids)
            rec = ep.record()
            rec.update(token_ids=s.token_ids, logprobs=s.logprobs, action_mask=s.action_mask, segments=s.segments,
                       policy_version=policy_version, demonstrated=True)
            records.append(rec)
        return records

    def complete(self, contexts: list[str], seeds: list[int] | None = None, greedy: bool | None = None) -> list[dict]:
        """One action per context (batched): records with ``text`` (the decoded action), ``token_ids``, ``logprobs``,
        ``action_mask``. For single-turn capability checks and :class:`ModelPolicy`."""
        seeds = list(range(len(contexts))) if seeds is None else [int(s) for s in seeds]
        makers = [lambda c=c, s=s: _OneAction(c, s) for c, s in zip(contexts, seeds)]
        return self._generate(makers, seeds, self.cfg.greedy if greedy is None else greedy, 1)

    # ---------------------------------------------------------------------------------------------------- internals
    def _outgrows(self, segment_len: int, n_obs: int) -> bool:
        """Whether a segment of `segment_len` tokens (the last action's stop token included), with `n_obs` observation
        tokens and a next action of up to `max_new_tokens` after it, would pass the model's positions: then the
        episode re-bases on a new segment (module docstring). Shared by run() and demonstrate()."""
        return segment_len + n_obs + self.cfg.max_new_tokens > self.max_positions

    def _prompt_ids(self, context: str) -> list[int]:
        ids = encode_context(self.tokenizer, context)
        room = self.max_positions - self.cfg.max_new_tokens - 1
        if len(ids) > room:  # keep <bos> and the most recent tokens
            ids = ids[:1] + ids[len(ids) - room + 1:]
        return ids

    def _forward(self, input_ids, mask, positions, cache, prefill: bool = False):
        """Logits after the last input position. Chunk prefills run under the configured autocast; single-token
        decode steps always in the model's dtype (see the module docstring, "dtype")."""
        with autocast_context(self.cfg.dtype if prefill else "fp32", self.model.device):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                             use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _generate(self, makers: list, seeds: list[int], greedy: bool, max_turns: int,
                  env_steps: bool = False) -> list[dict]:
        was_training, threads = self.model.training, torch.get_num_threads()
        self.model.eval()
        if self.cfg.num_threads:
            torch.set_num_threads(self.cfg.num_threads)
        # environment steps (tool calls) of one decode step run side by side (rollout.tool_threads); not for
        # complete(), whose "episodes" have no environment
        pool = (ThreadPoolExecutor(self.cfg.tool_threads, thread_name_prefix="tool-call")
                if env_steps and self.cfg.tool_threads > 1 else None)
        try:
            with torch.inference_mode():
                return self._loop(makers, seeds, greedy, max_turns, pool)
        finally:
            if pool is not None:
                pool.shutdown()
            self.model.train(was_training)
            torch.set_num_threads(threads)

    def _shared_prefix(self, prompts: list[list[int]]) -> SharedPrefix | None:
        """The longest common token-id prefix of `prompts` with its keys and values (one forward, under the prefill
        autocast like the chunks it stands in for); None with fewer than two prompts or under ``MIN_SHARED_PREFIX``
        common tokens."""
        if len(prompts) < 2:
            return None
        first = prompts[0]
        n = min(len(p) for p in prompts)
        P = next((j for j in range(n) if any(p[j] != first[j] for p in prompts[1:])), n)
        if P < MIN_SHARED_PREFIX:
            return None
        device = self.model.device
        prefix = DynamicCache()
        self._forward(torch.tensor([first[:P]], device=device), None, torch.arange(P, device=device)[None], prefix,
                      prefill=True)
        return SharedPrefix(first[:P], prefix)

    def _extend(self, cache: SlotCache, rows: list[int], chunks: list[tuple[bool, list[int]]], lens: list[int],
                prefix: SharedPrefix | None = None) -> tuple[torch.Tensor, int]:
        """Append known tokens to several rows at once with one side forward; returns the logits after each chunk and
        how many tokens came from `prefix` instead of the forward.

        `chunks[i]` is ``(reset, ids)``: with `reset` the row starts a new segment (its old columns are dropped);
        otherwise `ids` continue its current segment. The rows' histories are copied out of the shared cache, the
        chunks (right-aligned, left-padded) run through the model against them, and each row's history and new
        columns are written back as the row's last columns -- so rows keep ending at the same column. When every
        chunk is a new segment and a shared `prefix` is given, the part of each prompt the prefix covers becomes the
        row's history, copied from the prefix, and only the rest of the prompt runs."""
        device = self.model.device
        k = len(rows)
        from_prefix = prefix is not None and all(reset for reset, _ in chunks)
        if from_prefix:
            hist = [prefix.covers(ids) for _, ids in chunks]
            chunks = [(True, ids[h:]) for (_, ids), h in zip(chunks, hist)]
        else:
            hist = [0 if reset else lens[b] for b, (reset, _) in zip(rows, chunks)]
        sizes = [len(ids) for _, ids in chunks]
        H, C = max(hist), max(sizes)
        inp = torch.full((k, C), self.pad_id, dtype=torch.long)
        valid = torch.zeros(k, H + C, dtype=torch.bool)
        pos = torch.zeros(k, C, dtype=torch.long)
        for i, ((_, ids), h, c) in enumerate(zip(chunks, hist, sizes)):
            inp[i, C - c:] = torch.tensor(ids)
            valid[i, H - h:H] = True
            valid[i, H + C - c:] = True
            pos[i, C - c:] = torch.arange(h, h + c)
        cols, qcols = torch.arange(H + C), torch.arange(H, H + C)
        allowed = (valid[:, None, :] & (cols[None, None, :] <= qcols[None, :, None])) | (
            cols[None, None, :] == qcols[None, :, None])
        rows_t = torch.tensor(rows, device=device)
        side = DynamicCache() if H == 0 else prefix.history(hist) if from_prefix else cache.history(rows_t, H)
        # one fresh prompt needs no mask: plain causal attention (sdpa's is_causal fast path)
        mask = None if k == 1 and H == 0 else _finish_mask(allowed[:, None], self.impl).to(device)
        logits = self._forward(inp.to(device), mask, pos.to(device), side, prefill=True)
        for i, (b, h, c) in enumerate(zip(rows, hist, sizes)):
            cache.place(b, side, i, H, h, H + C - c, c)
            lens[b] = h + c
        return logits, sum(hist) if from_prefix else 0

    def _loop(self, makers: list, seeds: list[int], greedy: bool, max_turns: int,
              pool: ThreadPoolExecutor | None = None) -> list[dict]:
        cfg, tok = self.cfg, self.tokenizer
        n = len(makers)
        out: list[dict | None] = [None] * n
        if n == 0:
            return []
        B = min(cfg.batch_size, n)
        device = self.model.device
        n_uniforms = max_turns * cfg.max_new_tokens
        waiting = deque(range(n))
        cache = SlotCache(self.n_layers, B, dtype=next(self.model.parameters()).dtype)
        lens = [0] * B                     # tokens of each row's current segment (its last `lens` cache columns)
        slot_ep = [-1] * B                 # episode in each slot, -1 when idle
        next_tok = [self.pad_id] * B       # the token each row feeds at the next main forward
        act: list[list[int]] = [[] for _ in range(B)]
        pending: dict[int, tuple[bool, list[int]]] = {}  # row -> (new segment?, known tokens to append)
        episodes: dict[int, object] = {}
        streams: dict[int, _Stream] = {}
        uniforms: dict[int, list[float]] = {}
        generators: dict[int, torch.Generator] = {}
        n_sampled: dict[int, int] = {}
        st = {"forwards": 0, "chunk_forwards": 0, "sampled_tokens": 0, "chunk_tokens": 0, "row_drops": 0,
              "rebases": 0, "cache_columns": 0, "live_columns": 0, "prefix_tokens": 0, "prefix_reused_tokens": 0}
        prefix: SharedPrefix | None = None

        def start(b: int) -> None:
            e = waiting.popleft()
            ep = makers[e]()
            episodes[e], streams[e], n_sampled[e] = ep, _Stream(), 0
            generators[e] = torch.Generator().manual_seed(seeds[e])
            uniforms[e] = torch.rand(n_uniforms, generator=generators[e], dtype=torch.float64).tolist()
            ids = self._prompt_ids(ep.context)
            streams[e].segments.append(0)
            streams[e].known(ids)
            slot_ep[b] = e
            pending[b] = (True, ids)

        def finish(b: int) -> None:
            e = slot_ep[b]
            rec = episodes.pop(e).record()
            s = streams.pop(e)
            rec.update(token_ids=s.token_ids, logprobs=s.logprobs, action_mask=s.action_mask, segments=s.segments)
            out[e] = rec
            del uniforms[e], generators[e], n_sampled[e]
            slot_ep[b], next_tok[b], lens[b] = -1, self.pad_id, 0
            if waiting:
                start(b)

        def sample(rows: list[int], logits: torch.Tensor) -> None:
            eps = [slot_ep[b] for b in rows]
            for e in eps:
                if n_sampled[e] >= len(uniforms[e]):  # more samples than the turn budget foresaw: draw more
                    uniforms[e] += torch.rand(n_uniforms, generator=generators[e], dtype=torch.float64).tolist()
            u = torch.tensor([uniforms[e][n_sampled[e]] for e in eps], dtype=torch.float64)
            toks, lps = sample_tokens(logits.cpu(), u, cfg.temperature, cfg.top_p, greedy)
            st["sampled_tokens"] += len(rows)
            ended: list[tuple[int, int, str]] = []  # (row, episode, action text) of the actions this forward ended
            for b, e, t, lp in zip(rows, eps, toks.tolist(), lps.tolist()):
                n_sampled[e] += 1
                s = streams[e]
                s.token_ids.append(t)
                s.logprobs.append(lp)
                s.action_mask.append(1)
                act[b].append(t)
                next_tok[b] = t
                if t not in self.stop_ids and len(act[b]) < cfg.max_new_tokens:
                    continue
                text = tok.decode(act[b], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                ended.append((b, e, text))
                act[b] = []
            # the environment steps of every action that ended in this forward run together (tool calls are I/O:
            # `env.tool_latency_s`, a remote API), then are handled in row order, so episodes do not depend on timing
            steps, texts = [episodes[e].step for _, e, _ in ended], [text for _, _, text in ended]
            results = (list(pool.map(lambda step, text: step(text), steps, texts))
                       if pool is not None and len(ended) > 1 else [step(text) for step, text in zip(steps, texts)])
            for (b, e, _), (done, obs_text, folded, context) in zip(ended, results):
                s = streams[e]
                if done:
                    finish(b)
                    continue
                obs_ids = encode_continuation(tok, obs_text)
                if folded or self._outgrows(lens[b] + 1, len(obs_ids)):  # + 1: the stop token, not yet fed
                    ids = self._prompt_ids(context)  # a new segment from the environment's own context
                    s.segments.append(len(s.token_ids))
                    s.known(ids)
                    pending[b] = (True, ids)
                    st["rebases"] += 1
                else:
                    s.known(obs_ids)
                    pending[b] = (False, [next_tok[b]] + obs_ids)  # the stop token has not been fed yet

        def flush() -> None:
            while pending:
                # new segments (no history, long) and continuations (history, short) go in separate forwards:
                # together, every row would be padded to the longest chunk and the longest history
                reset = [b for b, (r, _) in pending.items() if r]
                group = sorted(reset or pending, key=lambda b: (len(pending[b][1]), b))
                rows, pairs = [], 0
                for b in group:  # similar lengths together, and a bounded attention matrix (peak memory)
                    c = len(pending[b][1])
                    h = 0 if pending[b][0] else max([lens[r] for r in rows + [b]])
                    if rows and (len(rows) + 1) * c * (h + c) > CHUNK_ATTENTION_BUDGET:
                        break
                    rows.append(b)
                chunks = [pending.pop(b) for b in rows]
                logits, reused = self._extend(cache, rows, chunks, lens, prefix)
                st["chunk_forwards"] += 1
                st["chunk_tokens"] += sum(len(ids) for _, ids in chunks) - reused
                st["prefix_reused_tokens"] += reused
                sample(rows, logits)

        for b in range(B):
            start(b)
        if cfg.prefix_cache:
            prefix = self._shared_prefix([pending[b][1] for b in range(B)])
            st["prefix_tokens"] = len(prefix.ids) if prefix else 0
        flush()
        while True:
            live = [b for b in range(len(slot_ep)) if slot_ep[b] >= 0]
            if not live:
                break
            # ---- main forward: every row feeds its last sampled token (idle rows a pad that sees only itself)
            L = cache.length
            lens_t = torch.tensor(lens, dtype=torch.long)
            allowed = (torch.arange(L + 1)[None, :] >= (L - lens_t)[:, None])[:, None, None, :]
            logits = self._forward(torch.tensor(next_tok, dtype=torch.long)[:, None].to(device),
                                   _finish_mask(allowed, self.impl).to(device), lens_t[:, None].to(device), cache)
            st["forwards"] += 1
            st["cache_columns"] += (L + 1) * len(slot_ep)
            for b in live:
                lens[b] += 1
            st["live_columns"] += sum(lens[b] for b in live)
            sample(live, logits[live] if len(live) < len(slot_ep) else logits)
            flush()
            # ---- housekeeping: release columns no row needs; drop idle rows once enough are idle and none can refill
            cache.release_left(cache.length - max(lens))
            idle = [b for b in range(len(slot_ep)) if slot_ep[b] < 0]
            if idle and not waiting and len(idle) >= max(1, math.ceil(DROP_IDLE_FRACTION * len(slot_ep))):
                keep = [b for b in range(len(slot_ep)) if slot_ep[b] >= 0]
                if keep:
                    cache.batch_select_indices(torch.tensor(keep, device=device))
                    lens, slot_ep = [lens[b] for b in keep], [slot_ep[b] for b in keep]
                    next_tok, act = [next_tok[b] for b in keep], [act[b] for b in keep]
                    st["row_drops"] += 1
        self.stats = st
        return out  # type: ignore[return-value]


# ============================================================================================ recomputation for RL
def split_segments(token_ids: list[int], values: list, segments: list[int] | None) -> list[list]:
    """Cut a per-token list of an episode into its segments (see the module docstring)."""
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


# ====================================================================================================== one episode
class ModelPolicy:
    """The language-model policy behind the ``reset(task)`` / ``act(obs, info) -> text`` interface of
    :func:`pipeline.policy.episodes.run_episode` (serving, single episodes). Each turn it encodes ``obs["context"]`` -- the
    same prompt text the engine and training use -- and writes one action with the engine's decoder.

    Args:
        model, tokenizer: the policy.
        cfg: sampling settings (``cfg.greedy`` or `greedy` picks argmax decoding).
        seed: seeds the sampling; turn k of the i-th episode since construction uses seed ``seed + 1000 * i + k``.
    """

    name = "model"

    def __init__(self, model, tokenizer, cfg: RolloutConfig | None = None, seed: int = 0, greedy: bool | None = None):
        self.cfg = (cfg or RolloutConfig()).model_copy(update={"batch_size": 1})
        self.engine = RolloutEngine(model, tokenizer, cfg=self.cfg)
        self.greedy = self.cfg.greedy if greedy is None else greedy
        self.seed, self.episode, self.turn = seed, -1, 0

    def reset(self, task: Task | None = None) -> None:
        self.episode += 1
        self.turn = 0

    def act(self, obs: dict, info: dict | None = None) -> str:
        seed = self.seed + 1000 * max(self.episode, 0) + self.turn
        self.turn += 1
        return self.engine.complete([obs["context"]], [seed], greedy=self.greedy)[0]["text"]
