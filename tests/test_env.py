"""The environment contract, its tools, the protocol parser, the reward and the scripted policies."""

from __future__ import annotations

import json
import string

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.envs import reward as R
from pipeline.envs.config import EnvConfig, RewardWeights
from pipeline.envs.runner import MAX_CONTEXT_CHARS, AgentEnv  # importing the runner registers agentrl/ToolTasks-v0
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.expert import ExpertPolicy, RandomPolicy
from pipeline.envs.protocol import InvalidAction, ParsedAction, format_action, parse_action
from pipeline.envs.shop.tasks import FAMILIES, TEMPLATES, answers_match, generate_tasks
from pipeline.envs.shop.tools import TOOL_NAMES, ToolError, safe_calc
from pipeline.policy.episodes import COMPONENTS, evaluate, run_episode, summarize


@pytest.fixture(scope="module")
def runtime():
    rt = ShopWorld.default()
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def splits(runtime):
    return {s: generate_tasks(runtime.world, s, 240, {1: 1, 2: 1, 3: 1, 4: 1}, seed=0,
                              solver=lambda p, a: runtime.solve(p, a)) for s in ("train", "validation", "test")}


def test_check_env_passes_through_gym_make():
    env = gym.make("agentrl/ToolTasks-v0")
    check_env(env.unwrapped, skip_render_check=False)
    env.close()


def test_same_seed_same_episode(runtime, splits):
    def play(seed):
        env = AgentEnv(world=runtime, tasks=splits["train"], config={"randomize_values": True,
                                                                         "tool_failure_rate": 0.3})
        obs, info = env.reset(seed=seed)
        trace = [obs["context"]]
        pol = ExpertPolicy()
        pol.reset(env.task)
        done = False
        while not done:
            obs, r, term, trunc, info = env.step(pol.act(obs, info))
            trace.append((obs["context"], r, term, trunc, obs["memory"].tolist()))
            done = term or trunc
        env.close()
        return trace

    assert play(7) == play(7)
    assert play(7) != play(8)


def test_terminated_is_answer_and_truncated_is_budget(runtime, splits):
    task = splits["train"][0]
    env = AgentEnv(world=runtime, tasks=[task], config={"max_steps": 3})
    env.reset(seed=0)
    for i in range(3):
        _, _, term, trunc, info = env.step(format_action("calc", {"expr": "1+1"}))
        assert not term
        assert trunc == (i == 2)
    assert info["is_success"] is False and info["reward_components"]["user_experience"] == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step(format_action("calc", {"expr": "1"}))
    env.reset(seed=0)
    _, _, term, trunc, info = env.step(format_action("answer", {"value": task.answer}))
    assert term and not trunc and info["is_success"]
    # the policy-text budget truncates as well
    env = AgentEnv(world=runtime, tasks=[task], config={"max_policy_chars": 100, "max_steps": 50})
    env.reset(seed=0)
    _, _, term, trunc, _ = env.step(format_action("search", {"query": "a long enough query to use the budget"}))
    assert not (term or trunc)
    _, _, term, trunc, _ = env.step(format_action("search", {"query": "a long enough query to use the budget"}))
    assert trunc and not term


@pytest.mark.parametrize("value", ["", " ", "\t "])
def test_a_blank_answer_is_an_invalid_call_not_an_answer(runtime, splits, value):
    """A policy that answers with nothing has not answered: the call breaks the answer schema, costs a step and the
    episode goes on (an answer call that succeeds always records a non-blank value, as the GX suites require)."""
    task = splits["train"][0]
    env = AgentEnv(world=runtime, tasks=[task])
    env.reset(seed=0)
    _, _, term, trunc, info = env.step(format_action("answer", {"value": value}))
    assert info["outcome"] == "invalid_params" and not (term or trunc)
    assert "answer" in info["tool_result"] and "value" in info["tool_result"]
    _, _, term, _, info = env.step(format_action("answer", {"value": task.answer}))
    assert term and info["is_success"] and info["answer"] == task.answer
    assert info["n_calls"] == 2  # the blank answer was charged as a call
    env.close()


def test_dict_actions_and_text_actions_agree(runtime, splits):
    task = next(t for t in splits["train"] if t.family == "lookup")
    env = AgentEnv(world=runtime, tasks=[task])
    step = task.plan[0]
    env.reset(seed=0)
    _, _, _, _, a = env.step({"tool": TOOL_NAMES.index("lookup"), "params": json.dumps(step["params"])})
    env.reset(seed=0)
    _, _, _, _, b = env.step(format_action("lookup", step["params"]))
    assert a["tool_result"] == b["tool_result"] and a["outcome"] == b["outcome"] == "ok"


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_expert_solves_every_task_with_documented_components(runtime, splits, split):
    metrics, records = evaluate("expert", splits[split], runtime, EnvConfig())
    o = metrics["overall"]
    assert o["success_rate"] == 1.0
    assert o["mean_efficiency"] == 0.0 and o["mean_safety"] == 0.0 and o["mean_user_experience"] == 1.0
    assert o["safety_violations"] == 0 and o["verifier_pass_rate"] == 1.0
    w = RewardWeights()
    assert all(r["return"] == pytest.approx(w.correctness + w.user_experience) for r in records)
    assert all(r["n_calls"] == t.min_calls for r, t in zip(records, splits[split]))


def test_expert_recovers_from_faults_and_redrawn_values(runtime, splits):
    metrics, _ = evaluate("expert", splits["validation"], runtime,
                          EnvConfig(randomize_values=True, tool_failure_rate=0.1, max_steps=16))
    assert metrics["overall"]["success_rate"] == 1.0
    assert metrics["overall"]["mean_tool_calls"] > np.mean([t.min_calls for t in splits["validation"]])


def test_random_policy_solves_almost_nothing(runtime, splits):
    metrics, _ = evaluate("random", splits["test"], runtime, EnvConfig(), seed=1)
    assert metrics["overall"]["success_rate"] < 0.02
    assert metrics["overall"]["safety_violations"] > 0


def test_step_rewards_sum_to_the_composite_return(runtime, splits):
    env = AgentEnv(world=runtime, tasks=splits["train"])
    rng = np.random.default_rng(0)
    for seed in range(30):
        obs, info = env.reset(seed=seed)
        pol = RandomPolicy([p["name"] for p in runtime.world.products], rng) if seed % 2 else ExpertPolicy(
            "redundant_call", rng)
        pol.reset(env.task)
        total, done = 0.0, False
        while not done:
            obs, r, term, trunc, info = env.step(pol.act(obs, info))
            total += r
            done = term or trunc
        c = R.RewardComponents(**info["reward_components"])
        assert total == pytest.approx(info["return"]) == pytest.approx(R.composite(c, RewardWeights()))
        assert 0 <= c.correctness <= 1 and -1 <= c.efficiency <= 0 and -1 <= c.safety <= 0
        assert 0 <= c.user_experience <= 1


@pytest.mark.parametrize("shaping", ["on_success", "always"])
def test_a_failed_episode_earns_no_shaping_by_default(runtime, splits, shaping):
    """With shaping 'on_success', a wrong answer given at once and a wrong answer after wasted calls both return 0
    (γ·safety only), so a group baseline cannot learn to give up early; with 'always' the quick wrong answer earns
    more, which is the incentive the default removes."""
    cfg = EnvConfig(reward=RewardWeights(shaping=shaping))
    env = AgentEnv(world=runtime, tasks=splits["train"], config=cfg)
    task = next(t for t in splits["train"] if t.level == 3)
    returns = {}
    for name, actions in {"quick": ['<call>answer {"value": "nope"}</call>'],
                          "wasted": ['<call>calc {"expr": "1+1"}</call>'] * 6 + ['<call>answer {"value": "nope"}</call>']}.items():
        env.reset(seed=0, options={"task_id": task.task_id})
        total = 0.0
        for a in actions:
            _, r, term, trunc, info = env.step(a)
            total += r
        assert term and not info["is_success"]
        returns[name] = total
    if shaping == "on_success":
        assert returns == {"quick": 0.0, "wasted": 0.0}
    else:
        assert returns["quick"] > returns["wasted"]
    # a correct answer still pays for its efficiency either way
    obs, info = env.reset(seed=0, options={"task_id": task.task_id})
    pol = ExpertPolicy("redundant_call", np.random.default_rng(0))
    pol.reset(env.task)
    done = False
    while not done:
        obs, r, term, trunc, info = env.step(pol.act(obs, info))
        done = term or trunc
    c, w = info["reward_components"], cfg.reward
    assert info["is_success"]
    assert info["return"] == pytest.approx(1.0 + w.efficiency * c["efficiency"] + w.user_experience * c["user_experience"])


def test_writes_outside_the_task_are_refused_and_never_executed(runtime, splits):
    task = next(t for t in splits["train"] if t.family == "update")
    other = next(p["name"] for p in runtime.world.products if p["name"] != task.entities[0])
    env = AgentEnv(world=runtime, tasks=[task])
    env.reset(seed=0)
    before = env._episode.conn.execute("SELECT stock FROM products WHERE name = ?", (other,)).fetchone()[0]
    _, r, _, _, info = env.step(format_action("update", {"name": other, "field": "stock", "value": 1}))
    assert info["outcome"] == "safety_violation" and r < 0
    assert env._episode.conn.execute("SELECT stock FROM products WHERE name = ?", (other,)).fetchone()[0] == before
    _, _, _, _, info = env.step(format_action("update", {"name": task.entities[0], "field": "price", "value": 1}))
    assert info["outcome"] == "invalid_params"  # only `stock` is writable at all
    # the allowed write works, and only inside this episode's private copy
    _, _, _, _, info = env.step(format_action("update", {"name": task.entities[0], "field": "stock", "value": 5}))
    assert info["outcome"] == "ok"
    master = runtime.master.execute("SELECT stock FROM products WHERE name = ?", (task.entities[0],)).fetchone()[0]
    assert master != 5 or task.answer == "5"
    env.reset(seed=0)
    assert env._episode.conn.execute("SELECT stock FROM products WHERE name = ?", (task.entities[0],)).fetchone()[0] == master


def test_tool_failure_modes(runtime, splits):
    env = AgentEnv(world=runtime, tasks=splits["train"][:1])
    env.reset(seed=0)
    cases = {
        "<call>teleport {}</call>": "invalid_action",
        '<call>lookup {"name": "x"}</call>': "invalid_params",
        '<call>lookup {"name": "Nope Thing", "field": "price"}</call>': "tool_error",
        '<call>calc {"expr": "1/0"}</call>': "tool_error",
        '<call>convert {"value": 3, "from": "kg", "to": "km"}</call>': "tool_error",
    }
    for text, outcome in cases.items():
        _, _, _, _, info = env.step(text)
        assert info["outcome"] == outcome, text
        assert info["observation_text"].startswith("<obs>error:")
    slow = AgentEnv(world=runtime, tasks=splits["train"][:1], config={"tool_latency_s": 0.05, "tool_timeout_s": 0.01})
    slow.reset(seed=0)
    _, _, _, _, info = slow.step('<call>calc {"expr": "1+1"}</call>')
    assert info["outcome"] == "timeout"


def test_calculator_never_evaluates_code():
    assert safe_calc("061-747") == -686
    assert safe_calc("2*(3+4)/7") == 2
    for bad in ("__import__('os')", "1;2", "2**3", "", "(1", "1e999*1e999", "9" * 200):
        with pytest.raises(ToolError):
            safe_calc(bad)


def test_context_is_append_only_until_folded_and_always_bounded(runtime, splits):
    env = AgentEnv(world=runtime, tasks=splits["train"][:1], config={"max_steps": 40, "history_window": 3})
    obs, info = env.reset(seed=0)
    hostile = "<call>calc {\"expr\": \"" + "9" * 100 + "\"}</call>" + "\u2603" * 50
    for _ in range(39):
        before = obs["context"]
        obs, _, term, trunc, info = env.step(hostile[:256])
        assert len(obs["context"]) <= MAX_CONTEXT_CHARS
        assert set(obs["context"]) <= set(string.printable)
        if not info["context_folded"]:
            assert obs["context"] == before + info["action_text"] + info["observation_text"]
        if term or trunc:
            break
    assert "State: earlier calls and results:" in obs["context"]


def test_splits_hold_out_entities_and_templates(splits):
    train_entities = {e for t in splits["train"] for e in t.entities}
    for split in ("validation", "test"):
        assert not train_entities & {e for t in splits[split] for e in t.entities}
    train_templates = {t.template_id for t in splits["train"]}
    unseen = [t for t in splits["test"] if not t.template_seen]
    assert unseen and not {t.template_id for t in unseen} & train_templates
    assert {t.family for t in splits["train"]} == set(FAMILIES)
    assert {t.level for t in splits["train"]} == {1, 2, 3, 4}
    assert all(len(TEMPLATES[f]) == 9 for f in FAMILIES)


def test_the_hardest_level_composes_steps_that_level_2_teaches(runtime, splits):
    """Level 4 (search -> lookup -> calc -> answer) is level 2's `search_lookup` (search -> lookup of the quoted
    flagship -> answer) with `lookup_calc`'s multiplication before the answer: every step of it is taught on level 2,
    so a level-4 success can come from composing skills the demonstrations teach (README, the environment)."""
    by_family = {f: [t for t in splits["train"] if t.family == f] for f in ("search_lookup", "search_lookup_calc",
                                                                            "lookup_calc")}
    assert all(by_family.values()) and {t.level for t in by_family["search_lookup"]} == {2}
    s2, s4, c2 = by_family["search_lookup"][0], by_family["search_lookup_calc"][0], by_family["lookup_calc"][0]
    assert [p["tool"] for p in s2.plan] == ["search", "lookup", "answer"]
    assert s2.plan[1]["params"]["name"] == s4.plan[1]["params"]["name"] == "{0:quoted}"
    assert [p["tool"] for p in s4.plan] == [p["tool"] for p in s2.plan[:2]] + [c2.plan[1]["tool"], "answer"]
    env = AgentEnv(world=runtime, tasks=splits["train"])
    recs = [run_episode(env, ExpertPolicy(), t, i) for i, t in enumerate(by_family["search_lookup"][:10])]
    assert all(r["success"] for r in recs)


def test_generation_is_seeded(runtime):
    a = generate_tasks(runtime.world, "train", 50, {1: 1, 4: 1}, seed=3, solver=lambda p, w: runtime.solve(p, w))
    b = generate_tasks(runtime.world, "train", 50, {1: 1, 4: 1}, seed=3, solver=lambda p, w: runtime.solve(p, w))
    c = generate_tasks(runtime.world, "train", 50, {1: 1, 4: 1}, seed=4, solver=lambda p, w: runtime.solve(p, w))
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b] != [t.to_dict() for t in c]
    assert {t.level for t in a} == {1, 4}


def test_train_wordings_widen_train_and_validation_but_never_test_or_the_heldout_wording(runtime):
    def gen(split, k, n=400):
        return generate_tasks(runtime.world, split, n, {1: 1, 2: 1, 3: 1, 4: 1}, seed=0,
                              solver=lambda p, w: runtime.solve(p, w), train_wordings=k)

    for split in ("train", "validation"):
        four, eight = gen(split, 4), gen(split, 8)
        used = {int(t.template_id.split("/")[1]) for t in eight}
        assert used == {0, 1, 2, 3, 5, 6, 7, 8}, split  # every extra wording is drawn, the held-out 4 never
        assert all(t.template_seen for t in eight)
        assert {int(t.template_id.split("/")[1]) for t in four} == {0, 1, 2, 3}
        assert {int(t.template_id.split("/")[1]) for t in gen(split, 1)} == {0}
    # the test split does not depend on train_wordings: same tasks, byte for byte, held-out wording included
    assert [t.to_dict() for t in gen("test", 4)] == [t.to_dict() for t in gen("test", 8)]
    test_unseen = {t.template_id for t in gen("test", 8) if not t.template_seen}
    assert test_unseen and all(tid.endswith("/4") for tid in test_unseen)
    assert not test_unseen & {t.template_id for t in gen("train", 8) + gen("validation", 8)}
    with pytest.raises(ValueError, match="train_wordings must be 1-8, got 9"):
        gen("train", 9, n=5)


@pytest.mark.parametrize("flaw", ["redundant_call", "wrong_order", "wrong_value"])
def test_imperfect_demonstrations_have_their_flaw(runtime, splits, flaw):
    env = AgentEnv(world=runtime, tasks=splits["train"])
    hard = [t for t in splits["train"] if t.level >= 2][:20]
    recs = [run_episode(env, ExpertPolicy(flaw, np.random.default_rng(i)), t, i) for i, t in enumerate(hard)]
    if flaw == "wrong_value":
        assert not any(r["success"] for r in recs)
    else:
        assert all(r["success"] for r in recs)
        assert all(r["n_calls"] == t.min_calls + 1 for r, t in zip(recs, hard))
        assert all(r["components"]["efficiency"] < 0 for r in recs)
    if flaw == "wrong_order":
        assert all(r["n_failed"] == 1 for r in recs)


def test_summary_reports_per_level_and_template(runtime, splits):
    metrics, _ = evaluate("expert", splits["test"], runtime, EnvConfig())
    assert set(metrics["per_level"]) == {"1", "2", "3", "4"}
    assert metrics["template_unseen"]["n"] + metrics["template_seen"]["n"] == len(splits["test"])
    with pytest.raises(ValueError):
        summarize([])


def test_tool_calls_per_success_counts_failed_episodes_calls_and_mean_over_solved_does_not():
    base = {"level": 1, "template_seen": True, "return": 0.0, "truncated": False, "n_violations": 0,
            "verifier": {"passed": True}, "components": {c: 0.0 for c in COMPONENTS}}
    recs = [dict(base, success=True, n_calls=2), dict(base, success=True, n_calls=4),
            dict(base, success=False, n_calls=6)]
    o = summarize(recs)["overall"]
    assert o["mean_tool_calls_solved"] == 3.0 and o["tool_calls_per_success"] == 6.0  # (2 + 4 + 6) / 2
    none = summarize([dict(base, success=False, n_calls=3)])["overall"]
    assert none["tool_calls_per_success"] is None and none["mean_tool_calls_solved"] is None


def test_answers_match():
    assert answers_match("2884", "2884") and answers_match("2884.0", "2884") and answers_match("'Blue Lamp'", "blue lamp")
    assert not answers_match("2885", "2884") and not answers_match(None, "1") and not answers_match("", "")


TOOLS = tuple(TOOL_NAMES)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_parser_survives_arbitrary_text(text):
    out = parse_action(text, TOOLS)
    assert isinstance(out, (ParsedAction, InvalidAction))
    if isinstance(out, ParsedAction):
        assert out.name in TOOLS and isinstance(out.params, dict)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.text(max_size=300),
    st.builds(lambda t, body: f"<call>{t} {body}</call>", st.sampled_from(TOOLS + ("rm", "")),
              st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                           lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
                           max_leaves=8).map(lambda v: json.dumps(v) if not isinstance(v, float) else str(v))),
))
def test_env_survives_arbitrary_actions(runtime, splits, text):
    env = AgentEnv(world=runtime, tasks=[t for t in splits["train"] if t.family == "update"][:1])
    env.reset(seed=0)
    master_before = runtime.master.execute("SELECT sum(stock), sum(price) FROM products").fetchone()
    obs, r, term, trunc, info = env.step(text)
    assert env.observation_space.contains(obs)
    assert info["outcome"] in ("ok", "answer", "invalid_action", "invalid_params", "tool_error", "timeout",
                               "safety_violation")
    assert runtime.master.execute("SELECT sum(stock), sum(price) FROM products").fetchone() == master_before
    env.close()


def test_a_refused_reset_leaves_no_episode_to_step(runtime, splits):
    """A reset whose options are refused in the middle of an episode ends the old episode and begins no new one: the
    next step is an error until a reset succeeds."""
    task = next(t for t in splits["train"] if t.family == "two_lookup")
    env = AgentEnv(world=runtime, tasks=[task])
    env.reset(seed=0, options={"task": task})
    with pytest.raises(ValueError, match="no task with task_id"):
        env.reset(seed=1, options={"task_id": "no-such-task"})
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(format_action("lookup", {"name": task.entities[0], "field": "price"}))
    env.reset(seed=0, options={"task": task})  # and the next reset works
    env.close()
