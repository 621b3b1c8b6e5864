"""Benchmark: the drift check's time on 100k trajectories (goal: under 10 s on this machine).

Synthesises two sets of `--n` episode records by resampling real ones: expert and random episodes played in the
environment on a few hundred generated tasks, each given rollout-sized token fields (`token_ids`, `action_mask`,
`logprobs` of ~40 tokens per step plus a ~90-token prompt), so feature extraction pays for the mask scan a rollout
record costs. The reference mixes 80 % expert / 20 % random episodes, the current 70 % / 30 % (a behaviour drift).

Prints, separately:

- the per-feature part: trajectory feature extraction (both sides), the chi-square/KS tests, and their sum; and the
  same for 100k task records (resampled generated tasks, entity values from the world);
- the multivariate part: embedding ``--hidden-samples`` observations per side with a policy-sized model (the built-in
  Llama of pipeline.policy, random weights: the cost does not depend on training) and the MMD permutation test;
- the total against the 10 s goal.

    python bench/drift.py [--n 100000] [--hidden-samples 200] [--permutations 500] [--dtype auto|fp32|bf16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pipeline.check_drift import checks as C
from pipeline.check_drift.config import DriftConfig
from pipeline.check_drift.features import (TASK_FEATURES, TRAJECTORY_FEATURES, hidden_state_features, observation_contexts,
                                     task_features, trajectory_features)
from pipeline.envs.config import EnvConfig
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.tasks import Task
from pipeline.envs.shop.world import generate_world
from pipeline.policy.episodes import evaluate

GOAL_S = 10.0


def base_episodes(world, n_tasks: int, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(tasks, expert episodes, random episodes) with synthetic rollout-sized token fields."""
    tasks = C.make_reference_sample(world, n_tasks, seed).tasks
    runtime = ShopWorld(world.world)
    try:
        objs = [Task.from_dict(t) for t in tasks]
        _, expert = evaluate("expert", objs, runtime, EnvConfig(), seed)
        _, rand = evaluate("random", objs, runtime, EnvConfig(), seed)
    finally:
        runtime.close()
    rng = np.random.default_rng(seed)
    for r in expert + rand:
        prompt = int(rng.integers(80, 100))
        mask = [0] * prompt
        for _ in r["steps"]:
            a, o = int(rng.integers(15, 30)), int(rng.integers(5, 15))
            mask += [1] * a + [0] * o
        r["token_ids"] = [int(x) for x in rng.integers(7, 1024, size=len(mask))]
        r["action_mask"] = mask
        r["logprobs"] = [-0.1 * m for m in mask]
    return tasks, expert, rand


def resample(expert: list[dict], rand: list[dict], n: int, expert_share: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    pick_expert = rng.random(n) < expert_share
    ie, ir = rng.integers(len(expert), size=n), rng.integers(len(rand), size=n)
    return [expert[a] if e else rand[b] for e, a, b in zip(pick_expert, ie, ir)]


def matmul_gflops() -> float:
    """fp32 matmul throughput right now (the machines are shared: quote times next to it)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="episodes (and tasks) per side")
    ap.add_argument("--base-tasks", type=int, default=400, help="tasks actually played, then resampled")
    ap.add_argument("--hidden-samples", type=int, default=DriftConfig().max_hidden_samples)
    ap.add_argument("--permutations", type=int, default=DriftConfig().mmd_permutations)
    ap.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default=DriftConfig().hidden_dtype,
                    help="compute dtype of the forward passes (check_drift.hidden_dtype)")
    args = ap.parse_args()
    cfg = DriftConfig(max_hidden_samples=args.hidden_samples, mmd_permutations=args.permutations,
                      hidden_dtype=args.dtype)

    print(f"machine now: {matmul_gflops():.0f} GFLOP/s fp32 matmul (a quiet 2-core machine: about 210)")
    t0 = time.perf_counter()
    world = ShopWorld(generate_world(0, 400, 80, 0.3))
    tasks, expert, rand = base_episodes(world, args.base_tasks, seed=1)
    ref = resample(expert, rand, args.n, 0.8, seed=2)
    cur = resample(expert, rand, args.n, 0.7, seed=3)
    print(f"setup: {len(expert) + len(rand)} episodes played, resampled to {args.n:,} per side "
          f"({time.perf_counter() - t0:.1f}s, not counted)")

    # ----------------------------------------------------------------------------------------- per-feature part
    (f_ref, f_cur), t_feat = timed(lambda: (trajectory_features(ref), trajectory_features(cur)))
    report, t_test = timed(C.compare_features, f_ref, f_cur, TRAJECTORY_FEATURES, cfg, "trajectory_drift")
    per_feature = t_feat + t_test
    print(f"per-feature, {args.n:,} vs {args.n:,} trajectories: features {t_feat:.2f}s + tests {t_test:.2f}s = "
          f"{per_feature:.2f}s ({len(report.tested)} tests; drifted: {', '.join(report.drifted_features) or 'none'})")

    big = C.make_reference_sample(world, 2000, seed=4).tasks
    rng = np.random.default_rng(5)
    tref = [big[i] for i in rng.integers(len(big), size=args.n)]
    tcur = [big[i] for i in rng.integers(len(big), size=args.n)]
    (g_ref, g_cur), t_tfeat = timed(lambda: (task_features(tref, world), task_features(tcur, world)))
    treport, t_ttest = timed(C.compare_features, g_ref, g_cur, TASK_FEATURES, cfg, "task_drift")
    print(f"per-feature, {args.n:,} vs {args.n:,} tasks: features {t_tfeat:.2f}s + tests {t_ttest:.2f}s = "
          f"{t_tfeat + t_ttest:.2f}s (drifted: {', '.join(treport.drifted_features) or 'none'})")

    # ------------------------------------------------------------------------------------------- multivariate part
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy
    from pipeline.policy.tokenizer import train_tokenizer

    contexts_ref = observation_contexts(tasks, ref[: 4 * args.hidden_samples], EnvConfig().history_window,
                                        [t.signature() for t in world.tools()])
    contexts_cur = observation_contexts(tasks, cur[: 4 * args.hidden_samples], EnvConfig().history_window,
                                        [t.signature() for t in world.tools()])
    tok = train_tokenizer(contexts_ref[:2000], vocab_size=ModelConfig().vocab_size)
    model = build_policy(ModelConfig(), tok)
    hidden_state_features(model, tok, contexts_ref[:4], dtype=cfg.hidden_dtype)  # warm-up (first-call set-up)
    rng = np.random.default_rng(6)
    k = args.hidden_samples
    pick = lambda c: [c[i] for i in rng.choice(len(c), size=min(len(c), k), replace=False)]  # noqa: E731
    sub_ref, sub_cur = pick(contexts_ref), pick(contexts_cur)
    embed = lambda c: hidden_state_features(model, tok, c, cfg.hidden_batch_size, cfg.hidden_max_tokens,  # noqa: E731
                                            dtype=cfg.hidden_dtype)
    (h_ref, h_cur), t_embed = timed(lambda: (embed(sub_ref), embed(sub_cur)))
    mmd, t_mmd = timed(C.mmd_test, h_ref, h_cur, cfg.mmd_permutations, cfg.seed, cfg.alpha)
    n_tok = sum(len(tok.encode(c)) for c in sub_ref + sub_cur)
    multivariate = t_embed + t_mmd
    print(f"multivariate, {len(sub_ref)} + {len(sub_cur)} observations ({n_tok:,} tokens, built-in policy size, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {cfg.hidden_dtype}): "
          f"embed {t_embed:.2f}s + MMD "
          f"({cfg.mmd_permutations} permutations) {t_mmd:.2f}s = {multivariate:.2f}s (p = {mmd.p_value:.3f})")

    print(f"machine after: {matmul_gflops():.0f} GFLOP/s fp32 matmul")
    total = per_feature + multivariate
    verdict = "within" if total < GOAL_S else "OVER"
    print(f"drift check on {args.n:,} trajectories: {total:.2f}s ({verdict} the {GOAL_S:.0f} s goal; per-feature "
          f"{per_feature:.2f}s + multivariate {multivariate:.2f}s)")


if __name__ == "__main__":
    main()
