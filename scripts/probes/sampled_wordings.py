"""Sampled success per question wording (template) of a policy on one level's tasks: whether RL can get a signal there.

    python scripts/probes/sampled_wordings.py models/adapted [--level 4] [--split train] [--tasks 80] [--samples 8]
        [--temperature 0.7]

Plays each of the first `--tasks` tasks of the level `--samples` times at `--temperature` (the RL rollouts' 0.7 by
default) and prints per wording the sampled success, the groups with at least one success, the groups with mixed
results (the only ones a group baseline learns from), and the most common tool sequences of the failures. Session
27: on run 15's adapted model, "How much are N of the flagship product of S?" scored 0 of 176 at 0.7 and at 1.0, the
measurement behind `train.guide_failed_groups` being on (README, RL section). Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from split import SPLIT_SEED, check_policy_folders, load_split  # noqa: E402 (sys.path[0] is scripts/probes/)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--level", type=int, default=4)
    ap.add_argument("--split", default="train", choices=tuple(SPLIT_SEED))
    ap.add_argument("--tasks", type=int, default=80, help="the first N tasks of the level")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    if args.samples < 1 or args.tasks < 1 or args.temperature <= 0:
        raise SystemExit("--samples and --tasks must be at least 1 and --temperature above 0")
    check_policy_folders(args.policy)
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine

    tasks, _, runtime, env, rollout = load_split(args.split, 10**9)  # every task; the probe seeds its own
    tasks = [t for t in tasks if t.level == args.level][:args.tasks]
    if not tasks:
        raise SystemExit(f"no level-{args.level} tasks in {args.split}")
    model, tok, _ = load_policy(args.policy)
    engine = RolloutEngine(model, tok, runtime, env, rollout.model_copy(update={"temperature": args.temperature}))
    played = [t for t in tasks for _ in range(args.samples)]
    records = engine.run(played, [777 + i for i in range(len(played))], greedy=False)  # session 27's seeds
    wins: dict[str, list[bool]] = defaultdict(list)
    fails: dict[str, Counter] = defaultdict(Counter)
    for t, r in zip(played, records):
        wins[t.template_id].append(bool(r["success"]))
        if not r["success"]:
            fails[t.template_id][" > ".join(c.get("tool") or "invalid" for c in r["calls"])] += 1
    k = args.samples
    print(f"{args.policy}: level {args.level}, first {len(tasks)} tasks of {args.split}, {k} samples each at "
          f"temperature {args.temperature}")
    for tpl in sorted(wins):
        v = wins[tpl]
        groups = [v[i:i + k] for i in range(0, len(v), k)]
        print(f"{tpl}: sampled {sum(v)}/{len(v)}; groups with a success {sum(any(g) for g in groups)}/{len(groups)}, "
              f"mixed {sum(0 < sum(g) < k for g in groups)}; failures: {fails[tpl].most_common(3)}")


if __name__ == "__main__":
    main()
