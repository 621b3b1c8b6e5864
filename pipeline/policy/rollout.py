"""The multi-turn rollout engine: many episodes at once, batched decoding with a KV cache kept across turns.

How it works (``RolloutEngine._loop``, its steps in :class:`pipeline.policy.decode_run.DecodeRun`):

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
  line and the tool list, :func:`pipeline.envs.prompt.render_header`; the default data's first prompts are 85-122 tokens,
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
- **The cache** (:mod:`pipeline.policy.kv_cache`): preallocated per-slot buffers in which each row's current segment
  is always its last ``lens[row]`` columns, so the masks and position ids follow from one length per row.
- **transformers 5.24 API**: the forward takes ``cache=`` (``past_key_values`` is deprecated) and returns ``.cache``;
  ``logits_to_keep=1`` keeps the output projection to the last position.
- **dtype**: ``fp32`` runs everything in fp32. ``bf16`` (and ``auto`` where the CPU supports bf16) runs the chunk
  prefills under bf16 autocast -- compute-bound, 2.3x faster -- but keeps single-token decode steps in fp32, which
  bench/rollout.py measured faster here: one-query attention is memory-bound and this CPU's bf16 SDPA kernel is slower
  than its fp32 one. The KV cache is stored in the model's dtype.

What an episode record holds (the :func:`pipeline.policy.episodes.run_episode` fields, so ``summarize`` works unchanged,
plus): ``token_ids`` (the whole episode as the model saw it, prompt included), ``logprobs`` (same length),
``action_mask`` (1 exactly on sampled tokens), ``segments`` (start offset of each token segment, see below),
``policy_version``, ``actions`` (each step's parsed call: ``{"tool", "params"}``, or ``{"tool": None, "params":
None, "error": reason}`` for text the protocol rejects; ``token_limit`` True where the action was cut at
``max_new_tokens`` rather than ended by ``</call>`` or ``<eos>``), ``step_rewards`` (the reward the environment paid at each
step, the change of R, so they sum to ``return``; per-turn credit reads them) and ``seed``. With
``env.context_actions`` on, also ``step_events`` (per step its events, e.g. ``["subgoal_done"]``) and
``context_actions`` (:mod:`pipeline.policy.episode_drivers`); a note re-bases the episode like a fold.

Decisions:

- **Recorded log-probabilities and sampling** (:mod:`pipeline.policy.sampling`): the log-probabilities of the
  distribution actually sampled from (temperature, top-p); inverse-CDF sampling with one uniform per sampled token from
  a generator seeded with the episode's seed, so an episode depends only on its own seed, not on its batch neighbours
  or its slot.
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
  (:func:`pipeline.policy.scoring.sequence_logprobs` with ``segments=``, or
  :func:`~pipeline.policy.scoring.split_segments`). The same happens when a segment would
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

from concurrent.futures import ThreadPoolExecutor

import torch
from transformers.cache_utils import DynamicCache

from pipeline.core.errors import AgentRLError
from pipeline.core.recipe import require_resolved
from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import Environment
from pipeline.policy.config import RolloutConfig
from pipeline.policy.constrain import CallConstraint
from pipeline.policy.decode_run import DecodeRun
from pipeline.policy.episode_drivers import EnvEpisode, OneAction, TokenStream
from pipeline.policy.kv_cache import SharedPrefix, SlotCache, attention_impl, finish_mask, n_cache_layers
from pipeline.policy.model import autocast_context, release_free_memory
from pipeline.policy.record import EpisodeRecord
from pipeline.policy.tokenizer import CALL_CLOSE, CALL_OPEN, EOS, PAD, encode_action, encode_context, encode_observation, marker_ids

MIN_SHARED_PREFIX = 8  # tokens; a shorter common prefix (<bos> alone, unrelated prompts) is not worth a forward


class RolloutEngine:
    """Batched multi-turn rollouts of a causal LM policy in `agentrl/ToolTasks-v0` (see the module docstring).

    Args:
        model: a transformers causal LM (sdpa or eager attention); put in eval mode during a run, mode restored after.
        tokenizer: its tokenizer, holding the protocol markers as single tokens.
        runtime: the loaded :class:`~pipeline.envs.contract.Environment` (only needed by :meth:`run`).
        env_cfg: the environment config (only needed by :meth:`run`).
        cfg: the :class:`RolloutConfig`.
    """

    def __init__(self, model, tokenizer, runtime: Environment | None = None, env_cfg: EnvConfig | None = None,
                 cfg: RolloutConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.runtime, self.env_cfg = runtime, env_cfg or EnvConfig()
        self.cfg = cfg or RolloutConfig()
        require_resolved(self.env_cfg, "env")  # `auto` limits are numbers by now (pipeline.core.recipe)
        require_resolved(self.cfg, "rollout")
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
        # the sampling hook: None samples softmax(logits / T) (pipeline.policy.sampling.sample_tokens); an object with
        # `sample(logits, u, temperature, top_p, streams, episodes) -> (tokens, logprobs)` samples the non-greedy rows
        # instead, recording the log-probabilities of the distribution it drew from (a training extension's noise)
        self.sampling_hook = None
        # rollout.constrain: schema -- each action decoded under its tools' JSON Schemas (pipeline.policy.constrain)
        self.constraint = (CallConstraint(tokenizer, int(model.get_output_embeddings().weight.shape[0]),
                                          ids[CALL_OPEN], ids[CALL_CLOSE])
                           if self.cfg.constrain == "schema" else None)

    # ------------------------------------------------------------------------------------------------------ public
    def run(self, tasks: list, seeds: list[int], greedy: bool | None = None,
            policy_version: int = 0, options: list[dict | None] | None = None) -> list[EpisodeRecord]:
        """Play one episode per (task, seed); returns the episode records in the order of `tasks`
        (:class:`pipeline.policy.record.EpisodeRecord`).

        `greedy` None means ``cfg.greedy``. `options`, one per episode, are extra reset options of the environment
        (see :meth:`pipeline.envs.runner.AgentEnv.reset`). The same tasks, seeds and options give the
        same records."""
        if self.runtime is None:
            raise AgentRLError("RolloutEngine.run needs an environment (pass runtime=...)")
        if len(tasks) != len(seeds):
            raise AgentRLError(f"run() got {len(tasks)} tasks but {len(seeds)} seeds; give one seed per episode")
        if options is not None and len(options) != len(tasks):
            raise AgentRLError(f"run() got {len(tasks)} tasks but {len(options)} options; give one (or None) per "
                               f"episode")
        options = options or [None] * len(tasks)
        makers = [lambda t=t, s=s, o=o: EnvEpisode(self.runtime, self.env_cfg, t, int(s), o)
                  for t, s, o in zip(tasks, seeds, options)]
        max_turns = self.env_cfg.max_steps
        records = self._generate(makers, [int(s) for s in seeds], self.cfg.greedy if greedy is None else greedy,
                                 max_turns, env_steps=True)
        for r in records:
            r["policy_version"] = policy_version
        release_free_memory()  # the run's freed KV cache and activations back to the OS (why: see the function)
        return records

    def demonstrate(self, tasks: list, seeds: list[int], make_policy, policy_version: int = 0,
                    options: list[dict | None] | None = None) -> list[dict]:
        """Episodes played by a scripted policy (``make_policy()`` gives a fresh one with ``reset(task)`` and
        ``act(obs, info)``, e.g. an environment's :meth:`~pipeline.envs.contract.Environment.expert`), recorded as :meth:`run` records the
        model's own: the same fields, the same token layout (prompt, each action's tokens with ``action_mask`` 1,
        each observation's with 0, a new segment where the environment folds the history or a segment would
        outgrow the model's positions), so the learner reads them like sampled episodes. Each action is tokenized
        as ``encode_action`` tokenizes it, the canonical tokens SFT trains on; ``logprobs`` are 0 (no
        sampling distribution produced them) and ``demonstrated`` is True. No model forward runs."""
        if self.runtime is None:
            raise AgentRLError("RolloutEngine.demonstrate needs an environment (pass runtime=...)")
        options = options or [None] * len(tasks)
        if not (len(tasks) == len(seeds) == len(options)):
            raise AgentRLError(f"demonstrate() got {len(tasks)} tasks, {len(seeds)} seeds and {len(options)} "
                               f"options; give one of each per episode")
        records = []
        for task, seed, opt in zip(tasks, seeds, options):
            ep, policy, s = EnvEpisode(self.runtime, self.env_cfg, task, int(seed), opt), make_policy(), TokenStream()
            policy.reset(task)
            s.segments.append(0)
            s.known(self._prompt_ids(ep.context))
            while True:
                text = policy.act(ep.obs, ep.last_info)
                ids = encode_action(self.tokenizer, text)
                s.token_ids += ids
                s.logprobs += [0.0] * len(ids)
                s.action_mask += [1] * len(ids)
                done, obs_text, folded, context = ep.step(text)
                if done:
                    break
                obs_ids = encode_observation(self.tokenizer, obs_text)
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
        makers = [lambda c=c, s=s: OneAction(c, s) for c, s in zip(contexts, seeds)]
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
        side = DynamicCache() if H == 0 else prefix.history(hist, C) if from_prefix else cache.history(rows, H, C)
        # one fresh prompt needs no mask: plain causal attention (sdpa's is_causal fast path)
        mask = None if k == 1 and H == 0 else finish_mask(allowed[:, None], self.impl).to(device)
        logits = self._forward(inp.to(device), mask, pos.to(device), side, prefill=True)
        for i, (b, h, c) in enumerate(zip(rows, hist, sizes)):
            cache.place(b, side, i, H, h, H + C - c, c)
            lens[b] = h + c
        return logits, sum(hist) if from_prefix else 0

    def _loop(self, makers: list, seeds: list[int], greedy: bool, max_turns: int,
              pool: ThreadPoolExecutor | None = None) -> list[dict]:
        """Play the episodes `makers` build, `cfg.batch_size` rows at a time (:class:`DecodeRun`); the run's counters
        become :attr:`stats`."""
        if not makers:
            return []
        run = DecodeRun(self, makers, seeds, greedy, max_turns, pool)
        out = run.run()
        self.stats = run.st
        return out


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

    def reset(self, task=None) -> None:
        self.episode += 1
        self.turn = 0

    def act(self, obs: dict, info: dict | None = None) -> str:
        seed = self.seed + 1000 * max(self.episode, 0) + self.turn
        self.turn += 1
        return self.engine.complete([obs["context"]], [seed], greedy=self.greedy)[0]["text"]
