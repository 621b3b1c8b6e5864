"""Fitting a training loop's steps into wall-clock seconds (``adapt.time_budget_s``).

A :class:`StepBudget` starts its clock when it is made. The loop (:func:`pipeline.adapt.sft.train_lm`) times its first
`probe` steps as configured; then the budget plans the run: the most steps whose training time, at the measured
seconds per step, and checks (SFT's checkpoint selection) fit in the time left, never more than configured. The
learning-rate schedule spans the planned steps from then on: the plan comes at the end of the warm-up, whose rate does
not depend on the total, so the run is a shorter schedule of the same shape, not a longer one cut off. Every `probe`
steps and after every check the plan is made again, at the mean seconds per step so far and the checks' measured cost
(until a check has been timed a share `reserve` of the time left is held for them); a new plan can only shorten the
run, and one line is printed when it shortens it by 2 % or more. Why again: in one built-in world the probe measured
1.15 s a step and the next 670 steps ran at 1.38, so a plan made once would have run out of time. Should the time
still run out, the loop stops after the step that used it up, as an early stop does.

The checks keep their share of the schedule: configured to start at step `check_from` of `steps`, they start at the
same fraction of the planned run (:meth:`StepBudget.check_from_step`), every `check_every` steps as configured.

A loop whose configured schedule is a maximum rather than a plan (continued pre-training, which stops at its copy
target, most often well before its last step) keeps that schedule (``shorten=False``) and only stops when its time is
up: a shorter schedule lowers its learning rate before the copying skill forms. Measured in one built-in world with
``adapt.time_budget_s: 1350``: pre-training planned to 773 of 1,200 steps ended at an exact-copy accuracy of 0.17,
where the configured schedule had reached 0.57 at step 700 and 0.83 at step 800, and the adapted model failed the
capability gate.

What the budget does not cover is the caller's to say: adapt's budget covers continued pre-training and SFT with its
selection checks, not the capability evaluation after them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# the most of adapt's budget continued pre-training may take: in the two built-in worlds' committed runs it ran its
# 1,200 steps in 32 % of adapt's time, or reached its copy target in 12 %
PRETRAIN_SHARE = 1 / 3
RESERVE = 0.15  # share of the time left held for checks until one has been timed (SFT's selection took 10-12 %)


@dataclass
class StepBudget:
    seconds: float  # wall-clock seconds from the budget's creation
    steps: int  # the configured number of steps (the most the plan allows)
    probe: int  # steps timed before the first plan (at least 2)
    check_every: int = 0  # cadence of the loop's checks (0: none)
    check_from: int = 0  # the configured first check step
    reserve: float = RESERVE
    name: str = "training"  # the loop's name in the line a plan that shortens it prints
    shorten: bool = True  # plan a shorter schedule; False: keep the configured one and only stop when time is up
    total: int = field(init=False)  # the planned number of steps
    plans: list = field(init=False)  # (step, planned total) of every plan made
    out_of_time: bool = field(init=False)  # the loop stopped because the time ran out before the plan's end
    start: float = field(init=False)

    def __post_init__(self) -> None:
        self.total, self.plans, self.out_of_time = self.steps, [], False
        self.probe = max(2, min(self.probe, self.steps))
        self.start = time.perf_counter()
        self._first_step_s: float | None = None  # training seconds after the first step (compilation, warm caches)
        self._checks_seen = 0

    def check_from_step(self, total: int | None = None) -> int:
        """The first check step of a run of `total` steps (the planned one by default): the configured check window's
        share of the schedule, kept.

        >>> b = StepBudget(60.0, 1500, 30, check_every=100, check_from=1000)
        >>> b.check_from_step(1500), b.check_from_step(900)
        (1000, 600)
        """
        total = self.total if total is None else total
        if not self.check_every:
            return total
        return max(1, total - round((self.steps - self.check_from) * total / self.steps))

    def checks_after(self, step: int, total: int) -> int:
        """Checks a run of `total` steps still makes after `step`: those in its window, and one after its last step."""
        first = self.check_from_step(total)
        return sum(1 for k in range(self.check_every, total, self.check_every) if k > step and k >= first) + 1 \
            if self.check_every else 0

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def after_step(self, step: int, train_s: float, check_s: float, checks: int) -> bool:
        """Called after each step (`step` steps done, `train_s` seconds of training and `checks` checks of `check_s`
        seconds in all so far); plans when due and returns True when the loop must stop now."""
        if step == 1:
            self._first_step_s = train_s
        if step < self.probe:
            return self.left() <= 0
        rate = (train_s - (self._first_step_s or 0.0)) / max(1, step - 1)  # the first step pays for compilation
        if self.shorten and (step % self.probe == 0 or checks > self._checks_seen):
            self._checks_seen = checks
            self._plan(step, rate, check_s / checks if checks else None)
        if step >= self.total:
            return True
        if self.left() < rate:
            self.out_of_time = True
            print(f"adapt: {self.name} time budget used up at step {step} of the {self.total} planned", flush=True)
            return True
        return False

    def _plan(self, step: int, rate: float, check_cost: float | None) -> None:
        left = self.left()
        if check_cost is None and self.check_every:
            left *= 1 - self.reserve

        def cost(total: int) -> float:
            return (total - step) * rate + (self.checks_after(step, total) * check_cost if check_cost else 0.0)

        best = step
        hi = self.total
        if cost(hi) <= left + 1e-9:
            best = hi
        else:  # the cost grows with the total: bisect for the largest total that fits
            lo = step
            while lo < hi - 1:
                mid = (lo + hi) // 2
                if cost(mid) <= left + 1e-9:
                    lo = mid
                else:
                    hi = mid
            best = lo
        before, self.total = self.total, max(step, min(self.total, best))
        if self.plans and self.total == before:
            return
        self.plans.append((step, self.total))
        if self.total < before and (len(self.plans) == 1 or before - self.total >= 0.02 * before):
            checks = f", {check_cost:.1f} s a check" if check_cost else ""
            print(f"adapt: {self.name} time budget: {self.total} of {self.steps} steps fit in the {self.left():.0f} s "
                  f"left at step {step} ({rate:.2f} s a step{checks})", flush=True)

    def summary(self) -> dict:
        """What ``metrics/adapt.json`` records of the budget."""
        return {"seconds": self.seconds, "configured_steps": self.steps, "planned_steps": self.total,
                "plans": [list(p) for p in self.plans], "out_of_time": self.out_of_time,
                "check_from": self.check_from_step() if self.check_every else None,
                "used_s": round(time.perf_counter() - self.start, 2)}


def probe_steps(warmup: int) -> int:
    """Steps timed before the first plan: the warm-up (its learning rates do not depend on the total), at least 10."""
    return max(10, warmup)
