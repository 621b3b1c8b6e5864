"""Probe one RL step: does a single AdamW step on real rollouts raise the successful episodes' log-probabilities?

    python scripts/rl_step_probe.py [--policy models/adapted] [--lr 1e-4] [--eps 1e-8] [--tasks 8] [--group 8]
                                    [--modes token-mean,seq-mean,pos-only] [--dtype auto]

Plays `--tasks` training tasks `--group` times each with the policy (sampling, as RL does), computes RLOO advantages,
then, for each loss mode, takes one AdamW step on a copy of the policy and prints the change of every episode's
summed log-probability, averaged over episodes with positive, negative and zero advantage. Modes: `token-mean` (the
trainer's loss: −Σ A·log π over action tokens ÷ their count), `seq-mean` (each episode's mean first, then the mean
over episodes), `pos-only` (negative advantages set to 0).

What it showed on the default adapted policy (session 4): at lr 1e-4 the step lowered the successful episodes'
log-probability by 0.9 nats (token-mean) and even by 0.65 with positive advantages only; at 1e-5 by nothing. Adam's
first step moves every parameter by about ±lr, so the update is mostly noise at the sizes RL needs: hence the
learning-rate warm-up (`train.lr_warmup_steps`).

Session 7, on the adapted policy of session 5 (64 episodes, success 0.64): the step now does what it should. At lr
1e-4, token-mean: successful episodes +0.09 nats, failed −2.8 (pos-only: +0.20 / −0.75); at 1e-5: +0.015 / −0.30.
`--dtype fp32` gives the same figures within 0.01 nats, so bf16 autocast in the learner is not what decides it
(the session-4 measurement ran in bf16 only, on an older adapted policy).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="models/adapted")
    ap.add_argument("--data", default="data")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eps", type=float, default=1e-8, help="AdamW eps")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="token-mean,seq-mean,pos-only")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                    help="learner dtype of the step and of the measurement (the trainer uses auto: bf16 autocast here)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from pipeline.env.config import EnvConfig
    from pipeline.env.core import WorldRuntime, load_tasks
    from pipeline.env.world import load_world
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import autocast_context, load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.policy.tokenizer import PAD, marker_ids
    from pipeline.train import core_algos as A
    from pipeline.train.trainer import collate_records, token_logprobs

    modes = args.modes.split(",")
    unknown = set(modes) - {"token-mean", "seq-mean", "pos-only"}
    if unknown:
        ap.error(f"unknown mode(s) {sorted(unknown)}; choose from token-mean, seq-mean, pos-only")
    torch.manual_seed(args.seed)
    data = Path(args.data)
    model, tok, _ = load_policy(args.policy)
    runtime = WorldRuntime(load_world(data / "env"))
    tasks = load_tasks(data / "tasks" / "train.jsonl")
    rng = np.random.default_rng(args.seed)
    picked = [tasks[i] for i in rng.choice(len(tasks), args.tasks, replace=False)]
    episodes = [t for t in picked for _ in range(args.group)]
    records = RolloutEngine(model, tok, runtime, EnvConfig(), RolloutConfig()).run(
        episodes, list(range(len(episodes))), greedy=False)
    scores = torch.tensor([r["return"] for r in records], dtype=torch.float32)
    adv, zero_var = A.group_advantages(scores, torch.arange(len(records)) // args.group, "rloo")
    batch = collate_records(records, marker_ids(tok)[PAD])
    print(f"{len(records)} episodes, success {np.mean([r['success'] for r in records]):.3f}, zero-variance groups "
          f"{float(zero_var.float().mean()):.2f}; one AdamW step at lr {args.lr:g}, eps {args.eps:g}")

    def episode_logp(m) -> torch.Tensor:
        with torch.no_grad(), autocast_context(args.dtype, "cpu"):
            lp = token_logprobs(m(input_ids=batch.ids, attention_mask=batch.attn).logits, batch.ids, 1.0)
        out = torch.zeros(len(records))
        out.index_add_(0, batch.episode, (lp.float() * batch.mask).sum(1))
        return out

    before = episode_logp(model)
    pos, neg = adv > 1e-6, adv < -1e-6
    print(f"{'mode':<11} {'Σ A·Δlogp':>10} {'Δlogp A>0':>10} {'Δlogp A<0':>10} {'Δlogp A=0':>10}")
    for mode in modes:
        m2 = copy.deepcopy(model).train()
        opt = torch.optim.AdamW(m2.parameters(), lr=args.lr, eps=args.eps, weight_decay=0.0)
        with autocast_context(args.dtype, "cpu"):
            lp = token_logprobs(m2(input_ids=batch.ids, attention_mask=batch.attn).logits, batch.ids, 1.0)
        a = adv[batch.episode][:, None] * batch.mask
        if mode == "pos-only":
            a = a.clamp(min=0)
        if mode == "seq-mean":
            loss = -((a * lp * batch.mask).sum(1) / batch.mask.sum(1).clamp(min=1)).mean()
        else:
            loss = -(a * lp * batch.mask).sum() / batch.mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0)
        opt.step()
        d = episode_logp(m2.eval()) - before
        mean = lambda sel: float(d[sel].mean()) if sel.any() else float("nan")  # noqa: E731
        print(f"{mode:<11} {float((adv * d).sum()):>10.3f} {mean(pos):>10.3f} {mean(neg):>10.3f} "
              f"{mean(~pos & ~neg):>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
