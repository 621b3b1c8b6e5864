"""Benchmark: environment steps per second with real tools, the shop world and the SQL analyst side by side.

Prints, in one run: reset cost, steps/s of the expert and of the random policy (policy time excluded: only
`env.reset`/`env.step` are timed, through the pipeline's runner, so parsing and schema checks are included), the cost
per tool, and the shop's cost with value redraws; each row also as a ratio to the shop expert's rate. Then the share
of time the environment would take in a rollout that generates `--tokens-per-s` tokens/s.

    python bench/env_steps.py [--episodes 2000] [--tokens-per-s 5000]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

import tempfile
from pathlib import Path

from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import BuildRequest
from pipeline.envs.registry import environment_class
from pipeline.envs.runner import AgentEnv


def build(name: str, n: int, tmp: Path):
    """Environment `name` built with its default options into `tmp`, loaded, and `n` training tasks."""
    cls = environment_class(name)
    res = cls.build(tmp, BuildRequest(0, {"train": n, "validation": 8, "test": 8}, {1: 1, 2: 1, 3: 1, 4: 1},
                                      cls.Options()))
    return cls.load(tmp), res.tasks["train"]


def measure(env: AgentEnv, policy, tasks, per_tool=None) -> tuple[int, float, float]:
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

    rows, tool_costs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("shop", "sql"):
            (Path(tmp) / name).mkdir()
            world, tasks = build(name, args.episodes, Path(tmp) / name)
            runs = [(f"{name}: expert", EnvConfig(), world.expert())]
            if name == "shop":
                runs.append((f"{name}: expert, values redrawn", EnvConfig(randomize_values=True), world.expert()))
            runs.append((f"{name}: random policy", EnvConfig(), world.random_policy(np.random.default_rng(0))))
            for label, cfg, policy in runs:
                per_tool: dict[str, list[float]] = defaultdict(list)
                env = AgentEnv(world=world, tasks=tasks, config=cfg)
                steps, t_step, t_reset = measure(env, policy, tasks, per_tool)
                rows.append((label, steps, t_step, t_reset))
                if label.endswith(": expert"):
                    tool_costs[name] = per_tool
                env.close()
            world.close()

    print(f"environment benchmark: {args.episodes} episodes per run, default worlds")
    print(f"{'run':38s} {'steps':>7s} {'steps/s':>9s} {'us/step':>8s} {'us/reset':>9s} {'episodes/s':>11s}")
    base = rows[0][1] / (rows[0][2] + rows[0][3])
    for label, steps, t_step, t_reset in rows:
        eps = args.episodes / (t_step + t_reset)
        print(f"{label:38s} {steps:7d} {steps / t_step:9.0f} {1e6 * t_step / steps:8.1f} "
              f"{1e6 * t_reset / args.episodes:9.1f} {eps:11.0f}  ({steps / (t_step + t_reset) / base:.2f}x shop expert)")
    for name, per_tool in tool_costs.items():
        print(f"per tool ({name} expert): " + ", ".join(
            f"{k} {1e6 * np.mean(v):.0f} us" for k, v in sorted(per_tool.items())))
    gen_per_action = args.tokens_per_action / args.tokens_per_s
    for label, steps, t_step, t_reset in rows:
        if label.endswith(": expert"):
            env_per_action = (t_step + t_reset) / steps
            print(f"{label}: env share of a rollout at {args.tokens_per_s:.0f} tokens/s and "
                  f"{args.tokens_per_action:.0f} tokens/action: "
                  f"{100 * env_per_action / (env_per_action + gen_per_action):.2f}% (goal: under 5%)")


if __name__ == "__main__":
    main()
