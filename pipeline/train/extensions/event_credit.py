"""Extension `event_credit` (``train.reward.credit: event``; docs/design.md §2.2): per-turn credit whose
discount falls at key events rather than at every turn.

**Credit** (`train.reward.credit`): ``episode`` (the return on the last action), ``turn`` (the discounted return from
each turn on, `train.gamma` per turn; `train.turn_credit: true` is the older spelling of it) and ``event``: the
discount is applied at key events rather than at every turn. The per-turn discount is γ_t = γ·γ_e if turn t carries a
key event else γ (with the default γ = 1: only at events), and G_t = r_t + γ_t·G_{t+1}
(:func:`pipeline.train.core_algos.stepwise_discounted_returns`): turns before a key decision get discounted credit
for what follows it. Events (`events`): ``write``, a call of a tool marked `writes` (attempted, refused or not: the
decision is the key, not its outcome), and any name a record's ``step_events`` (one list of names per step) carries,
e.g. ``subgoal_done``. With PPO the discount γ_e is applied in GAE at the last action token of an event turn.

The credit rule ``event`` (the per-turn rule of :mod:`pipeline.train.credit`) asks this extension for the discounts
(:meth:`pipeline.train.extensions.base.Extension.turn_discounts`); the metrics are ``credit/event_turns_per_episode``
and ``credit/events_<name>_per_episode``.
"""

from __future__ import annotations

import torch

from pipeline.core.errors import AgentRLError
from pipeline.train import core_algos as A
from pipeline.train.extensions.base import Extension


def write_tool_names(runtime) -> frozenset[str]:
    """The names of the environment's tools marked `writes` (the ``write`` events of event credit)."""
    return frozenset(s.name for s in runtime.tools() if s.writes)


def turn_events(records: list[dict], names: list[str], write_tools: frozenset[str],
                width: int) -> tuple[torch.Tensor, dict]:
    """(episodes, width) bool: whether each turn carries a key event of `names` (event credit): ``write``, the turn
    called a tool of `write_tools` (from the record's ``actions``); any other name, the record's ``step_events`` of
    that step hold it. Also the events per episode, as metrics. Records whose actions or step events do not align
    with their step rewards are refused."""
    out = torch.zeros(len(records), width, dtype=torch.bool)
    counts = dict.fromkeys(names, 0)
    for i, r in enumerate(records):
        n = len(r["step_rewards"])
        actions, step_events = r.get("actions") or [], r.get("step_events")
        if "write" in names and len(actions) != n:
            raise AgentRLError(f"train.reward.credit event: episode of task {r.get('task_id')!r} has {len(actions)} "
                               f"actions for {n} step rewards (rollout records carry one action per step)")
        if step_events is not None and len(step_events) != n:
            raise AgentRLError(f"train.reward.credit event: episode of task {r.get('task_id')!r} has "
                               f"{len(step_events)} step_events entries for {n} step rewards (one list per step)")
        for t in range(n):
            hits = {e for e in (step_events[t] if step_events is not None else []) if e in counts and e != "write"}
            if "write" in names and (actions[t] or {}).get("tool") in write_tools:
                hits.add("write")
            for e in hits:
                counts[e] += 1
            out[i, t] = bool(hits)
    n_ep = max(1, len(records))
    mets = {"credit/event_turns_per_episode": float(out.sum()) / n_ep,
            **{f"credit/events_{e}_per_episode": c / n_ep for e, c in counts.items()}}
    return out, mets


class EventCredit(Extension):
    """On when the credit (``train.reward.credit``) is 'event'."""

    name = "event_credit"
    curve_keys = ("credit/event_turns_per_episode",)

    def __init__(self, cfg, write_tools: frozenset[str]):
        self.cfg, self.write_tools = cfg, write_tools

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(cfg, write_tool_names(runtime)) if cfg.credit == "event" else None

    def turn_discounts(self, records: list[dict], turn_mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        events, mets = turn_events(records, self.cfg.reward.events, self.write_tools, turn_mask.shape[1])
        return A.event_discounts(events, self.cfg.gamma, self.cfg.reward.event_gamma), mets
