"""Config of the `train` phase (the `train` section of params.yaml): the RL algorithm, its stabilisers, sampling,
off-policy correction and the DeepSpeed engine. Every field is documented; combinations that cannot work are refused
with the reason."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig


class TrainConfig(PhaseConfig):
    """RL training of the adapted policy (seed 1.4, 2, 3.2, 3.4, 3.5)."""

    seed: int = Field(0, description="Seed of task sampling, rollouts and initialisation of the value head.")
    incoming_tasks: str | None = Field("data/incoming", description="Folder of incoming production tasks (every *.jsonl in it, in the task schema; the folder check_drift reads): each file must pass the 'tasks' suite, then its tasks join the RL task pool as `incoming/<file stem>/<task_id>`. Tasks that name a validation/test entity or use a test-only template, copies of training tasks, and tasks whose answer the training world does not reproduce are left out and counted (metrics/train.json `incoming`). A missing folder adds nothing; null disables.")
    algorithm: Literal["ppo", "grpo", "rloo"] = Field("rloo", description="'ppo': clipped surrogate with a value head and GAE; 'grpo': group baseline (score − group mean)/group std; 'rloo': leave-one-out group baseline.")
    updates: int = Field(120, ge=1, le=100_000, description="Policy updates (one batch of rollouts each). Session 13: with `merge_alpha` 0.5 the validated ensemble kept improving to update 120 (level 4 climbs late: 0.46 at updates 30-60, 0.67-0.72 from 70); early stopping may end a run sooner.")
    tasks_per_update: int = Field(8, ge=1, description="Distinct tasks per update, over all ranks (a multiple of the number of ranks).")
    group_size: int = Field(8, ge=1, description="Rollouts per task (the group of a group baseline; ≥ 2 for grpo/rloo).")
    epochs: int = Field(1, ge=1, le=16, description="Passes over each batch of rollouts (PPO epochs).")
    minibatches: int = Field(1, ge=1, le=64, description="Shuffled minibatches per epoch (one optimizer step each).")
    micro_batches: int = Field(4, ge=1, le=64, description="Chunks each minibatch is forwarded in, rows of similar "
                               "length together; DeepSpeed accumulates their gradients into one optimizer step (the "
                               "same step, with the learner's activation memory of one chunk).")
    lr: float = Field(2e-4, gt=0, le=1, description="AdamW learning rate of full-parameter RL. Session 11, on the default (level 4 scarce, validation greedy L1-L4 1.00/0.82/0.99/0.20 after SFT; 8 tasks x 8 rollouts per update, 1 rank): 5e-5 moved nothing in 40 updates (validation 0.48/0.47/0.48/0.48 on the previous start); 2e-4 without an anchor lifted validation level 4 from 0.23 to 0.51 in 50 updates but let levels 1 and 3 fall (0.98 -> 0.82, 0.90 -> 0.61); 2e-4 with `bc_coef` 0.1 lifted level 4 to 0.77 and kept levels 1-3 (README, RL status). Adam's first steps are tamed by `lr_warmup_steps`.")
    lr_warmup_steps: int = Field(10, ge=0, le=100_000, description="Optimizer steps over which the learning rate rises linearly from lr/(steps+1) to lr. Adam's first steps move every parameter by about ±lr whatever the gradient's size (its second-moment estimate is still one sample), which is what broke the adapted policy at higher learning rates; 0 disables.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay (seed 5.2 against overfitting).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm (DeepSpeed `gradient_clipping`).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip ε.")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value clipping ε (null disables).")
    vf_coef: float = Field(0.5, ge=0, description="Weight of the value loss (PPO only).")
    gamma: float = Field(1.0, gt=0, le=1, description="Discount γ: GAE over action tokens (PPO) and per-turn credit.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (PPO).")
    turn_credit: bool = Field(False, description="Per-turn credit assignment (seed 2.2): each turn's tokens get the discounted return from that turn on, R_t = Σ γ^(t'−t) r_t', minus the baseline, instead of the episode return; the per-turn rewards are the environment's (`step_rewards`; with `efficiency_weight` the last turn takes the rescoring's difference). grpo/rloo: the group's baseline on the episode scores (core_algos.turn_advantages); ppo: each turn's reward on its last action token, then GAE (core_algos.turn_token_rewards). Logged: `turn_credit/turns_per_episode`, `turn_credit/adv_spread_within_episode`. Off by default: with γ 1 and R paid almost all at the answer, every turn gets nearly its episode's advantage anyway; it matters with γ < 1 or safety penalties paid mid-episode.")
    entropy_coef: float = Field(0.0, ge=0, le=1, description="Initial entropy-bonus coefficient λ of L = L_RL − λ·H(π).")
    entropy_target: float | None = Field(None, gt=0, description="Adaptive entropy: λ rises when the mean policy entropy (nats/token) falls below this target (null: λ fixed at `entropy_coef`). Off by default: the adapted policy's entropy is about 0.05-0.1 nats/token, near any floor worth setting, and session 9 measured that a target of 0.15 drove λ to its maximum, entropy to 0.27 and invalid actions from 4 % to 23 %; the session-11 default runs without it (λ stays 0).")
    entropy_alarm: float = Field(0.02, ge=0, description="Mean policy entropy (nats/token, at the rollout temperature) below which an update logs an entropy-collapse warning (`alarms/entropy_collapse`). At the default `rollout_temperature` 0.7 the default run measured 0.03-0.05 (means over 10 updates; 0.07-0.18 at 1.0), so the floor is 0.02.")
    entropy_coef_max: float = Field(0.1, ge=0, le=1, description="Upper bound of the adaptive λ (seed 2.1: 0.01–0.1).")
    bc_coef: float = Field(0.1, ge=0, description="Weight of the behaviour-cloning loss (demonstration action tokens' negative log-likelihood, `bc_batch` demonstrations per optimizer step) on the successful demonstrations (seed 2.1); 0 disables. The anchor that keeps the levels RL is not working on: at lr 2e-4 without it, validation level 1 fell 0.98 -> 0.82 and level 3 0.90 -> 0.61 while level 4 rose; with 0.1 they held (session 11).")
    bc_entity_augmentation: float = Field(0.0, ge=0, le=1, description="Share of the behaviour-cloning demonstrations whose entity names are replaced by fictitious ones (drawn once per run; pipeline.adapt.sft.augment_names), as `adapt.sft.entity_augmentation` does for SFT: the replayed demonstrations then teach copying a name from the question or a tool result, not the training names themselves. 0 by default: session 12 measured 1.0 against 0 (rollout temperature 0.7, 60 updates, the default start) and validation moved the same way (update 60: L1-L4 0.82/0.95/0.80/0.51 against 0.84/0.84/0.82/0.59; level 3 fell in both).")
    rollout_entity_augmentation: float = Field(0.0, ge=0, le=1, description="Share of RL episodes on a task without a search step that are played with the products it names renamed to fictitious names (a fresh draw per episode, in that episode's private database copy; the ground truth is solved again), so that RL on a few hundred training names does not come to depend on them. Search tasks keep their real names (the corpus documents name the real products). 0 by default: 1.0 did not help (session 12; docs/defaults.md).")
    bc_batch: int = Field(8, ge=1, description="Demonstrations in the behaviour-cloning term of each update.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty (k3) to the adapted reference policy; 0 disables (no reference copy is kept).")
    reward_norm_window: int = Field(0, ge=0, description="R' = (R − μ)/σ over the last K episode returns (seed 2.2); 0 disables.")
    curriculum_start_level: int = Field(4, ge=1, le=4, description="Highest level open at the start; the next opens when recent success on the highest open level passes the threshold.")
    curriculum_threshold: float = Field(0.8, gt=0, le=1, description="Success rate that opens the next level.")
    level_weight_floor: float = Field(0.1, ge=0, le=1, description="Open levels are sampled with weight max(floor, 1 − recent success): rollouts go where the policy still fails.")
    level_success_window: int = Field(64, ge=4, description="Episodes per level in the recent-success window.")
    goal_sampling: bool = Field(True, description="Within a level, sample tasks with p(g) ∝ 1/(count(g)+1) (seed 3.2).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field("token-mean", description="How the policy loss averages over the batch: `token-mean`, every action token the same (a long episode weighs by its length); `seq-mean-token-mean`, each episode's token mean, then the mean over episodes (every episode once). Only the policy term; entropy, value and KL stay token means.")
    guide_failed_groups: bool = Field(True, description="Expert-guided groups (off-policy guidance: LUFFY, Yan et al. 2025; ReLIFT, Ma et al. 2025): in a group whose rollouts all fail, the last rollout is replaced by the scripted expert's episode of the same task and seed (recorded in the policy's token layout by `RolloutEngine.demonstrate`; its tokens get importance weight 1), so the group carries a signal. The curriculum and the episode metrics (`rollout/success`, `return`, `reward_spread`, `tool_calls`) see the policy's own episodes only; the learner's figures are those of the batch it trained on; `guidance/groups_guided` counts the replacements. It reaches task families that sampling never solves, which plain RL cannot learn, by partly imitating their ground-truth plans. Any algorithm: a group is the `group_size` rollouts of one task (PPO's GAE runs over the demonstration like over any episode). On since session 27: test 0.725 -> 0.792 against 0.753 without it (docs/defaults.md has the measurements, and the start on which it hurt).")
    skip_zero_variance_groups: bool = Field(True, description="Groups whose returns are all equal carry no signal: leave them out of the loss (they are counted either way).")
    rollout_temperature: float | None = Field(0.7, gt=0, le=10, description="Sampling temperature of the RL rollouts; the learner divides its logits by the same temperature, so the recorded and recomputed log-probabilities are those of one distribution, softmax(logits / T), and that is the policy RL improves (greedy evaluation is unaffected). null: `rollout.temperature`. A train-only key, so that trying it reruns `train` and not `adapt`. 0.7: at 1.0 the invalid share of the rollouts rose from 7 % to 34 % and test success fell, at 0.7 it stayed at 5-8 % (session 12; docs/defaults.md).")
    efficiency_weight: float | None = Field(None, ge=0, le=100, description="β of the efficiency component in the return RL optimises (R recomputed from each episode's reward components with this β, the other weights and the shaping as in `env.reward`); null: `env.reward.efficiency`. A train-only key: `env.reward` is read by build_env and adapt too, and evaluation keeps the environment's own reward. Null by default: β 2.0 stalled level 4, whose gain comes from recovering from a wrong first lookup with a search, the path a larger β charges for (session 14; docs/defaults.md).")
    merge_alpha: float = Field(0.5, gt=0, le=1, description="Weight-space ensemble with the adapted policy (WiSE-FT, Wortsman et al. 2022): the policy that is validated, kept as the best and written to models/policy is θ_adapted + α·(θ_RL − θ_adapted), while training goes on with θ_RL itself; 1 keeps the RL weights as they are. RL on this small policy lifts the level it works on and erodes the others on held-out entities; the average keeps the gain and little of the erosion (session 13: validation 0.843 for θ_RL at update 120, 0.875 for its ensemble at 0.5; docs/defaults.md). It keeps what RL gains; it does not make RL gain.")
    max_staleness: int = Field(0, ge=0, description="Rollouts may come from a policy up to this many versions behind the learner (0: synchronous, on-policy).")
    is_clip: float = Field(2.0, ge=1, description="c of the truncated importance weight w = min(c, π_train/π_sample).")
    async_rollouts: bool = Field(False, description="Rollout worker generates with a weight snapshot while the learner trains; the snapshot syncs every `sync_every` updates.")
    sync_every: int = Field(1, ge=1, description="Updates between weight syncs of the asynchronous rollout worker.")
    rollout_workers: int = Field(2, ge=1, le=64, description="Rollout threads of the asynchronous mode; they share one weight snapshot, each decodes its share of the batch, and slow tools in one overlap with decoding in the others. 2 since session 23: with the tool calls of a decode step side by side (`rollout.tool_threads`), at 20 ms tool latency on 2 cores (8 x 8 episodes per update, two measurements), 1, 2, 3 and 4 threads gave 1.02x, 1.13-1.15x, 1.05x and 0.92-0.93x the synchronous episodes/s: more threads than cores slow the learner beside them (4.5 s per 3 updates alone, 12.4 s beside 4 threads).")
    num_ranks: int = Field(2, ge=1, le=1024, description="DeepSpeed processes launched on this machine (CPU ranks here; GPUs where present).")
    deepspeed_config: str = Field("configs/deepspeed_zero2.json", description="DeepSpeed config file (ZeRO stage, bf16). Batch sizes and clipping come from this section; a file that contradicts them is refused.")
    checkpoint_every: int = Field(10, ge=1, description="Updates between checkpoints (engine state plus curriculum, sampler, normaliser and RNG state).")
    eval_every: int = Field(10, ge=1, description="Updates between greedy evaluations on the validation split.")
    eval_tasks: int = Field(200, ge=1, description="Validation tasks per evaluation (greedy, fixed seeds).")
    test_tasks: int = Field(400, ge=1, description="Test tasks in the final SFT-versus-RL comparison (greedy).")
    early_stopping_metric: Literal["success", "mean_return", "level_mean_success"] = Field("success", description="Validation metric (greedy, every `eval_every` updates) that picks the best policy, which becomes the stage's output, and that early stopping watches: 'success' (success rate over the validation tasks), 'mean_return', or 'level_mean_success' (the mean of the per-level success rates: each level weighs the same).")
    early_stopping_patience: int | None = Field(4, ge=1, description="Stop after this many consecutive validation evaluations without improvement (seed 5.2.2); null never stops early (the best policy is still the output). 4: session 13's default run had plateaus of 3 evaluations before a rise (validation 0.815 at update 40, no better at 50-60, 0.855 at 70; 0.870 at 80, no better at 90-110, 0.875 at 120).")
    early_stopping_min_delta: float = Field(0.0, ge=0, description="An evaluation improves only when it beats the best value so far by more than this; a tie keeps the earlier policy.")

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
        if self.bc_entity_augmentation > 0 and self.bc_coef == 0:
            raise ValueError(f"bc_entity_augmentation={self.bc_entity_augmentation} renames the behaviour-cloning "
                             f"demonstrations, but bc_coef is 0, so there is no behaviour cloning; set bc_coef > 0 "
                             f"or bc_entity_augmentation to 0")
        if self.entropy_target is not None and self.entropy_coef_max < self.entropy_coef:
            raise ValueError("entropy_coef_max must be at least entropy_coef")
        return self
