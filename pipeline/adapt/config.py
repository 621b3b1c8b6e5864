"""The `adapt` phase's config (the `adapt` section of params.yaml): adapters, pre-training, SFT, the capability check
and the adaptation gate. Each class mirrors its params.yaml sub-section key for key."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig

ADAPTER_KINDS = ("auto", "lora", "bottleneck", "none")
LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class AdapterConfig(PhaseConfig):
    """How the base is adapted: LoRA (peft), the bottleneck adapter of docs/design.md §3.3.2, or full fine-tuning (pipeline.adapt.adapters)."""

    kind: Literal["auto", "lora", "bottleneck", "none"] = Field("auto", description="'lora' (peft, merged into the weights after training), 'bottleneck' (h' = h + W2·σ(W1·h) after each decoder layer's MLP, kept as modules), 'none' (full fine-tuning), or 'auto': 'none' for the built-in from-scratch base (no pre-trained features for a low-rank update to adapt), 'lora' for a pre-trained one.")
    lora_r: int = Field(32, ge=1, le=1024, description="LoRA rank r.")
    lora_alpha: float = Field(64.0, gt=0, description="LoRA scale α (the update is (α/r)·B·A).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch's input.")
    lora_target_modules: list[str] = Field(default_factory=lambda: list(LLAMA_PROJECTIONS), min_length=1, description="Module names LoRA wraps (every attention and MLP projection of a Llama by default).")
    bottleneck_dim: int = Field(64, ge=1, description="Bottleneck adapter width r (must be < the model's hidden size).")
    bottleneck_activation: Literal["gelu", "relu", "silu", "tanh"] = Field("gelu", description="Bottleneck adapter non-linearity σ.")
    train_also: list[str] = Field(default_factory=list, description="Base parameters trained next to the adapter: a name component (e.g. 'embed_tokens', 'norm') or a regex over the full parameter name. Ignored for kind 'none' (everything trains).")


class PretrainConfig(PhaseConfig):
    """Continued pre-training on the environment's documents and training questions (docs/design.md §3.3.2); full parameters."""

    steps: int = Field(1200, ge=0, description="Most optimizer steps; 0 skips continued pre-training. Fewer when `copy_target` is reached first.")
    batch_size: int = Field(64, ge=1, description="Sequences per step.")
    lr: float = Field(1e-3, gt=0, le=1, description="Peak learning rate (linear warm-up, cosine decay to 10%).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    max_len: int = Field(128, ge=8, description="Longest pre-training sequence in tokens (longer texts are cut).")
    include_documents: Literal["auto"] | bool = Field("auto", description="The world's documents in the pre-training text (pipeline.adapt.entity_source.documents): auto, those of an environment that offers corpus() (capability HasCorpus; the built-in ones do not, so their mix is drills alone); true, corpus() or else data/env/corpus.jsonl; false, none.")
    include_questions: bool = Field(False, description="Add the training tasks' questions to the documents (text the policy reads in every prompt; no actions or answers).")
    copy_drills: int = Field(20000, ge=0, description="Synthetic texts that end in a JSON field copied from a quoted fictitious name (pipeline.adapt.drills.copy_drills): they form the copying circuit held-out names need, which SFT alone forms late. 0: none.")
    word_drills: int = Field(10000, ge=0, description="Synthetic texts that copy an unquoted word of a sentence into a JSON field (pipeline.adapt.drills.word_drills): the skill of writing the field a question asks for. 0: none.")
    copy_target: float | None = Field(0.8, gt=0, le=1, description="Stop pre-training once the exact-copy accuracy on held-out name drills (checked every `check_every` steps) reaches this: whether SFT learns to copy held-out names decided every default run; null: always run `steps`.")
    check_every: int = Field(100, ge=1, description="Steps between copy-accuracy checks (`copy_target`).")
    subprocess: bool = Field(True, description="Run pre-training in a child process that hands back the weights, generator states and logged metrics (the same weights), so the heap its loop leaves behind goes back to the OS before SFT; false: in this process.")


class SFTConfig(PhaseConfig):
    """Supervised fine-tuning on the demonstrations: loss on the action tokens only."""

    steps: int = Field(1500, ge=1, description="Optimizer steps (1,500: at 1,000 every validation curve was still climbing). Fewer steps: lower `select_from` too, or set `select_every: 0`.")
    batch_size: int = Field(32, ge=1, description="Sequences (demonstration segments) per step.")
    micro_batches: int = Field(1, ge=1, le=64, description="Chunks each batch is forwarded in, their gradients accumulated into one step (the same step up to bf16 rounding, the activation memory of one chunk); 1 is bit-identical to the unchunked loop.")
    compile: bool = Field(True, description="torch.compile the training forward (Inductor, dynamic shapes; needs a C++ compiler; about 1.5x faster than eager on the default), under deterministic algorithms so runs reproduce; false: eager PyTorch.")
    shared_prefix: bool = Field(True, description="Compute the tokens every row of a batch starts with (the system line and tool list) once per batch instead of once per row; the same loss and gradients up to float rounding.")
    lr: float = Field(1e-3, gt=0, le=1, description="Peak learning rate (linear warm-up, cosine decay to 10%).")
    warmup_steps: int = Field(30, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay on matrices (not on biases and norms).")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    max_len: int = Field(1024, ge=16, description="Longest training segment in tokens; a longer one is cut at the end (counted in metrics as sft/truncated_examples).")
    entity_augmentation: float = Field(1.0, ge=0, le=1, description="Chance that a drawn demonstration has its entity names replaced by fictitious ones (pipeline.policy.demos.augment_names): the policy learns to copy names from the question and tool results instead of memorising training names.")
    log_every: int = Field(10, ge=1, description="Log the loss curve every this many steps.")
    select_every: int = Field(100, ge=0, description="Checkpoint selection: every this many steps from `select_from` on, and after the last, score the model on the first `select_tasks` evaluation tasks and keep the best (`select_mode`; earliest on a tie); 0: off, the last weights are kept.")
    select_from: int = Field(1000, ge=1, description="First step at which a checkpoint is scored (`select_every`): the default's best checks came at its last steps, so earlier checks would only cost time.")
    select_tasks: int = Field(200, ge=1, description="Tasks of the evaluation split (the first this many) each selection check plays.")
    select_mode: Literal["greedy", "sampled"] = Field("greedy", description="Score of a checkpoint: the mean over levels of its greedy (or sampled, at rollout.temperature) success on the selection tasks.")
    select_patience: int = Field(3, ge=0, description="Stop SFT after this many selection checks in a row without a better score (the learning-rate schedule still spans `steps`); 0: train all `steps`.")

    @model_validator(mode="after")
    def _check_select(self) -> "SFTConfig":
        if self.select_every and self.select_from > self.steps:
            raise ValueError(f"select_from={self.select_from} is after the last step (steps={self.steps}): no "
                             f"checkpoint but the last would be scored; lower select_from or set select_every: 0")
        return self


class CapabilityConfig(PhaseConfig):
    """Capability evaluation after adaptation (docs/design.md §3.3.1), through the rollout engine."""

    split: Literal["validation", "test"] = Field("validation", description="Task split evaluated (validation: the test split stays untouched until the final evaluation phase).")
    max_tasks: int | None = Field(None, ge=1, description="Evaluate only the first this many tasks of the split (null: all).")
    sampled_per_task: int = Field(4, ge=1, le=64, description="Sampled episodes per task (seeds differ): more samples resolve a hard level's few-percent success and its group hit rate.")
    recovery_failure_rate: float = Field(0.25, gt=0, lt=1, description="env.tool_failure_rate of the recovery run (injected transient tool errors); success is measured among episodes that hit one.")
    seed: int = Field(0, description="Base seed of the evaluation episodes.")


class GateConfig(PhaseConfig):
    """The capability gate: an adapted model below any minimum stops the pipeline with a report of what fell short."""

    enabled: bool = Field(True, description="Apply the gate (false: only report).")
    fraction: float = Field(0.4, gt=0, le=1, description="With `min: auto`: the share f of the expert's margin over chance each minimum asks for (success per taught level: random + f·(expert − random); tool_first_acc: c + f·(1 − c), c = 1/tools; param_acc: f; docs/recipe.md).")
    min: dict[str, float] | Literal["auto"] = Field(
        default_factory=lambda: {
            "eval/greedy/success_L1": 0.15,
            "eval/greedy/success_L2": 0.4,
            "eval/greedy/success_L3": 0.4,
            "eval/greedy/tool_first_acc": 0.8,
            "eval/greedy/param_acc": 0.45,
        },
        description="Minimum value of capability metrics by key (pipeline.adapt.capability.metric_keys; an unknown key is an error before training), or 'auto': derived from the expert's and the random policy's success on the gate's split, for the levels the demonstrations teach, with `fraction` (docs/recipe.md).",
    )


class AdaptConfig(PhaseConfig):
    """The `adapt` phase: continued pre-training, SFT with adapters, capability evaluation and gate."""

    seed: int = Field(0, description="Seed of data order and dropout (the model's initialisation has model.seed).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (null: torch's default, one per core).")
    time_budget_s: float | None = Field(None, gt=0, description="Wall-clock seconds for continued pre-training and SFT with its selection checks (not the capability evaluation after them): each plans the steps that fit at its measured speed, never more than configured; pre-training may take at most a third of it (pipeline.adapt.budget, docs/recipe.md). null: the step counts alone.")
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig, description="Continued pre-training.")
    adapter: AdapterConfig = Field(default_factory=AdapterConfig, description="Adapter used for SFT.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised fine-tuning on the demonstrations.")
    eval: CapabilityConfig = Field(default_factory=CapabilityConfig, description="Capability evaluation.")
    gate: GateConfig = Field(default_factory=GateConfig, description="Capability gate.")
