"""Config of the `train` phase (the `train` section of params.yaml): the RL algorithm, its stabilisers, sampling,
off-policy correction and the DeepSpeed engine. Every field is documented; combinations that cannot work are refused
with the reason."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.core.config import PhaseConfig
from pipeline.reward_model.config import LearnedRewardConfig

# the reward components every episode record carries (pipeline.envs.reward), in the order of the weights
COMPONENTS = ("correctness", "efficiency", "safety", "user_experience")

class ExplorationConfig(PhaseConfig):
    """Annealed tool-choice noise of RL rollouts (docs/design.md §3.2)."""

    tool_noise: float = Field(0.0, ge=0, le=1, description="ε_max: probability that an RL rollout's action calls a tool drawn uniformly from the task's tools instead of the policy's choice (recorded log-probabilities are the mixture's, so the importance weights correct for it); 0 disables.")
    anneal: bool = Field(True, description="ε_t = ε_max·(1 − t/T) over the run's updates (t the 0-based update, T = train.updates); false keeps ε_max throughout.")




class PopulationConfig(PhaseConfig):
    """A population of RL runs selected on validation (docs/design.md §2.1: population training)."""

    size: int = Field(1, ge=1, le=16, description="Members trained one after the other from the adapted policy, the best on validation kept as the stage's policy; 1 trains one policy (off).")
    vary: Literal["seed", "entropy"] = Field("seed", description="What differs between members: 'seed' (member i uses train.seed + i) or 'entropy' (member i uses entropy_coefs[i] as its entropy bonus λ, same seed).")
    entropy_coefs: list[float] = Field(default_factory=list, description="With vary: entropy, the entropy-bonus coefficient of each member (one per member, each in [0, 1]); empty otherwise.")

    @model_validator(mode="after")
    def _check(self) -> "PopulationConfig":
        if self.vary == "entropy":
            if len(self.entropy_coefs) != self.size:
                raise ValueError(f"vary: entropy needs one entropy coefficient per member: size is {self.size}, "
                                 f"entropy_coefs has {len(self.entropy_coefs)}")
            if any(not 0.0 <= c <= 1.0 for c in self.entropy_coefs):
                raise ValueError(f"entropy_coefs must lie in [0, 1], got {self.entropy_coefs}")
        elif self.entropy_coefs:
            raise ValueError("entropy_coefs is only read with vary: entropy; leave it empty with vary: seed")
        return self




class TaskGenerationConfig(PhaseConfig):
    """Adversarial task generation during RL (`train.task_generation`); see :mod:`pipeline.train.extensions.task_generation`."""

    enabled: bool = Field(False, description="Every `every` updates, generate new training tasks in the slices where recent success is lowest and add them to the RL pool (the environment must implement generate_tasks).")
    every: int = Field(5, ge=1, le=100_000, description="Updates between generation rounds.")
    tasks: int = Field(8, ge=1, le=1000, description="Tasks asked of the environment per round, shared among the targeted slices by failure rate.")
    slices: int = Field(2, ge=1, le=64, description="Weakest slices targeted per round.")
    by: Literal["template", "family", "level"] = Field("template", description="What a slice is: 'template' (a family's wording, `template_id`), 'family' or 'level'.")
    window: int = Field(256, ge=8, le=100_000, description="Recent episodes (all ranks) the weakness statistics read.")
    min_episodes: int = Field(8, ge=1, description="Episodes a slice needs in the window before it can be called weak.")
    min_success: float = Field(0.5, gt=0, le=1, description="A slice whose recent success rate is below this is weak; none below it: nothing is generated.")
    max_tasks: int = Field(512, ge=1, le=1_000_000, description="Most generated tasks the pool may hold; generation stops there.")
    share: float = Field(0.25, ge=0, le=1, description="Share of each update's tasks replaced by generated tasks of open levels, least played (then newest) first; 0: they only join the pool, where the goal sampler finds them among all the others.")

    @model_validator(mode="after")
    def _check(self) -> "TaskGenerationConfig":
        if self.min_episodes > self.window:
            raise ValueError(f"task_generation.min_episodes={self.min_episodes} exceeds window={self.window}: no "
                             f"slice could ever have enough episodes to be called weak")
        return self




class SamplingConfig(PhaseConfig):
    """`train.sampling`: sample reuse (prioritised replay), trajectory slicing and adversarial task sampling."""

    replay: bool = Field(False, description="Train each update on its new episodes plus prioritised replayed episodes of earlier updates (off by default).")
    capacity: int = Field(256, ge=1, le=100_000, description="Episodes the replay store keeps (first in, first out).")
    alpha: float = Field(0.6, ge=0, le=4, description="Priority exponent α of p(i) ∝ |δ_i|^α + ε (0: uniform).")
    eps: float = Field(0.01, gt=0, description="ε of p(i) ∝ |δ_i|^α + ε: every stored episode keeps a chance.")
    beta_is: float = Field(0.4, ge=0, le=1, description="Exponent of the priority importance weight w_i = (N·p(i))^(−β_is)/max w (0: no correction, 1: full).")
    beta_min: float = Field(0.5, gt=0, le=1, description="Lower bound of the share β of new episodes in an update.")
    beta_max: float = Field(1.0, gt=0, le=1, description="Upper bound of the share β of new episodes; β = clip(N_new/(N_new + N_store), β_min, β_max).")
    max_age: int = Field(4, ge=1, le=1000, description="Replayed episodes are at most this many policy versions old; older ones are evicted.")
    slice_turns: int = Field(0, ge=0, le=64, description="Trajectory slicing: a token segment with more than this many turns is trained as rows of at most this many turns each (context: the segment's prompt, then the window); 0 disables.")
    adversarial: bool = Field(False, description="Within a level, sample tasks the policy recently failed more often: weight max(floor, 1 − success_task)^power (off by default).")
    adversarial_floor: float = Field(0.1, gt=0, le=1, description="Lowest per-task weight of adversarial sampling, so solved tasks are still drawn.")
    adversarial_power: float = Field(1.0, ge=0, le=8, description="Exponent k of max(floor, 1 − success_task)^k (0: uniform).")
    adversarial_window: int = Field(8, ge=1, le=1000, description="Recent episodes per task in its success rate.")

    @model_validator(mode="after")
    def _check(self) -> "SamplingConfig":
        if self.beta_min > self.beta_max:
            raise ValueError(f"train.sampling.beta_min ({self.beta_min}) must not exceed beta_max ({self.beta_max})")
        return self




class RewardConfig(PhaseConfig):
    """How the learner forms returns from the reward components and credits them to turns (docs/design.md §3.6.1,
    2.2)."""

    weighting: Literal["fixed", "softmax", "lagrange"] = Field("fixed", description="'fixed': the environment's return (env.reward weights); 'softmax': w_i = α_i·4·softmax(Q/τ)_i, Q_i the component's recent shortfall from its best, so weight goes where the policy is weakest; 'lagrange': correctness plus λ_j·(x_j − b_j) for each constrained component, λ by projected dual ascent.")
    window: int = Field(256, ge=1, le=1_000_000, description="softmax: episodes (where the component counts) in each component's recent-shortfall window.")
    temperature: float = Field(0.5, gt=0, le=100, description="softmax: τ; small τ puts nearly all weight on the weakest component, large τ keeps the fixed weights.")
    thresholds: dict[str, float] = Field(default_factory=lambda: {"safety": -0.01, "efficiency": -0.25}, description="lagrange: constraint mean x_j ≥ b_j per component (safety, efficiency, user_experience); components not listed are not in the return.")
    lambda_lr: float = Field(1.0, gt=0, le=1000, description="lagrange: dual step η of λ_j ← clip(λ_j − η·(mean_j − b_j), 0, lambda_max).")
    lambda_max: float = Field(10.0, gt=0, le=1000, description="lagrange: upper bound of every λ_j (projection).")
    credit: str = Field("episode", description="The credit rule, by its name in the registry of pipeline/train/credit.py: 'episode': the return on the last action; 'turn': discounted return from each turn on (train.gamma per turn; train.turn_credit: true is the same); 'event': the discount event_gamma applies at turns with a key event instead of at every turn; or a user's `module:function` or entry point of the group agentrl.credit (docs/rl-options.md).")
    event_gamma: float = Field(0.9, gt=0, le=1, description="event: discount γ_e applied after a turn that carries a key event.")
    events: list[str] = Field(default_factory=lambda: ["write", "subgoal_done"], min_length=1, description="event: what counts as a key event: 'write' (a call of a tool that writes) and names a record's step_events carry (e.g. subgoal_done).")

    @field_validator("credit")
    @classmethod
    def _check_credit(cls, v: str) -> str:
        _credit_rule(v)
        return v

    @field_validator("thresholds")
    @classmethod
    def _check_thresholds(cls, v: dict[str, float]) -> dict[str, float]:
        for name, b in v.items():
            if name not in COMPONENTS[1:]:
                raise ValueError(f"thresholds: {name!r} is not a constrainable component; choose from "
                                 f"{list(COMPONENTS[1:])} (correctness is the objective)")
            lo, hi = (0.0, 1.0) if name == "user_experience" else (-1.0, 0.0)
            if not lo <= b <= hi:
                raise ValueError(f"thresholds: {name} = {b} is outside the component's range [{lo}, {hi}]")
        return v




class TrainConfig(PhaseConfig):
    """RL training of the adapted policy (docs/design.md §1.4, §2, §3.2, §3.4, §3.5)."""

    seed: int = Field(0, description="Seed of task sampling, rollouts and initialisation of the value head.")
    incoming_tasks: str | None = Field("data/incoming", description="Folder of incoming production tasks (*.jsonl, task schema) that join the RL pool after the 'tasks' suite and a filter of held-out, duplicate and unverifiable tasks (counted in metrics/train.json `incoming`); null disables.")
    production_tasks: str | None = Field("data/production/snapshot/tasks", description="Folder of the tasks `agentrl snapshot` made from served traffic (*.jsonl, task schema): they join the RL pool exactly as the incoming tasks do (same checks and filter, counted with them); null disables.")
    algorithm: str = Field("rloo", description="The advantage estimator, by its name in the registry of pipeline/train/estimators.py: 'ppo': a value head and GAE; 'grpo': group baseline (score − group mean)/group std; 'rloo': leave-one-out group baseline; or a user's `module:function` or entry point of the group agentrl.estimators (docs/rl-options.md). All train the clipped surrogate.")
    updates: int = Field(120, ge=1, le=100_000, description="Policy updates (one batch of rollouts each); early stopping may end a run sooner.")
    time_budget_s: float | None = Field(None, gt=0, description="Wall-clock seconds for the updates, validations and checkpoints (not the setup or the test evaluation after them): at a validated update the run stops, like early stopping, when the next `eval_every` updates and their validation would not fit (pipeline.train.extensions.time_budget, docs/recipe.md). null: `updates` alone.")
    tasks_per_update: int = Field(8, ge=1, description="Distinct tasks per update, over all ranks (a multiple of the number of ranks).")
    group_size: int = Field(8, ge=1, description="Rollouts per task (the group of a group baseline; ≥ 2 for grpo, rloo and every other critic-free estimator).")
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
    exploration: ExplorationConfig = Field(default_factory=ExplorationConfig, description="Annealed tool-choice noise of RL rollouts (pipeline/train/extensions/tool_noise.py); off by default.")
    population: PopulationConfig = Field(default_factory=PopulationConfig, description="A population of policies (different seeds or entropy settings), trained one after another, the best on validation kept (pipeline/train/extensions/population.py); size 1 is off.")
    task_generation: TaskGenerationConfig = Field(default_factory=TaskGenerationConfig, description="Adversarial task generation: new training tasks in the slices (wording, family or level) of lowest recent success join the RL pool every few updates (pipeline/train/extensions/task_generation.py); off by default.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sample reuse (prioritised replay with the mixing ratio β), trajectory slicing and adversarial task sampling (pipeline/train/extensions: replay.py, slicing.py, adversarial.py); all off by default.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Returns from the reward components (fixed, softmax-weighted or Lagrangian-constrained) and their credit (episode, turn or event-discounted) (pipeline/train/extensions/reward_weighting.py); fixed and episode by default.")
    learned_reward: LearnedRewardConfig = Field(default_factory=LearnedRewardConfig, description="The learned verifier (models/reward_model) as a reward component, extra_reward = coef·score, with the reward-hacking guard (pipeline/reward_model/reward.py); coef 0 is off.")
    extensions: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Extensions of the RL loop besides the built-in ones (pipeline/train/extensions), in order: `module:Class` or an entry point of the group agentrl.extensions, each mapped to its options ({} for none); docs/rl-options.md shows how to write one.")

    @field_validator("algorithm")
    @classmethod
    def _check_algorithm(cls, v: str) -> str:
        _estimator(v)
        return v

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        critic = _estimator(self.algorithm).critic
        if not critic and self.group_size < 2:
            raise ValueError(f"algorithm {self.algorithm!r} compares rollouts within a group, so group_size must be "
                             f"at least 2 (got {self.group_size})")
        if self.tasks_per_update % self.num_ranks:
            raise ValueError(f"tasks_per_update={self.tasks_per_update} must be a multiple of num_ranks="
                             f"{self.num_ranks}: every rank generates the groups of its own tasks")
        if self.async_rollouts and self.max_staleness < self.sync_every:
            raise ValueError(f"async_rollouts with sync_every={self.sync_every} produces batches up to "
                             f"{self.sync_every} versions old, so max_staleness must be at least that (got "
                             f"{self.max_staleness}); otherwise every such batch would be dropped")
        if self.exploration.tool_noise > 0 and self.async_rollouts:
            raise ValueError("train.exploration.tool_noise is not supported with train.async_rollouts: the worker "
                             "builds its own rollout engines, which the noise does not reach; set one of them off")
        if self.entropy_target is not None and self.entropy_coef_max < self.entropy_coef:
            raise ValueError("entropy_coef_max must be at least entropy_coef")
        if self.sampling.replay and critic:  # the one place this rule is checked
            if self.reward.weighting != "fixed":
                raise ValueError(f"train.sampling.replay with algorithm {self.algorithm!r} (a critic) recomputes a "
                                 f"replayed episode's advantage (GAE for ppo) from its recorded return, which "
                                 f"train.reward.weighting={self.reward.weighting!r} would have weighted differently: "
                                 f"use weighting 'fixed', or a group baseline (grpo/rloo), whose replayed episodes "
                                 f"keep the advantage they were trained with")
            if _credit_rule(self.credit).per_turn:
                raise ValueError(f"train.sampling.replay with a critic (ppo) works with per-episode credit only: "
                                 f"the per-turn credit {self.credit!r} would need each replayed episode's turn "
                                 f"rewards and discounts re-derived; use grpo/rloo (their per-turn advantages are "
                                 f"stored), credit 'episode' or replay off")
        return self

    @property
    def credit(self) -> str:
        """The credit rule: `reward.credit`, with the older `turn_credit: true` meaning at least 'turn'."""
        return "turn" if self.reward.credit == "episode" and self.turn_credit else self.reward.credit


def _estimator(name: str):
    """The registered estimator `name` gives (:func:`pipeline.train.estimators.get_estimator`), its error as the
    ValueError of a config field. Imported here, not at the top, so that this module stays the package's leaf."""
    from pipeline.core.errors import AgentRLError
    from pipeline.train.estimators import get_estimator

    try:
        return get_estimator(name)
    except AgentRLError as exc:
        raise ValueError(str(exc).removeprefix("train.algorithm: ")) from None


def _credit_rule(name: str):
    """The registered credit rule `name` gives (:func:`pipeline.train.credit.get_credit`), its error as the ValueError
    of a config field. Imported here, not at the top, so that this module stays the package's leaf."""
    from pipeline.core.errors import AgentRLError
    from pipeline.train.credit import get_credit

    try:
        return get_credit(name)
    except AgentRLError as exc:
        raise ValueError(str(exc).removeprefix("train.reward.credit: ")) from None
