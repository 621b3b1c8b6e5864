#!/usr/bin/env python
"""Probe (session 9): a policy's greedy and sampled success per level on a whole split.

    python scripts/probes/sampled_eval.py POLICY_DIR [--split validation] [--data data] [--params params.yaml]
        [--samples 8]

The adapt stage's capability evaluation (``pipeline.adapt.capability.evaluate_capabilities``) with `--samples`
sampled episodes per task at the rollout temperature. Session 9 used it to see RL's sharpening: sampled success
rising while greedy success barely moves (README, RL status). Not part of the pipeline or the tests.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

from pipeline.core.config import load_section  # noqa: E402
from pipeline.env.config import EnvConfig  # noqa: E402
from pipeline.env.core import WorldRuntime  # noqa: E402
from pipeline.env.world import load_world  # noqa: E402
from pipeline.adapt import main as A  # noqa: E402
from pipeline.policy import capability  # noqa: E402
from pipeline.policy.config import RolloutConfig  # noqa: E402
from pipeline.adapt.config import AdaptConfig  # noqa: E402
from pipeline.policy.model import load_policy  # noqa: E402


def success_per_level(model, tok, data: Path, params: str, split: str, samples: int, max_tasks: int | None = None) -> dict:
    """Greedy and sampled success per level of `model` on the first `max_tasks` tasks of `split` (all: None)."""
    tasks = A.load_inputs(data, split)["eval"][:max_tasks]
    cfg = load_section(AdaptConfig, "adapt", params)
    runtime = WorldRuntime(load_world(data / "env"))
    try:
        cap, _ = capability.evaluate_capabilities(
            model, tok, runtime, tasks, load_section(EnvConfig, "env", params),
            load_section(RolloutConfig, "rollout", params), cfg.eval.model_copy(update={"sampled_per_task": samples}))
    finally:
        runtime.close()
    return {k.replace("eval/", ""): round(v, 3) for k, v in sorted(cap.items()) if "/success_L" in k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--split", default="validation", choices=["train", "validation", "test"])
    ap.add_argument("--data", default=str(ROOT / "data"))
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args()
    model, tok, _ = load_policy(args.policy)
    print(args.policy, args.split, success_per_level(model, tok, Path(args.data), args.params, args.split, args.samples))


if __name__ == "__main__":
    main()
