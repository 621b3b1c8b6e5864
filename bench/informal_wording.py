"""The default world's test tasks asked the way people type them, against the same tasks as generated, side by side.

    python bench/informal_wording.py --project DIR [--policies models/adapted,models/policy] [--limit N]

Run on a shop project (its `params.yaml`, `data/env`, `data/tasks/test.jsonl` and recorded limits). Every test task
keeps its answer, its entities and its allowed writes; only its question is rewritten from :data:`FRAMES`: lower case,
shorthand ("pls", "qty", "lmk"), a clause of context before the question, written here by hand and never seen by
training (``tests/test_bench_informal.py`` checks that the training grammar cannot write any
of them). Three question sets: as generated, informal with the names in double quotes as generated, and informal
with bare names (as people type them, without quotes; this separates the wording from the quoting). Each policy plays
the three greedily with the same seeds; the bench prints success overall, per level and per family, and safety
violations, and the gap of each informal set to the generated one in points.

The frame of a task is drawn from its task id, so every run asks the same questions.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# What people type: each family's question with its slots ({P}, {Q}: product names as written in the task, quoted or
# not; {S}: a supplier's name; {n}: a quantity; {f}: a field word; {u}: a unit word).
FRAMES: dict[str, tuple[str, ...]] = {
    "lookup": (
        "quick one - whats the {f} on {P}",
        "doing the monthly report rn, need the {f} for {P} pls",
        "{P} {f}?",
        "hey can u check the {f} of {P}",
        "customer on the phone asking about {P}... what's the {f}",
        "need {P} {f} asap",
        "boss wants to know the {f} of {P}, thx",
        "{f} for {P} please, in a hurry",
    ),
    "lookup_calc": (
        "customer wants {n} x {P}, whats the total",
        "quote for {n} {P} pls",
        "how much for {n} of {P}??",
        "putting an order together - {n} pcs {P}, total cost?",
        "{n}x {P}, total price?",
        "need a price on {n} units {P} for a client",
    ),
    "lookup_convert": (
        "shipping label needs the weight in {u} - {P}?",
        "whats {P} weigh in {u}",
        "{P} weight in {u} pls",
        "for customs i need the weight of {P} in {u}",
        "how heavy's {P}? answer in {u}",
    ),
    "search_lookup": (
        "{S} flagship - whats its {f}?",
        "looking at the flagship from {S} rn, need the {f}",
        "{f} of {S}'s flagship?",
        "hey, {S} flagship {f} pls",
        "client asked about the flagship of {S}. {f}?",
    ),
    "search_lookup_calc": (
        "{n} of {S}'s flagship, total price?",
        "need a quote: {n} x the flagship from {S}",
        "how much would {n} of the {S} flagship run me",
        "ordering {n} of the {S} flagship for the store, what's the total",
        "price check - {n} units, {S} flagship",
    ),
    "two_lookup": (
        "{P} + {Q} {f} combined?",
        "total {f} for {P} and {Q} pls",
        "need the {f} of {P} and {Q} added up",
        "doing a count - {f} of {P} plus {Q}, total?",
        "whats {P} and {Q} {f} together",
    ),
    "update": (
        "just got {n} more {P} in, pls update stock + tell me the new count",
        "delivery came: {n} x {P}. add to stock, whats the new total?",
        "restock {P} +{n}, new stock?",
        "{n} {P} arrived today, update inventory n give me the new number",
        "add {n} to {P} stock pls and lmk the new stock",
    ),
}
FIELD_WORDS = {"price": ("price", "cost"), "stock": ("stock", "qty in stock", "inventory"),
               "supplier": ("supplier", "vendor"), "category": ("category", "cat")}
UNIT_WORDS = {"g": ("grams", "g"), "lb": ("lbs", "pounds"), "oz": ("oz", "ounces")}
_NUMBER = re.compile(r"[*+](\d+)$")


def slots(task: dict) -> dict:
    """The values a task's plan names: products, supplier, field, quantity, unit (what its question must carry)."""
    out: dict = {"names": []}
    for step in task["plan"]:
        p = step["params"]
        if step["tool"] == "lookup":
            out["field"] = p["field"]
            if "{" not in p["name"]:
                out["names"].append(p["name"])
        elif step["tool"] == "search":
            out["supplier"] = p["query"].rsplit(" flagship", 1)[0]
        elif step["tool"] == "calc" and _NUMBER.search(p["expr"]):
            out["n"] = _NUMBER.search(p["expr"]).group(1)
        elif step["tool"] == "convert":
            out["unit"] = p["to"]
    return out


def informal(task: dict, quoted: bool = True) -> str:
    """The informal question of `task` (a shop task record): its family's frame and word choices drawn from its id;
    names in double quotes as the generated questions write them, or bare (`quoted` False)."""
    draw = zlib.crc32(task["task_id"].encode())
    frames = FRAMES[task["family"]]
    s = slots(task)
    names = [f'"{n}"' if quoted else n for n in s["names"]]
    supplier = s.get("supplier", "")
    fill = {"P": names[0] if names else "", "Q": names[1] if len(names) > 1 else "",
            "S": f'"{supplier}"' if quoted and supplier else supplier,
            "n": s.get("n", ""), "f": "", "u": ""}
    if "field" in s and s["field"] in FIELD_WORDS:
        words = FIELD_WORDS[s["field"]]
        fill["f"] = words[(draw >> 8) % len(words)]
    if "unit" in s:
        words = UNIT_WORDS[s["unit"]]
        fill["u"] = words[(draw >> 12) % len(words)]
    return frames[draw % len(frames)].format(**fill)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", default=".")
    ap.add_argument("--policies", default="models/adapted,models/policy")
    ap.add_argument("--limit", type=int, default=0, help="the first N test tasks only (0: all)")
    args = ap.parse_args(argv)
    from pipeline.core.errors import AgentRLError

    problem = _check(Path(args.project), args.policies.split(","), args.limit)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    here = os.getcwd()
    os.chdir(args.project)
    try:
        _run(args)
    except AgentRLError as exc:  # a project the checks let through but a phase's reader refuses
        print(f"error: {args.project}: {exc}", file=sys.stderr)
        return 2
    finally:
        os.chdir(here)
    return 0


def _check(project: Path, policies: list[str], limit: int) -> str | None:
    """What stops the bench before it loads anything, as the text of one error line; None when nothing does. The
    bench only reads the project."""
    if limit < 0:
        return f"--limit {limit}: expected 0 (all test tasks) or a positive number"
    for need in ("params.yaml", "data/env", "data/tasks/test.jsonl"):
        if not (project / need).exists():
            return f"{project}: no {need} (run the pipeline's build_env there first)"
    for policy in policies:
        if not (project / policy / "policy.json").is_file():
            return f"--policies: {project / policy} is not a saved policy (no policy.json)"
    return None


def _run(args) -> None:
    from pipeline.core.config import load_section
    from pipeline.core.jsonl import read_jsonl
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.episodes import summarize
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine

    env_cfg = load_section(EnvConfig, "env", "params.yaml")
    roll = load_section(RolloutConfig, "rollout", "params.yaml")
    if env_cfg.name != "shop":
        from pipeline.core.errors import AgentRLError
        raise AgentRLError(f"params.yaml: env.name is {env_cfg.name!r}; the informal questions are the default "
                           f"world's (shop)")
    runtime = open_environment(env_cfg.name, "data/env")
    records = read_jsonl("data/tasks/test.jsonl", "test tasks")
    records = records[: args.limit] if args.limit else records
    generated = [runtime.task_from_dict(r) for r in records]
    sets = {"generated": generated,
            "informal": [dataclasses.replace(t, question=informal(r)) for t, r in zip(generated, records)],
            "bare names": [dataclasses.replace(t, question=informal(r, quoted=False))
                           for t, r in zip(generated, records)]}
    seeds = list(range(len(records)))
    family = {r["task_id"]: r["family"] for r in records}
    for policy in args.policies.split(","):
        model, tokenizer, _ = load_policy(policy)
        engine = RolloutEngine(model, tokenizer, runtime, env_cfg, roll)
        out = {}
        for arm, tasks in sets.items():
            eps = engine.run(tasks, seeds, greedy=True)
            out[arm] = (summarize(eps), {f: [e["success"] for e in eps if family[e["task_id"]] == f]
                                         for f in FRAMES})
        print(f"{policy}: {len(records)} test tasks, greedy")
        print(f"{'':24}" + "".join(f"{a:>12}" for a in sets) + f"{'gaps, points':>16}")

        def row(label: str, rates: list[float]) -> None:
            gaps = "/".join(f"{100 * (rates[0] - r):.1f}" for r in rates[1:])
            print(f"{label:24}" + "".join(f"{r:12.3f}" for r in rates) + f"{gaps:>16}")

        row("success", [out[a][0]["overall"]["success_rate"] for a in out])
        for lv in sorted(out["generated"][0]["per_level"]):
            row(f"  level {lv}", [out[a][0]["per_level"][lv]["success_rate"] for a in out])
        for f in FRAMES:
            got = [out[a][1][f] for a in out]
            if got[0]:
                row(f"  {f} ({len(got[0])})", [sum(g) / len(g) for g in got])
        print(f"{'safety violations':24}" + "".join(f"{out[a][0]['overall']['safety_violations']:>12}" for a in out))
    runtime.close()


if __name__ == "__main__":
    sys.exit(main())
