"""Early stopping: the pure rule on scripted validation curves (milliseconds), its checkpoint state, and the RL loop
on a tiny model with a scripted validation curve: it stops at the right update, the best policy (not the last) is the
stage's output, and a rerun after the stop resumes into the same decision instead of training on."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import pytest
import torch

from pipeline.train.early_stopping import METRICS, EarlyStopping, metric_value

torch.set_num_threads(1)


def run_curve(es: EarlyStopping, curve: list[float], every: int = 10) -> list:
    decisions = []
    for i, v in enumerate(curve):
        if es.stopped:
            break
        decisions.append(es.update(v, (i + 1) * every))
    return decisions


# ------------------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("curve, patience, min_delta, stop_at, best_at", [
    ([0.1, 0.3, 0.5, 0.4, 0.45, 0.2, 0.9], 2, 0.0, 50, 30),   # two evaluations below the best 0.5: stop at the 5th
    ([0.1, 0.3, 0.5, 0.4, 0.6, 0.5, 0.55, 0.1], 2, 0.0, 70, 50),  # a new best resets the count
    ([0.5, 0.5, 0.5], 2, 0.0, 30, 10),                        # ties do not improve: the earlier policy stays
    ([0.50, 0.52, 0.53, 0.54], 2, 0.05, 30, 10),             # gains within min_delta do not count
    ([0.2, 0.1, 0.3], 1, 0.0, 20, 10),                        # patience 1 stops at the first non-improvement
    ([0.1, 0.2, 0.1, 0.1, 0.1], None, 0.0, None, 20),         # patience None never stops, still keeps the best
    ([float("nan"), 0.2, float("nan"), 0.1], 3, 0.0, None, 20),  # NaN never improves
])
def test_scripted_curve_stops_at_the_right_update_and_keeps_the_best(curve, patience, min_delta, stop_at, best_at):
    es = EarlyStopping("success", patience, min_delta)
    decisions = run_curve(es, curve)
    assert es.stop_step == stop_at and es.stopped == (stop_at is not None)
    assert es.best_step == best_at
    assert [d.step for d in decisions if d.stop] == ([stop_at] if stop_at else [])
    if stop_at:
        assert decisions[-1].stop and decisions[-1].step == stop_at  # nothing is evaluated after the stop
        assert f"stopped at update {stop_at}" in decisions[-1].reason and f"update {best_at}" in decisions[-1].reason
    improved = [d.step for d in decisions if d.improved]
    assert improved[-1] == best_at  # the loop saves on every improvement: the last save is the best
    summary = es.summary(completed_all=stop_at is None)
    assert summary["stopped"] == (stop_at is not None) and summary["best_update"] == best_at and summary["reason"]


def test_update_after_the_stop_is_refused():
    es = EarlyStopping("success", 1)
    run_curve(es, [0.5, 0.1])
    with pytest.raises(RuntimeError, match="already stopped"):
        es.update(0.9, 30)


def test_bad_settings_and_unknown_metrics_are_refused():
    with pytest.raises(ValueError, match="known metrics are"):
        EarlyStopping("val_loss", 2)
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping("success", 0)
    with pytest.raises(ValueError, match="min_delta"):
        EarlyStopping("success", 2, -0.1)
    with pytest.raises(ValueError, match="known metrics are"):
        metric_value("accuracy", {"overall": {}})


def test_metrics_read_the_evaluation_summary_and_match_the_config_choices():
    from pipeline.train.config import TrainConfig

    summary = {"overall": {"success_rate": 0.25, "mean_return": -0.5}}
    assert metric_value("success", summary) == 0.25 and metric_value("mean_return", summary) == -0.5
    choices = typing.get_args(TrainConfig.model_fields["early_stopping_metric"].annotation)
    assert set(choices) == set(METRICS)


def test_the_level_mean_weighs_every_level_the_same_whatever_its_share_of_the_tasks():
    """Level 4 rising from 0.2 to 0.6 while level 1 slips from 1.0 to 0.95: over the tasks (level 1 is nine tenths
    of them) success falls, so `success` would keep the earlier policy; the per-level mean rises."""
    def summary(l1: float, l4: float) -> dict:
        return {"overall": {"success_rate": 0.9 * l1 + 0.1 * l4},
                "per_level": {1: {"success_rate": l1}, 4: {"success_rate": l4}}}

    before, after = summary(1.0, 0.2), summary(0.95, 0.6)
    assert metric_value("success", after) < metric_value("success", before)
    assert metric_value("level_mean_success", before) == pytest.approx(0.6)
    assert metric_value("level_mean_success", after) == pytest.approx(0.775)
    es = EarlyStopping("level_mean_success", 1)
    assert [es.update(metric_value("level_mean_success", s), step).improved
            for step, s in ((10, before), (20, after))] == [True, True]
    assert math.isnan(metric_value("level_mean_success", {"overall": {}, "per_level": {}}))


@pytest.mark.parametrize("cut", range(1, 7))
def test_a_resumed_stopper_decides_exactly_as_the_uninterrupted_one(cut):
    curve = [0.1, 0.3, 0.3, 0.5, 0.45, 0.44, 0.43, 0.9]
    whole = EarlyStopping("mean_return", 3, 0.01)
    expected = run_curve(whole, curve)
    first = EarlyStopping("mean_return", 3, 0.01)
    got = run_curve(first, curve[:cut])
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores must survive JSON
    resumed = EarlyStopping("mean_return", 3, 0.01)
    resumed.load_state_dict(state)
    for i, v in enumerate(curve[cut:], start=cut):
        if resumed.stopped:
            break
        got.append(resumed.update(v, (i + 1) * 10))
    assert got == expected
    assert resumed.state_dict() == whole.state_dict()
    with pytest.raises(ValueError, match="saved with"):
        EarlyStopping("mean_return", 2, 0.01).load_state_dict(state)


# ---------------------------------------------------------------------------------------------- inside train()
class ScriptedValidation:
    """Follows `pipeline.train.validation.evaluate_greedy` (rollout, tasks, dist, seed) -> summary, with a scripted success curve
    indexed by evaluation; records a copy of the policy's weights at every evaluation."""

    def __init__(self, curve: list[float], start: int = 0):
        self.curve, self.calls, self.weights = curve, start, []

    def __call__(self, rollout, tasks, dist, seed):
        value = self.curve[self.calls]
        self.calls += 1
        self.weights.append({k: v.detach().clone() for k, v in rollout.model.state_dict().items()})
        level = {"success_rate": value, "mean_return": value - 0.5}
        return {"overall": dict(level), "per_level": {"1": dict(level)}}


def _train(project: Path, evaluate, ckpt: str, out: str):
    from pipeline.core.config import load_section
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.config import RolloutConfig
    from pipeline.train.config import TrainConfig
    from pipeline.train.distributed import init_dist
    from pipeline.train.loop import Hooks, train
    from pipeline.core.tracking import NullRun

    params = project / "params.yaml"
    cfg = load_section(TrainConfig, "train", params)
    runtime = ShopWorld.load(project / "data" / "env")
    tasks = project / "data" / "tasks"
    logs: list[str] = []
    result = train(cfg, load_section(EnvConfig, "env", params), load_section(RolloutConfig, "rollout", params),
                   policy_dir=project / "models" / "adapted", train_tasks=load_task_file(tasks / "train.jsonl", runtime, validate=False),
                   val_tasks=load_task_file(tasks / "validation.jsonl", runtime, validate=False), runtime=runtime, out_dir=project / out,
                   ckpt_dir=project / ckpt, dist=init_dist(), run=NullRun("train"),
                   hooks=Hooks(evaluate=evaluate, log=logs.append))
    return result, logs


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from test_train import make_project

    root = make_project(tmp_path_factory.mktemp("early-stop"), updates=8)
    text = (root / "params.yaml").read_text().replace("eval_every: 2", "eval_every: 1")
    text = text.replace("checkpoint_every: 2", "checkpoint_every: 4")
    # An entropy bonus on every group makes each update move the weights, even when a tiny random policy's rewards
    # are all equal (zero advantages): the test can then tell the best update's weights from the last one's.
    (root / "params.yaml").write_text(text + "  early_stopping_patience: 2\n  entropy_coef: 0.05\n"
                                      "  skip_zero_variance_groups: false\n")
    return root


def test_training_stops_at_the_right_update_and_the_best_policy_is_the_output(project):
    from pipeline.policy.model import load_policy

    curve = [0.1, 0.4, 0.3, 0.35, 0.9, 0.9, 0.9, 0.9]  # best at update 2; updates 3 and 4 do not improve: stop at 4
    scripted = ScriptedValidation(curve)
    result, logs = _train(project, scripted, "ckpt", "policy")
    es = result["early_stopping"]
    assert scripted.calls == 4 and len(result["history"]) == 4 and result["completed"]
    assert es["stopped"] and es["stop_update"] == 4 and es["best_update"] == 2 and es["best_value"] == 0.4
    assert "stopped at update 4" in es["reason"] and any("early stopping: stopped at update 4" in m for m in logs)
    assert result["best"]["update"] == 2 and [e["update"] for e in result["evals"]] == [1, 2, 3, 4]
    # The output holds the weights evaluated at update 2, not those of the last update (which differ: RL trained on).
    model, _, meta = load_policy(project / "policy")
    saved = model.state_dict()
    assert meta["rl_update"] == 2
    assert all(torch.equal(saved[k], v) for k, v in scripted.weights[1].items())
    assert any(not torch.equal(saved[k], v) for k, v in scripted.weights[3].items())
    # The stop wrote a checkpoint (update 4 is not a multiple of checkpoint_every): a rerun resumes into the same
    # decision and trains no further.
    assert (project / "ckpt" / "latest").read_text().strip() == "update-4"
    again = ScriptedValidation(curve, start=4)
    rerun, logs = _train(project, again, "ckpt", "policy")
    assert again.calls == 4 and any("resumed from" in m for m in logs)
    assert rerun["early_stopping"] == es and rerun["history"] == result["history"] and rerun["completed"]
    assert load_policy(project / "policy")[2]["rl_update"] == 2


def test_patience_null_trains_every_update_and_still_keeps_the_best(project, tmp_path):
    from pipeline.policy.model import load_policy

    params = project / "params.yaml"
    original = params.read_text()
    try:
        params.write_text(original.replace("early_stopping_patience: 2", "early_stopping_patience: null")
                          .replace("updates: 8", "updates: 3"))
        scripted = ScriptedValidation([0.2, 0.6, 0.1])
        result, _ = _train(project, scripted, "ckpt-null", "policy-null")
    finally:
        params.write_text(original)
    es = result["early_stopping"]
    assert len(result["history"]) == 3 and not es["stopped"] and es["stop_update"] is None
    assert "ran every update" in es["reason"] and es["best_update"] == 2
    assert load_policy(project / "policy-null")[2]["rl_update"] == 2


def test_the_kept_policy_is_the_weight_ensemble_with_the_start_when_merge_alpha_is_below_one(project):
    """`train.merge_alpha`: validation scores, and the output keeps, θ_start + α(θ_RL − θ_start), while RL trains on
    θ_RL: the same run with α 1 (which scores θ_RL itself) follows the same weights, and every ensemble scored at
    α 0.5 lies halfway between the start and those weights."""
    from pipeline.policy.model import load_policy

    params = project / "params.yaml"
    original = params.read_text()
    start = load_policy(project / "models" / "adapted")[0].state_dict()
    runs = {}
    try:
        for alpha in (1.0, 0.5):
            params.write_text(original.replace("updates: 8", "updates: 3").replace("early_stopping_patience: 2",
                                                                               "early_stopping_patience: null")
                              + f"  merge_alpha: {alpha}\n")
            scripted = ScriptedValidation([0.2, 0.6, 0.1])
            runs[alpha] = scripted, _train(project, scripted, f"ckpt-merge-{alpha}", f"policy-merge-{alpha}")[0]
    finally:
        params.write_text(original)
    (rl, _), (ens, result) = runs[1.0], runs[0.5]
    assert result["best"]["update"] == 2
    for theta, scored in zip(rl.weights, ens.weights):
        assert any(not torch.equal(theta[k], start[k]) for k in start)  # RL moved the weights ...
        for k in start:  # ... and the scored policy is the halfway point
            assert torch.allclose(scored[k], start[k] + 0.5 * (theta[k] - start[k]), atol=1e-6), k
    model, _, meta = load_policy(project / "policy-merge-0.5")
    assert meta["merge_alpha"] == 0.5 and meta["rl_update"] == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ens.weights[1].items())


def test_the_worker_records_the_decision_in_train_json(project, monkeypatch):
    """The real validation evaluation (no script): whatever the tiny policy scores, train.json, the output policy and
    the evaluation history agree about the best update and about why training ended."""
    from pipeline.train.worker import run_worker

    monkeypatch.chdir(project)
    text = (project / "params.yaml").read_text().replace("updates: 8", "updates: 2")
    text = text.replace("early_stopping_patience: 2", "early_stopping_patience: 1")
    (project / "params-worker.yaml").write_text(text)
    run_worker("params-worker.yaml", ckpt="ckpt-worker", out="models/policy-worker",
               metrics_path="metrics/train-worker.json", curve_path="metrics/curve-worker.csv")
    metrics = json.loads((project / "metrics/train-worker.json").read_text())
    es, evals = metrics["early_stopping"], metrics["evals"]
    first, second = evals[0]["val_success"], evals[1]["val_success"]
    assert es["stopped"] == (second <= first)  # patience 1: stops at update 2 unless it improved
    assert es["best_update"] == (1 if second <= first else 2) == metrics["best_update"]
    meta = json.loads((project / "models/policy-worker/policy.json").read_text())
    assert meta["rl_update"] == es["best_update"] == meta["step"]
    assert meta["phase"] == "train" and meta["parent"]["phase"] != "train"  # lineage: this policy came from RL
    assert meta["train_config"]["early_stopping_patience"] == 1


def test_doctests():
    import doctest

    import pipeline.train.early_stopping as es

    result = doctest.testmod(es)
    assert result.attempted > 0 and result.failed == 0
