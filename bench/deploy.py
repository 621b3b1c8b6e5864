"""Benchmark: fp32, bf16 and int8 variants of the policy side by side on test tasks.

Prints, per variant: test success (greedy, the same tasks and seeds), latency of one action with episodes played one
at a time (batch 1), batched throughput (actions/s through the rollout engine), and state size; each as a ratio to
fp32. Goals: int8 at most 0.35 of fp32 size, with success within `deploy.parity_tolerance` of fp32.

The policy is ``--policy`` (default: models/policy, else models/adapted); when neither exists, the built-in model at its
default size with random weights, and the output says so (success is then 0 for every variant, and every action runs
to max_new_tokens: a worst case for speed, not a measure of quality). Quote ratios: the machine is shared and noisy.

    python bench/deploy.py [--policy DIR] [--tasks 48] [--latency-tasks 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def load_model(policy: str | None, signatures: list[str]):
    from pipeline.policy.model import build_policy, load_policy

    for cand in ([policy] if policy else ["models/policy", "models/adapted"]):
        if cand and (ROOT / cand).is_dir():
            model, tok, _ = load_policy(ROOT / cand)
            return model, tok, cand
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer

    tok = train_tokenizer(corpus_texts(ROOT / "data", signatures), ModelConfig().vocab_size)
    return build_policy(ModelConfig(), tok), tok, "built-in default size, RANDOM weights (no trained policy found)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default=None)
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--latency-tasks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from pipeline.core.config import load_section
    from pipeline.deploy.config import DeployConfig, QuantizationConfig
    from pipeline.deploy.quantize import make_variant, measure_variant, state_size_bytes
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.config import RolloutConfig

    params = ROOT / "params.yaml"
    env_cfg = load_section(EnvConfig, "env", params)
    cfg = load_section(DeployConfig, "deploy", params)
    roll = load_section(RolloutConfig, "rollout", params).model_copy(
        update={"dtype": "fp32", "num_threads": args.threads, "batch_size": 32})
    runtime = open_environment(env_cfg.name, ROOT / "data/env")
    model, tok, source = load_model(args.policy, [s.signature() for s in runtime.tools()])
    tasks = load_task_file(ROOT / "data/tasks/test.jsonl", runtime)[: args.tasks]
    variants = [("fp32", "fp32", None), ("bf16", "bf16", None),
                ("int8", "int8", cfg.quantization),
                ("int8/weight_only", "int8", cfg.quantization.model_copy(update={"linear": "weight_only"})),
                ("int8/fp32 embedding", "int8", QuantizationConfig(linear=cfg.quantization.linear, embeddings=False))]
    rows = {}
    for name, prec, q in variants:
        v = make_variant(model, prec, q)
        m = measure_variant(v, tok, runtime, tasks, env_cfg, roll, cfg.seed, 1, args.latency_tasks)
        rows[name] = {"success": sum(r["success"] for r in m["records"]) / len(tasks), "size": state_size_bytes(v),
                      **m["timing"]}
    runtime.close()
    ref = rows["fp32"]
    print(f"policy: {source}; {len(tasks)} test tasks (greedy, seed {cfg.seed}+i), latency over "
          f"{args.latency_tasks} episodes at batch 1, throughput at batch 32, {args.threads} thread(s)")
    print(f"{'variant':<20} {'success':>8} {'size MB':>8} {'size/fp32':>9} {'ms/action':>10} {'lat/fp32':>8} "
          f"{'actions/s':>10} {'thr/fp32':>8}")
    for name, r in rows.items():
        print(f"{name:<20} {r['success']:>8.3f} {r['size'] / 1e6:>8.2f} {r['size'] / ref['size']:>9.3f} "
              f"{r['latency_per_action_ms']:>10.1f} {r['latency_per_action_ms'] / ref['latency_per_action_ms']:>8.2f} "
              f"{r['actions_per_s']:>10.0f} {r['actions_per_s'] / ref['actions_per_s']:>8.2f}")
    i8 = rows["int8"]
    drop = ref["success"] - i8["success"]
    print(f"goal int8 size <= 0.35 x fp32: {i8['size'] / ref['size']:.3f} -> "
          f"{'MET' if i8['size'] <= 0.35 * ref['size'] else 'NOT MET'}; success drop {drop:+.3f} "
          f"(tolerance {cfg.parity_tolerance}) -> {'within' if drop <= cfg.parity_tolerance else 'OUTSIDE'}")


if __name__ == "__main__":
    main()
