"""The learned verifier (phase `reward_model`), its use as a reward in `train` and the reward-hacking guard:
known-answer tests of the features, the model maths and the guard's statistic; the stage on a tiny project (held-out
AUC above chance, files, MLflow); a tiny training run with `train.learned_reward.coef` > 0; a real loop the guard
stops."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pipeline.core.errors import AgentRLError
from pipeline.reward_model import model as M
from pipeline.reward_model.config import LearnedRewardConfig, RewardModelConfig
from pipeline.reward_model.features import (featurize, hash_keys, parse_call, redundant_calls, rule_labels,
                                            trajectory_keys)
from pipeline.reward_model.guard import hacking_alarm, slope
from pipeline.reward_model.reward import ALARM, SCORE, LearnedReward, make_learned_reward

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = [
    {"action": '<call>search {"query": "Aurora flagship"}</call>',
     "observation": '<obs>"Aurora Trading" is a supplier. Its flagship product is "Frosty Planter".</obs>\n'},
    {"action": '<call>lookup {"name": "Frosty Planter", "field": "stock"}</call>', "observation": "<obs>246</obs>\n"},
    {"action": '<call>lookup {"name": "Frosty Planter", "field": "stock"}</call>', "observation": "<obs>246</obs>\n"},
    {"action": "<call>lookup {oops</call>", "observation": "<obs>error: invalid action</obs>\n"},
    {"action": '<call>answer {"value": "246"}</call>', "observation": "<obs>246</obs>\n"},
]


# ----------------------------------------------------------------------------------------------- features (known)
def test_trajectory_keys_of_a_hand_written_episode():
    assert trajectory_keys(STEPS) == [
        "len:5",
        "tool:search", "at0:search", "bigram:^>search", "first:search", "param:search.query",
        "obs:aurora", "obs:flagship", "obs:frosty", "obs:is", "obs:its", "obs:planter", "obs:product",
        "obs:supplier", "obs:trading",
        "tool:lookup", "at1:lookup", "bigram:search>lookup", "param:lookup.field", "param:lookup.name",
        "tool:lookup", "at2:lookup", "bigram:lookup>lookup", "repeat", "repeat:lookup", "param:lookup.field",
        "param:lookup.name",
        "tool:invalid", "at3:invalid", "bigram:lookup>invalid", "obs:action", "obs:error", "obs:invalid",
        "tool:answer", "at4:answer", "bigram:invalid>answer", "param:answer.value",
        "last:answer", "answer_seen", "answer_numeric",  # 246 was seen, but not in the last observation (an error)
    ]
    truncated = trajectory_keys(STEPS[:2])
    assert truncated[-2:] == ["last:lookup", "no_answer"]
    assert featurize(STEPS, 64) == [zlib.crc32(k.encode()) % 64 for k in trajectory_keys(STEPS)]
    assert hash_keys(["a"], 7) == [zlib.crc32(b"a") % 7]


def test_parse_call_and_the_rule_labels():
    assert parse_call('<call>answer {"value": 3}</call>') == ("answer", {"value": 3})
    assert parse_call("<call>answer [1]</call>") is None and parse_call("answer 3") is None
    ok = {"tool": "lookup", "params": {"name": "A"}, "outcome": "ok"}
    calls = [ok, dict(ok), {"tool": "answer", "params": {"value": "1"}, "outcome": "answer"}]
    assert redundant_calls(calls) == 1 and redundant_calls([ok, {**ok, "outcome": "tool_error"}]) == 0
    passed = {"passed": True}
    assert rule_labels({"success": True, "verifier": passed, "calls": calls[1:], "n_failed": 0}) == (1, 1)
    assert rule_labels({"success": True, "verifier": passed, "calls": calls, "n_failed": 0}) == (1, 0)  # redundant
    assert rule_labels({"success": False, "verifier": passed, "calls": calls[1:], "n_failed": 1}) == (0, 0)
    assert rule_labels({"success": True, "verifier": {"passed": False}, "calls": calls[1:], "n_failed": 0}) == (1, 0)


# -------------------------------------------------------------------------------------------------- model (known)
def test_the_model_is_a_logistic_regression_over_summed_feature_weights():
    model = M.RewardModel(8)
    with torch.no_grad():
        model.weight.weight.copy_(torch.arange(16, dtype=torch.float32).reshape(8, 2) / 10)
        model.bias.copy_(torch.tensor([-1.0, 0.5]))
    # trajectory [1, 1, 3]: success logit -1 + 0.2 + 0.2 + 0.6 = 0; sound 0.5 + 0.3 + 0.3 + 0.7 = 1.8; [] = bias
    p = model.predict([[1, 1, 3], []])
    assert p[0] == pytest.approx([0.5, 1 / (1 + np.exp(-1.8))]) and p[1] == pytest.approx(1 / (1 + np.exp([1.0, -0.5])))


def test_auc_calibration_and_head_metrics_known_answers():
    assert M.auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert M.auc(np.array([0.5, 0.5, 0.5]), np.array([0, 1, 1])) == 0.5  # ties count half
    assert M.auc(np.array([0.2, 0.9]), np.array([1, 1])) is None
    # bins [0, .5) and [.5, 1]: |0.5 - 0.1|·2/4 + |1 - 0.9|·2/4 = 0.25
    ece = M.expected_calibration_error(np.array([0.1, 0.1, 0.9, 0.9]), np.array([0, 1, 1, 1]), 2)
    assert ece == pytest.approx(0.25)
    h = M.head_metrics(np.array([0.2, 0.6, 0.7, 1.0]), np.array([0, 0, 1, 1]), 2)
    assert h["auc"] == 1.0 and h["accuracy"] == 0.75 and h["positive_rate"] == 0.5
    assert h["brier"] == pytest.approx((0.04 + 0.36 + 0.09 + 0.0) / 4)


def test_fit_separates_a_feature_that_decides_the_label(tmp_path):
    X = [[1, 5], [2, 5], [1, 6], [2, 6]] * 10
    Y = np.array([[1, 0], [0, 0], [1, 1], [0, 1]] * 10)  # success iff feature 1, sound iff feature 6
    model, losses = M.fit(X, Y, 8, epochs=200, lr=0.1, l2=0.0, seed=0)
    p = model.predict(X[:4])
    assert losses[-1] < losses[0] / 5 and ((p > 0.5) == Y[:4]).all()
    M.save(model, tmp_path / "rm", {"env": "shop"})
    again, meta = M.load(tmp_path / "rm")
    assert np.allclose(again.predict(X[:4]), p) and meta["dim"] == 8 and meta["env"] == "shop"
    with pytest.raises(AgentRLError, match="run the `reward_model` stage"):
        M.load(tmp_path / "missing")


def test_labels_marked_unknown_do_not_move_the_fit_and_all_known_equals_the_plain_fit():
    """People's feedback labels success only: its sound labels are masked. Whatever value a masked label holds, the
    fit is the same; a mask of ones is the unmasked fit (the mean over every label)."""
    X = [[1, 5], [2, 5], [1, 6], [2, 6]] * 5 + [[3, 5], [3, 6]] * 3
    Y = np.array([[1, 0], [0, 0], [1, 1], [0, 1]] * 5 + [[1, 0], [0, 0]] * 3)
    known = np.ones_like(Y)
    known[20:, 1] = 0  # the last six rows: success from a person, soundness unknown
    flipped = Y.copy()
    flipped[20:, 1] = 1 - flipped[20:, 1]
    fits = [M.fit(X, y, 8, epochs=50, lr=0.1, l2=0.0, seed=0, known=known)[0] for y in (Y, flipped)]
    assert torch.equal(fits[0].weight.weight, fits[1].weight.weight) and torch.equal(fits[0].bias, fits[1].bias)
    plain = M.fit(X, Y, 8, epochs=50, lr=0.1, l2=0.0, seed=0)[0]
    ones = M.fit(X, Y, 8, epochs=50, lr=0.1, l2=0.0, seed=0, known=np.ones_like(Y))[0]
    assert torch.allclose(plain.weight.weight, ones.weight.weight, atol=1e-6)
    assert not torch.allclose(fits[0].weight.weight, plain.weight.weight, atol=1e-3)  # the mask changed the fit


# -------------------------------------------------------------------------------------------------- guard (known)
def test_the_guard_fires_only_when_the_learned_score_rises_while_the_rule_reward_falls():
    assert slope([1.0, 3.0, 5.0]) == 2.0 and slope([4.0]) == 0.0
    learned = [0.50, 0.52, 0.55, 0.60, 0.66]  # slope 0.04
    falling = [1.0, 0.98, 0.95, 0.90, 0.86]   # slope -0.036
    rising = [1.0, 1.02, 1.05, 1.10, 1.16]
    fired, s_l, s_r = hacking_alarm(learned, falling, 5, 0.005, -0.005)
    assert fired and s_l == pytest.approx(0.04) and s_r == pytest.approx(-0.036)
    assert not hacking_alarm(learned, rising, 5, 0.005, -0.005)[0]             # both improve: fine
    assert not hacking_alarm(learned[:4], falling[:4], 5, 0.005, -0.005)[0]    # window not full yet
    assert not hacking_alarm(learned, falling, 5, 0.05, -0.005)[0]             # the score's rise is below threshold
    # only the last `window` updates count: an old rise followed by a flat score does not fire
    assert not hacking_alarm([0.1, 0.5, 0.9, 0.9, 0.9], [1.0, 0.9, 0.8, 0.8, 0.8], 3, 0.005, -0.005)[0]
    with pytest.raises(ValueError, match="at least 2"):
        hacking_alarm(learned, falling, 1, 0.0, 0.0)


def test_learned_reward_config_refuses_bad_values_and_coef_zero_reads_nothing(tmp_path):
    with pytest.raises(ValidationError):
        LearnedRewardConfig(guard_window=1)
    with pytest.raises(ValidationError):
        LearnedRewardConfig(coef=-1)
    with pytest.raises(ValidationError):
        RewardModelConfig(holdout_fraction=1.0)
    assert make_learned_reward(LearnedRewardConfig(model="nowhere"), "shop", None) is None
    with pytest.raises(AgentRLError, match="reward model not found"):
        make_learned_reward(LearnedRewardConfig(coef=1.0, model="nowhere"), "shop", None)
    M.save(M.RewardModel(64), tmp_path / "sql-rm", {"env": "sql"})
    with pytest.raises(AgentRLError, match="trained on environment 'sql', not 'shop'"):
        make_learned_reward(LearnedRewardConfig(coef=1.0, model=str(tmp_path / "sql-rm")), "shop", None)


def test_the_stage_trains_no_verifier_when_no_run_reads_one(tmp_path, monkeypatch):
    """reward_model.when: used (the default) with train.learned_reward.coef 0: a fixed marker, no model and no
    training; its bytes do not change between runs, so the `train` stage (which lists the folder) stays up to date.
    A run that then asks for the learned reward is told to rerun the stage; when: always trains regardless."""
    from pipeline.reward_model.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTRL_TRACKING", "off")  # its MLflow run is the flow's business (tests/test_flow.py)
    Path("params.yaml").write_text("reward_model: {}\ntrain:\n  learned_reward:\n    coef: 0.0\n")
    result = main("params.yaml")
    assert result["trained"] is False and "coef is 0" in result["reason"]
    marker = Path("models/reward_model") / M.UNUSED_FILE
    first = marker.read_bytes()
    assert sorted(p.name for p in Path("models/reward_model").iterdir()) == [M.UNUSED_FILE]
    assert json.loads(Path("metrics/reward_model.json").read_text()) == result
    main("params.yaml")
    assert marker.read_bytes() == first
    with pytest.raises(AgentRLError, match="holds no trained verifier"):
        make_learned_reward(LearnedRewardConfig(coef=1.0), "shop", None)
    # when: always goes on to train: here it stops at the missing adapted policy, which proves it tried
    Path("params.yaml").write_text("reward_model:\n  when: always\n")
    with pytest.raises(AgentRLError, match="policy folder models/adapted does not exist"):
        main("params.yaml")


class OneRank:
    rank, world_size, is_main = 0, 1, True

    def all_gather(self, obj):
        return [obj]


def test_apply_adds_coef_times_score_to_return_last_step_reward_and_extra_reward():
    model = M.RewardModel(16)
    with torch.no_grad():
        model.bias.copy_(torch.tensor([0.0, np.log(3.0)]))  # p_success 0.5, p_sound 0.75 for every trajectory
    lr = LearnedReward(LearnedRewardConfig(coef=2.0, success_weight=0.5), model, OneRank())
    recs = [{"steps": STEPS, "return": 1.0, "step_rewards": [0.0, 1.0]},
            {"steps": STEPS[:1], "return": -0.5, "step_rewards": [-0.5], "extra_reward": 0.25}]
    m = lr.apply(recs)
    # score 0.5·0.5 + 0.5·0.75 = 0.625, extra 1.25
    assert recs[0]["return"] == pytest.approx(2.25) and recs[0]["step_rewards"] == pytest.approx([0.0, 2.25])
    assert recs[1]["extra_reward"] == pytest.approx(1.5) and recs[1]["return"] == pytest.approx(0.75)
    assert m[SCORE] == pytest.approx(0.625) and m["reward_model/extra"] == pytest.approx(1.25)
    assert m["reward_model/rule_return"] == pytest.approx((1.0 + -0.75) / 2)  # second: its other extra is not rule
    # an expert episode that replaced a rollout is paid but left out of the means the guard watches
    expert = {"steps": STEPS, "return": 4.0, "step_rewards": [4.0]}
    m = lr.apply([recs[0], expert], own=[recs[0], recs[1]])
    assert expert["return"] == pytest.approx(5.25) and m["reward_model/rule_return"] == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------- the stage, for real
@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from test_train import make_project

    from pipeline.core.config import load_section
    from pipeline.core.tracking import Tracker
    from pipeline.envs.config import EnvConfig
    from pipeline.policy.config import RolloutConfig
    from pipeline.reward_model.main import train_reward_model

    root = make_project(tmp_path_factory.mktemp("reward-model"), updates=3)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        cfg = RewardModelConfig(rollout_tasks=16, rollouts_per_task=2, holdout_fraction=0.4, epochs=200)
        result = train_reward_model(cfg, load_section(EnvConfig, "env"), load_section(RolloutConfig, "rollout"),
                                    tracker=Tracker())
    finally:
        os.chdir(cwd)
    return root, result


def test_the_stage_trains_on_demos_and_rollouts_and_beats_chance_on_held_out_tasks(project):
    from mlflow.tracking import MlflowClient

    root, result = project
    assert result["episodes"]["demos"] > 0 and result["episodes"]["rollouts"] == 32
    assert result["episodes"]["heldout"] > 0 and result["episodes"]["fit"] > 0
    for head in ("success", "sound"):
        h = result["heldout"][head]
        assert h["auc"] is not None and h["auc"] > 0.6, (head, h)
        assert 0 <= h["ece"] <= 1 and 0 <= h["brier"] <= 1
    written = json.loads((root / "metrics" / "reward_model.json").read_text())
    assert written["heldout"] == result["heldout"]
    assert (root / "models" / "reward_model" / M.WEIGHTS_FILE).is_file()
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.search_runs([client.get_experiment_by_name("agentrl").experiment_id],
                             filter_string="attributes.run_name = 'reward_model'",
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    assert run.data.metrics["reward_model/heldout/success/auc"] == pytest.approx(result["heldout"]["success"]["auc"])
    assert run.data.params["reward_model.rollout_tasks"] == "16"
    artefacts = {a.path for a in client.list_artifacts(run.info.run_id, "reward_model")}
    assert f"reward_model/{M.WEIGHTS_FILE}" in artefacts


def _params(root: Path, name: str, **learned) -> str:
    text = (root / "params.yaml").read_text() + "  guide_failed_groups: false\n  learned_reward:\n"
    text += "".join(f"    {k}: {v}\n" for k, v in learned.items())
    (root / name).write_text(text)
    return name


def test_a_training_run_with_the_learned_reward_reports_the_score_and_pays_it(project, monkeypatch):
    from pipeline.train.worker import run_worker

    root, _ = project
    monkeypatch.chdir(root)
    params = _params(root, "params-lr.yaml", coef=2.0)
    result = run_worker(params, ckpt="ckpt-lr", out="models/policy-lr", metrics_path="metrics/train-lr.json",
                        curve_path="metrics/train-lr.csv")
    assert result["completed"] and len(result["history"]) == 3
    curve = Path("metrics/train-lr.csv").read_text().splitlines()
    assert {"reward_model_score", "reward_model_rule_return", "alarms_reward_hacking"} <= set(curve[0].split(","))
    for h in result["history"]:
        assert 0 < h[SCORE] < 1 and h["reward_model/extra"] == pytest.approx(2.0 * h[SCORE])
        # the episodes' returns carry the extra reward: what the learner sees is the rule reward plus coef·score
        assert h["rollout/return"] == pytest.approx(h["reward_model/rule_return"] + h["reward_model/extra"])
        assert h[ALARM] == 0.0


def test_the_guard_stops_a_real_loop_and_keeps_a_validated_policy(project, monkeypatch, capsys):
    """A reward model that pays for invalid actions (what a tiny random policy mostly writes) at coef 5, and a guard
    whose thresholds make any full window an alarm: the run stops after `guard_window` updates, like early stopping,
    with a kept policy (an evaluation is forced when none has run yet)."""
    from pipeline.policy.model import load_policy
    from pipeline.train.worker import run_worker

    root, _ = project
    monkeypatch.chdir(root)
    hack = M.RewardModel(4096)
    with torch.no_grad():
        hack.weight.weight[hash_keys(["tool:invalid"], 4096)[0]] = 3.0
        hack.bias.fill_(-3.0)
    M.save(hack, root / "rm-hack", {"env": "shop"})
    text = (root / "params.yaml").read_text().replace("updates: 3", "updates: 6").replace("eval_every: 2",
                                                                                          "eval_every: 5")
    (root / "params-hack.yaml").write_text(text)
    base = Path("params-hack.yaml").read_text()
    Path("params-hack.yaml").write_text(base + "  guide_failed_groups: false\n  learned_reward:\n    coef: 5.0\n"
                                        "    model: rm-hack\n    guard_window: 2\n    guard_learned_slope: -1000\n"
                                        "    guard_rule_slope: 1000\n")
    result = run_worker("params-hack.yaml", ckpt="ckpt-hack", out="models/policy-hack",
                        metrics_path="metrics/train-hack.json", curve_path="metrics/train-hack.csv")
    out = capsys.readouterr().out
    es = result["early_stopping"]
    assert result["completed"] and len(result["history"]) == 2
    assert es["stopped"] and es["stop_update"] == 2 and "reward-hacking guard" in es["reason"]
    assert result["history"][0][ALARM] == 0.0 and result["history"][1][ALARM] == 1.0
    assert "update 2: reward-hacking alarm" in out
    assert result["best"]["update"] == 2 and load_policy(root / "models" / "policy-hack")[2]["rl_update"] == 2
    assert json.loads((root / "metrics" / "train-hack.json").read_text())["early_stopping"]["stopped"]


def test_the_stage_works_on_another_environment_through_the_contract_alone(tmp_path):
    """The SQL analyst: its demonstrations replayed through the runner, labelled by the rules and fitted, with nothing
    environment-specific in the phase (demonstrations only: no policy is needed)."""
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build
    from pipeline.envs.config import EnvConfig
    from pipeline.policy.config import RolloutConfig
    from pipeline.reward_model.main import train_reward_model

    env = EnvConfig(name="sql")
    build(BuildEnvConfig(options={"n_customers": 200, "n_products": 96, "n_orders": 1500},
                         tasks_per_split={"train": 80, "validation": 8, "test": 8}), env, tmp_path / "data",
          tmp_path / "build_env.json")
    (tmp_path / "adapted").mkdir()
    cfg = RewardModelConfig(rollout_tasks=0, holdout_fraction=0.4, policy=str(tmp_path / "adapted"))
    result = train_reward_model(cfg, env, RolloutConfig(), data_dir=tmp_path / "data", out_dir=tmp_path / "rm",
                                metrics_path=tmp_path / "rm.json")
    assert result["env"] == "sql" and result["episodes"]["demos"] > 20 and result["episodes"]["rollouts"] == 0
    assert 0 < result["label_rates"]["demo"]["sound"] < 1  # flawed demonstrations (redundant, out of order) exist
    assert result["heldout"]["sound"]["auc"] > 0.6
    assert M.load(tmp_path / "rm")[1]["env"] == "sql"
    with pytest.raises(AgentRLError, match="would overwrite the model's own file"):
        train_reward_model(cfg, env, RolloutConfig(), data_dir=tmp_path / "data", out_dir=tmp_path / "rm",
                           metrics_path=tmp_path / "rm" / M.META_FILE)
