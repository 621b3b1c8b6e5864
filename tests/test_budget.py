"""Time budgets: adapt's :class:`pipeline.adapt.budget.StepBudget` plans the steps that fit at the measured speed
(checks included, never more than configured, a new plan only shortens the run, the checks keep their share of the
schedule) and stops a run whose time is up; RL's ``time_budget`` extension stops at a validated update when the next
stretch would not fit. Clocks are faked where a figure is asserted; one real tiny loop of each kind runs too."""

from __future__ import annotations

import pytest

from pipeline.adapt import budget as budget_mod
from pipeline.adapt.budget import StepBudget


class Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(budget_mod, "time", c)
    return c


def run(b: StepBudget, clock: Clock, step_s: float, check_s: float = 0.0, checks_at=()) -> int:
    """Steps a loop takes under `b`: each step costs `step_s`, a check at a step in `checks_at` (and in the budget's
    window) `check_s` more, as train_lm times them."""
    train, checks, spent, step = 0.0, 0, 0.0, 0
    while step < b.total:
        clock.now += step_s
        train += step_s
        if (step + 1) in checks_at and step + 1 < b.total and step + 1 >= b.check_from_step():
            clock.now += check_s
            spent, checks = spent + check_s, checks + 1
        step += 1
        if b.after_step(step, train, spent, checks):
            break
    return step


def test_the_plan_fits_the_steps_into_the_time_left(clock, capsys):
    b = StepBudget(10.0, 100, probe=10, name="sft")
    assert run(b, clock, 0.2) == 50  # 2 s for the 10 probe steps, 8 s left at 0.2 s a step
    assert b.plans == [(10, 50)] and not b.out_of_time
    assert clock.now == pytest.approx(10.0)
    line = "adapt: sft time budget: 50 of 100 steps fit in the 8 s left at step 10 (0.20 s a step)\n"
    assert capsys.readouterr().out == line


def test_steps_that_slow_down_after_the_first_plan_shorten_it_again_before_the_time_runs_out(clock):
    b = StepBudget(20.0, 1000, probe=10)
    step, train = 0, 0.0
    while step < b.total:
        dt = 0.1 if step < 10 else 0.2  # twice as slow after the first plan
        clock.now += dt
        train += dt
        step += 1
        if b.after_step(step, train, 0.0, 0):
            break
    first = b.plans[0]
    assert first[0] == 10 and 195 <= first[1] <= 200  # planned at the probe's speed: 19 s left at 0.1 s a step
    assert len(b.plans) > 1 and b.total < first[1] and step == b.total and not b.out_of_time
    assert clock.now <= 20.0


def test_a_loop_that_keeps_its_schedule_makes_no_plan_and_stops_when_its_time_is_up(clock):
    b = StepBudget(10.0, 100, probe=10, shorten=False)  # continued pre-training: the schedule is a maximum
    assert run(b, clock, 0.2) == 50 and b.plans == [] and b.total == 100 and b.out_of_time


def test_a_budget_that_allows_more_than_configured_runs_the_configured_steps(clock):
    b = StepBudget(1000.0, 100, probe=10)
    assert run(b, clock, 0.2) == 100 and b.total == 100


def test_checks_keep_their_share_of_the_schedule_and_their_measured_cost_shortens_the_plan(clock):
    # configured: 1,500 steps, checks every 100 from step 1,000 (the last third)
    b = StepBudget(300.0, 1500, probe=30, check_every=100, check_from=1000)
    steps = run(b, clock, 0.2, check_s=10.0, checks_at=range(100, 1501, 100))
    first_plan = b.plans[0][1]
    # before a check is timed, 15 % of the time left is held for the checks: (300 - 6) * 0.85 / 0.2 + 30 steps
    assert first_plan == 30 + int((300 - 30 * 0.2) * 0.85 / 0.2)
    assert b.check_from_step(first_plan) == first_plan - round(500 * first_plan / 1500)
    assert len(b.plans) > 1 and all(later[1] <= earlier[1] for earlier, later in zip(b.plans, b.plans[1:]))
    assert steps == b.total < first_plan  # ten seconds a check: more than the reserve held for them
    assert clock.now <= 300.0 + 0.2  # the last check after the final step (train_lm's caller) is the caller's


def test_a_run_whose_time_is_up_stops_and_says_so(clock, capsys):
    b = StepBudget(5.0, 100, probe=10)
    step, train = 0, 0.0
    while True:
        dt = 0.1 if step < 10 else 1.0  # steps become ten times slower after the plan
        clock.now += dt
        train += dt
        step += 1
        if b.after_step(step, train, 0.0, 0):
            break
    assert b.out_of_time and step < b.total and clock.now <= 5.0 + 1.0
    assert f"adapt: training time budget used up at step {step} of the {b.total} planned" in capsys.readouterr().out


def test_a_real_loop_under_a_budget_ends_its_learning_rate_schedule_at_the_planned_step():
    import torch

    from pipeline.adapt import sft

    model = torch.nn.Linear(4, 4)
    lrs = []

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model

        def forward(self, input_ids, attention_mask, **_):
            x = torch.nn.functional.one_hot(input_ids % 4, 4).float()
            return type("Out", (), {"logits": self.lin(x)})()

    batch = {"input_ids": torch.tensor([[1, 2, 3, 0]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
             "labels": torch.tensor([[1, 2, 3, 0]])}

    def batches():
        while True:
            yield batch

    b = StepBudget(3.0, 10**7, probe=10)
    res = sft.train_lm(Wrapped(), batches(), 10**7, 1e-2, warmup=5, budget=b, log_every=1,
                       log=lambda step, m: lrs.append((step, m["lr"])))
    assert 10 <= res.steps < 10**7 and b.plans and res.steps <= b.total
    if not b.out_of_time:  # the schedule reached its end: the cosine's floor at the planned last step
        assert res.steps == b.total and lrs[-1][1] == pytest.approx(sft.lr_at(b.total - 1, b.total, 1e-2, 5))
        assert lrs[-1][1] < 0.2 * 1e-2  # near the floor, not at the peak of a 10**7-step schedule
    assert b.summary()["planned_steps"] == b.total


class FakeDist:
    world_size, rank, is_main = 1, 0, True

    @staticmethod
    def all_gather(x):
        return [x]


class FakeValidation:
    def __init__(self, every):
        self.every = every

    def due(self, update):
        return update % self.every == 0


class FakeLoop:
    def __init__(self, every):
        self.dist, self.validation, self.history = FakeDist(), FakeValidation(every), []


def test_rl_stops_at_the_validated_update_after_which_the_next_stretch_would_not_fit(monkeypatch):
    from pipeline.train.config import TrainConfig
    from pipeline.train.extensions import make_extensions
    from pipeline.train.extensions import time_budget

    c = Clock()
    monkeypatch.setattr(time_budget, "time", c)
    cfg = TrainConfig(time_budget_s=100.0, eval_every=2, eval_tasks=64, tasks_per_update=8, group_size=8)
    (ext,) = [e for e in make_extensions(cfg, None, None) if e.name == "time_budget"]
    loop = FakeLoop(every=2)
    reasons = []
    for u in range(100):
        ext.begin_update(loop, u)
        c.now += 10.0  # an update: 10 s, of which 5 s of rollouts
        loop.history.append({"update": u + 1})
        reason = ext.should_stop(loop, u, {"sys/rollout_s": 5.0})
        if loop.validation.due(u + 1):
            c.now += 5.0  # its validation: 64 greedy episodes, estimated at 5 s from the rollouts before one ran
        if reason:
            reasons.append((u + 1, reason))
            break
    # after update 6 (70 s) its validation, two updates and their validation end at 100 s: it goes on; after
    # update 8 (95 s) they would not fit
    assert reasons and reasons[0][0] == 8 and "train.time_budget_s" in reasons[0][1]
    assert ext.eval_s == [5.0, 5.0, 5.0] and loop.history[-1]["budget/left_s"] == pytest.approx(5.0)
    assert ext.state_dict()["used_s"] == pytest.approx(c.now)


@pytest.mark.slow
def test_rl_whose_time_is_up_stops_at_once_and_keeps_a_validated_policy(tmp_path, monkeypatch):
    from tests.test_train import make_project
    from pipeline.train.worker import run_worker

    root = make_project(tmp_path / "budget")
    monkeypatch.chdir(root)
    text = (root / "params.yaml").read_text().replace("  updates: 4\n", "  updates: 4\n  time_budget_s: 0.001\n")
    assert "time_budget_s" in text
    (root / "params-budget.yaml").write_text(text)
    result = run_worker("params-budget.yaml", ckpt="ckpt", out="models/policy-budget")
    assert [x["update"] for x in result["history"]] == [1]  # the time was up after the first update (4 asked)
    es = result["early_stopping"]
    assert es["stopped"] and es["stop_update"] == 1 and es["reason"].startswith("train.time_budget_s:")
    assert "time is up" in es["reason"]
    # no validation was due (eval_every 2), yet the stopped run's policy is a validated one, as after early stopping
    assert result["best"]["update"] == 1 and (root / "models/policy-budget").is_dir()
