"""Early stopping on a validation metric, with patience (docs/design.md §5.2.2, item 3).

The training loop evaluates the policy greedily on the validation split every `eval_every` updates and feeds the chosen
metric to :meth:`EarlyStopping.update`, which answers with a :class:`Decision`: whether this evaluation is a new best
(the loop then saves the policy as the stage's output, so the best checkpoint, not the last, is what the stage
produces), and whether to stop, with the reason in words.

Rules, all in one place:

- higher is better (every metric in :data:`METRICS` is one to maximise);
- an evaluation *improves* when its value exceeds the best so far by more than `min_delta` (the first evaluation
  always improves); a tie keeps the earlier best, so the earlier, equally good policy stays the output;
- after `patience` consecutive evaluations without improvement, training stops; `patience=None` never stops (the best
  policy is still tracked and kept);
- a NaN value never improves (it counts towards the patience).

The state (:meth:`EarlyStopping.state_dict`) is plain JSON-able data and is saved in every training checkpoint, so a
killed run resumes with the same best value and the same count of evaluations since the best, and decides exactly as
the uninterrupted run would have.

Deliberately left out: "min" mode (no metric here is a loss) and learning-rate reduction on a plateau.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass


def _overall(key: str) -> Callable[[Mapping], float]:
    return lambda summary: float(summary["overall"][key])


def _level_mean(summary: Mapping) -> float:
    levels = summary["per_level"]
    return float(sum(s["success_rate"] for s in levels.values()) / len(levels)) if levels else math.nan


# validation metric name -> how to read it from `pipeline.policy.episodes.summarize` output (all maximised)
METRICS: dict[str, Callable[[Mapping], float]] = {
    "success": _overall("success_rate"),
    "mean_return": _overall("mean_return"),
    # every level weighs the same, whatever its share of the validation tasks: a climb on the hardest level is not
    # drowned by the three levels that start near their ceiling, and a fall on one of them costs as much
    "level_mean_success": _level_mean,
}


def metric_value(name: str, summary: Mapping) -> float:
    """The metric `name` of an evaluation summary; an unknown name fails and lists the known ones."""
    try:
        read = METRICS[name]
    except KeyError:
        raise ValueError(f"unknown early-stopping metric {name!r}; known metrics are {sorted(METRICS)}") from None
    return read(summary)


@dataclass(frozen=True)
class Decision:
    """The outcome of one evaluation: `improved` (a new best: keep this policy), `stop`, and the `reason` in words."""

    step: int
    value: float
    improved: bool
    stop: bool
    best_value: float
    best_step: int | None
    evals_since_best: int
    reason: str


class EarlyStopping:
    """Patience-based early stopping on a maximised metric; pure (no I/O, no clock), so a scripted curve tests it.

    >>> es = EarlyStopping("success", patience=2, min_delta=0.0)
    >>> [(d.step, d.improved, d.stop) for d in (es.update(v, s) for s, v in [(10, .2), (20, .5), (30, .4), (40, .5)])]
    [(10, True, False), (20, True, False), (30, False, False), (40, False, True)]
    >>> es.best_step, es.stopped
    (20, True)
    """

    def __init__(self, metric: str, patience: int | None, min_delta: float = 0.0):
        if metric not in METRICS:
            raise ValueError(f"unknown early-stopping metric {metric!r}; known metrics are {sorted(METRICS)}")
        if patience is not None and patience < 1:
            raise ValueError(f"patience must be at least 1 evaluation (or None to never stop), got {patience}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta}")
        self.metric, self.patience, self.min_delta = metric, patience, float(min_delta)
        self.best_value = -math.inf
        self.best_step: int | None = None
        self.evals_since_best = 0
        self.stopped = False
        self.stop_step: int | None = None
        self.reason = ""
        self.history: list[dict] = []

    def halt(self, step: int, reason: str) -> None:
        """Stop at `step` for another `reason` than the validation metric (an extension's, e.g. the reward-hacking
        guard): the run ends as an early-stopped one, its best validated policy the output. No-op once stopped."""
        if not self.stopped:
            self.stopped, self.stop_step, self.reason = True, step, reason

    def update(self, value: float, step: int) -> Decision:
        """Record the evaluation at `step` (the update count); returns the decision. Refused once stopped."""
        if self.stopped:
            raise RuntimeError(f"early stopping already stopped training at step {self.stop_step}: {self.reason}")
        value = float(value)
        improved = not math.isnan(value) and value > self.best_value + self.min_delta
        if improved:
            previous = self.best_value
            self.best_value, self.best_step, self.evals_since_best = value, step, 0
            reason = (f"{self.metric} {value:.4g} is the first evaluation" if previous == -math.inf else
                      f"{self.metric} improved to {value:.4g} (from {previous:.4g})")
        else:
            self.evals_since_best += 1
            reason = (f"{self.metric} {value:.4g} did not improve on the best {self.best_value:.4g} (update "
                      f"{self.best_step}) by more than {self.min_delta:g} for {self.evals_since_best} evaluation(s)")
        stop = self.patience is not None and self.evals_since_best >= self.patience
        if stop:
            self.stopped, self.stop_step = True, step
            reason = (f"stopped at update {step}: {self.metric} did not improve on its best {self.best_value:.4g} "
                      f"(update {self.best_step}) by more than {self.min_delta:g} in {self.patience} consecutive "
                      f"evaluation(s)")
            self.reason = reason
        decision = Decision(step, value, improved, stop, self.best_value, self.best_step, self.evals_since_best,
                            reason)
        self.history.append({"step": step, "value": value, "improved": improved, "stop": stop})
        return decision

    def summary(self, completed_all: bool | None = None) -> dict:
        """What metrics/train.json records: the settings, the best, and whether and why training stopped."""
        reason = self.reason
        if not self.stopped and completed_all:
            reason = ("ran every update; " + ("early stopping is disabled (patience null)" if self.patience is None
                                              else f"{self.metric} never went {self.patience} evaluations without "
                                                   f"improving"))
        return {"metric": self.metric, "patience": self.patience, "min_delta": self.min_delta,
                "stopped": self.stopped, "stop_update": self.stop_step, "reason": reason,
                "best_update": self.best_step, "best_value": None if self.best_step is None else self.best_value,
                "evals_since_best": self.evals_since_best, "evaluations": len(self.history)}

    # -------------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"metric": self.metric, "patience": self.patience, "min_delta": self.min_delta,
                "best_value": None if self.best_step is None else self.best_value, "best_step": self.best_step,
                "evals_since_best": self.evals_since_best, "stopped": self.stopped, "stop_step": self.stop_step,
                "reason": self.reason, "history": [dict(h) for h in self.history]}

    def load_state_dict(self, state: Mapping) -> None:
        mine = (self.metric, self.patience, self.min_delta)
        theirs = (state["metric"], state["patience"], float(state["min_delta"]))
        if mine != theirs:
            raise ValueError(f"early-stopping state was saved with (metric, patience, min_delta)={theirs}, "
                             f"not {mine}")
        self.best_value = -math.inf if state["best_step"] is None else float(state["best_value"])
        self.best_step = state["best_step"]
        self.evals_since_best = int(state["evals_since_best"])
        self.stopped, self.stop_step, self.reason = bool(state["stopped"]), state["stop_step"], state["reason"]
        self.history = [dict(h) for h in state["history"]]


__all__ = ["METRICS", "Decision", "EarlyStopping", "metric_value"]
