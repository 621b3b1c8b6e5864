#!/usr/bin/env python
"""Probe (session 9): SFT from one pre-trained checkpoint, eager or compiled, on the adapt stage's own batches.

    python scripts/probes/compiled_sft.py PRETRAINED_DIR {eager,compiled} [--steps 1000] [--data data] [--eval 200]

PRETRAINED_DIR is a policy folder saved after the adapt stage's pre-training (``save_policy``). The batches come from
the same sampler and seed as ``agentrl adapt`` (``DemoSampler``, ``item_batches``, seed [adapt.seed, 2]), so two runs
differ only in the forward: eager PyTorch or ``torch.compile``. It prints the losses (50-step means every 100 steps)
and the validation success per level (greedy and sampled) of the result on the first ``--eval`` validation tasks.
Session 9's figures are in the README's adapt section. Not part of the pipeline or the tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipeline.core.config import load_section  # noqa: E402
from pipeline.env.config import EnvConfig  # noqa: E402
from pipeline.adapt import main as A  # noqa: E402
from pipeline.policy import sft  # noqa: E402
from pipeline.adapt.config import AdaptConfig  # noqa: E402
from pipeline.policy.model import autocast_context, load_policy  # noqa: E402
from sampled_eval import success_per_level  # noqa: E402  (this folder's sibling probe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pretrained")
    ap.add_argument("mode", choices=["eager", "compiled"])
    ap.add_argument("--steps", type=int, default=None, help="SFT steps (default: adapt.sft.steps)")
    ap.add_argument("--data", default=str(ROOT / "data"))
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--eval", type=int, default=200, help="validation tasks evaluated afterwards (0: none)")
    args = ap.parse_args()
    cfg: AdaptConfig = load_section(AdaptConfig, "adapt", args.params)
    env_cfg: EnvConfig = load_section(EnvConfig, "env", args.params)
    steps = args.steps or cfg.sft.steps
    data = Path(args.data)
    inputs = A.load_inputs(data, "validation")
    model, tok, _ = load_policy(args.pretrained)
    pool = sft.NamePool.from_entities(json.loads((data / "env" / "entities.json").read_text()))
    sampler = sft.DemoSampler(tok, inputs["demos"], {t.task_id: t.to_dict() for t in inputs["train"]},
                              env_cfg.history_window, cfg.sft.max_len, cfg.sft.entity_augmentation, pool)
    for p in model.parameters():  # full fine-tuning, as adapter kind 'auto' does on the built-in model
        p.requires_grad_(True)
    rng = np.random.default_rng([cfg.seed, 2])
    t = time.perf_counter()
    res = sft.train_lm(model, sft.item_batches(sampler.lengths, sampler, cfg.sft.batch_size, rng, tok.pad_token_id),
                       steps, cfg.sft.lr, warmup=cfg.sft.warmup_steps, weight_decay=cfg.sft.weight_decay,
                       grad_clip=cfg.sft.grad_clip, autocast=lambda: autocast_context("auto"),
                       compile=args.mode == "compiled")
    L = res.losses
    print(f"{args.mode}: {steps} steps in {time.perf_counter() - t:.1f} s; 50-step mean losses every 100 steps:",
          [round(float(np.mean(L[i:i + 50])), 4) for i in range(0, len(L), 100)], "last 50:",
          round(float(np.mean(L[-50:])), 4))
    if args.eval:
        print(success_per_level(model, tok, data, args.params, "validation", 2, args.eval))

if __name__ == "__main__":
    main()
