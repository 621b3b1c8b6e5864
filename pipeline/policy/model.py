"""The policy model: build the built-in small Llama or load a local Hugging Face model; save and load policies.

- :func:`build_policy` builds ``LlamaForCausalLM`` from :class:`ModelConfig` (d_model 256, 4 layers, 4 heads, SwiGLU
  672, tied embeddings: about 3M parameters with the ~1k-token vocabulary, the prototype's size
  on this CPU), or loads ``cfg.base`` with ``local_files_only=True`` (nothing is downloaded) and sizes its embeddings to
  the tokenizer.
- :func:`save_policy` writes ``save_pretrained`` weights and tokenizer plus ``policy.json`` (config, data version,
  step, anything the caller adds) into a temporary sibling folder, then swaps it in with renames: a failed
  save never leaves a partial model where a good one stood. The folder is a function of the model, the tokenizer and
  `meta` alone (no time, commit, host or path of the run; keys sorted), so a rerun that trains the same weights
  writes the same bytes and DVC gives its output the same hash; the run's commit and time are MLflow's to record
  (:mod:`pipeline.core.tracking` tags every run with its git commit, and MLflow stamps its start and end).
- :func:`load_policy` loads such a folder back and refuses, with an :class:`AgentRLError` that says what to fix, a
  missing path, a folder that is not a model, and a tokenizer that does not fit the model's embedding.
- A foreign base (docs/models.md): :func:`load_base_tokenizer` adds the protocol markers and a pad token, checks its
  chat template and binds the environment's tool specs to it (:mod:`pipeline.policy.chat`); :func:`build_policy`
  resizes the embedding to the tokenizer (a model whose embedding cannot be resized is refused);
  :func:`save_policy` records the bound tools in ``policy.json`` (``chat_tools``, a JSON string that keeps their
  key order) and :func:`load_policy` binds them
  again (running the template check), so every phase renders the same prompt.
- :func:`autocast_context` gives bf16 autocast (weights stay fp32) or a null context, per ``cfg.dtype``.

Weights are always kept in fp32: training needs fp32 master weights and the rollout engine's log-probabilities are
compared with fp32 forwards. bf16 is a compute dtype only (autocast).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from pipeline.core.atomic import replace_dir
from pipeline.core.errors import AgentRLError
from pipeline.policy.config import ModelConfig
from pipeline.policy.chat import bind_tools, bound_tools, chat_format
from pipeline.policy.tokenizer import MARKERS, marker_ids

POLICY_JSON = "policy.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# Keys a saved policy never holds: they differ between two runs that train the same weights (older policies have
# git_commit and saved_at: they are read as they are, and dropped when their meta is saved again).
RUN_SPECIFIC = frozenset({"git_commit", "saved_at"})


# ------------------------------------------------------------------------------------------------------------ memory
_LIBC = None


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``); False where there is no glibc.

    Why: PyTorch's CPU tensors come from glibc malloc, whose mmap threshold rises to the largest freed block (up to
    32 MiB), so after the first steps every activation is carved from the heap. With a new sequence length in every
    batch the freed blocks rarely fit the next request, and the resident size grows although the live tensors do not:
    300 SFT steps of the default grew a process from 0.7 to 4.2 GiB, while a trim brings it back to 1.4 GiB. A trim
    is not free: the pages it returns are faulted in again by the next steps. Measured on 200 SFT steps of the default
    (alternated runs): never trimming, peak 3.9-4.1 GiB at 9.2-10.0k tokens/s; trimming every 10 steps,
    3.4 GiB at 8.4k; every 5, 3.1 GiB at 8.0-8.1k; :class:`HeapTrimmer` with 1 GiB of headroom (the SFT loop's
    choice, :data:`pipeline.adapt.sft.TRIM_HEADROOM_MIB`), 2.8 GiB at 7.6k; with 0.5 GiB, 2.5 GiB at 7.0k. So the
    bound costs 10-20 % of SFT throughput, which the default pays to stay under the 4 GiB memory goal. A fixed low
    mmap threshold (``MALLOC_MMAP_THRESHOLD_=131072``) also stops the growth but page-faults every activation afresh:
    3.4k tokens/s. Nothing numerical changes: the same tensors are computed in the same order.
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC is False:
        return False
    _LIBC.malloc_trim(0)
    return True


def resident_mib() -> float | None:
    """This process's resident memory in MiB (Linux ``/proc/self/statm``); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Call :meth:`maybe` after every step: it trims the heap (:func:`release_free_memory`) once the resident size
    has grown by `headroom_mib` since the last trim, so a long loop stays within about the live size plus the
    headroom and pays for a trim only when fragmentation has built up (see :func:`release_free_memory`)."""

    def __init__(self, headroom_mib: float = 1024.0):
        self.headroom = headroom_mib
        now = resident_mib()
        self.limit = None if now is None else now + headroom_mib
        self.trims = 0

    def maybe(self) -> bool:
        if self.limit is None:
            return False
        now = resident_mib()
        if now is None or now <= self.limit:
            return False
        release_free_memory()
        self.trims += 1
        self.limit = (resident_mib() or now) + self.headroom
        return True


# ------------------------------------------------------------------------------------------------------------- dtype
def supports_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bf16 compute is fast on `device` (CPU: oneDNN's bf16 check, true with AVX512-BF16 or AMX)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> torch.dtype:
    """'auto' -> bf16 where supported else fp32; 'fp32'; 'bf16'."""
    if dtype == "auto":
        return torch.bfloat16 if supports_bf16(device) else torch.float32
    if dtype in ("fp32", "float32"):
        return torch.float32
    if dtype in ("bf16", "bfloat16"):
        return torch.bfloat16
    raise AgentRLError(f"unknown dtype {dtype!r}; dtypes are auto, fp32, bf16")


def dtype_notice(dtype: str, device: str | torch.device = "cpu") -> str | None:
    """The line a phase prints when ``dtype: auto`` falls back to fp32 on `device`, else None.

    bf16 and fp32 runs of the same params give other weights and figures, and fp32 on a CPU takes about 4x as long
    (adapt 3,213 s on an AVX2-only CPU against 834 s on an AVX512-BF16 one). The README's "Same figures
    where, and where not" says which kind of machine the committed figures come from. Said once per phase so that
    nobody compares runs of the two kinds unaware."""
    if dtype != "auto" or resolve_dtype(dtype, device) != torch.float32:
        return None
    kind = torch.device(device).type
    why = "this GPU has no bf16" if kind == "cuda" else "this CPU has no fast bf16 (AVX512-BF16 or AMX)"
    return (f"compute dtype fp32: dtype 'auto' and {why}; expect about 4x the time of a bf16 machine and other "
            "figures than a bf16 machine gives (README: 'Same figures where, and where not')")


def autocast_context(cfg: ModelConfig | str, device: str | torch.device = "cpu"):
    """``torch.autocast(device, bfloat16)`` when the config's dtype resolves to bf16, else a null context.

    `cfg` is a :class:`ModelConfig` (or any object with a `dtype` field) or a dtype name."""
    name = cfg if isinstance(cfg, str) else cfg.dtype
    device = torch.device(device)
    if resolve_dtype(name, device) == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------------------- build
def builtin_config(cfg: ModelConfig, tokenizer):
    from transformers import LlamaConfig

    ids = marker_ids(tokenizer)
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads, max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=cfg.tie_embeddings, rope_theta=cfg.rope_theta, rms_norm_eps=1e-5,
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
        attn_implementation="sdpa",
    )


def build_policy(cfg: ModelConfig, tokenizer):
    """The policy model for `tokenizer`: the built-in Llama initialised from ``cfg.seed`` (the global RNG is left as it
    was), or ``cfg.base`` loaded locally with its embeddings resized to the tokenizer when they differ."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    marker_ids(tokenizer)  # the protocol markers must be single tokens
    if cfg.base == "builtin":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = LlamaForCausalLM(builtin_config(cfg, tokenizer))
        return model.float().eval()
    try:
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(cfg.base, local_files_only=True, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001  (missing files, an unknown architecture, corrupt weights)
        raise AgentRLError(f"model.base={cfg.base!r}: cannot load it locally as a causal LM ({type(exc).__name__}: "
                           f"{(str(exc).splitlines() or [''])[0][:200]}); give a local model directory or a hub id "
                           f"already in the local cache, or 'builtin'") from None
    n_embed = model.get_input_embeddings().num_embeddings
    if n_embed != len(tokenizer):
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        except Exception as exc:  # noqa: BLE001  (a model class that cannot resize its embedding)
            raise AgentRLError(f"model.base={cfg.base!r}: its embedding has {n_embed} rows but the tokenizer has "
                               f"{len(tokenizer)} tokens (the protocol markers added), and resizing failed "
                               f"({type(exc).__name__}: {str(exc)[:200]})") from None
        if model.get_input_embeddings().num_embeddings != len(tokenizer):
            raise AgentRLError(f"model.base={cfg.base!r}: resizing the embedding to the tokenizer's {len(tokenizer)} "
                               f"tokens left {model.get_input_embeddings().num_embeddings} rows")
    ids = marker_ids(tokenizer)
    model.config.pad_token_id = ids["<pad>"]
    model.config.eos_token_id = ids["<eos>"]
    return model.float().eval()


def load_base_tokenizer(cfg: ModelConfig, tools=None):
    """The tokenizer of a non-built-in base, with the protocol markers added as special tokens (single ids), a pad
    token and left padding; with a chat template, checked and bound to `tools` (tool specs with name, description
    and a JSON-schema ``parameters``, or OpenAI function dicts: :func:`pipeline.policy.chat.bind_tools`).
    (The built-in base trains its own: pipeline.policy.tokenizer.train_tokenizer.)

    Refused with an :class:`AgentRLError` naming the folder: no tokenizer files, a tokenizer that does not load, no
    end-of-sequence token, markers that do not become single tokens, a chat template that breaks (module
    :mod:`pipeline.policy.chat`)."""
    from transformers import AutoTokenizer

    from pipeline.policy.chat import bind_tools

    if cfg.base == "builtin":
        raise AgentRLError("the built-in base has no tokenizer to load; train one with "
                           "train_tokenizer(corpus_texts(...))")
    where = f"model.base={cfg.base!r}"
    base = Path(cfg.base).expanduser()
    if base.is_dir() and not any((base / n).is_file() for n in TOKENIZER_FILES):
        raise AgentRLError(f"{where}: the folder has no tokenizer ({', '.join(TOKENIZER_FILES)}); save the model's "
                           f"tokenizer into it (tokenizer.save_pretrained)")
    try:
        tok = AutoTokenizer.from_pretrained(cfg.base, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise AgentRLError(f"{where}: cannot load its tokenizer locally ({type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None
    if tok.eos_token is None:
        raise AgentRLError(f"{where}: the tokenizer has no eos token; the policy ends an action at </call> or eos "
                           f"(set eos_token, for a chat model its end-of-turn token, in tokenizer_config.json)")
    missing = [m for m in MARKERS if len(tok.encode(m, add_special_tokens=False)) != 1]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "<pad>"})
    tok.padding_side = "left"
    try:
        marker_ids(tok)
    except AgentRLError as exc:
        raise AgentRLError(f"{where}: {exc}") from None
    bind_tools(tok, tools)
    return tok


def n_parameters(model) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ---------------------------------------------------------------------------------------------------- save and load
def check_pair(model, tokenizer, where: str) -> None:
    """A tokenizer fits a model when every one of its ids has an embedding row (and, for our own policies, exactly)."""
    n_embed = model.get_input_embeddings().num_embeddings
    if len(tokenizer) != n_embed:
        raise AgentRLError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
                           f"{n_embed} rows; save and load a model together with the tokenizer it was trained with")
    marker_ids(tokenizer)


@contextlib.contextmanager
def _quiet_progress():
    """Hide transformers' weight-loading/saving progress bars for the duration (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def save_policy(model, tokenizer, path: str | Path, meta: dict | None = None) -> Path:
    """Write model, tokenizer and ``policy.json`` to `path`, atomically (temp folder, then renames).

    `meta` is stored under ``policy.json``; conventional keys: ``data_version`` (checksums of the data the model was
    trained on), ``step``, ``phase``, ``model_config``. ``n_parameters``, ``vocab_size`` and the HF config are added
    here. Returns the final path.

    Nothing run-specific is written (no save time, git commit, host or absolute path; the HF config's
    ``_name_or_path``, the folder the model was loaded from, is left out), and ``policy.json`` is written with sorted
    keys: saving the same model twice gives byte-identical folders, so DVC hashes a reproduced output alike. Keys of
    `meta` in :data:`RUN_SPECIFIC` are dropped for the same reason (train passes on the meta of the policy it
    started from, which a policy saved before this rule still carries).

    The weights are stored in fp32 whatever the model computes in: a model trained by a bf16 engine (DeepSpeed on a
    GPU, ``"bf16": "auto"``) is widened on the way out (exact; the live model is not touched), so the artefact's dtype
    and the loaders' behaviour do not depend on where training ran. An fp32 model is saved as it is."""
    path = Path(path)
    meta = {k: v for k, v in (meta or {}).items() if k not in RUN_SPECIFIC}
    check_pair(model, tokenizer, str(path))
    state_dict = None
    if any(t.is_floating_point() and t.dtype != torch.float32 for t in model.parameters()):
        state_dict = {k: (v.detach().float() if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        with _quiet_progress():
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        if state_dict is not None:  # the config records the stored dtype, not the live model's
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = "float32"
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        # after save_pretrained, which fills in the config's `architectures`: the first save of a fresh model and
        # every later one then record the same config
        info = {
            **(meta or {}),
            # as a JSON string: policy.json sorts its keys, and the template renders the tools in their own key order
            **({"chat_tools": json.dumps(bound_tools(tokenizer))} if chat_format(tokenizer) is not None else {}),
            "n_parameters": n_parameters(model),
            "vocab_size": len(tokenizer),
            "hf_config": {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"},
        }
        (tmp / POLICY_JSON).write_text(json.dumps(info, indent=2, sort_keys=True, default=str) + "\n")

    replace_dir(path, write)
    return path


def copy_policy(src: str | Path, dst: str | Path) -> Path:
    """Copy a policy folder written by :func:`save_policy` to `dst`, atomically like it (a missing `src` is an
    :class:`AgentRLError`, and `dst` is then left as it was)."""
    src, dst = Path(src), Path(dst)
    if not (src / POLICY_JSON).is_file():
        raise AgentRLError(f"no policy to copy at {src} (no {POLICY_JSON})")
    dst.parent.mkdir(parents=True, exist_ok=True)
    return replace_dir(dst, lambda tmp: shutil.copytree(src, tmp))


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer, meta)`` from a folder written by :func:`save_policy` (or any local HF causal-LM folder
    with its tokenizer; `meta` is then ``{}``). The model is returned in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise AgentRLError(f"policy path {path} does not exist")
    if not path.is_dir():
        raise AgentRLError(f"policy path {path} is not a directory (a policy is a folder written by save_policy)")
    missing = [n for n in ("config.json",) if not (path / n).is_file()]
    if missing or not any((path / w).is_file() for w in WEIGHT_FILES):
        what = "config.json" if missing else f"weights ({' or '.join(WEIGHT_FILES[:3:2])})"
        raise AgentRLError(f"{path} is not a model directory: {what} missing")
    if not any((path / n).is_file() for n in TOKENIZER_FILES):
        raise AgentRLError(f"{path} has no tokenizer (tokenizer.json); save the model with its tokenizer")
    meta: dict = {}
    if (path / POLICY_JSON).is_file():
        try:
            meta = json.loads((path / POLICY_JSON).read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise AgentRLError(f"{path / POLICY_JSON}: not UTF-8 text (byte {exc.start + 1})") from None
        except json.JSONDecodeError as exc:
            raise AgentRLError(f"{path / POLICY_JSON}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise AgentRLError(f"{path / POLICY_JSON}: JSON nested too deeply to read") from None
        if not isinstance(meta, dict):
            raise AgentRLError(f"{path / POLICY_JSON}: expected a JSON object, got {type(meta).__name__}")
    try:  # any failure here is a broken input folder (corrupt weights raise safetensors' own error type)
        with _quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as exc:  # noqa: BLE001
        raise AgentRLError(f"{path}: cannot load the model ({type(exc).__name__}: "
                           f"{(str(exc).splitlines() or [''])[0][:300]})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise AgentRLError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: "
                           f"{(str(exc).splitlines() or [''])[0][:200]})") from None
    tokenizer.padding_side = "left"
    check_pair(model, tokenizer, str(path))
    if getattr(tokenizer, "chat_template", None):  # the start-up check, with the tools the policy was trained with
        try:
            tools = meta.get("chat_tools")
            bind_tools(tokenizer, json.loads(tools) if isinstance(tools, str) else tools)
        except AgentRLError as exc:
            raise AgentRLError(f"{path}: {exc}") from None
    return model.eval(), tokenizer, meta
