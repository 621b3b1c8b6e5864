"""Context management and task decomposition as actions (docs/design.md §1.2, §3.7): tools of the
pipeline, not of an environment, that every environment's episodes offer when ``env.context_actions.enabled``.

=====================  ========================================================================================
``note(text)``         compresses the history: the turns up to and including the note are replaced in the context
                       by one ``Note: <text>`` line (the latest note wins; the turns after it stay verbatim and
                       fold into the usual summary line only if they outgrow ``env.history_window`` themselves).
                       The context after a note is ``header + "Note: <text>\\n"`` exactly
                       (:func:`pipeline.envs.prompt.render_context`); the step reports ``context_folded``, so the
                       rollout engine starts a new token segment there, as it does at every fold.
``remember(text)``     stores a note in the long-term memory (:mod:`pipeline.envs.memory`) when the episode ends.
``recall(query)``      the best ``recall_k`` notes (BM25) written by episodes that ended before this one began.
``plan(steps)``        declares sub-goals: tool names, optionally with words the call must contain
                       (``["lookup", "calc", "answer"]``); the rule verifier (:func:`pipeline.envs.verifier.
                       match_plan`) completes them in order as later calls satisfy them.
=====================  ========================================================================================

Decisions:

- **They cost a step, not efficiency.** Each one is an action: it counts against ``env.max_steps`` and
  ``env.max_policy_chars`` (the budgets bound their use), but by default not in the efficiency and user-experience
  components, which count the environment's calls only (``count_in_efficiency: true`` counts them). Reasoning: their
  use is paid for by the budget they take from the task; an extra penalty would teach the policy never to use them
  before it could learn what they buy. Their outcome is ``ok`` (an ``invalid_params`` like any tool's when their
  parameters break the schema), so the verifier's order check skips over them.
- **Events per step.** The runner's step info carries ``events`` (a list per step): ``note``, ``remember``,
  ``recall_hit`` / ``recall_miss``, ``plan``, ``subgoal_done`` (this call completed a sub-goal of the latest plan)
  and ``plan_complete`` (it completed the last one). Episode records then carry ``step_events`` (aligned with
  ``steps`` and ``step_rewards``) for credit assignment at key decisions, and ``context_actions``, the episode's
  counts (:meth:`ContextState.finish`), which :func:`context_metrics` averages into each update's metrics.
- **Off by default**: with ``enabled: false`` nothing here runs, the tool list, prompt, rewards and records are
  byte-identical to a run without this module.
- A new ``plan`` replaces the previous one (its sub-goals count from the calls after it).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from pipeline.core.config import PhaseConfig
from pipeline.envs.contract import ToolSpec
from pipeline.envs.memory import open_store
from pipeline.envs.protocol import sanitize
from pipeline.envs.verifier import OK, match_plan

CONTEXT_TOOLS = ("note", "remember", "recall", "plan")
MAX_NOTE_CHARS = 200
NOTED = "noted: earlier turns replaced by your note"  # the observation of a note
MAX_STEP_CHARS = 48
STAT_KEYS = ("context_calls", "notes", "remembered", "recalls", "recall_hits", "plan_steps", "plan_completed")


class ContextActionsConfig(PhaseConfig):
    """`env.context_actions`: the context-management and decomposition actions (see the module docstring)."""

    enabled: bool = Field(False, description="Offer the context actions (note, remember, recall, plan) in every episode, in the prompt's tool list.")
    tools: list[Literal["note", "remember", "recall", "plan"]] = Field(
        default_factory=lambda: list(CONTEXT_TOOLS),
        description="Which of the context actions to offer, in the prompt's order.")
    memory_path: str = Field("", description="SQLite file of the long-term memory (remember/recall), shared by every episode and process that names it; empty: one in-process store, lost at exit.")
    recall_k: int = Field(2, ge=1, le=10, description="Notes a recall returns at most (best BM25 score first).")
    max_plan_steps: int = Field(8, ge=1, le=32, description="Sub-goals a plan may declare at most.")
    count_in_efficiency: bool = Field(False, description="Count context actions as calls in the efficiency and user-experience components (default: they cost a step of the budget only).")

    @field_validator("tools")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if not v or len(set(v)) != len(v):
            raise ValueError(f"env.context_actions.tools must name each of {list(CONTEXT_TOOLS)} at most once and at "
                             f"least one of them, got {v}")
        return v


def _text(maxlen: int) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": maxlen, "pattern": "\\S"}


def context_specs(cfg: ContextActionsConfig) -> list[ToolSpec]:
    """The ToolSpecs of the configured context actions (JSON Schemas like every tool's)."""
    obj = lambda props: {"type": "object", "properties": props, "required": list(props),  # noqa: E731
                         "additionalProperties": False}
    specs = {
        "note": ToolSpec("note", "replace the earlier turns of your context with this text (keep what you still need)",
                         obj({"text": _text(MAX_NOTE_CHARS)})),
        "remember": ToolSpec("remember", "store a note in long-term memory for later episodes",
                             obj({"text": _text(MAX_NOTE_CHARS)})),
        "recall": ToolSpec("recall", "find notes stored in earlier episodes", obj({"query": _text(MAX_NOTE_CHARS)})),
        "plan": ToolSpec("plan", "declare your sub-goals in order: tool names, optionally with words the call contains",
                         obj({"steps": {"type": "array", "minItems": 1, "maxItems": cfg.max_plan_steps,
                                        "items": _text(MAX_STEP_CHARS)}})),
    }
    return [specs[name] for name in cfg.tools]


class ContextState:
    """One episode's context actions: the latest note, the plan and its progress, memory reads and writes."""

    def __init__(self, cfg: ContextActionsConfig, task_id: str):
        self.cfg, self.task_id = cfg, task_id
        self.names = frozenset(cfg.tools)
        self.note: str | None = None
        self.note_upto = 0  # history pairs the note replaces
        self.plan: list[str] = []
        self.plan_from = 0  # calls before the plan's own call + 1
        self.plan_done = 0
        self.to_remember: list[str] = []
        self.read_ids: list[int] = []
        self.counts = dict.fromkeys(STAT_KEYS, 0)
        self._pending: list[str] = []
        self._pending_note: str | None = None
        uses_memory = bool(self.names & {"remember", "recall"})
        self.store = open_store(cfg.memory_path) if uses_memory else None
        self.visible_upto = self.store.last_id() if self.store is not None else 0

    def execute(self, name: str, params: dict) -> str:
        """Run a context action whose parameters passed its schema; returns the observation text."""
        self.counts["context_calls"] += 1
        if name == "note":
            self._pending_note = sanitize(params["text"])
            self._pending.append("note")
            return NOTED
        if name == "remember":
            self.to_remember.append(sanitize(params["text"]))
            self.counts["remembered"] += 1
            self._pending.append("remember")
            return "remembered for later episodes"
        if name == "recall":
            found = self.store.search(params["query"], self.visible_upto, self.cfg.recall_k)
            self.counts["recalls"] += 1
            self.counts["recall_hits"] += bool(found)
            self.read_ids += [i for i, _ in found if i not in self.read_ids]
            self._pending.append("recall_hit" if found else "recall_miss")
            return "; ".join(f"{k + 1}) {t}" for k, (_, t) in enumerate(found)) if found else "no note matches"
        if name == "plan":
            self.plan, self.plan_done = list(params["steps"]), 0
            self._pending.append("plan")
            return f"plan of {len(self.plan)} sub-goals: {'; '.join(self.plan)}"
        raise ValueError(f"not a context action: {name!r}")

    def after_step(self, tool: str | None, outcome: str, calls: list[dict], n_history: int) -> tuple[list[str], bool]:
        """Book the step just taken (its call is `calls[-1]`, its pair the history's last); returns the step's events
        and whether a note replaced the history at this step."""
        events, self._pending = self._pending, []
        noted = tool == "note" and outcome == OK and self._pending_note is not None
        if noted:
            self.note, self.note_upto = self._pending_note, n_history
            self.counts["notes"] += 1
        self._pending_note = None
        if tool == "plan" and outcome == OK:
            self.plan_from = len(calls)
        elif self.plan:
            done = sum(i is not None for i in match_plan(self.plan, calls[self.plan_from:]))
            if done > self.plan_done:
                events.append("subgoal_done")
                if done == len(self.plan):
                    events.append("plan_complete")
            self.plan_done = done
        return events, noted

    def env_calls(self, calls: list[dict]) -> int:
        """The calls the efficiency and user-experience components count."""
        if self.cfg.count_in_efficiency:
            return len(calls)
        return sum(c["tool"] not in self.names for c in calls)

    def finish(self, success: bool) -> dict:
        """The episode ended: write its notes to memory, credit the notes it read; returns its counts."""
        if self.store is not None:
            if self.to_remember:
                self.store.add(self.to_remember, self.task_id)
            self.store.credit(self.read_ids, success)
        out = {**self.counts, "plan_steps": len(self.plan), "plan_completed": self.plan_done}
        if self.store is not None:
            mem = self.store.stats()
            out.update(memory_notes=mem["notes"], memory_utility=mem["utility"])
        return out


def note_of(history: list[tuple[str, str]]) -> tuple[str, int] | None:
    """The note in force after `history` ((action_text, observation_text) pairs as recorded in a demonstration's or
    episode's steps) as :func:`pipeline.envs.prompt.render_context` takes it, or None: what replaying a recorded
    episode's contexts needs (e.g. cutting demonstrations into segments for SFT)."""
    from pipeline.envs.protocol import parse_action

    for k in range(len(history) - 1, -1, -1):
        action, obs = history[k]
        parsed = parse_action(action, ("note",), max_chars=1 << 16)
        if not hasattr(parsed, "params") or not obs.startswith(f"<obs>{NOTED}"):
            continue
        text = parsed.params.get("text")
        if isinstance(text, str):
            return sanitize(text), k + 1
    return None


def context_metrics(records: list[dict]) -> dict:
    """Per-update means of the episodes' context-action counts (``context/...``); {} when the actions are off."""
    stats = [r["context_actions"] for r in records if r.get("context_actions")]
    if not stats:
        return {}
    out = {f"context/{k}": float(np.mean([s.get(k, 0) for s in stats])) for k in STAT_KEYS}
    out["context/episodes_with_actions_share"] = float(np.mean([s["context_calls"] > 0 for s in stats]))
    declared = sum(s["plan_steps"] for s in stats)
    out["context/plan_completion"] = sum(s["plan_completed"] for s in stats) / declared if declared else 0.0
    if any("memory_notes" in s for s in stats):
        out["context/memory_notes"] = float(max(s.get("memory_notes", 0) for s in stats))
        out["context/memory_utility"] = float(stats[-1].get("memory_utility", 0.0))
    return out
