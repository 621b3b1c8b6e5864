"""Extension `learned_reward` (``train.learned_reward.coef`` > 0): the learned verifier of the `reward_model` stage
as a reward component, extra_reward = coef·score, and the reward-hacking guard that stops training when the learned
score rises while the rule reward falls. The verifier and the guard are :mod:`pipeline.reward_model.reward`'s; this
module only joins them to the loop.

Before learning, every record the learner will see is paid (the expert's demonstrations too), while the metrics and
the guard count only the policy's own episodes. After the update's figures joined the history, the guard looks at
its window; when it fires (and ``guard_stop``), the run stops like early stopping, after a validation if none has
been kept yet.
"""

from __future__ import annotations

from pipeline.reward_model.reward import LearnedReward, make_learned_reward
from pipeline.train.extensions.base import Extension


class LearnedRewardTerm(Extension):
    name = "learned_reward"
    curve_keys = ("reward_model/score", "reward_model/rule_return", "alarms/reward_hacking")

    def __init__(self, cfg, env_name: str):
        self.cfg, self.env_name = cfg, env_name
        self.reward: LearnedReward | None = None  # read in attach, where the ranks are known

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(cfg.learned_reward, env_cfg.name) if cfg.learned_reward.coef > 0 else None

    def attach(self, loop) -> None:
        self.reward = make_learned_reward(self.cfg, self.env_name, loop.dist)

    def before_learn(self, loop, u: int, records: list[dict], own: list[dict]) -> tuple[list[dict], dict]:
        return records, self.reward.apply(records, own)

    def should_stop(self, loop, u: int, metrics: dict) -> str | None:
        log = loop.hooks.log if loop.dist.is_main else None
        if self.reward.watch(loop.history, metrics, u + 1, log):
            return self.reward.stop_reason(u + 1)
        return None
