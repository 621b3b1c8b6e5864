"""The learned verifier as a reward component of `train` (``train.learned_reward``), and the guard's hook.

With ``coef`` > 0 every episode the learner trains on (after expert guidance) gets ``extra_reward = coef·score``,
``score = w·p_success + (1 − w)·p_sound``, added to ``record["extra_reward"]`` (other reward components add theirs
to the same field), to its ``return`` and to its last ``step_rewards`` entry (so per-turn credit sees it at the end).
The rule reward is then ``return − extra_reward``. The update's metrics get the means over all ranks
(``reward_model/score``, ``/p_success``, ``/p_sound``, ``/extra``, ``/rule_return``), identical on every rank, so
the guard (:mod:`pipeline.reward_model.guard`), which reads them back from the run's history, decides the same
everywhere and after a resume. When it fires: a log line, ``alarms/reward_hacking`` = 1, and (``guard_stop``) the
run stops like early stopping does (:meth:`LearnedReward.halt`): the best validated policy is the stage's output.

``coef`` 0 builds nothing and reads no model: the run is byte-identical to one without this module.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from pipeline.core.errors import AgentRLError
from pipeline.reward_model.config import LearnedRewardConfig
from pipeline.reward_model.guard import hacking_alarm
from pipeline.reward_model.model import RewardModel, load

SCORE, RULE = "reward_model/score", "reward_model/rule_return"
ALARM = "alarms/reward_hacking"


def rule_return(record: dict) -> float:
    """The environment's return of an episode without the extra reward components."""
    return float(record["return"]) - float(record.get("extra_reward", 0.0))


class LearnedReward:
    def __init__(self, cfg: LearnedRewardConfig, model: RewardModel, dist):
        self.cfg, self.model, self.dist = cfg, model, dist
        self.last: tuple[int, float, float] | None = None  # (update, learned slope, rule slope) of the last check

    def scores(self, records: list[dict]) -> np.ndarray:
        """(n, 3): score, p_success, p_sound of each record."""
        p = self.model.predict_steps([r["steps"] for r in records])
        if len(p) == 0:
            return np.zeros((0, 3))
        w = self.cfg.success_weight
        return np.column_stack([w * p[:, 0] + (1 - w) * p[:, 1], p[:, 0], p[:, 1]])

    def apply(self, records: list[dict], own: list[dict] | None = None) -> dict:
        """Add the learned reward to `records` in place; the update's metrics: means over every rank's records that
        are also in `own` (the policy's own episodes, by identity: expert episodes that replaced failed rollouts are
        paid but not counted, so the guard watches the policy); `own` None counts all."""
        s = self.scores(records)
        for r, (score, _, _) in zip(records, s):
            extra = self.cfg.coef * float(score)
            r["extra_reward"] = float(r.get("extra_reward", 0.0)) + extra
            r["return"] = float(r["return"]) + extra
            if r.get("step_rewards"):
                r["step_rewards"] = [*r["step_rewards"][:-1], float(r["step_rewards"][-1]) + extra]
        mine = {id(r) for r in own} if own is not None else {id(r) for r in records}
        keep = [i for i, r in enumerate(records) if id(r) in mine]
        local = (s[keep].sum(axis=0).tolist() if keep else [0.0, 0.0, 0.0],
                 sum(rule_return(records[i]) for i in keep), len(keep))
        parts = self.dist.all_gather(local)
        n = max(1, sum(p[2] for p in parts))
        sums = np.sum([p[0] for p in parts], axis=0)
        return {SCORE: float(sums[0] / n), "reward_model/p_success": float(sums[1] / n),
                "reward_model/p_sound": float(sums[2] / n), "reward_model/extra": float(self.cfg.coef * sums[0] / n),
                RULE: float(sum(p[1] for p in parts) / n)}

    def watch(self, history: list[dict], metrics: dict, update: int, log: Callable[[str], None] | None) -> bool:
        """Run the guard over the run's history (this update's entry last); record its metrics in `metrics`; True
        when training must stop."""
        rows = [h for h in history if SCORE in h and RULE in h]
        fired, s_learned, s_rule = hacking_alarm([h[SCORE] for h in rows], [h[RULE] for h in rows],
                                                 self.cfg.guard_window, self.cfg.guard_learned_slope,
                                                 self.cfg.guard_rule_slope)
        guard = {ALARM: float(fired)}
        if s_learned is not None:
            guard.update({"reward_model/guard_learned_slope": s_learned, "reward_model/guard_rule_slope": s_rule})
            self.last = (update, s_learned, s_rule)
        metrics.update(guard)
        if history:  # this update's entry (metrics/train_curve.csv, the checkpointed history)
            history[-1].update(guard)
        if fired and log is not None:
            log(f"warning: update {update}: reward-hacking alarm: over the last {self.cfg.guard_window} updates the "
                f"learned score rose {s_learned:+.4f}/update while the rule reward fell {s_rule:+.4f}/update"
                + ("; stopping training (the best validated policy is kept)" if self.cfg.guard_stop else ""))
        return fired and self.cfg.guard_stop

    def stop_reason(self, update: int) -> str:
        """Why the guard stops training at `update` (metrics/train.json's early-stopping reason)."""
        _, s_learned, s_rule = self.last or (update, float("nan"), float("nan"))
        return (f"stopped at update {update} by the reward-hacking guard: over the last {self.cfg.guard_window} "
                f"updates the learned score rose {s_learned:+.4f}/update while the rule reward fell "
                f"{s_rule:+.4f}/update")


def make_learned_reward(cfg: LearnedRewardConfig, env_name: str, dist) -> LearnedReward | None:
    """The learned reward of a run, None when ``coef`` is 0; a model trained on another environment is refused."""
    if cfg.coef == 0:
        return None
    model, meta = load(cfg.model)
    if meta.get("env") not in (None, env_name):
        raise AgentRLError(f"train.learned_reward.model {cfg.model} was trained on environment {meta.get('env')!r}, "
                           f"not {env_name!r}; rerun the `reward_model` stage")
    return LearnedReward(cfg, model, dist)
