"""Extension `adversarial` (``train.sampling.adversarial``; docs/design.md §2.2 and §3.4: oversample the failure cases).

It works inside a level, after the curriculum chose it: task g gets weight max(floor, 1 − s_g)^k, s_g its success
rate over its last `window` episodes (every rank's, so the state stays the same on all ranks); a task not tried yet
counts as failed (weight 1). With goal sampling on, the weight multiplies p(g) ∝ 1/(count(g)+1), so rarely tried and
often failed tasks both come first.

Metrics, every update: ``sampling/adversarial_tasks_seen``, ``sampling/adversarial_task_success`` (mean recent
success over the tasks seen) and ``sampling/adversarial_planned_weight`` (mean weight of the tasks the plan drew).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.train.extensions.base import Extension


def failure_weights(success, floor: float, power: float) -> np.ndarray:
    """max(floor, 1 − s)^power per task; a task without outcomes (s = nan) counts as failed.

    >>> failure_weights([1.0, 0.5, float("nan")], 0.1, 2.0).round(4).tolist()
    [0.01, 0.25, 1.0]
    """
    s = np.nan_to_num(np.asarray(success, dtype=np.float64), nan=0.0)
    return np.maximum(floor, 1.0 - s) ** power


class TaskFailures:
    """Recent success of each task (its last `window` episodes), for adversarial task sampling."""

    def __init__(self, floor: float, power: float, window: int):
        self.floor, self.power, self.window = floor, power, window
        self.outcomes: dict[str, deque] = {}
        self.planned: list[float] = []  # weights of the tasks the last plan drew (reported)

    def update(self, task_ids, successes) -> None:
        for t, s in zip(task_ids, successes):
            self.outcomes.setdefault(t, deque(maxlen=self.window)).append(float(s))

    def success(self, task_id: str) -> float:
        o = self.outcomes.get(task_id)
        return sum(o) / len(o) if o else float("nan")

    def weights(self, task_ids: list[str]) -> np.ndarray:
        return failure_weights([self.success(t) for t in task_ids], self.floor, self.power)

    def state_dict(self) -> dict:
        return {"outcomes": {t: list(o) for t, o in self.outcomes.items()}, "planned": list(self.planned)}

    def load_state_dict(self, state: dict) -> None:
        self.outcomes = {t: deque(o, maxlen=self.window) for t, o in state["outcomes"].items()}
        self.planned = list(state["planned"])


class AdversarialSampling(Extension):
    """On when ``train.sampling.adversarial``; its state is the :class:`TaskFailures`."""

    name = "adversarial"
    curve_keys = ("sampling/adversarial_planned_weight",)

    def __init__(self, failures: TaskFailures):
        self.tasks = failures

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        s = cfg.sampling
        return cls(TaskFailures(s.adversarial_floor, s.adversarial_power, s.adversarial_window)) if s.adversarial else None

    def task_weights(self, loop, task_ids: list[str]) -> np.ndarray:
        return self.tasks.weights(task_ids)

    def plan(self, loop, tasks: list) -> list:
        # the weights of the drawn tasks, as they were when drawn (nothing updates them within a plan)
        self.tasks.planned = [float(self.tasks.weights([t.task_id])[0]) for t in tasks]
        return tasks

    def observe(self, loop, u: int, records: list[dict]) -> dict:
        """Every rank's (task, success) of the update's own episodes into the task outcomes."""
        gathered = loop.dist.all_gather([(r["task_id"], r["success"]) for r in records])
        outcomes = [o for part in gathered for o in part]
        self.tasks.update([t for t, _ in outcomes], [s for _, s in outcomes])
        known = [self.tasks.success(t) for t in self.tasks.outcomes]
        planned = self.tasks.planned
        return {"sampling/adversarial_tasks_seen": len(known),
                "sampling/adversarial_task_success": float(np.mean(known)),
                "sampling/adversarial_planned_weight": float(np.mean(planned)) if planned else 0.0}

    def state_dict(self) -> dict:
        return self.tasks.state_dict()

    def load_state_dict(self, state: dict, loop) -> None:
        self.tasks.load_state_dict(state)
