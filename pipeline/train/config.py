"""Config of the `train` phase (the `train` section of params.yaml): the RL algorithm, its stabilisers, sampling,
off-policy correction and the DeepSpeed engine. Every field is documented; combinations that cannot work are refused
with the reason."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig
from pipeline.reward_model.config import LearnedRewardConfig
from pipeline.train.exploration import ExplorationConfig
from pipeline.train.population import PopulationConfig
from pipeline.train.replay import SamplingConfig
from pipeline.train.reward_weights import RewardConfig
from pipeline.train.task_generator import TaskGenerationConfig


class TrainConfig(PhaseConfig):
    """RL training of the adapted policy (docs/design.md §1.4, §2, §3.2, §3.4, §3.5)."""

    seed: int = Field(0, description="Seed of task sampling, rollouts and initialisation of the value head.")
    incoming_tasks: str | None = Field("data/incoming", description="Folder of incoming production tasks (*.jsonl, task schema) that join the RL pool after the 'tasks' suite and a filter of held-out, duplicate and unverifiable tasks (counted in metrics/train.json `incoming`); null disables.")
    production_tasks: str | None = Field("data/production/snapshot/tasks", description="Folder of the tasks `agentrl snapshot` made from served traffic (*.jsonl, task schema): they join the RL pool exactly as the incoming tasks do (same checks and filter, counted with them); null disables.")
    algorithm: Literal["ppo", "grpo", "rloo"] = Field("rloo", description="'ppo': clipped surrogate with a value head and GAE; 'grpo': group baseline (score − group mean)/group std; 'rloo': leave-one-out group baseline.")
    updates: int = Field(120, ge=1, le=100_000, description="Policy updates (one batch of rollouts each); early stopping may end a run sooner.")
    tasks_per_update: int = Field(8, ge=1, description="Distinct tasks per update, over all ranks (a multiple of the number of ranks).")
    group_size: int = Field(8, ge=1, description="Rollouts per task (the group of a group baseline; ≥ 2 for grpo/rloo).")
    epochs: int = Field(1, ge=1, le=16, description="Passes over each batch of rollouts (PPO epochs).")
    minibatches: int = Field(1, ge=1, le=64, description="Shuffled minibatches per epoch (one optimizer step each).")
    micro_batches: int = Field(4, ge=1, le=64, description="Length-sorted chunks each minibatch is forwarded in, gradients accumulated into one optimizer step: the same step with one chunk's activation memory.")
    lr: float = Field(2e-4, gt=0, le=1, description="AdamW learning rate of full-parameter RL (with `bc_coef` as the anchor that keeps the other levels).")
    lr_warmup_steps: int = Field(10, ge=0, le=100_000, description="Optimizer steps over which the learning rate rises linearly from lr/(steps+1) to lr, taming Adam's first ±lr steps; 0 disables.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay (docs/design.md §5.2, against overfitting).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm (DeepSpeed `gradient_clipping`).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip ε.")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value clipping ε (null disables).")
    vf_coef: float = Field(0.5, ge=0, description="Weight of the value loss (PPO only).")
    gamma: float = Field(1.0, gt=0, le=1, description="Discount γ: GAE over action tokens (PPO) and per-turn credit.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (PPO).")
    turn_credit: bool = Field(False, description="Per-turn credit (docs/design.md §2.2): each turn's tokens get the discounted return from that turn on (the environment's `step_rewards`) minus the baseline, instead of the episode return; matters with γ < 1 or mid-episode penalties.")
    entropy_coef: float = Field(0.0, ge=0, le=1, description="Initial entropy-bonus coefficient λ of L = L_RL − λ·H(π).")
    entropy_target: float | None = Field(None, gt=0, description="Adaptive entropy: λ rises while the mean policy entropy (nats/token) is below this target, up to `entropy_coef_max`; null keeps λ at `entropy_coef`.")
    entropy_alarm: float = Field(0.02, ge=0, description="Mean policy entropy (nats/token, at the rollout temperature) below which an update logs an entropy-collapse warning (`alarms/entropy_collapse`).")
    entropy_coef_max: float = Field(0.1, ge=0, le=1, description="Upper bound of the adaptive λ (docs/design.md §2.1: 0.01–0.1).")
    bc_coef: float = Field(0.1, ge=0, description="Weight of the behaviour-cloning loss on successful demonstrations (docs/design.md §2.1), the anchor that keeps the levels RL is not working on; 0 disables.")
    bc_batch: int = Field(8, ge=1, description="Demonstrations in the behaviour-cloning term of each optimizer step.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty (k3) to the adapted reference policy; 0 disables (no reference copy is kept).")
    reward_norm_window: int = Field(0, ge=0, description="R' = (R − μ)/σ over the last K episode returns (docs/design.md §2.2); 0 disables.")
    curriculum_start_level: int = Field(4, ge=1, le=4, description="Highest level open at the start; the next opens when recent success on the highest open level passes the threshold.")
    curriculum_threshold: float = Field(0.8, gt=0, le=1, description="Success rate that opens the next level.")
    level_weight_floor: float = Field(0.1, ge=0, le=1, description="Open levels are sampled with weight max(floor, 1 − recent success): rollouts go where the policy still fails.")
    level_success_window: int = Field(64, ge=4, description="Episodes per level in the recent-success window.")
    goal_sampling: bool = Field(True, description="Within a level, sample tasks with p(g) ∝ 1/(count(g)+1) (docs/design.md §3.2).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field("token-mean", description="Policy-loss average: `token-mean` weighs every action token the same, `seq-mean-token-mean` every episode the same (its token mean, then the mean over episodes).")
    guide_failed_groups: bool = Field(True, description="In a group whose rollouts all fail, replace the last one by the scripted expert's episode of the same task and seed (off-policy guidance, importance weight 1), so the group carries a signal.")
    skip_zero_variance_groups: bool = Field(True, description="Groups whose returns are all equal carry no signal: leave them out of the loss (they are counted either way).")
    rollout_temperature: float | None = Field(0.7, gt=0, le=10, description="Sampling temperature of RL rollouts and of the learner's log-probabilities (one distribution, softmax(logits / T)); null: `rollout.temperature`.")
    merge_alpha: float = Field(0.5, gt=0, le=1, description="The validated and kept policy is θ_adapted + α·(θ_RL − θ_adapted) (WiSE-FT weight ensemble) while training goes on with θ_RL; 1 keeps the RL weights.")
    max_staleness: int = Field(0, ge=0, description="Rollouts may come from a policy up to this many versions behind the learner (0: synchronous, on-policy).")
    is_clip: float = Field(2.0, ge=1, description="c of the truncated importance weight w = min(c, π_train/π_sample).")
    async_rollouts: bool = Field(False, description="Rollout worker generates with a weight snapshot while the learner trains; the snapshot syncs every `sync_every` updates.")
    sync_every: int = Field(1, ge=1, description="Updates between weight syncs of the asynchronous rollout worker.")
    rollout_workers: int = Field(2, ge=1, le=64, description="Rollout threads of the asynchronous mode, sharing one weight snapshot, so slow tools in one overlap with decoding in the others.")
    num_ranks: int = Field(2, ge=1, le=1024, description="DeepSpeed processes launched on this machine (CPU ranks here; GPUs where present); with AGENTRL_HOSTFILE, on all its nodes together (pipeline/train/nodes.py).")
    deepspeed_config: str = Field("configs/deepspeed_zero2.json", description="DeepSpeed config file (ZeRO stage, bf16); batch sizes and clipping come from this section, and a file that contradicts them is refused.")
    checkpoint_every: int = Field(10, ge=1, description="Updates between checkpoints (engine state plus curriculum, sampler, normaliser and RNG state).")
    eval_every: int = Field(10, ge=1, description="Updates between greedy evaluations on the validation split.")
    eval_tasks: int = Field(200, ge=1, description="Validation tasks per evaluation (greedy, fixed seeds).")
    test_tasks: int = Field(400, ge=1, description="Test tasks in the final SFT-versus-RL comparison (greedy).")
    early_stopping_metric: Literal["success", "mean_return", "level_mean_success"] = Field("success", description="Validation metric that picks the best policy (the stage's output) and that early stopping watches: overall success, mean return, or the mean of per-level success rates.")
    early_stopping_patience: int | None = Field(4, ge=1, description="Stop after this many consecutive evaluations without improvement (docs/design.md §5.2.2); null never stops early (the best policy is still the output).")
    early_stopping_min_delta: float = Field(0.0, ge=0, description="An evaluation improves only when it beats the best value so far by more than this; a tie keeps the earlier policy.")
    exploration: ExplorationConfig = Field(default_factory=ExplorationConfig, description="Annealed tool-choice noise of RL rollouts (pipeline/train/exploration.py); off by default.")
    population: PopulationConfig = Field(default_factory=PopulationConfig, description="A population of policies (different seeds or entropy settings), trained one after another, the best on validation kept (pipeline/train/population.py); size 1 is off.")
    task_generation: TaskGenerationConfig = Field(default_factory=TaskGenerationConfig, description="Adversarial task generation: new training tasks in the slices (wording, family or level) of lowest recent success join the RL pool every few updates (pipeline/train/task_generator.py); off by default.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sample reuse (prioritised replay with the mixing ratio β), trajectory slicing and adversarial task sampling (pipeline/train/replay.py, pipeline/train/sampling.py); all off by default.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Returns from the reward components (fixed, softmax-weighted or Lagrangian-constrained) and their credit (episode, turn or event-discounted) (pipeline/train/reward_weights.py); fixed and episode by default.")
    learned_reward: LearnedRewardConfig = Field(default_factory=LearnedRewardConfig, description="The learned verifier (models/reward_model) as a reward component, extra_reward = coef·score, with the reward-hacking guard (pipeline/reward_model/reward.py); coef 0 is off.")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.algorithm in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"algorithm {self.algorithm!r} compares rollouts within a group, so group_size must be "
                             f"at least 2 (got {self.group_size})")
        if self.tasks_per_update % self.num_ranks:
            raise ValueError(f"tasks_per_update={self.tasks_per_update} must be a multiple of num_ranks="
                             f"{self.num_ranks}: every rank generates the groups of its own tasks")
        if self.async_rollouts and self.max_staleness < self.sync_every:
            raise ValueError(f"async_rollouts with sync_every={self.sync_every} produces batches up to "
                             f"{self.sync_every} versions old, so max_staleness must be at least that (got "
                             f"{self.max_staleness}); otherwise every such batch would be dropped")
        if self.entropy_target is not None and self.entropy_coef_max < self.entropy_coef:
            raise ValueError("entropy_coef_max must be at least entropy_coef")
        if self.sampling.replay and self.algorithm == "ppo" and self.reward.weighting != "fixed":
            raise ValueError(f"train.sampling.replay with algorithm 'ppo' recomputes a replayed episode's GAE from its "
                             f"recorded return, which train.reward.weighting={self.reward.weighting!r} would have "
                             f"weighted differently: use weighting 'fixed', or a group baseline (grpo/rloo), whose "
                             f"replayed episodes keep the advantage they were trained with")
        return self
