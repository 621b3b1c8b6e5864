"""Configs of the environment (`env` section, shared by every phase that steps it) and of the `build_env` phase.

`env` describes how episodes run (budgets, tool latency, reward weights); `build_env` describes the data that phase
generates (world size, task counts, level mix, demonstration flaws). Both mirror `params.yaml` key for key.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.core.config import PhaseConfig
from pipeline.envs.context_actions import ContextActionsConfig

LEVELS = (1, 2, 3, 4)
SPLITS = ("train", "validation", "test")


class RewardWeights(PhaseConfig):
    """Weights of R = α·correctness + β·efficiency + γ·safety + δ·user_experience (docs/design.md §1.3, §3.6)."""

    correctness: float = Field(1.0, gt=0, le=100, description="α: weight of the correct-answer component (0 or 1).")
    efficiency: float = Field(0.5, ge=0, le=100, description="β: weight of the efficiency component (≤ 0: calls beyond the minimum).")
    safety: float = Field(1.0, ge=0, le=100, description="γ: weight of the safety component (≤ 0: −1 per violation, capped at −1).")
    user_experience: float = Field(0.1, ge=0, le=100, description="δ: weight of the user-experience component in [0, 1].")
    shaping: Literal["on_success", "always"] = Field("on_success", description="When β·efficiency and δ·user_experience count: 'on_success' (only in an episode whose answer is correct; a failed episode's return is γ·safety alone) or 'always' (the plain sum, which pays a failed episode more for giving up early than for working through the task).")


class EnvConfig(PhaseConfig):
    """Which environment every phase acts in, and how an episode runs."""

    name: str | dict[str, float] = Field("shop", description="The environment: a built-in name (shop, sql), the name of an installed entry point of the group agentrl.environments, or module:Class (see docs/environments.md; `agentrl envs` lists them); or a mapping {name: weight} of two or more for a mixed run, every task in its own environment.")
    max_steps: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(8, description="Step budget: an episode not answered after this many actions is truncated. 'auto': derived by build_env from the tasks and demonstrations (docs/recipe.md).")
    max_policy_chars: Annotated[int, Field(ge=64)] | Literal["auto"] = Field(2000, description="Budget of policy-written text per episode, in characters (the environment is tokenizer-agnostic); exceeding it truncates the episode. 'auto': derived by build_env from the demonstrations (docs/recipe.md).")
    max_action_chars: Annotated[int, Field(ge=16, le=4096)] | Literal["auto"] = Field(256, description="Longest accepted action text; longer text is an invalid action (the `params` Text space has this length). 'auto': derived by build_env from the demonstrations (docs/recipe.md).")
    history_window: int = Field(6, ge=1, description="Action/observation pairs kept verbatim in the context; older ones are folded into a one-line summary of their results (docs/design.md §3.7).")
    tool_latency_s: float = Field(0.0, ge=0, le=10, description="Added latency of every tool call, in seconds (to exercise asynchronous rollouts).")
    tool_timeout_s: float = Field(2.0, gt=0, le=60, description="A tool call slower than this is cut off and reported as a timeout error.")
    tool_failure_rate: float = Field(0.0, ge=0, lt=1, description="Chance that a tool call fails with a transient 'temporarily unavailable' error (fault injection; the policy should retry).")
    tool_latency_spike_rate: float = Field(0.0, ge=0, lt=1, description="Chance that a tool call is delayed by a latency spike of `tool_latency_spike_s` on top of `tool_latency_s` (fault injection, drawn from the episode's seed); a call whose total latency reaches `tool_timeout_s` is a timeout error.")
    tool_latency_spike_s: float = Field(0.5, gt=0, le=10, description="Length of one latency spike, in seconds.")
    randomize_values: bool = Field(False, description="Redraw the numeric attributes of the task's entities in every episode's private copy of the database (ground truth recomputed), so a policy must read its tool results instead of memorising them.")
    reward: RewardWeights = Field(default_factory=RewardWeights, description="Composite reward weights.")
    context_actions: ContextActionsConfig = Field(default_factory=ContextActionsConfig, description="Context management and task decomposition as actions: note, remember/recall (long-term memory), plan (pipeline.envs.context_actions); off by default.")
