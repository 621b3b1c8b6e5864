"""Config of the `check_drift` phase (`check_drift` section of `params.yaml`), mirrored key for key.

Every threshold of the drift and consistency checks lives here, with the reason for its default. The library functions
in :mod:`pipeline.check_drift.checks` and :mod:`pipeline.check_drift.consistency` take this object, so a test, the phase and a
notebook use one set of defaults.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.core.config import PhaseConfig

CORRECTIONS = ("bonferroni", "holm")
_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class DriftConfig(PhaseConfig):
    """Drift and state-representation checks: inputs, per-feature tests, the hidden-state test, consistency."""

    # ------------------------------------------------------------------------------------------------------- inputs
    reference_tasks: str = Field(
        "data/tasks/train.jsonl",
        description="Reference task file: the tasks the policy was trained on.")
    reference_trajectories: str = Field(
        "auto",
        description="Reference episodes (JSON Lines of episode records). 'auto': the policy's greedy rollouts on a "
                    "sample of the reference tasks when a policy exists, else the demonstrations "
                    "data/demos/train.jsonl (the behaviour the first policy is trained to imitate).")
    current: str = Field(
        "auto",
        description="Current task data: a JSON Lines file, or a folder whose *.jsonl files are read together. 'auto': "
                    "the folder data/incoming/ when it holds at least one *.jsonl file, else the validation split "
                    "data/tasks/validation.jsonl.")
    current_trajectories: str | None = Field(
        None,
        description="Current episodes, e.g. collected from the deployed policy (JSON Lines of episode records). "
                    "null: the policy's greedy rollouts on a sample of the current tasks when a policy exists; with "
                    "neither, the behaviour check is skipped (and says so).")
    world_dir: str = Field(
        "data/env",
        description="World (written by build_env) whose database gives the entity values of the reference tasks, and "
                    "from which the false-alarm calibration draws fresh reference samples.")
    current_world_dir: str | None = Field(
        None,
        description="World the current tasks refer to (e.g. a production database export); null: world_dir.")
    policy: str = Field(
        "models/policy",
        description="Policy folder (pipeline.policy.model.save_policy). When it does not exist yet, the checks that "
                    "need a model (rollouts, hidden-state drift, token-id consistency) are skipped and say why; the "
                    "prompt-level consistency check still runs.")
    seed: int = Field(0, description="Seed of every subsample, permutation and calibration sample in the phase.")

    # ------------------------------------------------------------------------------------------- per-feature tests
    alpha: float = Field(
        0.01, gt=0, lt=0.5,
        description="Family-wise false-alarm level of the whole drift verdict: the statistical checks (task_drift, "
                    "task_drift_per_env, calibration, trajectory_drift, state_drift) are judged together by Holm's "
                    "step-down rule at this level (pipeline/check_drift/verdict.py), so on data without drift the "
                    "verdict fails with probability at most alpha, however many checks run.")
    correction: Literal["bonferroni", "holm"] = Field(
        "bonferroni",
        description="Multiple-testing correction across the features of one check: 'bonferroni' (p * m) or 'holm' "
                    "(step-down; same family-wise guarantee, never less powerful). Across checks the verdict always "
                    "uses Holm (alpha).")
    min_expected_count: float = Field(
        5.0, gt=0,
        description="Chi-square: categories whose expected count is below this in either sample are pooled into one "
                    "'(other)' category (Cochran's rule); fewer than two categories left skips the test.")
    min_samples: int = Field(
        20, ge=2,
        description="A feature with fewer non-missing values than this on either side is skipped, not tested.")
    ks_min_statistic: float = Field(
        0.1, ge=0, le=1,
        description="Kolmogorov-Smirnov: a continuous feature drifts only if it is significant AND its statistic D "
                    "(the largest gap between the two CDFs) is at least this. With large samples every tiny "
                    "difference is significant; 0 disables the effect-size floor.")
    chi2_min_effect: float = Field(
        0.1, ge=0, le=1,
        description="Chi-square: a categorical feature drifts only if it is significant AND its effect size "
                    "(Cohen's w = Cramér's V for two samples, sqrt(chi2 / n)) is at least this (0.1 is Cohen's "
                    "'small'); 0 disables the floor.")
    trajectory_outcomes: Literal["report", "test"] = Field(
        "report",
        description="The behaviour check's outcome features (success, return, correctness): 'report' tests and "
                    "records them without failing the check (on the policy's own training tasks they measure the "
                    "generalisation gap, which deploy's vs-champion test gates), 'test' gates on them too.")
    skip_features: list[str] = Field(
        default_factory=list,
        description="Features left out of the per-feature checks (names from pipeline.check_drift.features.TASK_FEATURES "
                    "and TRAJECTORY_FEATURES).")

    # -------------------------------------------------------------------------------------- hidden-state MMD test
    mmd_permutations: int = Field(
        2000, ge=19, le=100_000,
        description="Permutations of the MMD test; its smallest p-value is 1 / (permutations + 1), which must lie "
                    "below the level the verdict's family rule gives the check (alpha / 5 at worst: 0.002 at alpha "
                    "0.01) for the check to be able to fire; 2000 gives 0.0005, and a Monte Carlo standard error of "
                    "the p-value of about 0.001 near that level.")
    max_hidden_samples: int = Field(
        200, ge=10, le=20_000,
        description="Observations per side embedded for the MMD test (a fixed-seed subsample; the forward passes "
                    "and the O(n^2) kernel dominate the check's time). With episodes, each contributes one "
                    "observation (a random step): the steps of one episode are not independent draws, and the "
                    "permutation test's level needs independent ones.")
    hidden_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Compute dtype of the drift test's forward passes: 'auto' is bf16 autocast where the CPU (or GPU) "
                    "computes it fast, else fp32 (a distribution test does not need fp32; bf16 is several times "
                    "faster here).")
    hidden_batch_size: int = Field(32, ge=1, le=4096, description="Observations per forward pass when embedding.")
    hidden_max_tokens: int = Field(
        512, ge=8,
        description="Longest observation embedded, in tokens; longer ones keep <bos> and their last tokens, as the "
                    "rollout engine does.")

    # ------------------------------------------------------------------------------------------------- rollouts
    max_rollout_episodes: int = Field(
        200, ge=1,
        description="Episodes rolled out with the policy (greedy) on a sample of the reference and of the current "
                    "tasks, when trajectories are not given.")

    # ---------------------------------------------------------------------------------------------- consistency
    consistency_probes: int = Field(
        64, ge=1,
        description="Probe observations for the train/serve consistency check (taken from reference episodes at "
                    "every step, so folded histories are included).")
    serving_preprocess: str = Field(
        "pipeline.envs.prompt:render_context",
        description="'module:function' of the serving path's prompt function, with render_context's signature "
                    "(question, tool_signatures, history, window) -> str. The training path is always "
                    "pipeline.envs.prompt:render_context.")

    # -------------------------------------------------------------------------------------------- calibration
    false_alarm_repeats: int = Field(
        20, ge=0, le=1000,
        description="Fresh samples drawn from the reference task generator (the world and build_env's level mix and "
                    "options), each a uniform subsample of a draw as large as the reference split, on which the task "
                    "check is run against the reference tasks at level alpha; the calibration check's p-value is "
                    "the binomial test of its alarms against alpha (joined to the verdict's family rule); 0 skips it.")
    false_alarm_sample_size: int = Field(
        400, ge=20,
        description="Tasks per fresh sample in the calibration (capped by the size of the current data).")
    fail_on_drift: bool = Field(
        False,
        description="Exit with an error (after writing metrics/drift.json) when any check fails. Off by default: the "
                    "verdict file is what the promotion gate and the retraining flow read.")

    @field_validator("serving_preprocess")
    @classmethod
    def _check_dotted(cls, v: str) -> str:
        if not _DOTTED.match(v):
            raise ValueError(f"must be 'module:function' (e.g. 'pipeline.envs.prompt:render_context'), got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_features(self) -> "DriftConfig":
        from pipeline.check_drift.features import ALL_FEATURES

        unknown = sorted(set(self.skip_features) - set(ALL_FEATURES))
        if unknown:
            raise ValueError(f"skip_features names unknown features {unknown}; features are {sorted(ALL_FEATURES)}")
        return self
