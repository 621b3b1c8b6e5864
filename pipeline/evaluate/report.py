"""The `evaluate` phase's library: metrics with bootstrap confidence intervals, and the overfitting checks of
docs/design.md §5.2.1.

Input: episode records (the fields :func:`pipeline.policy.episodes.run_episode` and the rollout engine write) of the SFT
and the RL policy on the train (a subset), validation and test splits. Everything here is a pure function of records,
a config and a seed, so the phase (:mod:`pipeline.evaluate.main`) only loads, plays and writes.

What is reported, per policy and split, overall and per difficulty level: success, mean return and each reward
component, tool calls, safety violations (mean per episode, share of episodes with one, and the total), and the share
of truncated episodes, each with a percentile bootstrap confidence interval (numpy, seeded; one set of resampled
episode indices per group, so the intervals of one group's metrics come from the same resamples).

The three symptoms of overfitting docs/design.md §5.2.1 names, each a *flag* with its numbers and
threshold:

- **overfitting**: the train-minus-validation gap of ``overfit_metric`` (success or mean return) exceeds
  ``overfit_threshold``; the gap's interval resamples both splits independently;
- **unseen templates**: on the test split, success on the held-out question template of each family
  (``template_seen`` false) trails success on the seen templates by more than ``unseen_template_threshold``;
- **rigid behaviour** (docs/design.md §3.2.1): the same tasks are played with ``diversity_seeds``
  different seeds (sampling at the rollout temperature); behaviour diversity is the mean of 1 − cos_sim(ϕ(τ1), ϕ(τ2))
  over pairs of episodes of the same task, with ϕ the bag of a trajectory's tool calls, tool bigrams, call outcomes and parameter values
  (:func:`trajectory_features`); solution-space coverage is the mean number of distinct solutions (call sequences with
  their parameters) per task across the seeds. Behaviour is flagged rigid when diversity is below
  ``min_behavior_diversity`` *and* the distinct solutions per task are below ``min_distinct_solutions``.

Tool calls per solved task, like for like (:func:`tool_calls_on_common_solved`): on the test tasks both policies solve,
the paired difference of their calls, overall and per level, with the calls RL spends on the tasks only it solves.

Deliberately left out: significance tests between the two policies (the report carries per-task test successes keyed
by task id, so the promotion gate can run its own paired test), and any judgement of whether a flag should block a
release (the gate decides).
"""

from __future__ import annotations

import json
import math
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import combinations

import numpy as np

from pipeline.evaluate.config import POLICIES, SPLITS, EvaluateConfig
from pipeline.policy.episodes import COMPONENTS


# ------------------------------------------------------------------------------------------------ episode metrics
def _component(name: str) -> Callable[[dict], float]:
    return lambda r: float(r["components"][name])


# metric name -> its per-episode value; the report gives the mean of each with a bootstrap interval
EPISODE_METRICS: dict[str, Callable[[dict], float]] = {
    "success": lambda r: float(r["success"]),
    "return": lambda r: float(r["return"]),
    **{c: _component(c) for c in COMPONENTS},
    "tool_calls": lambda r: float(r["n_calls"]),
    "safety_violations": lambda r: float(r["n_violations"]),
    "violation_episode_rate": lambda r: float(r["n_violations"] > 0),
    "truncated": lambda r: float(r["truncated"]),
}


def episode_values(records: Sequence[dict]) -> dict[str, np.ndarray]:
    """One array per :data:`EPISODE_METRICS` entry, one value per record."""
    return {name: np.array([f(r) for r in records], dtype=np.float64) for name, f in EPISODE_METRICS.items()}


def bootstrap_means(values: dict[str, np.ndarray], n_boot: int, confidence: float,
                    rng: np.random.Generator) -> dict[str, dict]:
    """Mean and percentile bootstrap interval of each array (all the same length n), from one shared set of
    `n_boot` resamples of the n indices.

    >>> out = bootstrap_means({"x": np.array([0.0, 1.0, 1.0, 1.0])}, 2000, 0.9, np.random.default_rng(0))
    >>> out["x"]["mean"], 0.25 <= out["x"]["ci_low"] <= 0.75 <= out["x"]["ci_high"] <= 1.0
    (0.75, True)
    """
    lengths = {name: len(v) for name, v in values.items()}
    n = next(iter(lengths.values()))
    if len(set(lengths.values())) != 1:
        raise ValueError(f"bootstrap_means resamples episodes: every array needs one value per episode, got {lengths}")
    if n == 0:
        raise ValueError("no episodes to bootstrap")
    idx = rng.integers(0, n, size=(n_boot, n))
    tail = (1 - confidence) / 2 * 100
    out = {}
    for name, v in values.items():
        means = v[idx].mean(axis=1)
        lo, hi = np.percentile(means, [tail, 100 - tail])
        out[name] = {"mean": float(v.mean()), "ci_low": float(lo), "ci_high": float(hi)}
    return out


def bootstrap_gap(a: np.ndarray, b: np.ndarray, n_boot: int, confidence: float, rng: np.random.Generator) -> dict:
    """mean(a) − mean(b) with a percentile interval, resampling a and b independently (unpaired samples)."""
    if len(a) == 0 or len(b) == 0:
        raise ValueError("no episodes to compare")
    ma = a[rng.integers(0, len(a), size=(n_boot, len(a)))].mean(axis=1)
    mb = b[rng.integers(0, len(b), size=(n_boot, len(b)))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(ma - mb, [tail, 100 - tail])
    return {"gap": float(a.mean() - b.mean()), "ci_low": float(lo), "ci_high": float(hi)}


def _group(records: Sequence[dict], cfg: EvaluateConfig, rng: np.random.Generator) -> dict:
    stats = bootstrap_means(episode_values(records), cfg.bootstrap_samples, cfg.confidence, rng)
    return {"n": len(records), **stats, "safety_violations_total": int(sum(r["n_violations"] for r in records))}


def split_report(records: Sequence[dict], cfg: EvaluateConfig, rng: np.random.Generator) -> dict:
    """Metrics with intervals overall and per level (and per seen/unseen template when both occur, per held-out slice
    when records carry `slices`, and per environment, overall and per level, in a mixed run)."""
    if not records:
        raise ValueError("no episodes to report")
    out = {"overall": _group(records, cfg, rng), "per_level": {}}
    for lv in sorted({r["level"] for r in records}):
        out["per_level"][str(lv)] = _group([r for r in records if r["level"] == lv], cfg, rng)
    if len({r["template_seen"] for r in records}) == 2:
        out["template_seen"] = _group([r for r in records if r["template_seen"]], cfg, rng)
        out["template_unseen"] = _group([r for r in records if not r["template_seen"]], cfg, rng)
    slices = sorted({name for r in records for name in r.get("slices", ())})
    if slices:  # what the environment holds out of training (Environment.heldout_slices), one group per slice
        out["per_slice"] = {name: _group([r for r in records if name in r.get("slices", ())], cfg, rng)
                            for name in slices}
    envs = sorted({r.get("env", "") for r in records})
    if len(envs) > 1:
        out["per_env"] = {}
        for env in envs:
            mine = [r for r in records if r.get("env", "") == env]
            out["per_env"][env] = {"overall": _group(mine, cfg, rng), "per_level": {
                str(lv): _group([r for r in mine if r["level"] == lv], cfg, rng)
                for lv in sorted({r["level"] for r in mine})}}
    return out


# ---------------------------------------------------------------------------------------------------------- flags
def overfitting(train: Sequence[dict], validation: Sequence[dict], cfg: EvaluateConfig,
                rng: np.random.Generator) -> dict:
    """Train minus validation `cfg.overfit_metric`; flagged above `cfg.overfit_threshold`."""
    f = EPISODE_METRICS[cfg.overfit_metric]
    a = np.array([f(r) for r in train])
    b = np.array([f(r) for r in validation])
    gap = bootstrap_gap(a, b, cfg.bootstrap_samples, cfg.confidence, rng)
    return {"metric": cfg.overfit_metric, "train": float(a.mean()), "validation": float(b.mean()), **gap,
            "threshold": cfg.overfit_threshold, "flagged": gap["gap"] > cfg.overfit_threshold}


def unseen_templates(test: Sequence[dict], cfg: EvaluateConfig, rng: np.random.Generator) -> dict:
    """Test success on seen minus held-out templates, overall, per family and per level; flagged above the threshold.
    Without episodes of both kinds the check is not applicable (``flagged`` None, with the reason).

    ``per_level`` separates the two things the test split measures at once: new entities with a known wording (seen
    templates) and new wordings (the held-out fifth template of each family, about a fifth of the test tasks). A
    level's overall test success mixes both, so a policy change that only moves one of them shows diluted there."""
    seen = [r for r in test if r["template_seen"]]
    unseen = [r for r in test if not r["template_seen"]]
    out: dict = {"n_seen": len(seen), "n_unseen": len(unseen), "threshold": cfg.unseen_template_threshold}
    if not seen or not unseen:
        return {**out, "flagged": None,
                "reason": f"the test episodes hold {len(seen)} seen- and {len(unseen)} unseen-template tasks; "
                          f"the check needs both"}
    succ = lambda rs: np.array([float(r["success"]) for r in rs])  # noqa: E731
    gap = bootstrap_gap(succ(seen), succ(unseen), cfg.bootstrap_samples, cfg.confidence, rng)

    def split_by(key: str) -> dict:
        groups = {}
        for value in sorted({r[key] for r in test}):
            s = [r for r in seen if r[key] == value]
            u = [r for r in unseen if r[key] == value]
            groups[str(value)] = {"n_seen": len(s), "n_unseen": len(u),
                                  "seen_success": float(succ(s).mean()) if s else None,
                                  "unseen_success": float(succ(u).mean()) if u else None}
        return groups

    return {**out, "seen_success": float(succ(seen).mean()), "unseen_success": float(succ(unseen).mean()), **gap,
            "per_family": split_by("family"), "per_level": split_by("level"),
            "flagged": gap["gap"] > cfg.unseen_template_threshold}


def solution(record: dict) -> tuple[str, ...]:
    """An episode's solution: its call sequence with parameters; an invalid action is known by its text (from
    ``steps``), so two different malformed attempts are two solutions, not one."""
    steps = record.get("steps") or []
    out = []
    for k, call in enumerate(record["calls"]):
        if call.get("tool") is None and k < len(steps):
            out.append(json.dumps(["<invalid>", steps[k].get("action")]))
        else:
            out.append(json.dumps([call.get("tool"), call.get("params")], sort_keys=True, default=str))
    return tuple(out)


def trajectory_features(record: dict) -> Counter:
    """ϕ(τ): counts of the episode's tools, tool bigrams (from a start marker), call outcomes and tool parameter
    values (a sparse vector as a Counter).

    >>> phi = trajectory_features({"calls": [{"tool": "lookup", "params": {"name": "a"}, "outcome": "ok"},
    ...                                      {"tool": "answer", "params": {"value": "3"}, "outcome": "answer"}]})
    >>> sorted(phi)[:3], phi["tool:lookup"]
    (['bigram:<start>>lookup', 'bigram:lookup>answer', 'outcome:answer'], 1)
    """
    phi: Counter = Counter()
    prev = "<start>"
    for call in record["calls"]:
        tool = call.get("tool") or "<invalid>"
        phi[f"tool:{tool}"] += 1
        phi[f"bigram:{prev}>{tool}"] += 1
        phi[f"outcome:{call.get('outcome')}"] += 1
        for key, value in sorted((call.get("params") or {}).items()) if isinstance(call.get("params"), dict) else ():
            phi[f"param:{tool}.{key}={value}"] += 1
        prev = tool
    return phi


def cosine(a: Counter, b: Counter) -> float:
    """Cosine similarity of two sparse count vectors; two empty vectors are identical (1), one empty one is not (0)."""
    na2 = sum(v * v for v in a.values())
    nb2 = sum(v * v for v in b.values())
    if na2 == 0 or nb2 == 0:
        return 1.0 if na2 == nb2 else 0.0
    # integer counts: sqrt(na2 * nb2) of equal vectors is exact, so identical trajectories get exactly 1
    return min(1.0, sum(v * b.get(k, 0) for k, v in a.items()) / math.sqrt(na2 * nb2))


def behaviour_diversity(records: Sequence[dict], cfg: EvaluateConfig) -> dict:
    """Rigid-behaviour check on episodes of the same tasks under different seeds (records grouped by task_id).

    Per task: the mean 1 − cos_sim(ϕ(τi), ϕ(τj)) over pairs of its episodes, the number of distinct solutions (call
    sequences with their parameters) and of distinct successful ones; the report averages them over tasks."""
    by_task: dict[str, list[dict]] = {}
    for r in records:
        by_task.setdefault(r["task_id"], []).append(r)
    groups = [g for g in by_task.values() if len(g) >= 2]
    if not groups:
        raise ValueError("the diversity check needs at least two episodes of one task")
    div, distinct, distinct_ok = [], [], []
    for g in groups:
        phis = [trajectory_features(r) for r in g]
        div.append(float(np.mean([1 - cosine(a, b) for a, b in combinations(phis, 2)])))
        sols = [solution(r) for r in g]
        distinct.append(len(set(sols)))
        distinct_ok.append(len({s for s, r in zip(sols, g) if r["success"]}))
    diversity, mean_distinct = float(np.mean(div)), float(np.mean(distinct))
    return {
        "tasks": len(groups), "episodes_per_task": float(np.mean([len(g) for g in groups])),
        "behavior_diversity": diversity, "distinct_solutions": mean_distinct,
        "distinct_successful_solutions": float(np.mean(distinct_ok)),
        "identical_share": float(np.mean([d == 1 for d in distinct])),
        "min_behavior_diversity": cfg.min_behavior_diversity, "min_distinct_solutions": cfg.min_distinct_solutions,
        "flagged": diversity < cfg.min_behavior_diversity and mean_distinct < cfg.min_distinct_solutions,
    }


def tool_calls_on_common_solved(sft: Sequence[dict], rl: Sequence[dict], cfg: EvaluateConfig,
                                rng: np.random.Generator) -> dict:
    """Tool calls per solved task, like for like: on the tasks *both* policies solve (same task, same seed), the
    mean calls of each and the paired difference RL − SFT with a bootstrap interval (resampling those tasks), overall
    and per level; also the mean calls on the tasks only RL solves. The per-policy mean over each one's own solved
    tasks (``tool_calls`` of the solved episodes, as metrics/train.json reports it) mixes a change of efficiency with
    a change of *which* tasks are solved: a policy that newly solves hard tasks by recovering from a wrong first call
    looks less efficient there even when it is as efficient as before on everything both solve."""
    a = {r["task_id"]: r for r in sft}
    b = {r["task_id"]: r for r in rl}
    common = sorted(t for t in set(a) & set(b) if a[t]["success"] and b[t]["success"])
    rl_only = sorted(t for t in set(a) & set(b) if b[t]["success"] and not a[t]["success"])

    def summary(ids: list[str], only: list[str]) -> dict:
        out: dict = {"n": len(ids), "n_rl_only": len(only),
                     "rl_only_rl": float(np.mean([b[t]["n_calls"] for t in only])) if only else None}
        if not ids:
            return {**out, "sft": None, "rl": None, "rl_minus_sft": None, "ci_low": None, "ci_high": None}
        x = np.array([a[t]["n_calls"] for t in ids], dtype=float)
        y = np.array([b[t]["n_calls"] for t in ids], dtype=float)
        d = y - x
        boot = d[rng.integers(0, len(d), size=(cfg.bootstrap_samples, len(d)))].mean(axis=1)
        q = (1 - cfg.confidence) / 2
        return {**out, "sft": float(x.mean()), "rl": float(y.mean()), "rl_minus_sft": float(d.mean()),
                "ci_low": float(np.quantile(boot, q)), "ci_high": float(np.quantile(boot, 1 - q))}

    levels = sorted({int(a[t]["level"]) for t in a})
    return {"overall": summary(common, rl_only),
            "per_level": {str(lv): summary([t for t in common if int(a[t]["level"]) == lv],
                                           [t for t in rl_only if int(a[t]["level"]) == lv]) for lv in levels}}


# --------------------------------------------------------------------------------------------------------- report
def build_report(greedy: dict[str, dict[str, list[dict]]], sampled: dict[str, list[dict]],
                 cfg: EvaluateConfig) -> dict:
    """The whole report from the episodes: `greedy[policy][split]` (greedy episodes of each policy on each split, the
    same tasks and seeds for both policies) and `sampled[policy]` (the diversity episodes)."""
    policies: dict = {}
    flags: dict = {}
    for name, splits in greedy.items():
        # one bootstrap stream per (policy, group), named rather than numbered: the order of the loops changes nothing
        rng = lambda key: np.random.default_rng([cfg.seed, zlib.crc32(f"{name}/{key}".encode())])  # noqa: E731
        policies[name] = {split: split_report(records, cfg, rng(split)) for split, records in splits.items()}
        flags[name] = {
            "overfitting": overfitting(splits["train"], splits["validation"], cfg, rng("overfitting")),
            "unseen_templates": unseen_templates(splits["test"], cfg, rng("unseen")),
            "rigid_behavior": behaviour_diversity(sampled[name], cfg),
        }
    raised = [f"{p}: {k}" for p, fl in flags.items() for k, v in fl.items() if v.get("flagged")]
    per_task = {p: {r["task_id"]: bool(r["success"]) for r in splits["test"]} for p, splits in greedy.items()}
    report = {"policies": policies, "flags": flags, "flagged": raised, "per_task_test_success": per_task,
              "paired_test": paired_counts(per_task)}
    if not set(POLICIES) - set(greedy):
        report["tool_calls_both_solved"] = tool_calls_on_common_solved(
            greedy["sft"]["test"], greedy["rl"]["test"], cfg, np.random.default_rng([cfg.seed, zlib.crc32(b"calls")]))
    return report


def paired_counts(per_task: dict[str, dict[str, bool]]) -> dict | None:
    """Discordant and concordant counts of the SFT and RL policies on the same test tasks (McNemar's table)."""
    if set(POLICIES) - set(per_task):
        return None
    sft, rl = per_task["sft"], per_task["rl"]
    common = sorted(set(sft) & set(rl))
    return {"tasks": len(common),
            "both": sum(sft[t] and rl[t] for t in common), "neither": sum(not sft[t] and not rl[t] for t in common),
            "rl_only": sum(rl[t] and not sft[t] for t in common), "sft_only": sum(sft[t] and not rl[t] for t in common)}


def success_rows(policies: dict) -> list[dict]:
    """Success (with interval) per policy, split and level, plus each split's overall row: the plot's table."""
    rows = []
    for policy, splits in policies.items():
        for split, rep in splits.items():
            groups = [*((lv, g) for lv, g in rep["per_level"].items()), ("all", rep["overall"])]
            for level, g in groups:
                s = g["success"]
                rows.append({"series": f"{policy} {split} L{level}" if level != "all" else f"{policy} {split} all",
                             "policy": policy, "split": split, "level": level, "success": round(s["mean"], 6),
                             "ci_low": round(s["ci_low"], 6), "ci_high": round(s["ci_high"], 6), "n": g["n"]})
    return rows


def markdown_report(report: dict) -> str:
    """A human-readable evaluation report (logged to MLflow next to the JSON)."""
    lines = ["# Evaluation report", ""]
    if report["flagged"]:
        lines += ["**Flags raised:** " + ", ".join(report["flagged"]), ""]
    else:
        lines += ["No flag raised.", ""]
    lines += ["| policy | split | n | success | mean return | tool calls | safety violations (total) |",
              "|---|---|---|---|---|---|---|"]
    fmt = lambda m: f"{m['mean']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]"  # noqa: E731
    for policy, splits in report["policies"].items():
        for split, rep in splits.items():
            o = rep["overall"]
            lines.append(f"| {policy} | {split} | {o['n']} | {fmt(o['success'])} | {fmt(o['return'])} | "
                         f"{fmt(o['tool_calls'])} | {o['safety_violations_total']} |")
    lines += ["", "| policy | check | value | threshold | flagged |", "|---|---|---|---|---|"]
    for policy, fl in report["flags"].items():
        o, u, d = fl["overfitting"], fl["unseen_templates"], fl["rigid_behavior"]
        lines.append(f"| {policy} | train − validation {o['metric']} | {o['gap']:+.3f} [{o['ci_low']:+.3f}, "
                     f"{o['ci_high']:+.3f}] | {o['threshold']} | {o['flagged']} |")
        value = f"{u['gap']:+.3f} [{u['ci_low']:+.3f}, {u['ci_high']:+.3f}]" if "gap" in u else u.get("reason", "")
        lines.append(f"| {policy} | seen − unseen template success | {value} | {u['threshold']} | {u['flagged']} |")
        lines.append(f"| {policy} | behaviour diversity / distinct solutions | {d['behavior_diversity']:.3f} / "
                     f"{d['distinct_solutions']:.2f} | {d['min_behavior_diversity']} / {d['min_distinct_solutions']} "
                     f"| {d['flagged']} |")
    per_level = {p: fl["unseen_templates"].get("per_level") for p, fl in report["flags"].items()}
    if per_level and all(per_level.values()):  # every policy has both kinds of test episode
        policies = list(per_level)
        cell = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
        lines += ["", "Test success per level on seen wordings (held-out entities) and on the held-out wording of "
                      "each family:", "",
                  "| level | tasks seen / held-out | "
                  + " | ".join(f"{p} seen | {p} held-out" for p in policies) + " |",
                  "|---|---|" + "---|---|" * len(policies)]
        for lv, g in per_level[policies[0]].items():
            row = " | ".join(f"{cell(per_level[p][lv]['seen_success'])} | {cell(per_level[p][lv]['unseen_success'])}"
                             for p in policies)
            lines.append(f"| {lv} | {g['n_seen']} / {g['n_unseen']} | {row} |")
    if report.get("paired_test"):
        pt = report["paired_test"]
        lines += ["", f"Paired test tasks: {pt['tasks']}; both solve {pt['both']}, neither {pt['neither']}, only RL "
                      f"{pt['rl_only']}, only SFT {pt['sft_only']}."]
    if report.get("tool_calls_both_solved"):
        tc = report["tool_calls_both_solved"]
        lines += ["", "Tool calls on the test tasks both policies solve (paired; RL − SFT with its interval), and RL's "
                      "calls on the tasks only RL solves:", "",
                  "| level | tasks both solve | SFT | RL | RL − SFT | only RL solves: tasks, RL calls |",
                  "|---|---|---|---|---|---|"]
        for lv, g in [*tc["per_level"].items(), ("all", tc["overall"])]:
            if g["n"]:
                only = f"{g['n_rl_only']}, {g['rl_only_rl']:.2f}" if g["n_rl_only"] else "0"
                lines.append(f"| {lv} | {g['n']} | {g['sft']:.2f} | {g['rl']:.2f} | {g['rl_minus_sft']:+.2f} "
                             f"[{g['ci_low']:+.2f}, {g['ci_high']:+.2f}] | {only} |")
    return "\n".join(lines) + "\n"


def flat_metrics(report: dict) -> dict[str, float]:
    """The numbers logged to MLflow: ``eval/<policy>/<split>/<metric>`` (means), and ``flags/<policy>/<check>``."""
    out: dict[str, float] = {}
    for policy, splits in report["policies"].items():
        for split, rep in splits.items():
            for name, m in rep["overall"].items():
                if isinstance(m, dict):
                    out[f"eval/{policy}/{split}/{name}"] = m["mean"]
            for lv, g in rep["per_level"].items():
                out[f"eval/{policy}/{split}/success_L{lv}"] = g["success"]["mean"]
    tc = report.get("tool_calls_both_solved")
    for lv, g in ([*tc["per_level"].items(), ("all", tc["overall"])] if tc else []):
        if g["rl_minus_sft"] is not None:
            out[f"tool_calls_both_solved/{'overall' if lv == 'all' else 'L' + lv}/rl_minus_sft"] = g["rl_minus_sft"]
    for policy, fl in report["flags"].items():
        for check, v in fl.items():
            if v.get("flagged") is not None:
                out[f"flags/{policy}/{check}"] = float(v["flagged"])
        for lv, g in (fl["unseen_templates"].get("per_level") or {}).items():
            for kind in ("seen", "unseen"):
                if g[f"{kind}_success"] is not None:
                    out[f"eval/{policy}/test/success_L{lv}_{kind}_template"] = g[f"{kind}_success"]
        out[f"overfit/{policy}/gap"] = fl["overfitting"]["gap"]
        out[f"diversity/{policy}/behavior_diversity"] = fl["rigid_behavior"]["behavior_diversity"]
        out[f"diversity/{policy}/distinct_solutions"] = fl["rigid_behavior"]["distinct_solutions"]
    return out


__all__ = ["EPISODE_METRICS", "POLICIES", "SPLITS", "EvaluateConfig", "behaviour_diversity", "bootstrap_gap",
           "bootstrap_means", "build_report", "cosine", "episode_values", "flat_metrics", "markdown_report",
           "overfitting", "paired_counts", "solution", "split_report", "success_rows", "tool_calls_on_common_solved",
           "trajectory_features",
           "unseen_templates"]
