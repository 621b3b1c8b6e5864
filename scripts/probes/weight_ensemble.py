"""Greedy success per level of weight-space ensembles θ_start + α·(θ_rl − θ_start) of two policies (WiSE-FT), the
measurement behind `train.merge_alpha` (README, RL section, session 13).

    python scripts/probes/weight_ensemble.py --start models/adapted --rl models/policy [--split validation]
        [--tasks 400] 0 0.5 1
    python scripts/probes/weight_ensemble.py --rl-checkpoint checkpoints/train/<key>/update-120 0.5

`--rl` is a policy folder; `--rl-checkpoint` a DeepSpeed checkpoint folder of the train stage (`update-N`), whose
module weights are read as θ_rl. The tasks are the first `--tasks` of the split, with the seeds the train stage
uses (validation 10,000 + i, test 20,000 + i), so α 1 and α 0 reproduce its figures for the two policies. Run from
the repository root (it reads params.yaml and data/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def checkpoint_weights(folder: Path, like: dict) -> dict:
    """θ of the policy inside a train-stage DeepSpeed checkpoint (keys `policy.<name>` of its module states)."""
    import torch

    states = folder / "mp_rank_00_model_states.pt"
    if not states.is_file():
        raise SystemExit(f"{folder}: no {states.name} (not a DeepSpeed checkpoint folder such as "
                         f"checkpoints/train/<key>/update-N)")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    missing = [k for k in like if f"policy.{k}" not in module]
    if missing:
        raise SystemExit(f"{folder}: no policy weights for {missing[:3]} (a checkpoint of another model?)")
    return {k: module[f"policy.{k}"] for k in like}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("alphas", type=float, nargs="+")
    ap.add_argument("--start", default="models/adapted")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--rl", help="policy folder of θ_rl")
    src.add_argument("--rl-checkpoint", help="DeepSpeed checkpoint folder (update-N) of θ_rl")
    ap.add_argument("--split", default="validation", choices=("validation", "test", "train"))
    ap.add_argument("--tasks", type=int, default=400)
    args = ap.parse_args()
    bad = [a for a in args.alphas if not 0 <= a <= 1]
    if bad:
        raise SystemExit(f"alphas outside [0, 1]: {bad}")

    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.train.core_algos import interpolate_weights
    from pipeline.train.distributed import Dist
    from pipeline.train.trainer import _evaluate
    from split import SPLIT_SEED, check_policy_folders, load_split

    check_policy_folders(args.start, args.rl)
    tasks, _, runtime, env, rollout = load_split(args.split, args.tasks)
    seed = SPLIT_SEED[args.split]
    model, tok, _ = load_policy(args.start)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    rl = (load_policy(args.rl)[0].state_dict() if args.rl
          else checkpoint_weights(Path(args.rl_checkpoint), start))
    for a in args.alphas:
        try:
            model.load_state_dict(interpolate_weights(start, rl, a))
        except ValueError as exc:
            raise SystemExit(f"{args.start} and {args.rl or args.rl_checkpoint} are not one architecture: {exc}")
        s = _evaluate(RolloutEngine(model, tok, runtime, env, rollout), tasks, Dist(), seed=seed)
        print(f"alpha {a:.2f}: {args.split} {s['overall']['success_rate']:.3f} (" + " / ".join(
            f"L{lv} {v['success_rate']:.2f}" for lv, v in sorted(s["per_level"].items())) + ")", flush=True)


if __name__ == "__main__":
    main()
