"""Benchmark: environment steps per second with real tools (SQLite, BM25 search, calculator, converter, writes).

Prints, in one run: reset cost, steps/s of the expert and of the random policy (policy time excluded: only
`env.reset`/`env.step` are timed), the cost per tool, and the cost with value redraws; then the share of time the
environment would take in a rollout that generates `--tokens-per-s` tokens/s (default: the rollout engine's rate
measured by bench/rollout.py when it exists; pass it explicitly otherwise).

    python bench/env_steps.py [--episodes 2000] [--tokens-per-s 5000]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from pipeline.envs.config import EnvConfig
from pipeline.envs.shop.core import ToolTasksEnv, WorldRuntime
from pipeline.envs.shop.expert import ExpertPolicy, RandomPolicy
from pipeline.envs.shop.tasks import generate_tasks
from pipeline.envs.shop.world import generate_world


def measure(env: ToolTasksEnv, policy, tasks, per_tool=None) -> tuple[int, float, float]:
    steps, t_step, t_reset = 0, 0.0, 0.0
    for i, task in enumerate(tasks):
        t0 = time.perf_counter()
        obs, info = env.reset(seed=i, options={"task": task})
        t_reset += time.perf_counter() - t0
        policy.reset(task)
        done = False
        while not done:
            action = policy.act(obs, info)
            t0 = time.perf_counter()
            obs, _, term, trunc, info = env.step(action)
            dt = time.perf_counter() - t0
            t_step += dt
            steps += 1
            if per_tool is not None:
                per_tool[info["tool"] or "invalid"].append(dt)
            done = term or trunc
    return steps, t_step, t_reset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--tokens-per-s", type=float, default=5000.0,
                    help="rollout generation rate to compare with (STACK.md: ~5,000 tokens/s for a 5M model, batched)")
    ap.add_argument("--tokens-per-action", type=float, default=20.0)
    args = ap.parse_args()

    world = generate_world(0, 400, 80, 0.3)
    rt = WorldRuntime(world)
    tasks = generate_tasks(world, "train", args.episodes, {1: 1, 2: 1, 3: 1, 4: 1}, 0, lambda p, a: rt.solve(p, a))
    rows = []
    per_tool: dict[str, list[float]] = defaultdict(list)
    for label, cfg, policy in (
        ("expert", EnvConfig(), ExpertPolicy()),
        ("expert, values redrawn per episode", EnvConfig(randomize_values=True), ExpertPolicy()),
        ("random policy", EnvConfig(), RandomPolicy([p["name"] for p in world.products], np.random.default_rng(0))),
    ):
        env = ToolTasksEnv(world=rt, tasks=tasks, config=cfg)
        steps, t_step, t_reset = measure(env, policy, tasks, per_tool if label == "expert" else None)
        rows.append((label, steps, t_step, t_reset))
        env.close()

    print(f"environment benchmark: {args.episodes} episodes, {len(world.products)} products, "
          f"{len(world.corpus)} documents")
    print(f"{'run':38s} {'steps':>7s} {'steps/s':>9s} {'us/step':>8s} {'us/reset':>9s} {'episodes/s':>11s}")
    base = rows[0][1] / (rows[0][2] + rows[0][3])
    for label, steps, t_step, t_reset in rows:
        eps = args.episodes / (t_step + t_reset)
        print(f"{label:38s} {steps:7d} {steps / t_step:9.0f} {1e6 * t_step / steps:8.1f} "
              f"{1e6 * t_reset / args.episodes:9.1f} {eps:11.0f}  ({steps / (t_step + t_reset) / base:.2f}x expert)")
    print("per tool (expert run): " + ", ".join(
        f"{k} {1e6 * np.mean(v):.0f} us" for k, v in sorted(per_tool.items())))
    label, steps, t_step, t_reset = rows[0]
    env_per_action = (t_step + t_reset) / steps
    gen_per_action = args.tokens_per_action / args.tokens_per_s
    print(f"env share of a rollout at {args.tokens_per_s:.0f} tokens/s and {args.tokens_per_action:.0f} tokens/action: "
          f"{100 * env_per_action / (env_per_action + gen_per_action):.2f}% (goal: under 5%)")
    rt.close()


if __name__ == "__main__":
    main()
