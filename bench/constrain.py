"""Decoding constrained by the tools' schemas against free decoding, on one trained policy, side by side.

    python bench/constrain.py --policy models/policy --tasks data/tasks/test.jsonl
    cd projects/calendar && python ../../bench/constrain.py --policy models/adapted --tasks data/tasks/validation.jsonl

Run from a project folder (its `params.yaml`, `data/env` and recorded limits). The same policy, tasks and seeds are
decoded greedily with `rollout.constrain` none and schema, alternated `--repeats` times (the episodes are the same
each time; the repeats time them); it prints per arm: test success overall and per level, safety violations, calls
per episode, rejected actions (unparsable, schema errors, cut at the token limit), and the wall time of the arm's
rollouts (min / median / max over the repeats), with the ratio schema / none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core.config import load_section  # noqa: E402
from pipeline.envs.config import EnvConfig  # noqa: E402
from pipeline.envs.registry import open_environment  # noqa: E402
from pipeline.envs.taskfile import load_task_file  # noqa: E402
from pipeline.policy.config import RolloutConfig  # noqa: E402
from pipeline.policy.episodes import summarize  # noqa: E402
from pipeline.policy.model import load_policy  # noqa: E402
from pipeline.policy.rollout import RolloutEngine  # noqa: E402

ARMS = ("none", "schema")


def rejected(records: list[dict]) -> dict[str, int]:
    acts = [a for r in records for a in r["actions"]]
    calls = [c for r in records for c in r["calls"]]
    return {"unparsable": sum(a["tool"] is None and not a["token_limit"] for a in acts),
            "token_limit": sum(bool(a["token_limit"]) for a in acts),
            "schema_errors": sum(c.get("outcome") == "invalid_params" for c in calls),
            "actions": len(acts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--limit", type=int, default=0, help="the first N tasks only (0: all)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    env_cfg = load_section(EnvConfig, "env", args.params)
    roll = load_section(RolloutConfig, "rollout", args.params)
    runtime = open_environment(env_cfg.name, "data/env")
    tasks = load_task_file(args.tasks, runtime)
    tasks = tasks[: args.limit] if args.limit else tasks
    seeds = list(range(len(tasks)))
    model, tokenizer, _ = load_policy(args.policy)
    out: dict[str, dict] = {arm: {"times": []} for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            engine = RolloutEngine(model, tokenizer, runtime, env_cfg, roll.model_copy(update={"constrain": arm}))
            t0 = time.perf_counter()
            records = engine.run(tasks, seeds, greedy=True)
            out[arm]["times"].append(time.perf_counter() - t0)
            out[arm].update(summary=summarize(records), rejected=rejected(records),
                            tokens=sum(sum(r["action_mask"]) for r in records))
    runtime.close()
    print(f"{args.policy} on {args.tasks}: {len(tasks)} tasks, greedy, {args.repeats} repeat(s)")
    print(f"{'':28}{'none':>14}{'schema':>14}")
    rows = [("success", lambda a: f"{out[a]['summary']['overall']['success_rate']:.3f}")]
    for lv in sorted(out["none"]["summary"]["per_level"]):
        rows.append((f"  level {lv}", lambda a, lv=lv: f"{out[a]['summary']['per_level'][lv]['success_rate']:.3f}"))
    rows += [("safety violations", lambda a: str(out[a]["summary"]["overall"]["safety_violations"])),
             ("calls per episode", lambda a: f"{out[a]['summary']['overall']['mean_tool_calls']:.2f}")]
    for key in ("actions", "unparsable", "schema_errors", "token_limit"):
        rows.append((key, lambda a, key=key: str(out[a]["rejected"][key])))
    rows.append(("sampled tokens", lambda a: str(out[a]["tokens"])))
    rows.append(("tokens/s (median)", lambda a: f"{out[a]['tokens'] / statistics.median(out[a]['times']):.0f}"))
    rows.append(("rollout s (min/med/max)", lambda a: "/".join(
        f"{f(out[a]['times']):.0f}" for f in (min, statistics.median, max))))
    for label, cell in rows:
        print(f"{label:28}{cell('none'):>14}{cell('schema'):>14}")
    speed = {a: out[a]["tokens"] / statistics.median(out[a]["times"]) for a in ARMS}
    print(f"sampled tokens per second, schema / none: {speed['schema'] / speed['none']:.2f}x (median; the arms' "
          f"episodes differ, so their times are compared per token)")


if __name__ == "__main__":
    main()
