"""Greedy success per question template (wording) of one or more policies, and what their failed episodes did: the
measurement behind the README's per-wording tables (session 17 onward).

    python scripts/probes/per_template.py models/adapted models/policy [--split test] [--tasks 400] [--level 4]

The tasks are the first `--tasks` of the split, with the seeds the train stage uses (validation 10,000 + i, test
20,000 + i), so a policy's per-level figures equal those in metrics/train.json. Each row is a task family's template
(`family/k`; `k` 4 is the held-out wording, only in test) with its first words, then `solved/n` per policy. Below it,
per policy and template, the most common tool sequences of the failed episodes. `--alpha A --start S` scores the
weight-space ensemble θ_S + A·(θ_policy − θ_S) of each policy instead (the train stage keeps A = `train.merge_alpha`).
Run from the repository root (it reads params.yaml and data/).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policies", nargs="+", help="policy folders (with policy.json)")
    ap.add_argument("--split", default="test", choices=("validation", "test", "train"))
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--level", type=int, default=None, help="only this level's tasks")
    ap.add_argument("--alpha", type=float, default=None, help="score θ_start + α·(θ_policy − θ_start)")
    ap.add_argument("--start", default="models/adapted")
    ap.add_argument("--failures", type=int, default=3, help="tool sequences shown per failing template")
    args = ap.parse_args()
    for folder in args.policies + ([args.start] if args.alpha is not None else []):
        if not (Path(folder) / "policy.json").is_file():
            raise SystemExit(f"{folder}: not a policy folder (no policy.json)")
    if args.alpha is not None and not 0 <= args.alpha <= 1:
        raise SystemExit(f"--alpha {args.alpha}: outside [0, 1]")

    from pipeline.config import load_section
    from pipeline.env.config import EnvConfig
    from pipeline.env.core import WorldRuntime, load_tasks
    from pipeline.env.world import load_world
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.rl.core_algos import interpolate_weights

    tasks = load_tasks(Path(f"data/tasks/{args.split}.jsonl"))[:args.tasks]
    seed = {"validation": 10_000, "test": 20_000, "train": 30_000}[args.split]
    seeds = [seed + i for i in range(len(tasks))]  # before the level filter: a task keeps the train stage's seed
    if args.level is not None:
        keep = [i for i, t in enumerate(tasks) if t.level == args.level]
        tasks, seeds = [tasks[i] for i in keep], [seeds[i] for i in keep]
        if not tasks:
            raise SystemExit(f"no level-{args.level} tasks in the first {args.tasks} of {args.split}")
    runtime = WorldRuntime(load_world(Path("data/env")))
    env, rollout = load_section(EnvConfig, "env", "params.yaml"), load_section(RolloutConfig, "rollout", "params.yaml")
    start = load_policy(args.start)[0].state_dict() if args.alpha is not None else None

    first_words = {t.template_id: " ".join(t.question.split()[:4]) for t in tasks}
    solved: dict[str, dict[str, int]] = defaultdict(dict)
    failed: dict[str, dict[str, Counter]] = {}
    for folder in args.policies:
        model, tok, _ = load_policy(folder)
        if start is not None:
            model.load_state_dict(interpolate_weights({k: v.clone() for k, v in start.items()}, model.state_dict(),
                                                      args.alpha))
        records = RolloutEngine(model, tok, runtime, env, rollout).run(tasks, seeds, greedy=True)
        failed[folder] = defaultdict(Counter)
        for t, r in zip(tasks, records):
            solved[t.template_id][folder] = solved[t.template_id].get(folder, 0) + bool(r["success"])
            if not r["success"]:
                failed[folder][t.template_id][" > ".join(str(c.get("tool") or "invalid") for c in r["calls"])
                                              or "(no call)"] += 1
    n = Counter(t.template_id for t in tasks)
    print(f"{args.split}, first {args.tasks} tasks" + (f", level {args.level}" if args.level else "")
          + (f", ensembles with {args.start} at alpha {args.alpha}" if start is not None else ""))
    print("template | first words | n | " + " | ".join(args.policies))
    for tid in sorted(n, key=lambda k: (k.split("/")[0], int(k.split("/")[1]))):
        print(f"{tid} | {first_words[tid]} | {n[tid]} | "
              + " | ".join(str(solved[tid].get(p, 0)) for p in args.policies))
    print("total | | " + f"{len(tasks)} | " + " | ".join(str(sum(solved[t].get(p, 0) for t in n)) for p in args.policies))
    for p in args.policies:
        for tid, seqs in sorted(failed[p].items()):
            print(f"  {p} {tid} failed: " + "; ".join(f"{s} ×{c}" for s, c in seqs.most_common(args.failures)))


if __name__ == "__main__":
    main()
