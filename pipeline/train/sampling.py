"""What the RL phase samples and the state that drives it (docs/design.md §2.1, §2.2, §3.2, §3.4): reward
normalisation, adaptive entropy coefficient, curriculum with success-following level weights, count-based goal
sampling, and :func:`plan_update`, which draws an update's tasks from them. Two jobs, two holders of state for
checkpoints: :class:`TaskSampler` (which tasks: curriculum, goals, their generator) and :class:`LearnerState` (how
the learner scores: the normaliser's window, the entropy coefficient). An extension may weigh the tasks of a level (:meth:`pipeline.train.extensions.base.Extension.task_weights`).

Each is a small class with explicit state, `state_dict()`/`load_state_dict()` so checkpoints restore it exactly,
and no hidden randomness: callers pass a `numpy.random.Generator`. Playing the episodes is the rollout engine's job.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.core.errors import AgentRLError
from pipeline.envs.contract import TaskFields as Task
from pipeline.train.config import TrainConfig


class RewardNormalizer:
    """R' = (R − μ)/σ over the last `window` episode returns (docs/design.md §2.2, dynamic reward reshaping)."""

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
    kept within [`min_coef`, `max_coef`] (docs/design.md §2.1: λ in 0.01–0.1; 4.2: a dynamic entropy coefficient)."""

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
    """p(g) ∝ 1/(count(g) + 1) over the tasks of a level (docs/design.md §3.2: goal sampling towards rarely tried
    goals)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def probabilities(self, task_ids: list[str], weights: np.ndarray | None = None) -> np.ndarray:
        inv = np.array([1.0 / (self.counts.get(t, 0) + 1) for t in task_ids])
        if weights is not None:  # per-task weights (an extension's)
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


@dataclass
class TaskSampler:
    """Which tasks an update plays, the same on every rank: the curriculum over levels, the goal sampler within a
    level, and the generator both draw from (checkpointed with the engine)."""

    curriculum: Curriculum
    goals: GoalSampler
    rng: np.random.Generator

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict(), "goals": self.goals.state_dict(),
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, s: dict) -> None:
        self.curriculum.load_state_dict(s["curriculum"])
        self.goals.load_state_dict(s["goals"])
        self.rng.bit_generator.state = s["rng"]


@dataclass
class LearnerState:
    """What the learner adapts from one update to the next: the reward normaliser's window (None: off) and the
    entropy coefficient (checkpointed with the engine)."""

    normalizer: RewardNormalizer | None
    entropy: AdaptiveEntropyCoef

    def state_dict(self) -> dict:
        return {"normalizer": self.normalizer.state_dict() if self.normalizer else None,
                "entropy": self.entropy.state_dict()}

    def load_state_dict(self, s: dict) -> None:
        if self.normalizer is not None and s["normalizer"] is not None:
            self.normalizer.load_state_dict(s["normalizer"])
        self.entropy.load_state_dict(s["entropy"])


def make_task_sampler(cfg: TrainConfig, levels: list[int] = (1, 2, 3, 4)) -> TaskSampler:
    """The task sampler for training tasks of `levels`; the curriculum opens at the highest of them not above
    `curriculum_start_level` (the lowest level when all lie above it)."""
    levels = sorted(levels)
    start = max([lv for lv in levels if lv <= cfg.curriculum_start_level] or levels[:1])
    return TaskSampler(curriculum=Curriculum(list(levels), start, cfg.curriculum_threshold, cfg.level_weight_floor,
                                             cfg.level_success_window),
                       goals=GoalSampler(), rng=np.random.default_rng([cfg.seed, 7]))


def make_learner_state(cfg: TrainConfig) -> LearnerState:
    """The reward normaliser (`reward_norm_window`) and the adaptive entropy coefficient of a run."""
    return LearnerState(
        normalizer=RewardNormalizer(cfg.reward_norm_window) if cfg.reward_norm_window else None,
        entropy=AdaptiveEntropyCoef(cfg.entropy_coef, cfg.entropy_target or 0.0, max_coef=cfg.entropy_coef_max))


def plan_update(state: TaskSampler, tasks_by_level: dict[int, list[Task]], cfg: TrainConfig,
                weights: Callable[[list[str]], np.ndarray | None] | None = None) -> list[Task]:
    """The update's tasks (same on every rank, since the state is): stratified levels, goal-sampled tasks.
    `weights(task_ids)`, when given and not None, multiplies the sampling weights of a level's tasks (an extension's,
    :meth:`pipeline.train.extensions.base.Extension.task_weights`)."""
    levels = state.curriculum.sample_levels(cfg.tasks_per_update, state.rng)
    chosen = []
    for lv in levels:
        pool = tasks_by_level.get(lv) or []
        if not pool:
            raise AgentRLError(f"no training task of level {lv}; the curriculum cannot sample it")
        ids = [t.task_id for t in pool]
        w = weights(ids) if weights is not None else None
        if cfg.goal_sampling:
            tid = state.goals.sample(ids, 1, state.rng, w)[0]
        elif w is not None:
            tid = ids[int(state.rng.choice(len(ids), p=w / w.sum()))]
        else:
            tid = ids[int(state.rng.integers(len(ids)))]
        chosen.append(next(t for t in pool if t.task_id == tid))
    return chosen
