"""What the rollout engine drives per episode: the token stream the model saw, and the episode behind it.

- :class:`TokenStream`: an episode's token ids, recorded log-probabilities, action mask and segment starts, as the
  model saw them (known tokens have log-probability 0 and mask 0).
- :class:`EnvEpisode`: one episode of the pipeline's runner over an environment; ``step(action text)`` returns what the engine needs next (done,
  observation text, whether the history was folded, the new context) and ``record()`` the episode record.
  With the context actions on (``env.context_actions``), the record also carries ``step_events`` (per step, the
  list of the step's events from the runner's info, e.g. ``["subgoal_done"]``; aligned with ``steps`` and
  ``step_rewards``) and ``context_actions`` (the episode's counts); without them the record is unchanged.
- :class:`OneAction`: an "episode" of one action from a given context (:meth:`RolloutEngine.complete`).

No model and no tensors here: batching, sampling and the cache are the engine's (:mod:`pipeline.policy.rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import Environment
from pipeline.envs.protocol import InvalidAction, parse_action
from pipeline.envs.runner import AgentEnv
from pipeline.policy.record import EpisodeRecord


@dataclass
class TokenStream:
    """Tokens of one episode as the model saw them."""

    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    action_mask: list = field(default_factory=list)
    segments: list = field(default_factory=list)

    def known(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.action_mask += [0] * len(ids)


class EnvEpisode:
    """Drives one AgentEnv episode for the engine (the same record fields as
    :func:`pipeline.policy.episodes.run_episode`)."""

    def __init__(self, runtime: Environment, env_cfg: EnvConfig, task, seed: int, options: dict | None = None):
        self.task, self.seed = task, seed
        self.env = AgentEnv(world=runtime, tasks=[task], config=env_cfg)
        obs, info = self.env.reset(seed=seed, options={**(options or {}), "task": task})
        self.context = obs["context"]
        self.obs, self.last_info = obs, info  # what a scripted policy acts on (RolloutEngine.demonstrate)
        self.tool_names, self.max_chars = self.env.tools.names, env_cfg.max_action_chars
        self.tool_specs = self.env.tools.specs  # what rollout.constrain's grammar is built from
        self.steps: list[dict] = []
        self.actions: list[dict] = []
        self.rewards: list[float] = []
        self.events: list[list[str]] | None = [] if "context_actions" in info else None

    def step(self, text: str, token_limit: bool = False) -> tuple[bool, str, bool, str]:
        """Returns (done, observation text, folded, new context); `token_limit`: the engine cut the action at
        ``rollout.max_new_tokens`` (recorded in the step's ``actions`` entry)."""
        obs, reward, terminated, truncated, info = self.env.step(text)
        self.obs, self.last_info = obs, info
        self.rewards.append(float(reward))
        if self.events is not None:
            self.events.append(list(info.get("events", [])))
        self.steps.append({"action": info["action_text"], "observation": info["observation_text"]})
        parsed = parse_action(text, self.tool_names, self.max_chars)
        self.actions.append({"tool": None, "params": None, "error": parsed.reason, "token_limit": token_limit}
                            if isinstance(parsed, InvalidAction)
                            else {"tool": parsed.name, "params": parsed.params, "token_limit": token_limit})
        done = terminated or truncated
        if done:
            self.info, self.truncated = info, truncated
            self.env.close()
        return done, info["observation_text"], bool(info["context_folded"]), obs["context"]

    def record(self) -> EpisodeRecord:
        task, info = self.task, self.info
        rec = {
            "task_id": task.task_id, "env": info["env"], "level": task.level, "family": task.family,
            "template_seen": task.template_seen,
            "success": bool(info["is_success"]), "return": float(info["return"]), "truncated": bool(self.truncated),
            "components": dict(info["reward_components"]), "n_calls": info["n_calls"],
            "n_violations": info["n_violations"], "n_failed": info["n_failed"], "verifier": info["verifier"],
            "answer": info["answer"], "ground_truth": info["ground_truth"], "steps": self.steps, "calls": info["calls"],
            "actions": self.actions, "step_rewards": self.rewards, "seed": self.seed,
            "tool_faults": dict(info["tool_faults"]),
        }
        if self.events is not None:
            rec.update(step_events=self.events, context_actions=dict(info["context_actions"]))
        return rec


class OneAction:
    """An 'episode' of one action from a given context (RolloutEngine.complete)."""

    def __init__(self, context: str, seed: int):
        self.context, self.seed, self.text = context, seed, None

    def step(self, text: str, token_limit: bool = False) -> tuple[bool, str, bool, str]:
        self.text = text
        return True, "", False, self.context

    def record(self) -> dict:
        return {"context": self.context, "text": self.text, "seed": self.seed}
