"""Greedy success per question template (wording) of one or more policies, and what their failed episodes did: the
measurement behind the README's per-wording tables (session 17 onward).

    python scripts/probes/per_template.py models/adapted models/policy [--split test] [--tasks 400] [--level 4]

The tasks are the first `--tasks` of the split, with the seeds the train stage uses (validation 10,000 + i, test
20,000 + i), so a policy's per-level figures equal those in metrics/train.json. Each row is a task family's template
(`family/k`; `k` 4 is the held-out wording, only in test) with its wording, then `solved/n` per policy. Below it,
per policy and template, the most common tool sequences of the failed episodes (`invalid`: an action text that was
not a valid call). Ensembles with the adapted policy: `weight_ensemble.py` (per level). Run from the repository root
(it reads params.yaml and data/).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from split import add_split_args, check_policy_folders, greedy_episodes, load_split  # noqa: E402 (sys.path[0] is scripts/probes/)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policies", nargs="+", help="policy folders (with policy.json)")
    add_split_args(ap)
    ap.add_argument("--level", type=int, default=None, help="only this level's tasks")
    ap.add_argument("--failures", type=int, default=3, help="tool sequences shown per failing template")
    args = ap.parse_args()
    if args.failures < 0:
        raise SystemExit(f"--failures {args.failures}: must be at least 0")

    from pipeline.env.tasks import TEMPLATES
    check_policy_folders(*args.policies)
    tasks, seeds, runtime, env, rollout = load_split(args.split, args.tasks)
    if args.level is not None:  # filtered after the seeds are drawn: a task keeps the train stage's seed
        keep = [i for i, t in enumerate(tasks) if t.level == args.level]
        tasks, seeds = [tasks[i] for i in keep], [seeds[i] for i in keep]
        if not tasks:
            raise SystemExit(f"no level-{args.level} tasks in the first {args.tasks} of {args.split}")

    solved: dict[str, Counter] = defaultdict(Counter)
    failed: dict[str, dict[str, Counter]] = {}
    for folder in args.policies:
        records = greedy_episodes(folder, tasks, seeds, runtime, env, rollout)
        failed[folder] = defaultdict(Counter)
        for t, r in zip(tasks, records):
            solved[t.template_id][folder] += bool(r["success"])
            if not r["success"]:
                failed[folder][t.template_id][" > ".join(c.get("tool") or "invalid" for c in r["calls"])
                                              or "(no call)"] += 1
    n = Counter(t.template_id for t in tasks)
    print(f"{args.split}, first {args.tasks} tasks" + (f", level {args.level}" if args.level is not None else ""))
    print("template | wording | n | " + " | ".join(args.policies))
    for tid in sorted(n, key=lambda k: (k.split("/")[0], int(k.split("/")[1]))):
        family, k = tid.split("/")
        print(f"{tid} | {TEMPLATES[family][int(k)]} | {n[tid]} | "
              + " | ".join(str(solved[tid][p]) for p in args.policies))
    print(f"total | | {len(tasks)} | " + " | ".join(str(sum(solved[t][p] for t in n)) for p in args.policies))
    for p in args.policies:
        for tid, seqs in sorted(failed[p].items()):
            print(f"  {p} {tid} failed: " + "; ".join(f"{s} ×{c}" for s, c in seqs.most_common(args.failures)))


if __name__ == "__main__":
    main()
