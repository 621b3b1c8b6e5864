"""Config of the `reward_model` phase (the `reward_model` section of params.yaml) and of the learned reward in
training (`train.learned_reward`, :class:`LearnedRewardConfig`, nested in the train config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig


class RewardModelConfig(PhaseConfig):
    """The learned verifier: what it trains on, its size and its held-out evaluation (docs/design.md §3.1.2, §3.6.2)."""

    when: Literal["used", "always"] = Field("used", description="'used': the stage trains the verifier only when training reads it (train.learned_reward.coef > 0) and otherwise writes a marker in seconds, so a default run trains none and its `train` stage does not rerun for it; 'always': train it regardless (to study the verifier on its own).")
    seed: int = Field(0, description="Seed of the rollouts' task draw and seeds, the held-out split and the fit.")
    policy: str = Field("models/adapted", description="Policy whose sampled rollouts on training tasks join the demonstrations as training data.")
    rollout_tasks: int = Field(192, ge=0, le=100_000, description="Training tasks the policy plays (drawn at random); 0: demonstrations only.")
    rollouts_per_task: int = Field(2, ge=1, le=64, description="Sampled episodes per drawn task.")
    rollout_temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature of those rollouts (higher: more flawed episodes to learn from).")
    max_demos: int | None = Field(None, ge=1, description="Demonstrations used (the first N); null: all.")
    holdout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of tasks (by a hash of the task id, so a task's episodes stay on one side) held out for the reported metrics.")
    hash_dim: int = Field(4096, ge=64, le=1 << 20, description="Buckets the trajectory features are hashed into (weights per head).")
    epochs: int = Field(300, ge=1, le=100_000, description="Full-batch Adam steps of the logistic fit.")
    lr: float = Field(0.05, gt=0, le=10, description="Adam learning rate of the fit.")
    l2: float = Field(1e-4, ge=0, description="L2 penalty on the feature weights.")
    calibration_bins: int = Field(10, ge=2, le=100, description="Equal-width bins of the expected calibration error.")
    feedback: str | None = Field("data/production/snapshot", description="A snapshot of captured traffic (`agentrl snapshot`), or a folder of capture segments of `agentrl serve`: its requests that got feedback join the training data with the people's success label (success head only); a missing or empty folder or null: rule labels only.")
    feedback_success_rating: float = Field(4, ge=1, le=5, description="A feedback rating (1-5) at or above this labels the episode a success; a feedback 'label' overrides the rating.")


class LearnedRewardConfig(PhaseConfig):
    """`train.learned_reward`: the learned verifier as a reward component, and the reward-hacking guard."""

    coef: float = Field(0.0, ge=0, le=100, description="Each episode gets extra_reward = coef·score added to its return and its last step reward; 0 disables (no model is read).")
    model: str = Field("models/reward_model", description="Folder of the reward model (the `reward_model` stage's output).")
    success_weight: float = Field(0.5, ge=0, le=1, description="score = w·p_success + (1 − w)·p_sound of the learned verifier's two heads.")
    guard_window: int = Field(5, ge=2, le=10_000, description="Updates over which the reward-hacking guard fits the slopes of the learned score and of the rule reward.")
    guard_learned_slope: float = Field(0.005, description="The guard fires when the learned score's slope (per update) over the window is above this ...")
    guard_rule_slope: float = Field(-0.005, description="... while the rule reward's slope (the mean env return without extra_reward, per update) is below this.")
    guard_stop: bool = Field(True, description="Stop training when the guard fires (cleanly, like early stopping: the best validated policy is the output); false only logs the alarm.")

    @model_validator(mode="after")
    def _check(self) -> "LearnedRewardConfig":
        if not self.model.strip():
            raise ValueError("learned_reward.model must name the reward model folder")
        return self
