"""SFT on the real demonstrations with the shared prompt prefix computed once per batch, against once per row.

    python bench/sft_prefix.py [--steps 40] [--warmup 3] [--data data] [--tokenizer models/adapted] [--compile on|off]

Both runs train the default policy model (``ModelConfig()``, freshly initialised from the same seed, with the adapt
stage's adapter) on the same length-bucketed batches of `data/demos` (the adapt stage's own sampler, entity
augmentation included) through :func:`pipeline.adapt.sft.train_lm`, once with ``shared_prefix`` off and once on.
`--warmup` steps (compilation) are not timed; both parts run in one call of the loop, as in the stage. Each arm
runs in a process of its own, so its peak resident memory (also printed) is its own. Printed side by side: tokens per second (padding excluded), seconds per
step, the share of tokens the prefix saved, and the largest difference between the two runs' step losses (the
same batches and weights: only float rounding may differ).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import multiprocessing
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(shared: bool, model, sampler, args, autocast) -> dict:
    """One train_lm call of warmup + steps, as in the stage; the timed figures are those of the
    steps after the warm-up, from the loop's own per-step log."""
    from pipeline.adapt import sft
    from pipeline.adapt.batching import item_batches

    torch.manual_seed(0)
    m = copy.deepcopy(model)
    stream = item_batches(sampler.lengths, sampler, args.batch, np.random.default_rng(0), sampler.tokenizer.pad_token_id)
    stamps: list[tuple[float, float]] = []  # (time at the end of the step, its tokens per second)
    log = lambda step, metrics: stamps.append((time.perf_counter(), metrics["tokens_per_s"]))  # noqa: E731
    t_start = time.perf_counter()
    res = sft.train_lm(m, stream, args.warmup + args.steps, 1e-3, autocast=autocast, compile=args.compile == "on",
                       shared_prefix=shared, log=log, log_every=1)
    ends = [t_start] + [t for t, _ in stamps]
    dts = [b - a for a, b in zip(ends, ends[1:])]
    timed = range(args.warmup, len(dts))
    seconds = sum(dts[i] for i in timed)
    tokens = sum(stamps[i][1] * dts[i] for i in timed)
    return {"shared_prefix": shared, "tokens_per_s": tokens / seconds, "s_per_step": seconds / len(timed),
            "warmup_s": sum(dts[: args.warmup]), "shared_share": res.shared_tokens / max(res.tokens, 1),
            "losses": res.losses}


def _arm(shared: bool, args: argparse.Namespace) -> dict:
    """One arm in its own process (spawned by main): its peak resident memory is its own."""
    from transformers import PreTrainedTokenizerFast

    from pipeline.adapt import adapters
    from pipeline.adapt.batching import DemoSampler
    from pipeline.adapt.config import AdaptConfig
    from pipeline.adapt.main import load_inputs
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.demos import NamePool, prompt_signatures
    from pipeline.policy.model import autocast_context, build_policy

    cfg, model_cfg, env_cfg = AdaptConfig(), ModelConfig(), EnvConfig()
    world = open_environment(env_cfg.name, args.data / "env")
    inputs = load_inputs(args.data, "validation", world)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer))
    pool = NamePool.from_entities(json.loads((args.data / "env" / "entities.json").read_text()))
    sampler = DemoSampler(tokenizer, inputs["demos"], {t.task_id: t.to_dict() for t in inputs["train"]},
                          env_cfg.history_window, cfg.sft.max_len, cfg.sft.entity_augmentation, pool,
                          signatures=prompt_signatures(world, inputs["train"], env_cfg.context_actions))
    model = build_policy(model_cfg, tokenizer)
    model = adapters.apply_adapter(model, cfg.adapter.model_copy(
        update={"kind": adapters.resolve_kind(cfg.adapter.kind, model_cfg.base)}))
    autocast = lambda: autocast_context(model_cfg)  # noqa: E731
    res = run(shared, model, sampler, args, autocast)
    res["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--data", type=Path, default=Path("data"))
    ap.add_argument("--tokenizer", type=Path, default=Path("models/adapted"))
    ap.add_argument("--compile", choices=["on", "off"], default="on")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    if not (args.tokenizer / "tokenizer.json").is_file() or not (args.data / "demos").is_dir():
        print(f"error: needs {args.tokenizer}/tokenizer.json and {args.data}/demos (run the pipeline first)",
              file=sys.stderr)
        return 2
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:  # one arm after the other
        off = pool.submit(_arm, False, args).result()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        on = pool.submit(_arm, True, args).result()
    diff = max(abs(a - b) for a, b in zip(off["losses"], on["losses"]))
    print(f"{args.steps} SFT steps of {args.batch} demonstrations, compile {args.compile}, each arm in its own process")
    print(f"{'':24} {'per row':>10} {'once':>10} {'once/per row':>13}")
    print(f"{'tokens/s':24} {off['tokens_per_s']:>10.0f} {on['tokens_per_s']:>10.0f} "
          f"{on['tokens_per_s'] / off['tokens_per_s']:>12.2f}x")
    print(f"{'warm-up s (compilation)':24} {off['warmup_s']:>10.1f} {on['warmup_s']:>10.1f} {on['warmup_s'] / off['warmup_s']:>13.2f}")
    print(f"{'peak resident MiB':24} {off['peak_mib']:>10.0f} {on['peak_mib']:>10.0f} {on['peak_mib'] / off['peak_mib']:>13.2f}")
    print(f"{'s/step':24} {off['s_per_step']:>10.3f} {on['s_per_step']:>10.3f} {on['s_per_step'] / off['s_per_step']:>13.2f}")
    print(f"prefix tokens not recomputed: {100 * on['shared_share']:.1f} % of tokens; largest step-loss difference "
          f"{diff:.2e} (final loss {off['losses'][-1]:.4f} against {on['losses'][-1]:.4f})")
    if args.json:
        args.json.write_text(json.dumps({"off": off, "on": on, "max_loss_diff": diff}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
