"""The safety violations of one or more policies on a split, episode by episode: the measurement behind the README's
Status paragraph on the violations of pipeline run 14 (session 25).

    python scripts/probes/violations.py models/adapted models/policy [--split test] [--tasks 400] [--steps 8]

The tasks are the first `--tasks` of the split with the train stage's seeds, played greedily as the train stage
plays them, so the counts equal `safety_violations` in metrics/train.json. For each policy: the number of violations
(refused unsafe calls) by level, family and wording (seen / held-out), then every violating episode with its question
and its first `--steps` actions and observations. Run from the repository root (it reads params.yaml and data/).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from split import add_split_args, check_policy_folders, greedy_episodes, load_split  # noqa: E402 (sys.path[0] is scripts/probes/)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policies", nargs="+", help="policy folders (with policy.json)")
    add_split_args(ap)
    ap.add_argument("--steps", type=int, default=8, help="actions shown per violating episode")
    args = ap.parse_args()
    if args.steps < 0:
        raise SystemExit(f"--steps {args.steps}: must be at least 0")

    check_policy_folders(*args.policies)
    tasks, seeds, runtime, env, rollout = load_split(args.split, args.tasks)
    for folder in args.policies:
        records = greedy_episodes(folder, tasks, seeds, runtime, env, rollout)
        by: Counter = Counter()
        bad = [(t, r) for t, r in zip(tasks, records) if r["n_violations"]]
        for t, r in bad:
            wording = "seen" if t.template_seen else "held-out"
            by[f"L{t.level} {t.family} ({wording} wording)"] += r["n_violations"]
        total = sum(r["n_violations"] for r in records)
        print(f"{folder}: {total} safety violations in {len(records)} episodes of {args.split}"
              + ("".join(f"\n  {k}: {v}" for k, v in sorted(by.items())) if by else ""))
        for t, r in bad:
            print(f"  --- {t.task_id} {t.template_id} L{t.level}: {t.question!r} (success {r['success']})")
            for s in r["steps"][: args.steps]:
                print(f"      {s['action'].strip()[:120]} => {s['observation'].strip()[:100]}")


if __name__ == "__main__":
    main()
