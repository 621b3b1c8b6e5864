"""The registry of credit rules (pipeline/train/credit.py): the built-in rules give the very advantages the kernel
gave before it asked a registry (pinned, bit for bit, on fixed records); one clear line for a name that is none; a
user's rule named as ``module:function`` or as an entry point of the group agentrl.credit, used by the kernel's
scoring, by the config's rules and by a real tiny training run."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import yaml

from pipeline.core.config import ConfigError, parse_section
from pipeline.core.errors import AgentRLError
from pipeline.train import credit as C
from pipeline.train.advantages import score_episodes, token_advantages
from pipeline.train.batch import collate_records
from pipeline.train.config import TrainConfig
from pipeline.train.extensions.base import Extension
from pipeline.train.extensions.event_credit import EventCredit
from pipeline.train.sampling import make_learner_state

HERE = __name__  # this module as pytest imported it, so that ``HERE:function`` is the same function object
CALLS: list[int] = []  # episodes of every call of `outcome_per_turn`


def outcome_per_turn(inputs: C.CreditInputs) -> C.Credit:
    """A user's per-turn rule: every turn is credited with the episode's outcome (its normalised return), paid at the
    episode's last turn: episode credit, written per turn."""
    CALLS.append(len(inputs.records))
    _, mask = C.turn_rewards(inputs.records)
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
    return C.Credit(returns=inputs.scores[:, None] * mask, mask=mask, rewards=inputs.scores[:, None] * last.float())


def success_only(inputs: C.CreditInputs) -> C.Credit:
    """A user's per-episode rule (registered by a test with ``per_turn=False``): 1 for a positive return, else 0."""
    won = (inputs.scores > 0).float()[:, None]
    return C.Credit(returns=won, mask=torch.ones_like(won), rewards=won)


NOT_A_FUNCTION = 3


class Bonus(Extension):
    """Recomputes the returns (as the reward weighting does): R' = R + a fixed amount per episode."""

    name = "bonus"

    def reweight(self, records, gather):
        d = np.array([0.25, -0.5, 0.0, 0.125])[: len(records)]
        return [dict(r, **{"return": r["return"] + x}) for r, x in zip(records, d)], d, {}


def ep(step_rewards, tools, group, step_events=None, segments=None) -> dict:
    """A record as the learner reads it: turn t has 1 + t % 2 action tokens, an observation token after each."""
    ids, mask = [5], [0]
    for t in range(len(step_rewards)):
        ids += [7] * (1 + t % 2) + [3]
        mask += [1] * (1 + t % 2) + [0]
    r = {"task_id": f"t{group}", "step_rewards": step_rewards, "action_mask": mask, "token_ids": ids,
         "logprobs": [-0.5] * len(ids), "group": group, "actions": [{"tool": t, "params": {}} for t in tools],
         "return": float(sum(step_rewards))}
    if step_events is not None:
        r["step_events"] = step_events
    if segments is not None:
        r["segments"] = segments
    return r


# key events (a write, a subgoal) in three episodes; the third is folded into two rows
RECORDS = [ep([0.0, -0.05, 1.1], ["lookup", "update", "answer"], 0),
           ep([0.0, 0.3], ["lookup", "answer"], 0, step_events=[["subgoal_done"], []]),
           ep([-0.1, 0.0, 0.7], ["plan", "update", "answer"], 1, segments=[0, 5]),
           ep([0.2], ["answer"], 1)]


def config(algorithm: str, credit: str, **more) -> TrainConfig:
    return parse_section(TrainConfig, {"algorithm": algorithm, "group_size": 2, "tasks_per_update": 2,
                                       "num_ranks": 1, "reward_norm_window": 8, "gamma": 0.9, "lam": 0.9,
                                       "reward": {"credit": credit, "event_gamma": 0.5}, **more}, "p:train")


def advantages(cfg: TrainConfig) -> tuple[list[float], list[float] | None]:
    """The action tokens' advantages (and a critic's returns) of one update of RECORDS: a reward normaliser with three
    returns in its window, the Bonus extension, and event credit's extension when the credit is 'event'."""
    state = make_learner_state(cfg)
    state.normalizer.update([0.1, 0.9, 0.4])
    exts = [Bonus()] + ([EventCredit(cfg, frozenset({"update"}))] if cfg.credit == "event" else [])
    sc = score_episodes(RECORDS, cfg, state, None, exts)
    batch = collate_records(RECORDS, 0)
    values = torch.linspace(-0.5, 0.5, batch.mask.numel()).reshape(batch.mask.shape)
    adv, ret = token_advantages(cfg, sc, batch, values if cfg.algorithm == "ppo" else None)
    m = batch.mask > 0
    return adv[m].tolist(), (ret[m].tolist() if ret is not None else None)


# What the kernel gave on RECORDS before the credit rules moved into the registry (when it branched on the credit's
# name), as `advantages` printed it then: the built-in rules must give exactly these bits.
BEFORE = {
    "episode-rloo": {
        "adv": [
            4.545672416687012, 4.545672416687012, 4.545672416687012, 4.545672416687012,
            -4.545672416687012, -4.545672416687012, -4.545672416687012, 0.8333733081817627,
            0.8333733081817627, 0.8333733081817627, 0.8333733081817627, -0.8333733081817627,
        ],
    },
    "episode-ppo": {
        "adv": [
            0.8788642883300781, 1.0739423036575317, 1.3382017612457275, 1.6474134922027588,
            -1.0172505378723145, -1.2499057054519653, -1.513711929321289, -0.09110293537378311,
            -0.08947913348674774, -0.06405201554298401, -0.10718633979558945, -0.8057330846786499,
        ],
        "ret": [
            1.2545971870422363, 1.5958940982818604, 2.0143990516662598, 2.525373935699463,
            -1.3591526746749878, -1.6537498235702515, -2.020298957824707, 0.22284215688705444,
            0.27653825283050537, 0.33998075127601624, 0.4040597975254059, -0.4293135404586792,
        ],
    },
    "turn-rloo": {
        "adv": [
            3.7229061126708984, 4.075953483581543, 4.075953483581543, 4.6365861892700195,
            -3.7229061126708984, -3.783514976501465, -3.783514976501465, 0.43032366037368774,
            0.9242868423461914, 0.9242868423461914, 1.1364182233810425, -0.43032366037368774,
        ],
    },
    "turn-ppo": {
        "adv": [
            0.8193628191947937, 1.009522557258606, 1.267473816871643, 1.6936287879943848,
            -1.0450459718704224, -1.2753541469573975, -1.5364990234375, -0.22279050946235657,
            0.0057576922699809074, 0.061983201652765274, 0.05762341991066933, -0.8356624245643616,
        ],
        "ret": [
            1.235708475112915, 1.5725746154785156, 1.985609531402588, 2.676896095275879,
            -1.3591526746749878, -1.6537498235702515, -2.020298957824707, 0.08084776997566223,
            0.4753659963607788, 0.5854470729827881, 0.7071046829223633, -0.4293135404586792,
        ],
    },
    "event-rloo": {
        "adv": [
            1.7932679653167725, 1.962215542793274, 1.962215542793274, 4.3638458251953125,
            -1.7932679653167725, -2.126617193222046, -2.126617193222046, -0.42880845069885254,
            -0.030304431915283203, -0.030304431915283203, 1.1364182233810425, 0.4288085401058197,
        ],
    },
    "event-ppo": {
        "adv": [
            0.5979255437850952, 0.6941666007041931, 0.8406486511230469, 2.198133945465088,
            -0.5297510623931885, -1.3444911241531372, -1.6560922861099243, -0.24115140736103058,
            -0.004238054621964693, 0.018661964684724808, 0.24603316187858582, -0.8198459148406982,
        ],
        "ret": [
            0.5346220135688782, 0.7070358395576477, 0.9170434474945068, 2.676896095275879,
            -0.6795762777328491, -1.653749704360962, -2.020298957824707, -0.11120820045471191,
            0.23825988173484802, 0.29272353649139404, 0.7071046829223633, -0.4293135404586792,
        ],
    },
}


def test_every_registered_rule_is_built_in_and_of_its_kind():
    assert sorted(C.CREDIT_RULES) == ["episode", "event", "turn"] == C.credit_names()
    assert [n for n, c in sorted(C.CREDIT_RULES.items()) if c.per_turn] == ["event", "turn"]
    assert C.get_credit("episode").fn is C.episode_credit
    assert C.get_credit("event").fn is C.get_credit("turn").fn is C.turn_credit  # event's discounts: its extension's


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_the_built_in_rules_give_the_advantages_they_gave_before_the_registry(key):
    credit, algorithm = key.split("-")
    adv, ret = advantages(config(algorithm, credit))
    assert adv == BEFORE[key]["adv"]
    assert ret == BEFORE[key].get("ret")


def test_unknown_or_broken_rules_are_refused_with_one_line():
    with pytest.raises(AgentRLError, match=r"^train.reward.credit: unknown credit rule 'steps'; choose one of "
                                           r"episode, event, turn, or module:function$"):
        C.get_credit("steps")
    with pytest.raises(ConfigError, match=r"params.yaml:train.reward.credit: .*unknown credit rule 'steps'; choose "
                                          r"one of episode, event, turn"):
        parse_section(TrainConfig, {"reward": {"credit": "steps"}}, "params.yaml:train")
    with pytest.raises(AgentRLError, match="cannot import no_such_module"):
        C.get_credit("no_such_module:rule")
    with pytest.raises(AgentRLError, match="has no function 'missing'"):
        C.get_credit(f"{HERE}:missing")
    with pytest.raises(AgentRLError, match="has no function 'NOT_A_FUNCTION'"):
        C.get_credit(f"{HERE}:NOT_A_FUNCTION")
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        parse_section(TrainConfig, {"reward": {"credit": "no_such_module:rule"}}, "params.yaml:train")


@pytest.mark.parametrize("algorithm", ["rloo", "ppo"])
def test_a_user_rule_named_as_module_function_scores_an_update(algorithm):
    """``outcome_per_turn`` goes through the kernel's per-turn path (one column per turn, rewards on each turn's last
    token), and gives on every token what the built-in episode rule gives."""
    cfg = config(algorithm, f"{HERE}:outcome_per_turn")
    assert C.get_credit(cfg.credit).per_turn  # a plain function is a per-turn rule
    CALLS.clear()
    state = make_learner_state(cfg)
    sc = score_episodes(RECORDS, cfg, state)
    assert CALLS == [4] and sc.turn_mask.sum(1).tolist() == [3, 2, 3, 1]
    assert sc.metrics["turn_credit/turns_per_episode"] == 2.25
    if algorithm == "rloo":  # the same advantage on every turn of an episode
        assert sc.metrics["turn_credit/adv_spread_within_episode"] == 0.0
    assert advantages(cfg) == advantages(config(algorithm, "episode"))


def test_a_registered_rule_keeps_its_kind_and_the_config_reads_it(monkeypatch):
    assert C.get_credit(f"{HERE}:success_only").per_turn  # unregistered: per turn
    monkeypatch.setitem(C.CREDIT_RULES, "won", C.CREDIT_RULES["episode"])
    assert C.register_credit("won", per_turn=False)(success_only) is success_only
    assert C.get_credit(f"{HERE}:success_only").per_turn is False and "won" in C.credit_names()
    # a per-episode rule: its one column is the score the group baseline and a critic read
    adv, _ = advantages(config("rloo", "won"))
    # R' = (1.3, −0.2, 0.6, 0.325) against the window's mean 0.467: in each group the first won and the second lost
    assert adv == [1.0] * 4 + [-1.0] * 3 + [1.0] * 4 + [-1.0]
    _, ret = advantages(config("ppo", f"{HERE}:success_only"))
    assert [ret[i] for i in (3, 6, 10, 11)] == [1.0, 0.0, 1.0, 0.0]  # each episode's last action: the rule's reward
    # replay with a critic takes per-episode rules only: the config asks the rule's kind, not its name
    replay = {"sampling": {"replay": True}}
    assert config("ppo", "won", **replay).credit == "won"
    with pytest.raises(ConfigError, match=f"per-episode credit only: the per-turn credit '{HERE}:outcome_per_turn'"):
        config("ppo", f"{HERE}:outcome_per_turn", **replay)


def test_a_rule_of_an_installed_entry_point_is_found(installed_package):
    installed_package("agentrl_outcome", f"from {HERE} import outcome_per_turn\n", "agentrl.credit",
                      {"outcome": "agentrl_outcome:outcome_per_turn"})
    assert "outcome" in C.credit_names()
    assert C.get_credit("outcome").fn is outcome_per_turn
    assert config("rloo", "outcome").credit == "outcome"


@pytest.mark.slow
def test_a_user_rule_trains_a_tiny_run(tmp_path, monkeypatch):
    """`train.reward.credit: module:function` in a real run: the kernel asks the user's rule on every update, logs the
    per-turn figures, and the run completes with a policy."""
    from pipeline.train.worker import run_worker
    from tests.test_train import make_project

    root = make_project(tmp_path / "credit", updates=2)
    monkeypatch.chdir(root)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"]["reward"] = {"credit": f"{HERE}:outcome_per_turn"}
    (root / "params-credit.yaml").write_text(yaml.safe_dump(params))
    CALLS.clear()
    result = run_worker("params-credit.yaml", ckpt="ckpt", out="models/policy-credit")
    assert [x["update"] for x in result["history"]] == [1, 2]
    assert len(CALLS) == 2  # one scoring per update
    assert all(x["turn_credit/turns_per_episode"] >= 1 for x in result["history"])
    assert result["completed"] and (root / "models/policy-credit").is_dir()
