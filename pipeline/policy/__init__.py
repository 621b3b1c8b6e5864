"""The language-model policy: its tokenizer, the model, the rollout engine, and (the adapt phase) adaptation.

- :mod:`pipeline.policy.tokenizer`: byte-level BPE trained on the environment's training text, protocol markers as
  single tokens (``train_tokenizer``, ``corpus_texts``, ``encode_context``/``encode_continuation``).
- :mod:`pipeline.policy.model`: build the built-in small Llama or load a local HF model; ``save_policy`` /
  ``load_policy`` (weights + tokenizer + ``policy.json``); bf16 autocast helpers.
- :mod:`pipeline.policy.rollout`: ``RolloutEngine`` (batched multi-turn rollouts with a KV cache kept across
  turns, per-token log-probabilities and action masks), ``sequence_logprobs`` (their recomputation for RL) and
  ``ModelPolicy`` (one episode, the ``run_episode`` interface).
- :mod:`pipeline.policy.config`: ``ModelConfig``, ``RolloutConfig`` (and the adapt phase's configs).

Nothing is imported here, so ``import pipeline.policy`` stays free of torch and transformers.
"""
