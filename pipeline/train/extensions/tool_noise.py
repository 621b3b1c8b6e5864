"""Extension `tool_noise` (``train.exploration``; docs/design.md §3.2): annealed action noise on the tool an action
calls, through the rollout engine's sampling hook (:attr:`pipeline.policy.rollout.RolloutEngine.sampling_hook`).

**What it does.** With ``train.exploration.tool_noise`` = ε_max > 0, every RL rollout (never a greedy validation or
test episode) draws the tool of each action from the mixture (1 − ε_t)·π + ε_t·uniform(the episode's tools): right
after the policy samples ``<call>``, with probability ε_t the engine writes the name tokens of a uniformly chosen
tool, and the policy goes on with the parameters (:class:`pipeline.policy.sampling.ToolChoiceNoise`). ε_t anneals
linearly over the run's updates, ε_t = ε_max·(1 − t/T) with t the 0-based update and T = ``train.updates``
(:func:`annealed_epsilon`); ``anneal: false`` keeps ε_max.

**Why the learner needs no other change.** The rollout records, for every token of the tool name, the log-probability
of the marginal mixture's conditional q (not π's), so the recorded log-probabilities are those of the distribution
actually sampled from. The learner's policy term is always the clipped surrogate of π_θ/π_old times the truncated
importance weight w = min(``train.is_clip``, π_old/q) computed from those recorded log-probabilities: in the one-forward
step π_old is π_θ's own detached value (its ratio is exactly 1, and w = min(c, π_θ/q) carries the correction), with
several epochs or minibatches π_old is a no-grad forward before the first step. A noised action the policy would rarely
have taken gets w ≈ π_θ/(ε_t/K) ≪ 1; the policy's own tool choice gets w ≈ 1/(1 − ε_t) at most (truncated at c).

**Reported per update** (metrics, MLflow and ``train_curve.csv``): ``explore/epsilon`` (ε_t), ``explore/tool_choices``
(actions that opened a tool choice over all ranks) and ``explore/noised_action_share`` (the share of them whose tool
the noise drew).

Asynchronous rollouts (``train.async_rollouts``) with tool noise are refused (by the train config): their batches are
generated for the next update while the current one learns, and their engines are built by the worker; not wired here.
"""

from __future__ import annotations

from pipeline.train.extensions.base import Extension


def annealed_epsilon(eps_max: float, t: int, T: int, anneal: bool = True) -> float:
    """ε_t = ε_max·(1 − t/T) for update t in 0..T−1 (clamped at 0 beyond T); ε_max without annealing."""
    if not anneal:
        return float(eps_max)
    return float(eps_max) * max(0.0, 1.0 - t / T)


def attach_tool_noise(engine, cfg) -> None:
    """Give the RL rollout engine the tool-choice noise of ``cfg.exploration`` (`cfg`: the TrainConfig) as its
    sampling hook."""
    from pipeline.policy.sampling import ToolChoiceNoise
    from pipeline.policy.tokenizer import CALL_OPEN, encode_continuation, marker_ids

    tok = engine.tokenizer  # a name's plain-text tokens (a chat template's action delta would add its turn tokens)
    engine.sampling_hook = ToolChoiceNoise(marker_ids(tok)[CALL_OPEN], lambda name: encode_continuation(tok, name))


def begin_update(engine, cfg, u: int) -> None:
    """Set ε_t of update `u` (0-based) before its rollouts and reset the counts."""
    engine.sampling_hook.reset(annealed_epsilon(cfg.exploration.tool_noise, u, cfg.updates, cfg.exploration.anneal))


def exploration_metrics(engine, dist) -> dict:
    """The update's ε_t and the counts of its tool choices over all ranks."""
    noise = engine.sampling_hook
    parts = dist.all_gather((noise.stats["actions"], noise.stats["noised"]))
    actions, noised = sum(a for a, _ in parts), sum(n for _, n in parts)
    return {"explore/epsilon": noise.epsilon, "explore/tool_choices": actions,
            "explore/noised_action_share": noised / actions if actions else 0.0}


class ToolNoise(Extension):
    """On when ``train.exploration.tool_noise`` > 0."""

    name = "tool_noise"
    curve_keys = ("explore/epsilon", "explore/tool_choices", "explore/noised_action_share")

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(cfg) if cfg.exploration.tool_noise > 0 else None

    def attach(self, loop) -> None:
        attach_tool_noise(loop.rollout, self.cfg)

    def begin_update(self, loop, u: int) -> None:
        begin_update(loop.rollout, self.cfg, u)

    def after_learn(self, loop, u: int, records: list[dict]) -> dict:
        return exploration_metrics(loop.rollout, loop.dist)
