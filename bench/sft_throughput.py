"""SFT training throughput of the policy as achieved FLOP/s against this machine's measured matrix-multiply peak.

    python bench/sft_throughput.py [--steps 8] [--batch 32] [--seq 128] [--threads N] [--modes full,lora]
        [--compile both|on|off] [--dtypes fp32,bf16]

For each dtype (fp32; bf16 autocast where the CPU supports it) and each mode (full fine-tuning; LoRA as the adapt
stage trains it), one child process builds the default policy model (``ModelConfig()``; vocabulary sized like the
built-in tokenizer), times ``--steps`` AdamW steps of the adapt stage's own loop (:func:`pipeline.adapt.sft.train_lm`)
on full-length batches of random tokens (no padding, so every token counts), and reports its peak resident memory.
Each row runs eager and with ``torch.compile`` (``adapt.sft.compile``, on by default; its compilation happens in the
warm-up steps and is not timed: the adapt stage pays it once, ~30 s on a cold cache).
In the same run, the peak is measured with square ``torch.mm`` in the same dtype (best of several sizes and repeats).

How FLOPs are counted (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1):

- **model FLOPs = 6·N·T** for full fine-tuning: N counts the weights that take part in a matrix multiply (every
  ``nn.Linear``, the output projection included; the embedding lookup is not a matmul, and with tied embeddings the
  shared matrix is counted once, as the output projection), T the tokens processed. 2·N·T forward, 4·N·T backward.
- **LoRA**: frozen weights need no weight gradient, so 4·N·T for the base plus 6·N_lora·T for the adapters.
- **attention**: the score and value matmuls add 12·L·S·d per token (S the sequence length, full S×S as the CPU SDPA
  kernel computes it); reported separately and included in the "with attention" ratio.

Utilisation = achieved FLOP/s ÷ measured matmul peak FLOP/s of the same dtype. Goal: at least 50 % at the default
width. The machines are shared and noisy: trust ratios measured in one run, not absolute numbers across runs.

Last measured (2026-12-05, ``--modes full --dtypes bf16 --compile on``, 1 thread (``OMP_NUM_THREADS=1``), a shared
2-core AMX machine at load average 3-5): bf16 full compiled 9,369 tokens/s = 189 GFLOP/s against a matmul peak of 939
(after: 841) GFLOP/s = 20 % (22 % with attention). The code before attention ran in fp32 during training
(:mod:`pipeline.adapt.fp32_attention`), run just before it: 4,158 tokens/s = 84 GFLOP/s, 14 % of a 616 (after: 1,084)
GFLOP/s peak. The one-second peak moved between 180 and 1,084 GFLOP/s that day and the same code's tokens/s by 2x
between runs, so the before/after figure to quote is the one measured in one process: compiled steps alternating
between bf16 and fp32 attention ran 1.35x, 1.51x and 1.63x as fast with fp32 attention (three rounds, load 9.5), and
1.14x, 1.25x and 1.37x in a second process (load 3.4: 4,588 against 5,575 tokens/s, the medians). In the
profile of a compiled bf16 step before, the bf16 flash-attention backward took 42 % of the time and all matrix
multiplies 27 %.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def matmul_peak(dtype_name: str, threads: int, seconds: float = 1.0) -> dict:
    import torch

    torch.set_num_threads(threads)
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    best = {"flops": 0.0}
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(2):
            torch.mm(a, b)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            torch.mm(a, b)
            reps += 1
        dt = time.perf_counter() - t0
        flops = 2 * n ** 3 * reps / dt
        if flops > best["flops"]:
            best = {"flops": flops, "n": n}
    return best


def train_child(q, dtype_name: str, mode: str, steps: int, batch: int, seq: int, threads: int, vocab: int,
                micro_batches: int = 1, compile: bool = False) -> None:
    import warnings

    import torch
    from torch import nn

    warnings.filterwarnings("ignore", category=FutureWarning)  # peft's deprecation notices, not ours
    from pipeline.adapt import adapters
    from pipeline.adapt import sft
    from pipeline.policy.config import ModelConfig
    from pipeline.adapt.config import AdapterConfig
    from pipeline.policy.model import autocast_context, resident_mib

    torch.set_num_threads(threads)
    mcfg = ModelConfig(dtype=dtype_name)
    tok = _FakeTokenizer(vocab)
    from pipeline.policy.model import build_policy

    model = build_policy(mcfg, tok)
    lin = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    n_matmul = sum(w.numel() for w in lin.values())
    wrapped = adapters.apply_adapter(model, AdapterConfig(kind="none" if mode == "full" else "lora"))
    n_lora = sum(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(7, vocab, (batch, seq), generator=g)),
             "attention_mask": torch.ones_like(ids), "labels": ids} for _ in range(4)]
    stream = (data[i % 4] for i in range(10 ** 9))
    rss0 = resident_mib() or float("nan")
    amp = lambda: autocast_context(mcfg)  # noqa: E731
    forward = torch.compile(wrapped, dynamic=True) if compile else wrapped  # as train_lm(compile=True) does
    # warm-up (allocator, kernels, compilation), then the timed steps through the same compiled module
    sft.train_lm(forward, stream, 2, 1e-4, autocast=amp, micro_batches=micro_batches)
    res = sft.train_lm(forward, stream, steps, 1e-4, autocast=amp, micro_batches=micro_batches)
    tokens = res.tokens
    L, d = mcfg.n_layers, mcfg.d_model
    model_flops = (6 * n_matmul * tokens) if mode == "full" else (4 * n_matmul * tokens + 6 * n_lora * tokens)
    attn_flops = 12 * L * seq * d * tokens
    q.put({"dtype": dtype_name, "mode": mode + (" compiled" if compile else ""), "tokens_per_s": tokens / res.seconds,
           "seconds": res.seconds,
           "n_matmul_params": n_matmul, "n_lora_params": n_lora, "model_flops_per_s": model_flops / res.seconds,
           "attn_flops_per_s": attn_flops / res.seconds, "rss_before_mb": rss0,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


class _FakeTokenizer:
    """Just enough of a tokenizer for build_policy (vocabulary size and the special tokens' ids)."""

    def __init__(self, n: int):
        from pipeline.policy.tokenizer import SPECIAL_TOKENS

        self.n, self.special = n, {t: i for i, t in enumerate(SPECIAL_TOKENS)}
        self.pad_token, self.pad_token_id = "<pad>", 0
        self.bos_token, self.eos_token = "<bos>", "<eos>"  # marker_ids reads the roles as a real tokenizer has them

    def __len__(self) -> int:
        return self.n

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.special[text]] if text in self.special else [7]


def run_in_child(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args))
    p.start()
    out = q.get()
    p.join()
    return out


def peak_child(q, dtype_name: str, threads: int) -> None:
    q.put(matmul_peak(dtype_name, threads))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--dtypes", default="fp32,bf16", help="compute dtypes to run (bf16 only where the CPU supports it)")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="chunks per step with gradient accumulation (default: adapt.sft.micro_batches' default)")
    ap.add_argument("--compile", choices=["both", "on", "off"], default="both",
                    help="eager and compiled rows (both), or only one of them")
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary size (the built-in tokenizer's is about 1000)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    import torch

    from pipeline.policy.model import supports_bf16

    from pipeline.adapt.config import SFTConfig

    threads = args.threads or torch.get_num_threads()
    micro = args.micro_batches or SFTConfig().micro_batches
    dtypes = [d for d in args.dtypes.split(",") if d == "fp32" or (d == "bf16" and supports_bf16())]
    rows = []
    print(f"SFT throughput: default policy model, batch {args.batch} x {args.seq} tokens, {args.steps} steps, "
          f"{threads} threads, {micro} chunk(s) per step; load average {os.getloadavg()[0]:.1f} at start")
    for dt in dtypes:
        peak = run_in_child(peak_child, dt, threads)
        compiles = {"both": [False, True], "on": [True], "off": [False]}[args.compile]
        for mode, comp in [(m, c) for m in args.modes.split(",") for c in compiles]:
            r = run_in_child(train_child, dt, mode, args.steps, args.batch, args.seq, threads, args.vocab, micro, comp)
            r["peak_matmul_flops_per_s"] = peak["flops"]
            r["utilisation"] = r["model_flops_per_s"] / peak["flops"]
            r["utilisation_with_attention"] = (r["model_flops_per_s"] + r["attn_flops_per_s"]) / peak["flops"]
            # the peak again, right after, to show how much the shared machine moved during the run
            r["peak_after_flops_per_s"] = run_in_child(peak_child, dt, threads)["flops"]
            rows.append(r)
            print(f"  {dt:4s} {r['mode']:13s}: {r['tokens_per_s']:8.0f} tokens/s  "
                  f"{r['model_flops_per_s'] / 1e9:6.1f} GFLOP/s "
                  f"(+{r['attn_flops_per_s'] / 1e9:.1f} attention) vs matmul peak {peak['flops'] / 1e9:6.1f} "
                  f"(after: {r['peak_after_flops_per_s'] / 1e9:.1f}) GFLOP/s = {r['utilisation']:.0%} "
                  f"({r['utilisation_with_attention']:.0%} with attention); peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"({r['rss_before_mb']:.0f} MB before training)")
    print(f"load average {os.getloadavg()[0]:.1f} at end (the machine's other work moves every figure)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
