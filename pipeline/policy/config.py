"""Configs of the policy model (`model` section) and of the rollout engine (`rollout` section).

Each mirrors its `params.yaml` section key for key (pydantic, ``extra="forbid"``, see :mod:`pipeline.core.config`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig


class ModelConfig(PhaseConfig):
    """The policy model: the built-in small Llama or a local Hugging Face model."""

    base: str = Field("builtin", min_length=1, description="'builtin' for the small Llama built from this config with a tokenizer trained on the environment's text, or a local model directory / hub id already in the local cache (loaded with local_files_only: nothing is downloaded).")
    vocab_size: int = Field(1024, ge=320, le=65536, description="Target vocabulary of the built-in byte-level BPE tokenizer (256 bytes + 7 special tokens + merges; training stops earlier when no pair repeats). The model's embedding is sized to the tokenizer actually trained.")
    d_model: int = Field(256, ge=16, le=8192, description="Built-in model: hidden size.")
    n_layers: int = Field(4, ge=1, le=64, description="Built-in model: decoder layers.")
    n_heads: int = Field(4, ge=1, le=128, description="Built-in model: attention heads (d_model must be divisible by it).")
    n_kv_heads: int | None = Field(None, ge=1, le=128, description="Built-in model: key/value heads (grouped-query attention); null means n_heads.")
    d_ff: int = Field(672, ge=16, le=65536, description="Built-in model: feed-forward (SwiGLU) hidden size.")
    max_positions: int = Field(4096, ge=256, le=131072, description="Built-in model: max_position_embeddings. RoPE has no position parameters, so this costs nothing; it bounds one token segment of an episode (the rollout engine re-bases an episode that would outgrow it).")
    tie_embeddings: bool = Field(True, description="Built-in model: share the input embedding and the output projection.")
    rope_theta: float = Field(10000.0, gt=0, description="Built-in model: RoPE base frequency.")
    dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description="Compute dtype for training and evaluation forwards: 'auto' is bf16 autocast where the CPU (or GPU) supports bf16, else fp32; 'fp32'; 'bf16' (autocast; weights stay fp32).")
    seed: int = Field(0, description="Seed of the built-in model's weight initialisation.")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} (each head gets "
                             f"d_model / n_heads dimensions)")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv} (grouped-query attention "
                             f"shares each key/value head among n_heads / n_kv_heads query heads)")
        return self


class RolloutConfig(PhaseConfig):
    """How the rollout engine samples actions (see pipeline.policy.rollout)."""

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (logits / T) of sampled rollouts: adapt's sampled capability metrics, and RL rollouts unless `train.rollout_temperature` sets their own.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p (renormalised); 1.0 disables it.")
    max_new_tokens: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(48, description="Most tokens the policy may write for one action; an action without </call> by then is sent to the environment as it is (an invalid action). 'auto': derived by adapt from the demonstrations in its tokenizer's tokens (docs/recipe.md).")
    batch_size: int = Field(64, ge=1, le=4096, description="Episodes decoded together; when one ends, the next task takes its slot (continuous batching).")
    greedy: bool = Field(False, description="Decode greedily (argmax) instead of sampling: evaluation sets it. RolloutEngine.run(greedy=...) overrides it per call.")
    dtype: Literal["auto", "fp32", "bf16"] = Field("fp32", description="Rollout compute dtype: 'fp32' (log-probabilities equal a fp32 forward's), or 'bf16' / 'auto' where supported (prompt and observation prefills under bf16 autocast, decode steps still fp32; log-probabilities move by ~1e-2).")
    prefix_cache: bool = Field(True, description="Prefill the token prefix that every first prompt shares (system line and tool list) once per engine call and only the rest of each prompt; the episodes are the same, only faster. false: every prompt is prefilled whole.")
    tool_threads: int = Field(8, ge=0, le=256, description="Threads that run the tool calls ending in the same decode step side by side (results handled in row order, so episodes equal those with 0): a decode step waits for its slowest call, not their sum.")
    constrain: Literal["none", "schema"] = Field("none", description="'schema': decode each action under its tools' JSON Schemas (pipeline.policy.constrain): only tokens that can continue a valid call -- a tool of the episode, its parameters as JSON in the schema's property order, enums, patterns and bounds respected -- can be sampled, so no action is unparsable or breaks its schema. 'none': the model writes freely.")
    num_threads: int = Field(0, ge=0, le=1024, description="torch intra-op threads while rolling out (the process setting is restored afterwards); 0 keeps the process setting. The small model's decode matrices are tiny, so few threads are fastest.")
