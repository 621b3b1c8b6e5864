#!/usr/bin/env python
"""Build a tiny random-initialised Qwen2 causal LM with its own byte-level BPE tokenizer and a tool-calling chat
template, fully offline, and save it as a Hugging Face folder.

    python scripts/make_tiny_hf_model.py OUT_DIR [--text FILE ...] [--vocab-size N] [--seed S]

The folder loads with ``AutoModelForCausalLM.from_pretrained(OUT_DIR, local_files_only=True)`` and
``AutoTokenizer.from_pretrained(OUT_DIR, local_files_only=True)``; point ``model.base`` in params.yaml at it to run
the pipeline on a foreign architecture (docs/models.md). What it stands for: a real pre-trained model of another
family than the built-in Llama, with a tokenizer that is not the pipeline's own:

- **Architecture**: ``Qwen2ForCausalLM`` (grouped-query attention with q/k/v biases, tied embeddings), hidden 128,
  6 layers, 4 heads (2 key/value heads), MLP 512: about 1.5M parameters. Its embedding has more rows than the
  tokenizer has tokens (rounded up to a multiple of 64, as released Qwen models pad theirs), so the pipeline's resize
  path runs.
- **Tokenizer**: byte-level BPE (Qwen2's pre-tokenisation and NFC normaliser, which its loader applies) trained on a small built-in corpus plus any
  text passed in; special tokens ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos, the end of a
  turn); no BOS. The protocol markers (``<call>`` ...) are deliberately *not* in it: the pipeline adds them.
- **Chat template**: Qwen2.5's layout (``<|im_start|>role\\n...<|im_end|>\\n``; ``tools`` as JSON lines inside
  ``<tools></tools>`` in the system turn; tool results as a user turn of ``<tool_response>`` blocks).

Deterministic: the same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

BUILTIN_CORPUS = (
    "You are a helpful assistant.",
    "You are an agent that can use tools.",
    "You may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    '{"type": "function", "function": {"name": "search", "description": "Search the documents.", "parameters": '
    '{"type": "object", "properties": {"query": {"type": "string", "description": "What to look for."}}, '
    '"required": ["query"]}}}',
    '{"type": "function", "function": {"name": "lookup", "description": "Look up one record by its id.", '
    '"parameters": {"type": "object", "properties": {"table": {"type": "string"}, "id": {"type": "integer"}}}}}',
    "Task: What is the price of the product sold by the supplier named in the question?",
    "Task: How many units of stock does the warehouse hold for this product?",
    "State: earlier calls and results: search -> no match",
    '<tool_response>\n[{"id": 12, "name": "Cedar Supply", "price": 19.5, "stock": 40}]\n</tool_response>',
    '{"query": "Cedar Supply flagship product", "field": "stock", "value": 42, "ok": true}',
    "The quick brown fox jumps over the lazy dog. A supplier ships products to a warehouse every week.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 25 100 3.14 -7 2024-01-31",
)


def train_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Byte-level BPE (Qwen2's pre-tokenisation) trained on `texts` plus the built-in corpus, wrapped as a
    ``PreTrainedTokenizerFast`` with the chat template; ``<|im_end|>`` is its eos, ``<|endoftext|>`` its pad."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # Qwen2's own normaliser and pre-tokenisation: AutoTokenizer loads the folder as a Qwen2 tokenizer (the config's
    # model_type), which sets them, so training with anything else would give merges it never applies
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[PAD, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = list(BUILTIN_CORPUS) * 4 + list(texts)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE, model_max_length=4096,
    )


def tiny_qwen2_config(vocab_size: int, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=-(-vocab_size // 64) * 64, hidden_size=128, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def make_tiny_hf_model(out_dir: str | Path, texts: Iterable[str] = (), vocab_size: int = 1024, seed: int = 0) -> Path:
    """Build and save the tiny Qwen2 model and its tokenizer into `out_dir` (created; existing files overwritten).
    Returns the folder. `texts` are extra tokenizer training text (for instance the environment's prompts)."""
    import torch
    from transformers import Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(texts, vocab_size)
    config = tiny_qwen2_config(len(tokenizer), tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float().eval()
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--text", action="append", default=[], help="extra tokenizer training text file (repeatable)")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    texts = []
    for name in args.text:
        p = Path(name)
        if not p.is_file():
            print(f"error: --text {name}: no such file", file=sys.stderr)
            return 2
        texts += p.read_text(encoding="utf-8").splitlines()
    out = make_tiny_hf_model(args.out_dir, texts, args.vocab_size, args.seed)
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out, local_files_only=True).parameters())
    print(json.dumps({"out_dir": str(out), "parameters": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
