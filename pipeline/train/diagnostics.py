"""What an update logs about its rollouts and the learner's health (docs/design.md §2.2.1, §3.8.2, §5.1):
episode figures, tool usage and its diversity, parameters without gradient, and the collapse alarms (entropy, reward
spread, advantage variance below a floor).

Only measurements; nothing here changes what is trained. The learner's own figures (losses, clip fraction, KL,
importance weights) come from :mod:`pipeline.train.core_algos` through :mod:`pipeline.train.learner`.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from pipeline.envs.runner import FAULT_COUNTS
from pipeline.train.sampling import TaskSampler

# collapse alarms: a diagnostic below its floor logs a warning (the entropy floor is `train.entropy_alarm`)
COLLAPSE = {"reward_spread": 1e-6, "advantage_var": 1e-8}
ALARM_KEYS = (("entropy", "policy/entropy"), ("reward_spread", "rollout/reward_spread"),
              ("advantage_var", "policy/advantage_var"))


def tool_usage(records: list[dict]) -> dict:
    """Share of each tool among the calls (``invalid``: an action that named none), the entropy of that
    distribution, and the share of distinct tool sequences among the episodes."""
    counts = Counter(c.get("tool") or "invalid" for r in records for c in r["calls"])
    total = sum(counts.values()) or 1
    probs = np.array([v / total for v in counts.values()])
    out = {f"tools/share_{k}": v / total for k, v in sorted(counts.items())}
    out["tools/entropy"] = float(-(probs * np.log(probs)).sum()) if len(probs) else 0.0
    seqs = Counter(tuple(c.get("tool") for c in r["calls"]) for r in records)
    out["tools/distinct_sequences_share"] = len(seqs) / max(1, len(records))
    return out


def params_without_grad(module: torch.nn.Module) -> int:
    """Trainable parameters whose gradient is missing or all zero."""
    return sum(1 for p in module.parameters() if p.requires_grad and (p.grad is None or not torch.any(p.grad != 0)))


def rollout_metrics(records: list[dict], outcomes: list[tuple[int, bool]], state: TaskSampler) -> dict:
    """This rank's episode figures, the success rate over every rank's `outcomes` ((level, success) pairs), the
    curriculum's state and tool usage."""
    return {
        "rollout/success": float(np.mean([s for _, s in outcomes])),
        "rollout/return": float(np.mean([r["return"] for r in records])),
        "rollout/reward_spread": float(np.std([r["return"] for r in records])),
        "rollout/tool_calls": float(np.mean([r["n_calls"] for r in records])),
        "curriculum/max_open_level": state.curriculum.max_open,
        **{f"curriculum/weight_l{lv}": w for lv, w in state.curriculum.weights().items()},
        **tool_usage(records),
    }


def fault_metrics(records: list[dict], dist) -> dict:
    """The environment's ``tool_faults`` summed over every rank's episodes (:mod:`pipeline.envs.runner`): the calls
    that reached a tool, the injected failures among them and their observed rate (to compare with
    ``env.tool_failure_rate``), the latency spikes, and the tools' unexpected exceptions. Training goes on through
    all of them: each is an error observation in its episode."""
    mine = {k: sum(r.get("tool_faults", {}).get(k, 0) for r in records) for k in FAULT_COUNTS}
    total = {k: sum(part[k] for part in dist.all_gather(mine)) for k in FAULT_COUNTS}
    return {**{f"faults/{k}": float(v) for k, v in total.items()},
            "faults/failure_rate": total["injected_failures"] / max(1, total["tool_calls"])}


def collapse_alarms(metrics: dict, entropy_floor: float) -> list[str]:
    """Adds ``alarms/<name>_collapse`` = 1 to `metrics` for each watched figure below its floor; returns the warning
    texts."""
    floors = {**COLLAPSE, "entropy": entropy_floor}
    warnings = []
    for name, key in ALARM_KEYS:
        if key in metrics and metrics[key] < floors[name]:
            metrics[f"alarms/{name}_collapse"] = 1.0
            warnings.append(f"{name} collapsed ({metrics[key]:.3g} < {floors[name]})")
    return warnings


def run_health(history: list[dict]) -> dict:
    """What ``metrics/train.json`` records of a run's health, from its per-update history: the tool faults summed
    over the run (with the observed failure rate), the batches dropped as too stale, and for each collapse alarm the
    updates it fired at."""
    faults = {k: int(sum(h.get(f"faults/{k}", 0) for h in history)) for k in FAULT_COUNTS}
    faults["failure_rate"] = faults["injected_failures"] / max(1, faults["tool_calls"])
    return {"tool_faults": faults,
            "dropped_stale_batches": int(sum(h.get("offpolicy/dropped_stale_batch", 0) for h in history)),
            "alarms": {name: [h["update"] for h in history if h.get(f"alarms/{name}_collapse")]
                       for name, _ in ALARM_KEYS}}
