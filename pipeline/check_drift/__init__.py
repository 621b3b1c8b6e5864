"""The `check_drift` phase's library: data, behaviour and state-representation drift, and train/serve consistency.

- :mod:`pipeline.check_drift.features`: the features compared (tasks, world entities, episodes) and the policy's
  hidden-state features (mean-pooled last hidden state of any Hugging Face causal LM);
- :mod:`pipeline.check_drift.checks`: per-feature tests (chi-square, Kolmogorov-Smirnov, Bonferroni/Holm), the kernel
  two-sample (MMD) test on hidden states, fresh reference samples and documented drifted samples, false-alarm rate;
- :mod:`pipeline.check_drift.verdict`: the verdict's family-wise rule (Holm across the statistical checks at one
  level, so its false-alarm rate on drift-free data is at most ``alpha``);
- :mod:`pipeline.check_drift.consistency`: train/serve consistency of prompts, token ids and hidden states (the design
  document, section 5.3.1);
- :mod:`pipeline.check_drift.config`: :class:`DriftConfig`, the `check_drift` section of params.yaml.

The phase entry point is :func:`pipeline.check_drift.main.main` (``agentrl check-drift``). The Great Expectations
suites of episode data it applies ("trajectories") live with the environment (:meth:`Environment.check_episodes`).
"""

from pipeline.check_drift.checks import (DRIFT_KINDS, DriftReport, FeatureTest, MMDResult, Sample, compare_features,
                                   false_alarm_rate, make_drifted_tasks, make_reference_sample, mmd_test, state_drift,
                                   task_drift, trajectory_drift)
from pipeline.check_drift.config import DriftConfig
from pipeline.check_drift.consistency import ConsistencyReport, Probe, check_consistency, probes_from_episodes
from pipeline.check_drift.features import (TASK_FEATURES, TRAJECTORY_FEATURES, hidden_state_features, observation_contexts,
                                     task_features, trajectory_features)

__all__ = [
    "DRIFT_KINDS", "TASK_FEATURES", "TRAJECTORY_FEATURES", "ConsistencyReport", "DriftConfig", "DriftReport",
    "FeatureTest", "MMDResult", "Probe", "Sample", "check_consistency", "compare_features", "false_alarm_rate",
    "hidden_state_features", "make_drifted_tasks", "make_reference_sample", "mmd_test", "observation_contexts",
    "probes_from_episodes", "state_drift", "task_drift", "task_features", "trajectory_drift", "trajectory_features",
]
