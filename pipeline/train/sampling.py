"""What the RL phase samples and the state that drives it (design document, sections 2.1, 2.2, 3.2, 3.4): reward
normalisation, adaptive entropy coefficient, curriculum with success-following level weights, count-based goal
sampling, adversarial task sampling (:class:`TaskFailures`, `train.sampling.adversarial`), the replay store
(:class:`pipeline.train.replay.ReplayStore`, `train.sampling.replay`), and :func:`plan_update`, which draws an
update's tasks from them (:class:`SamplerState` bundles them for checkpoints).

Adversarial sampling (design document 2.2 and 3.4: oversample the failure cases) works inside a level, after the
curriculum chose it: task g gets weight max(floor, 1 − s_g)^k, s_g its success rate over its last `window` episodes
(every rank's, so the state stays the same on all ranks); a task not tried yet counts as failed (weight 1). With goal
sampling on, the weight multiplies p(g) ∝ 1/(count(g)+1), so rarely tried and often failed tasks both come first.

Each is a small class with explicit state, `state_dict()`/`load_state_dict()` so checkpoints restore it exactly,
and no hidden randomness: callers pass a `numpy.random.Generator`. Playing the episodes is the rollout engine's job.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.core.errors import AgentRLError
from pipeline.envs.contract import TaskFields as Task
from pipeline.train.config import TrainConfig
from pipeline.train.replay import ReplayStore


class RewardNormalizer:
    """R' = (R − μ)/σ over the last `window` episode returns (design document 2.2, dynamic reward reshaping)."""

    def __init__(self, window: int, eps: float = 1e-6):
        if window < 2:
            raise ValueError(f"reward normalisation window must be at least 2, got {window}")
        self.window, self.eps = window, eps
        self.history: deque[float] = deque(maxlen=window)

    def update(self, rewards) -> None:
        self.history.extend(float(r) for r in rewards)

    def affine(self) -> tuple[float, float]:
        """(shift, scale) with normalize(r) = (r − shift) / scale: (0, 1) until two returns are known."""
        if len(self.history) < 2:
            return 0.0, 1.0
        h = np.asarray(self.history)
        return float(h.mean()), float(h.std() + self.eps)

    def normalize(self, rewards) -> np.ndarray:
        shift, scale = self.affine()
        return (np.asarray(rewards, dtype=np.float64) - shift) / scale

    def state_dict(self) -> dict:
        return {"window": self.window, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.window = state["window"]
        self.history = deque(state["history"], maxlen=self.window)


class AdaptiveEntropyCoef:
    """λ of L = L_RL − λ·H(π): rises (×`rate`) while entropy is below `target`, decays back towards `init` above it,
    kept within [`min_coef`, `max_coef`] (design document 2.1: λ in 0.01–0.1; 4.2: a dynamic entropy coefficient)."""

    def __init__(self, init: float, target: float, rate: float = 1.5, min_coef: float = 0.0, max_coef: float = 0.1):
        self.value, self.init, self.target, self.rate = init, init, target, rate
        self.min_coef, self.max_coef = min_coef, max_coef

    def update(self, entropy: float) -> float:
        if entropy < self.target:
            self.value = max(self.value, 1e-4) * self.rate
        else:
            self.value = self.init + (self.value - self.init) / self.rate
        self.value = float(np.clip(self.value, self.min_coef, self.max_coef))
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Curriculum:
    """Difficulty levels unlocked in order: the next level opens when recent success on the highest open level
    passes `threshold`. Among open levels, weights follow recent failure, max(`floor`, 1 − success), so rollouts go
    where the policy still fails (this is what made RL take off, in 3 runs of 3)."""

    def __init__(self, levels: list[int], start_level: int, threshold: float, floor: float = 0.1, window: int = 64):
        if start_level not in levels:
            raise ValueError(f"start level {start_level} is not one of {levels}")
        self.levels = sorted(levels)
        self.max_open = start_level
        self.threshold, self.floor, self.window = threshold, floor, window
        self.outcomes: dict[int, deque] = {lv: deque(maxlen=window) for lv in self.levels}

    @property
    def open_levels(self) -> list[int]:
        return [lv for lv in self.levels if lv <= self.max_open]

    def success(self, level: int) -> float | None:
        o = self.outcomes[level]
        return sum(o) / len(o) if o else None

    def update(self, levels, successes) -> None:
        for lv, s in zip(levels, successes):
            self.outcomes[int(lv)].append(float(s))
        top = self.success(self.max_open)
        if (top is not None and len(self.outcomes[self.max_open]) >= min(16, self.window)
                and top >= self.threshold and self.max_open < self.levels[-1]):
            self.max_open = self.levels[self.levels.index(self.max_open) + 1]

    def weights(self) -> dict[int, float]:
        w = {}
        for lv in self.open_levels:
            s = self.success(lv)
            w[lv] = max(self.floor, 1.0 - (s if s is not None else 0.0))
        total = sum(w.values())
        return {lv: v / total for lv, v in w.items()}

    def sample_levels(self, n: int, rng: np.random.Generator) -> list[int]:
        """Stratified: each open level gets round(n·weight) draws (largest remainders fill the rest)."""
        w = self.weights()
        exact = {lv: n * p for lv, p in w.items()}
        counts = {lv: int(np.floor(x)) for lv, x in exact.items()}
        for lv in sorted(exact, key=lambda lv: exact[lv] - counts[lv], reverse=True)[: n - sum(counts.values())]:
            counts[lv] += 1
        out = [lv for lv, c in counts.items() for _ in range(c)]
        rng.shuffle(out)
        return out

    def state_dict(self) -> dict:
        return {"max_open": self.max_open, "outcomes": {lv: list(o) for lv, o in self.outcomes.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.max_open = state["max_open"]
        self.outcomes = {int(lv): deque(o, maxlen=self.window) for lv, o in state["outcomes"].items()}


class GoalSampler:
    """p(g) ∝ 1/(count(g) + 1) over the tasks of a level (design document 3.2: goal sampling towards rarely tried
    goals)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def probabilities(self, task_ids: list[str], weights: np.ndarray | None = None) -> np.ndarray:
        inv = np.array([1.0 / (self.counts.get(t, 0) + 1) for t in task_ids])
        if weights is not None:  # adversarial sampling's per-task weights
            inv = inv * weights
        return inv / inv.sum()

    def sample(self, task_ids: list[str], n: int, rng: np.random.Generator,
               weights: np.ndarray | None = None) -> list[str]:
        p = self.probabilities(task_ids, weights)
        picks = rng.choice(len(task_ids), size=n, replace=n > len(task_ids), p=p)
        chosen = [task_ids[i] for i in picks]
        for t in chosen:
            self.counts[t] = self.counts.get(t, 0) + 1
        return chosen

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = dict(state["counts"])


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


def observe_tasks(state: "SamplerState", records: list[dict], dist) -> dict:
    """Every rank's (task, success) of an update's own episodes into the adversarial sampler; its metrics ({} when
    it is off)."""
    if state.tasks is None:
        return {}
    outcomes = [o for part in dist.all_gather([(r["task_id"], r["success"]) for r in records]) for o in part]
    state.tasks.update([t for t, _ in outcomes], [s for _, s in outcomes])
    known = [state.tasks.success(t) for t in state.tasks.outcomes]
    return {"sampling/adversarial_tasks_seen": len(known), "sampling/adversarial_task_success": float(np.mean(known)),
            "sampling/adversarial_planned_weight": float(np.mean(state.tasks.planned)) if state.tasks.planned else 0.0}


@dataclass
class SamplerState:
    """Everything the task sampling depends on; checkpointed with the engine."""

    curriculum: Curriculum
    goals: GoalSampler
    normalizer: RewardNormalizer | None
    entropy: AdaptiveEntropyCoef
    rng: np.random.Generator
    reward_weights: Any = None  # train.reward.weighting state (pipeline.train.reward_weights); None: fixed
    tasks: TaskFailures | None = None  # adversarial task sampling (train.sampling.adversarial)
    replay: ReplayStore | None = None  # the replay store (train.sampling.replay)

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict(), "goals": self.goals.state_dict(),
                "normalizer": self.normalizer.state_dict() if self.normalizer else None,
                "entropy": self.entropy.state_dict(), "rng": self.rng.bit_generator.state,
                **({"reward_weights": self.reward_weights.state_dict()} if self.reward_weights is not None else {}),
                **{k: getattr(self, k).state_dict() for k in ("tasks", "replay") if getattr(self, k) is not None}}

    def load_state_dict(self, s: dict) -> None:
        self.curriculum.load_state_dict(s["curriculum"])
        self.goals.load_state_dict(s["goals"])
        if self.normalizer is not None and s["normalizer"] is not None:
            self.normalizer.load_state_dict(s["normalizer"])
        self.entropy.load_state_dict(s["entropy"])
        self.rng.bit_generator.state = s["rng"]
        if self.reward_weights is not None and s.get("reward_weights") is not None:
            self.reward_weights.load_state_dict(s["reward_weights"])
        for key in ("tasks", "replay"):
            if getattr(self, key) is not None and s.get(key) is not None:
                getattr(self, key).load_state_dict(s[key])


def make_sampler_state(cfg: TrainConfig, levels: list[int] = (1, 2, 3, 4)) -> SamplerState:
    """The sampling state for training tasks of `levels`; the curriculum opens at the highest of them not above
    `curriculum_start_level` (the lowest level when all lie above it)."""
    levels = sorted(levels)
    start = max([lv for lv in levels if lv <= cfg.curriculum_start_level] or levels[:1])
    return SamplerState(
        curriculum=Curriculum(list(levels), start, cfg.curriculum_threshold,
                              cfg.level_weight_floor, cfg.level_success_window),
        goals=GoalSampler(),
        normalizer=RewardNormalizer(cfg.reward_norm_window) if cfg.reward_norm_window else None,
        entropy=AdaptiveEntropyCoef(cfg.entropy_coef, cfg.entropy_target or 0.0, max_coef=cfg.entropy_coef_max),
        rng=np.random.default_rng([cfg.seed, 7]),
        tasks=(TaskFailures(cfg.sampling.adversarial_floor, cfg.sampling.adversarial_power,
                            cfg.sampling.adversarial_window) if cfg.sampling.adversarial else None),
        replay=ReplayStore(cfg.sampling.capacity, cfg.seed) if cfg.sampling.replay else None,
    )


def plan_update(state: SamplerState, tasks_by_level: dict[int, list[Task]], cfg: TrainConfig) -> list[Task]:
    """The update's tasks (same on every rank, since the state is): stratified levels, goal-sampled tasks."""
    levels = state.curriculum.sample_levels(cfg.tasks_per_update, state.rng)
    chosen = []
    if state.tasks is not None:
        state.tasks.planned = []
    for lv in levels:
        pool = tasks_by_level.get(lv) or []
        if not pool:
            raise AgentRLError(f"no training task of level {lv}; the curriculum cannot sample it")
        ids = [t.task_id for t in pool]
        w = state.tasks.weights(ids) if state.tasks is not None else None  # adversarial sampling
        if cfg.goal_sampling:
            tid = state.goals.sample(ids, 1, state.rng, w)[0]
        elif w is not None:
            tid = ids[int(state.rng.choice(len(ids), p=w / w.sum()))]
        else:
            tid = ids[int(state.rng.integers(len(ids)))]
        if w is not None:
            state.tasks.planned.append(float(w[ids.index(tid)]))
        chosen.append(next(t for t in pool if t.task_id == tid))
    return chosen
