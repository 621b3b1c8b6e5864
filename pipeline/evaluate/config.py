"""The `evaluate` phase's config (the `evaluate` section of params.yaml)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.core.config import PhaseConfig

SPLITS = ("train", "validation", "test")
POLICIES = ("sft", "rl")


class EvaluateConfig(PhaseConfig):
    """The `evaluate` phase: SFT and RL policies on every split; overfitting, unseen templates, rigid behaviour."""

    seed: int = Field(0, description="Seed of the episodes (episode i of a split gets seed + i, the same for both policies, so results pair up), of the sampled diversity episodes and of the bootstrap.")
    sft_policy: str = Field("models/adapted", description="The SFT policy's folder (written by the adapt stage).")
    rl_policy: str = Field("models/policy", description="The RL policy's folder (written by the train stage).")
    tasks_dir: str = Field("data/tasks", description="Folder of the task splits train.jsonl, validation.jsonl and test.jsonl (each checked with the 'tasks' suite).")
    world_dir: str = Field("data/env", description="The world the tasks refer to (written by build_env).")
    train_tasks: int = Field(200, ge=1, description="Training tasks evaluated: the first N of the split (tasks are generated in random order), enough to estimate the train/validation gap.")
    max_tasks: int | None = Field(None, ge=1, description="Validation and test tasks evaluated: the first N of each split; null: all of them.")
    bootstrap_samples: int = Field(1000, ge=100, le=100_000, description="Bootstrap resamples behind every confidence interval.")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="Coverage of the percentile bootstrap intervals.")
    overfit_metric: Literal["success", "return"] = Field("return", description="Metric of the train/validation gap: 'return' (mean episode return, the 'training/validation return gap' of docs/design.md §5.2.1) or 'success' (success rate).")
    overfit_threshold: float = Field(0.1, ge=0, description="Overfitting is flagged when train minus validation `overfit_metric` exceeds this.")
    unseen_template_threshold: float = Field(0.1, ge=0, le=1, description="Failure on unseen templates is flagged when test success on the seen templates exceeds success on the held-out ones by more than this.")
    diversity_split: Literal["train", "validation", "test"] = Field("validation", description="Split whose tasks are replayed with several seeds for the rigid-behaviour check.")
    diversity_tasks: int = Field(32, ge=1, description="Tasks (the first N of `diversity_split`) replayed with several seeds.")
    diversity_seeds: int = Field(4, ge=2, le=64, description="Sampled episodes per task (different seeds, rollout temperature) in the rigid-behaviour check.")
    min_behavior_diversity: float = Field(0.05, ge=0, le=1, description="Behaviour is rigid when the mean 1 − cos_sim between trajectory features of the same task's episodes is below this ...")
    min_distinct_solutions: float = Field(1.5, ge=1, description="... and the mean number of distinct solutions (call sequences with parameters) per task across the seeds is below this.")
