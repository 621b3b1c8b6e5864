"""Parameter-efficient adaptation of the policy: peft LoRA, the bottleneck adapter of docs/design.md §3.3.2, or full fine-tuning.

- **LoRA** (peft): W' = W + (α/r)·B·A on the chosen projections, B zero-initialised, the base frozen. After training,
  :func:`finalize` merges the update into the weights (``merge_and_unload``), so the adapted model is a plain
  transformers model of the base's class and every later phase (RL, DeepSpeed, quantisation) reads it like any other.
- **Bottleneck** (docs/design.md §3.3.2; Houlsby et al. 2019, "Parameter-Efficient Transfer Learning for NLP"): after each
  decoder layer's MLP, h' = h + W₂·σ(W₁·h) with W₁: d→r, W₂: r→d, r ≪ d, W₂ zero-initialised so the adapted model starts
  as the base. The non-linearity σ makes it impossible to fold into the base weights, so the adapted model keeps the
  adapters: it is saved as :class:`LlamaBottleneckForCausalLM` (``model_type: llama_bottleneck``: a Llama whose MLPs
  carry an ``adapter`` submodule), registered with transformers' Auto classes when this module is imported, so
  ``AutoModelForCausalLM.from_pretrained`` and :func:`pipeline.policy.model.load_policy` load it once
  ``pipeline.adapt.adapters`` has been imported (:func:`load_adapted` does both).
- **none**: full fine-tuning, every parameter trainable: what ``auto`` picks for the built-in from-scratch base
  (:func:`resolve_kind`), which has no pre-trained features for an adapter to adapt.

`train_also` keeps chosen base parameters trainable next to an adapter (for instance ``embed_tokens`` and ``norm``
for a base whose vocabulary was just trained); LoRA's merge leaves them as trained.

Deliberately left out: QLoRA (no CUDA here), DoRA and other peft variants (one line in :func:`lora_config` away), and
bottleneck adapters for architectures other than Llama (the wrapper class is Llama's; LoRA covers any base).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pipeline.core.errors import AgentRLError

ADAPTER_KINDS = ("lora", "bottleneck", "none")  # what `auto` resolves to: see resolve_kind
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}
BOTTLENECK_MODEL_TYPE = "llama_bottleneck"


# ------------------------------------------------------------------------------------------------------- bottleneck


class BottleneckAdapter(nn.Module):
    """y ↦ y + W₂·σ(W₁·y): W₁ (d→r) Kaiming-uniform, W₂ (r→d) zero, so the adapter starts as the identity."""

    def __init__(self, d: int, r: int, activation: str = "gelu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise AgentRLError(f"unknown bottleneck activation {activation!r}; activations are {sorted(ACTIVATIONS)}")
        self.down = nn.Linear(d, r)
        self.act = ACTIVATIONS[activation]()
        self.up = nn.Linear(r, d)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.up(self.act(self.down(y)))


def _apply_adapter(module: nn.Module, inputs, output):
    """Forward hook on an MLP: its output goes through the MLP's `adapter` (before the layer's residual add)."""
    return module.adapter(output)


def insert_bottlenecks(model: nn.Module, r: int, activation: str) -> list[nn.Module]:
    """Add a :class:`BottleneckAdapter` as ``layer.mlp.adapter`` to every decoder layer, applied by a forward hook.

    The adapter is a child of the MLP, so the base's parameter names are unchanged and a state dict gains only
    ``...mlp.adapter.{down,up}.{weight,bias}``. Returns the adapters.
    """
    layers = _decoder_layers(model)
    d = model.config.hidden_size
    if not 0 < r < d:
        raise AgentRLError(f"bottleneck_dim must lie in 1..{d - 1} (r ≪ d = hidden size {d}), got {r}")
    adapters = []
    for layer in layers:
        mlp = layer.mlp
        if hasattr(mlp, "adapter"):
            raise AgentRLError("the model already has bottleneck adapters")
        ref = next(mlp.parameters())
        mlp.adapter = BottleneckAdapter(d, r, activation).to(device=ref.device, dtype=ref.dtype)
        mlp.register_forward_hook(_apply_adapter)
        adapters.append(mlp.adapter)
    return adapters


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
        raise AgentRLError(f"bottleneck adapters need a Llama-style decoder (model.model.layers[i].mlp); "
                           f"{type(model).__name__} has none: use adapter kind 'lora'")
    return layers


class LlamaBottleneckConfig(LlamaConfig):
    """A Llama config plus the bottleneck adapter's size and activation."""

    model_type = BOTTLENECK_MODEL_TYPE

    def __init__(self, bottleneck_dim: int = 16, bottleneck_activation: str = "gelu", **kwargs):
        self.bottleneck_dim = bottleneck_dim
        self.bottleneck_activation = bottleneck_activation
        super().__init__(**kwargs)


class LlamaBottleneckForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with a bottleneck adapter after every decoder layer's MLP (see the module docstring)."""

    config_class = LlamaBottleneckConfig

    def __init__(self, config: LlamaBottleneckConfig):
        super().__init__(config)
        insert_bottlenecks(self, config.bottleneck_dim, config.bottleneck_activation)


AutoConfig.register(BOTTLENECK_MODEL_TYPE, LlamaBottleneckConfig, exist_ok=True)
AutoModelForCausalLM.register(LlamaBottleneckConfig, LlamaBottleneckForCausalLM, exist_ok=True)


def to_bottleneck(model: nn.Module, r: int, activation: str = "gelu") -> LlamaBottleneckForCausalLM:
    """A :class:`LlamaBottleneckForCausalLM` holding `model`'s weights and fresh (identity) adapters."""
    if not isinstance(model, LlamaForCausalLM):
        raise AgentRLError(f"bottleneck adapters are implemented for Llama models, got {type(model).__name__}; "
                           "use adapter kind 'lora'")
    if isinstance(model, LlamaBottleneckForCausalLM):
        raise AgentRLError("the model already has bottleneck adapters")
    cfg = LlamaBottleneckConfig(bottleneck_dim=r, bottleneck_activation=activation,
                                **{k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures")})
    cfg._attn_implementation = model.config._attn_implementation
    ref = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        new = LlamaBottleneckForCausalLM(cfg).to(device=ref.device, dtype=ref.dtype)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    bad = [k for k in missing if ".mlp.adapter." not in k and k != "lm_head.weight"]
    if bad or unexpected:
        raise AgentRLError(f"could not move the base weights into the bottleneck model: missing {bad[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        new.tie_weights()
    with torch.no_grad():
        for layer in new.model.layers:  # adapters start as the identity whatever the seed
            nn.init.zeros_(layer.mlp.adapter.up.weight)
            nn.init.zeros_(layer.mlp.adapter.up.bias)
    return new.eval()


# ------------------------------------------------------------------------------------------------------------ LoRA


def lora_config(r: int, alpha: float, dropout: float, target_modules: Iterable[str]):
    """The peft LoRA config of the policy (a causal LM)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=r, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=list(target_modules), bias="none")


def _module_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}


# ------------------------------------------------------------------------------------------------------ the switch


def resolve_kind(kind: str, base: str) -> str:
    """The adapter kind to use: `kind` itself, or for ``auto`` full fine-tuning ('none') on the built-in base and
    LoRA on any pre-trained base.

    Why: a from-scratch model has no pre-trained features for a low-rank update to adapt. Measured on the default
    model and data after continued pre-training: LoRA (r=32, all projections, lr 2e-3) reached an SFT loss of 1.48
    where full fine-tuning (lr 1e-3) reached 0.57 at the same 300 steps, and stayed unable to write valid calls.
    """
    if kind == "auto":
        return "none" if base == "builtin" else "lora"
    if kind not in ADAPTER_KINDS:
        raise AgentRLError(f"unknown adapter kind {kind!r}; kinds are auto, {', '.join(ADAPTER_KINDS)}")
    return kind



def apply_adapter(model: nn.Module, cfg) -> nn.Module:
    """Wrap `model` for training according to `cfg` (an :class:`~pipeline.policy.config.AdapterConfig`).

    Returns the model to train; only the adapter's parameters (plus those named by ``cfg.train_also``) require
    gradients, except for kind ``none``, which trains everything. Undo with :func:`finalize`.
    """
    if cfg.kind not in ADAPTER_KINDS:
        raise AgentRLError(f"adapter kind {cfg.kind!r} is not a concrete kind ({', '.join(ADAPTER_KINDS)}); "
                           "resolve 'auto' with resolve_kind first")
    if cfg.kind == "none":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if cfg.kind == "lora":
        from peft import get_peft_model

        present = _module_names(model)
        absent = [m for m in cfg.lora_target_modules if m not in present]
        if absent:
            raise AgentRLError(f"adapter.lora_target_modules names modules the model lacks: {absent}; "
                               f"its linear layers are {sorted(_linear_names(model))}")
        # LoRA's A matrices are drawn from torch's global generator: seed it here, as the bottleneck is seeded, so
        # the initial adapter does not depend on whatever the process drew before (two adapt runs in one process
        # ended with different weights without it).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            wrapped = get_peft_model(model, lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                                                        cfg.lora_target_modules))
    else:
        wrapped = to_bottleneck(model, cfg.bottleneck_dim, cfg.bottleneck_activation)
        for name, p in wrapped.named_parameters():
            p.requires_grad_(".mlp.adapter." in name)
    _unfreeze(wrapped, cfg.train_also)
    return wrapped


def _linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _unfreeze(model: nn.Module, patterns: Iterable[str]) -> None:
    """Make base parameters whose dotted name contains a component matching one of `patterns` trainable."""
    patterns = list(patterns)
    if not patterns:
        return
    hit = {p: 0 for p in patterns}
    for name, param in model.named_parameters():
        parts = name.split(".")
        for pat in patterns:
            if pat in parts or re.fullmatch(pat, name):
                param.requires_grad_(True)
                hit[pat] += 1
    unused = [p for p, n in hit.items() if n == 0]
    if unused:
        raise AgentRLError(f"adapter.train_also names {unused}, which match no parameter of the model")


def finalize(model: nn.Module) -> nn.Module:
    """The model to save after training: LoRA merged into the base weights (a plain transformers model);
    a bottleneck model as it is (its adapters cannot be merged, see the module docstring); a full model as it is.
    Every parameter's ``requires_grad`` is reset to True (the saved model is an ordinary model again)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(True)
    return model.eval()


def trainable_summary(model: nn.Module) -> dict:
    """Counts of trainable and total (unique) parameters."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return {"trainable": trainable, "total": total, "trainable_fraction": trainable / max(total, 1)}


def load_adapted(path):
    """:func:`pipeline.policy.model.load_policy` with the bottleneck model class registered (this module's import)."""
    from pipeline.policy.model import load_policy

    return load_policy(path)
