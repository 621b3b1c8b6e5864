"""The language-model policy, shared by every phase that trains, rolls out or serves it.

- :mod:`pipeline.policy.tokenizer`: byte-level BPE trained on the environment's training text, protocol markers as
  single tokens (``train_tokenizer``, ``corpus_texts``, ``encode_context``/``encode_continuation``).
- :mod:`pipeline.policy.model`: build the built-in small Llama or load a local HF model; ``save_policy`` /
  ``load_policy`` (weights + tokenizer + ``policy.json``); bf16 autocast helpers.
- :mod:`pipeline.policy.rollout`: ``RolloutEngine`` (batched multi-turn rollouts with a KV cache kept across turns,
  per-token log-probabilities and action masks) and ``ModelPolicy`` (one episode, the ``run_episode`` interface); its
  parts: :mod:`~pipeline.policy.sampling` (the sampling maths), :mod:`~pipeline.policy.kv_cache` (the cache and the
  attention masks), :mod:`~pipeline.policy.episode_drivers` (what the engine drives per episode).
- :mod:`pipeline.policy.scoring`: ``sequence_logprobs``, the learner's recomputation of a rollout's log-probabilities.
- :mod:`pipeline.policy.demos`: demonstrations as training sequences (token ids, loss masks) and entity-name
  augmentation, shared by SFT and RL's behaviour-cloning anchor.
- :mod:`pipeline.policy.episodes`: ``run_episode``, ``evaluate``, ``summarize`` (task files are read by
  :func:`pipeline.envs.taskfile.load_task_file`).
- :mod:`pipeline.policy.config`: ``ModelConfig``, ``RolloutConfig``.

Nothing is imported here, so ``import pipeline.policy`` stays free of torch and transformers.
"""
