"""The episode record: what one played episode is, as every phase passes it on (a typed dict).

Records stay plain dicts -- they are written to JSON Lines, logged, gathered across DeepSpeed ranks and filtered by
pandas -- and :class:`EpisodeRecord` declares their keys and types once, so a reader (and a type checker) knows
what a record holds and who adds what. :func:`record_problems` checks a record against it; the tests run it on the
records the environment runner, the rollout engine, demonstrations and the RL loop produce.

Who writes which keys:

- every played episode (:func:`pipeline.policy.episodes.run_episode`, a scripted or model policy step by step):
  :data:`EPISODE_KEYS`;
- the rollout engine's episodes (:class:`pipeline.policy.episode_drivers.EnvEpisode`) add :data:`STREAM_KEYS`: the
  parsed actions, per-step rewards, seed and tool faults, the token stream and ``policy_version``; with
  ``env.context_actions`` on also ``step_events`` / ``context_actions``; demonstrations also ``demonstrated``;
- the RL loop and its extensions, on the records of one update: ``group`` (the loop), ``extra_reward`` (reward
  components added to ``return``: the learned reward), ``replayed`` / ``replay_weight`` / ``replay_adv`` /
  ``replay_turn_adv`` (replay); evaluate adds ``slices`` (the held-out slices a task belongs to).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, get_type_hints


class EpisodeRecord(TypedDict("_Return", {"return": float}, total=False), total=False):  # `return`: a keyword
    # the episode (the runner)
    task_id: str
    env: str
    level: int
    family: str
    template_seen: bool
    success: bool
    truncated: bool
    components: dict            # reward components of the episode (correctness, efficiency, safety, ...)
    n_calls: int
    n_violations: int
    n_failed: int
    verifier: dict              # the environment's verifier's verdict ({"passed": bool, ...})
    answer: Any
    ground_truth: Any
    steps: list                 # per step {"action": text, "observation": text}
    calls: list                 # per call {"tool", "params", "outcome"}
    actions: list               # per step the parsed call {"tool", "params", "token_limit"} or an "error"
    step_rewards: list          # reward paid at each step (they sum to `return`)
    seed: int
    tool_faults: dict
    step_events: list           # env.context_actions: per step its events
    context_actions: dict       # env.context_actions: the episode's counts
    # the token stream (the rollout engine)
    token_ids: list
    logprobs: list
    action_mask: list
    segments: list
    policy_version: int
    demonstrated: bool          # played by a scripted policy (logprobs 0)
    # added during RL and evaluation
    group: Any                  # the episode's group (same task) in one update
    extra_reward: float         # reward components added to `return` after the episode (the learned reward)
    replayed: bool
    replay_weight: float
    replay_adv: float
    replay_turn_adv: list
    slices: list


FIELDS: dict[str, Any] = get_type_hints(EpisodeRecord)
EPISODE_KEYS = ("task_id", "env", "level", "family", "template_seen", "success", "return", "truncated", "components",
                "n_calls", "n_violations", "n_failed", "verifier", "answer", "ground_truth", "steps", "calls")
STREAM_KEYS = ("actions", "step_rewards", "seed", "tool_faults", "token_ids", "logprobs", "action_mask", "segments",
               "policy_version")


def record_problems(record: Mapping, required: tuple[str, ...] = EPISODE_KEYS) -> list[str]:
    """What is wrong with `record` as an :class:`EpisodeRecord`: required keys missing, keys it does not declare,
    values of another type (``Any`` fields unchecked; an int passes as a float)."""
    out = [f"missing {k!r}" for k in required if k not in record]
    for key, value in record.items():
        if key not in FIELDS:
            out.append(f"undeclared key {key!r}")
            continue
        kind = FIELDS[key]
        if kind is Any or value is None and key in ("answer", "ground_truth"):
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else isinstance(value, kind)
        if not ok:
            out.append(f"{key!r} is {type(value).__name__}, not {kind.__name__}")
    return out
