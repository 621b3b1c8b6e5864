"""One call of the rollout engine's decoding loop (:meth:`pipeline.policy.rollout.RolloutEngine._loop`, whose module
docstring explains the design): `B` rows of a shared KV cache, each playing one episode at a time; a row that
finishes its episode takes the next waiting one. Per main forward every live row feeds its last sampled token;
known tokens (prompts, observations, a new segment's context) go in side forwards (:meth:`DecodeRun.flush`); rows
that ended an action step their environments together (:meth:`DecodeRun.step_envs`).

The state lives on the object so each step is a method of its own; nothing here is shared between calls.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from pipeline.policy.episode_drivers import TokenStream
from pipeline.policy.kv_cache import SharedPrefix, SlotCache, finish_mask
from pipeline.policy.sampling import sample_tokens
from pipeline.policy.tokenizer import encode_observation

DROP_IDLE_FRACTION = 0.25  # drop finished rows once this share of slots is idle (and no task waits)
CHUNK_ATTENTION_BUDGET = 1 << 22  # query-key pairs per row-batch of a chunk prefill (bounds its peak memory)


class DecodeRun:
    """The rows, the cache and the episodes of one decoding call of `engine` (a RolloutEngine)."""

    def __init__(self, engine, makers: list, seeds: list[int], greedy: bool, max_turns: int,
                 pool: ThreadPoolExecutor | None):
        self.engine, self.makers, self.seeds, self.greedy, self.pool = engine, makers, seeds, greedy, pool
        cfg = engine.cfg
        n = len(makers)
        self.out: list[dict | None] = [None] * n
        self.B = min(cfg.batch_size, n)
        self.device = engine.model.device
        self.n_uniforms = max_turns * cfg.max_new_tokens
        self.waiting = deque(range(n))
        self.cache = SlotCache(engine.n_layers, self.B, dtype=next(engine.model.parameters()).dtype)
        self.lens = [0] * self.B                 # tokens of each row's current segment (its last `lens` columns)
        self.slot_ep = [-1] * self.B             # episode in each slot, -1 when idle
        self.next_tok = [engine.pad_id] * self.B  # the token each row feeds at the next main forward
        self.act: list[list[int]] = [[] for _ in range(self.B)]
        self.pending: dict[int, tuple[bool, list[int]]] = {}  # row -> (new segment?, known tokens to append)
        self.episodes: dict[int, object] = {}
        self.streams: dict[int, TokenStream] = {}
        self.uniforms: dict[int, list[float]] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.n_sampled: dict[int, int] = {}
        self.st = {"forwards": 0, "chunk_forwards": 0, "sampled_tokens": 0, "chunk_tokens": 0, "row_drops": 0,
                   "rebases": 0, "cache_columns": 0, "live_columns": 0, "prefix_tokens": 0, "prefix_reused_tokens": 0}
        self.prefix: SharedPrefix | None = None

    def run(self) -> list[dict]:
        """Every episode's record, in the order of `makers`."""
        for b in range(self.B):
            self.start(b)
        if self.engine.cfg.prefix_cache:
            self.prefix = self.engine._shared_prefix([self.pending[b][1] for b in range(self.B)])
            self.st["prefix_tokens"] = len(self.prefix.ids) if self.prefix else 0
        self.flush()
        while True:
            live = [b for b in range(len(self.slot_ep)) if self.slot_ep[b] >= 0]
            if not live:
                break
            self.main_forward(live)
            self.flush()
            self.housekeeping()
        return self.out  # type: ignore[return-value]

    def start(self, b: int) -> None:
        """Row `b` takes the next waiting episode: its sampling stream, its prompt as pending known tokens."""
        e = self.waiting.popleft()
        ep = self.makers[e]()
        self.episodes[e], self.streams[e], self.n_sampled[e] = ep, TokenStream(), 0
        self.generators[e] = torch.Generator().manual_seed(self.seeds[e])
        self.uniforms[e] = torch.rand(self.n_uniforms, generator=self.generators[e], dtype=torch.float64).tolist()
        ids = self.engine._prompt_ids(ep.context)
        self.streams[e].segments.append(0)
        self.streams[e].known(ids)
        self.slot_ep[b] = e
        self.pending[b] = (True, ids)

    def finish(self, b: int) -> None:
        """Row `b`'s episode is over: its record out, the row idle or refilled."""
        e = self.slot_ep[b]
        rec = self.episodes.pop(e).record()
        s = self.streams.pop(e)
        rec.update(token_ids=s.token_ids, logprobs=s.logprobs, action_mask=s.action_mask, segments=s.segments)
        self.out[e] = rec
        del self.uniforms[e], self.generators[e], self.n_sampled[e]
        self.slot_ep[b], self.next_tok[b], self.lens[b] = -1, self.engine.pad_id, 0
        if self.waiting:
            self.start(b)

    def sample(self, rows: list[int], logits: torch.Tensor) -> None:
        """One token for each of `rows` from `logits` (the engine's sampling hook for sampled rows, when set); the
        actions that ended go to their environments."""
        engine, cfg = self.engine, self.engine.cfg
        eps = [self.slot_ep[b] for b in rows]
        for e in eps:
            if self.n_sampled[e] >= len(self.uniforms[e]):  # more samples than the turn budget foresaw: draw more
                self.uniforms[e] += torch.rand(self.n_uniforms, generator=self.generators[e],
                                               dtype=torch.float64).tolist()
        u = torch.tensor([self.uniforms[e][self.n_sampled[e]] for e in eps], dtype=torch.float64)
        toks, lps = self.choose(rows, eps, logits.cpu(), u)
        constraint = engine.constraint
        self.st["sampled_tokens"] += len(rows)
        ended: list[tuple[int, int, str, bool]] = []  # (row, episode, action text, cut) of the actions that ended
        for b, e, t, lp in zip(rows, eps, toks.tolist(), lps.tolist()):
            self.n_sampled[e] += 1
            s = self.streams[e]
            s.token_ids.append(t)
            s.logprobs.append(lp)
            s.action_mask.append(1)
            self.act[b].append(t)
            self.next_tok[b] = t
            if constraint is not None:
                constraint.consume(e, t)
            if t not in engine.stop_ids and len(self.act[b]) < cfg.max_new_tokens:
                continue
            if constraint is not None:
                constraint.end(e)
            text = engine.tokenizer.decode(self.act[b], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            ended.append((b, e, text, t not in engine.stop_ids))  # last: cut at rollout.max_new_tokens
            self.act[b] = []
        self.step_envs(ended)

    def choose(self, rows: list[int], eps: list[int], logits: torch.Tensor,
               u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its recorded log-probability: greedy or sampled (through the engine's sampling
        hook when set), under the tools' schemas when ``rollout.constrain`` is on (rows starting an action get a
        fresh matcher over their episode's tools)."""
        engine, cfg = self.engine, self.engine.cfg
        hook, constraint = engine.sampling_hook, engine.constraint
        if constraint is not None:
            own = [(e, getattr(self.episodes[e], "tool_specs", None), not self.act[b]) for b, e in zip(rows, eps)]
            logits = logits.float()
            if self.greedy:  # the most probable allowed token; its log-probability the model's own, as unconstrained
                toks = constraint.mask_(logits.clone(), own, keep=logits.argmax(dim=-1)).argmax(dim=-1)
                return toks, torch.log_softmax(logits, dim=-1).gather(-1, toks[:, None])[:, 0]
            logits = constraint.mask_(logits, own)
        if hook is None or self.greedy:
            return sample_tokens(logits, u, cfg.temperature, cfg.top_p, self.greedy)
        return hook.sample(logits, u, cfg.temperature, cfg.top_p, [self.streams[e] for e in eps],
                           [self.episodes[e] for e in eps])

    def step_envs(self, ended: list[tuple[int, int, str, bool]]) -> None:
        """The environment steps of every action that ended in this forward run together (tool calls are I/O:
        `env.tool_latency_s`, a remote API), then are handled in row order, so episodes do not depend on timing."""
        engine = self.engine
        steps, texts = [self.episodes[e].step for _, e, _, _ in ended], [(text, cut) for _, _, text, cut in ended]
        results = (list(self.pool.map(lambda step, tc: step(*tc), steps, texts))
                   if self.pool is not None and len(ended) > 1 else [step(*tc) for step, tc in zip(steps, texts)])
        for (b, e, _, _), (done, obs_text, folded, context) in zip(ended, results):
            s = self.streams[e]
            if done:
                self.finish(b)
                continue
            obs_ids = encode_observation(engine.tokenizer, obs_text)
            if folded or engine._outgrows(self.lens[b] + 1, len(obs_ids)):  # + 1: the stop token, not yet fed
                ids = engine._prompt_ids(context)  # a new segment from the environment's own context
                s.segments.append(len(s.token_ids))
                s.known(ids)
                self.pending[b] = (True, ids)
                self.st["rebases"] += 1
            else:
                s.known(obs_ids)
                self.pending[b] = (False, [self.next_tok[b]] + obs_ids)  # the stop token has not been fed yet

    def flush(self) -> None:
        """Feed every row's pending known tokens in side forwards, then sample each row's next token."""
        pending, lens = self.pending, self.lens
        while pending:
            # new segments (no history, long) and continuations (history, short) go in separate forwards:
            # together, every row would be padded to the longest chunk and the longest history
            reset = [b for b, (r, _) in pending.items() if r]
            group = sorted(reset or pending, key=lambda b: (len(pending[b][1]), b))
            rows = []
            for b in group:  # similar lengths together, and a bounded attention matrix (peak memory)
                c = len(pending[b][1])
                h = 0 if pending[b][0] else max([lens[r] for r in rows + [b]])
                if rows and (len(rows) + 1) * c * (h + c) > CHUNK_ATTENTION_BUDGET:
                    break
                rows.append(b)
            chunks = [pending.pop(b) for b in rows]
            logits, reused = self.engine._extend(self.cache, rows, chunks, lens, self.prefix)
            self.st["chunk_forwards"] += 1
            self.st["chunk_tokens"] += sum(len(ids) for _, ids in chunks) - reused
            self.st["prefix_reused_tokens"] += reused
            self.sample(rows, logits)

    def main_forward(self, live: list[int]) -> None:
        """Every row feeds its last sampled token (idle rows a pad that sees only itself); the live rows sample."""
        L = self.cache.length
        lens_t = torch.tensor(self.lens, dtype=torch.long)
        allowed = (torch.arange(L + 1)[None, :] >= (L - lens_t)[:, None])[:, None, None, :]
        logits = self.engine._forward(torch.tensor(self.next_tok, dtype=torch.long)[:, None].to(self.device),
                                      finish_mask(allowed, self.engine.impl).to(self.device),
                                      lens_t[:, None].to(self.device), self.cache)
        self.st["forwards"] += 1
        self.st["cache_columns"] += (L + 1) * len(self.slot_ep)
        for b in live:
            self.lens[b] += 1
        self.st["live_columns"] += sum(self.lens[b] for b in live)
        self.sample(live, logits[live] if len(live) < len(self.slot_ep) else logits)

    def housekeeping(self) -> None:
        """Release columns no row needs; drop idle rows once enough are idle and none can refill."""
        self.cache.release_left(self.cache.length - max(self.lens))
        n = len(self.slot_ep)
        idle = [b for b in range(n) if self.slot_ep[b] < 0]
        if idle and not self.waiting and len(idle) >= max(1, math.ceil(DROP_IDLE_FRACTION * n)):
            keep = [b for b in range(n) if self.slot_ep[b] >= 0]
            if keep:
                self.cache.batch_select_indices(torch.tensor(keep, device=self.device))
                self.lens, self.slot_ep = [self.lens[b] for b in keep], [self.slot_ep[b] for b in keep]
                self.next_tok, self.act = [self.next_tok[b] for b in keep], [self.act[b] for b in keep]
                self.st["row_drops"] += 1
