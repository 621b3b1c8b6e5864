"""Extension `time_budget` (``train.time_budget_s``): RL stops when the next validation would end after its
wall-clock budget, the way early stopping stops it (the best validated policy is the output).

The clock counts this stage's updates, validations and checkpoints from the first update (a resumed run goes on
from the time its checkpoint recorded); the setup before it and the test evaluation after it are outside the budget.
The decision is taken where it loses nothing: at an update that is validated anyway, the run goes on only if the
next stretch, ``train.eval_every`` updates at their mean duration and the validation after them, still fits. Until
a validation has been timed its cost is estimated from the updates' rollouts (a validation plays
``train.eval_tasks`` greedy episodes where an update plays ``tasks_per_update × group_size`` sampled ones). Should
the time run out between validations anyway (an update far slower than the mean), the run stops there.

Every rank takes the same decision: a stop on any rank (their clocks differ by a few milliseconds) stops all. The
budget is one run's: each member of a population (``train.population``) is such a run and gets it whole.
"""

from __future__ import annotations

import time

from pipeline.train.extensions.base import Extension


class TimeBudget(Extension):
    name = "time_budget"
    curve_keys = ("budget/left_s",)

    def __init__(self, seconds: float, cfg):
        self.seconds, self.cfg = seconds, cfg
        self.used_before = 0.0  # seconds of earlier processes of this run (from the checkpoint)
        self.start: float | None = None
        self.update_s: list[float] = []  # each update's duration, up to its stop check
        self.rollout_s: list[float] = []
        self.eval_s: list[float] = []  # measured validations (with the checkpoint and logging around them)
        self._t_begin = 0.0
        self._t_check: float | None = None  # when the previous update's stop check ended
        self._validated = False  # the previous update was validated

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(cfg.time_budget_s, cfg) if cfg.time_budget_s is not None else None

    def used(self) -> float:
        return self.used_before + (time.perf_counter() - self.start if self.start is not None else 0.0)

    def begin_update(self, loop, u: int) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        if self._t_check is not None and self._validated:
            self.eval_s.append(now - self._t_check)
        self._t_begin = now

    def eval_estimate(self) -> float:
        """Seconds of one validation: the measured mean, or the updates' rollout time scaled to its episodes."""
        if self.eval_s:
            return sum(self.eval_s) / len(self.eval_s)
        per_episode = (sum(self.rollout_s) / max(1, len(self.rollout_s))) / (
            self.cfg.tasks_per_update * self.cfg.group_size)
        return per_episode * self.cfg.eval_tasks

    def should_stop(self, loop, u: int, metrics: dict) -> str | None:
        now = time.perf_counter()
        self.update_s.append(now - self._t_begin)
        self.rollout_s.append(float(metrics.get("sys/rollout_s", 0.0)))
        self._validated = loop.validation.due(u + 1)
        left = self.seconds - self.used()
        mean_update = sum(self.update_s) / len(self.update_s)
        if self._validated:  # this validation, then the next stretch and its validation
            need = 2 * self.eval_estimate() + self.cfg.eval_every * mean_update
        else:
            need = 0.0
        stop = left < need or left <= 0
        stop = any(loop.dist.all_gather(stop))
        metrics["budget/left_s"] = left
        if loop.history:
            loop.history[-1]["budget/left_s"] = left
        self._t_check = time.perf_counter()
        if not stop:
            return None
        return (f"train.time_budget_s: {self.used():.0f} s of {self.seconds:.0f} s used at update {u + 1}; "
                f"{'the next validated stretch needs about ' + format(need, '.0f') + ' s' if need else 'time is up'}")

    def state_dict(self) -> dict:
        return {"used_s": self.used()}

    def load_state_dict(self, state: dict, loop) -> None:
        self.used_before = float(state.get("used_s", 0.0))
