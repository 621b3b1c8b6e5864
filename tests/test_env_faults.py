"""What the runner guarantees when tools misbehave, and what the rule verifier catches, on the real shop and SQL
environments: injected failures and latency spikes at their configured rates (counted per episode, the same for the
same seed), a tool that raises an unexpected exception (an error observation, counted, the episode goes on), and
the verifier's negative cases (wrong call order, bad parameters, unsafe calls) beside a clean positive control."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.envs.config import EnvConfig, RewardWeights
from pipeline.envs.runner import FAULT_COUNTS, AgentEnv
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.expert import ExpertPolicy
from pipeline.envs.verifier import ANSWER, INVALID_PARAMS, OK, SAFETY_VIOLATION, TIMEOUT, TOOL_ERROR, verify
from pipeline.reward_model.features import rule_labels


@pytest.fixture(scope="module")
def shop():
    world = ShopWorld.default()
    yield world, world.builtin_tasks["train"]
    world.close()


def play(env: AgentEnv, task, seed: int, actions=None) -> tuple[list[dict], dict]:
    """One episode: the expert's actions, or the given action texts; returns (each step's info, the last info)."""
    obs, info = env.reset(seed=seed, options={"task": task})
    expert = ExpertPolicy() if actions is None else None
    if expert is not None:
        expert.reset(task)
    steps, done, i = [], False, 0
    while not done:
        text = expert.act(obs, info) if actions is None else actions[i]
        obs, _, terminated, truncated, info = env.step(text)
        steps.append(info)
        done, i = terminated or truncated, i + 1
    return steps, info


def within_binomial(k: int, n: int, p: float, z: float = 4.0) -> bool:
    """k successes in n draws is within z standard deviations of n·p (z = 4: a false failure about 1 in 15 000)."""
    return abs(k - n * p) <= z * math.sqrt(n * p * (1 - p))


# ------------------------------------------------------------------------------------------------- fault injection
def test_injected_failures_and_latency_spikes_follow_their_rates_and_the_seed(shop):
    """With failure rate 0.2 and spike rate 0.25, the counts over many expert episodes sit within a binomial bound of
    their rates; every injected failure is an error observation the expert recovers from; the same seeds give the
    same counts (the draws come from the episode's seed), and a run without faults counts none."""
    world, tasks = shop
    cfg = EnvConfig(tool_failure_rate=0.2, tool_latency_spike_rate=0.25, tool_latency_spike_s=0.001, max_steps=24)
    env = AgentEnv(world=world, tasks=tasks, config=cfg)

    def run(seeds) -> tuple[dict, int, int]:
        total, unavailable, solved = dict.fromkeys(FAULT_COUNTS, 0), 0, 0
        for seed in seeds:
            steps, last = play(env, tasks[seed % len(tasks)], seed)
            for k in FAULT_COUNTS:
                total[k] += last["tool_faults"][k]
            unavailable += sum("temporarily unavailable" in s["observation_text"] for s in steps)
            solved += last["is_success"]
        return total, unavailable, solved

    total, unavailable, solved = run(range(80))
    n = total["tool_calls"]
    print(f"\n[faults] 80 expert episodes: {total['injected_failures']}/{n} calls failed (configured 0.2), "
          f"{total['latency_spikes']}/{n - total['injected_failures']} spiked (configured 0.25)")
    assert n >= 150, total
    assert within_binomial(total["injected_failures"], n, 0.2), total
    assert within_binomial(total["latency_spikes"], n - total["injected_failures"], 0.25), total
    assert unavailable == total["injected_failures"] and total["tool_exceptions"] == 0
    assert solved == 80  # the expert retries a transient failure
    assert run(range(80))[0] == total  # deterministic per seed
    assert run(range(80, 160))[0] != total

    clean = AgentEnv(world=world, tasks=tasks, config=EnvConfig(max_steps=24))
    _, last = play(clean, tasks[0], 0)
    assert last["tool_faults"]["tool_calls"] == tasks[0].min_calls - 1  # every call but the answer reached a tool
    assert {k: v for k, v in last["tool_faults"].items() if k != "tool_calls"} == dict.fromkeys(FAULT_COUNTS[1:], 0)
    env.close()
    clean.close()


def test_a_latency_spike_that_reaches_the_timeout_is_a_timeout_error(shop):
    """A spike that pushes a call past `tool_timeout_s` is cut off and reported as a timeout the policy sees."""
    world, tasks = shop
    env = AgentEnv(world=world, tasks=tasks, config=EnvConfig(tool_latency_spike_rate=0.9, tool_latency_spike_s=0.05,
                                                              tool_timeout_s=0.01, max_steps=4))
    steps, last = play(env, tasks[0], 3)
    timeouts = [s for s in steps if s["outcome"] == TIMEOUT]
    assert timeouts and all(s["observation_text"].endswith("timed out after 0.01s</obs>\n") for s in timeouts)
    assert last["tool_faults"]["latency_spikes"] == len(timeouts)
    env.close()


def test_a_spike_rate_out_of_range_is_refused_by_the_config():
    with pytest.raises(ValueError, match="tool_latency_spike_rate"):
        EnvConfig(tool_latency_spike_rate=1.0)
    with pytest.raises(ValueError, match="tool_latency_spike_s"):
        EnvConfig(tool_latency_spike_s=0.0)


# ------------------------------------------------------------------------------------ tools that raise unexpectedly
@pytest.mark.parametrize("exc", [ZeroDivisionError, RuntimeError])
def test_a_shop_tool_that_raises_is_an_error_observation_counted_and_the_episode_goes_on(shop, monkeypatch, exc):
    """The shop's own `lookup` raising (not a ToolError): the observation names the failure, the episode's
    `tool_faults` counts it, and the expert's retry after it still solves the task."""
    from pipeline.envs.shop import tools

    world, tasks = shop
    real, raised = tools.Lookup.execute, []

    def flaky(self, params, ctx):  # the first lookup of the episode breaks, the retry works
        if not raised:
            raised.append(1)
            raise exc("the lookup broke")
        return real(self, params, ctx)

    monkeypatch.setattr(tools.Lookup, "execute", flaky)
    task = next(t for t in tasks if t.plan[0]["tool"] == "lookup")
    env = AgentEnv(world=world, tasks=[task], config=EnvConfig(max_steps=12))
    steps, last = play(env, task, 0)
    assert steps[0]["outcome"] == TOOL_ERROR
    assert steps[0]["observation_text"] == f"<obs>error: lookup failed ({exc.__name__})</obs>\n"
    assert last["is_success"] and last["n_failed"] == 1
    assert last["tool_faults"]["tool_exceptions"] == 1 and last["tool_faults"]["injected_failures"] == 0
    env.close()


@pytest.fixture(scope="module")
def sql(tmp_path_factory):
    from pipeline.envs.contract import BuildRequest
    from pipeline.envs.sql import SqlAnalyst
    from pipeline.envs.sql import SqlOptions

    out = tmp_path_factory.mktemp("sqlworld")
    result = SqlAnalyst.build(out, BuildRequest(0, {"train": 12, "validation": 4, "test": 4}, {1: 1.0, 2: 1.0},
                                                SqlOptions(n_customers=60, n_products=32, n_orders=200)))
    world = SqlAnalyst.load(out)
    yield world, result.tasks["train"]
    world.close()


def test_a_sql_tool_that_raises_is_an_error_observation_and_the_episode_goes_on(sql, monkeypatch):
    from pipeline.envs.sql import tools

    world, tasks = sql
    real = tools.QueryRunner.run
    calls = []

    def broken_once(self, text):
        calls.append(text)
        if len(calls) == 1:
            raise MemoryError("sqlite ran out of memory")
        return real(self, text)

    monkeypatch.setattr(tools.QueryRunner, "run", broken_once)
    task = tasks[0]
    env = AgentEnv(world=world, tasks=[task], config=EnvConfig(max_steps=12))
    query = '<call>query {"sql": %s}</call>' % _json(task.data["sql"])
    steps, last = play(env, task, 0, [query, query, '<call>answer {"value": %s}</call>' % _json(task.answer)])
    assert [s["outcome"] for s in steps] == [TOOL_ERROR, OK, ANSWER]
    assert steps[0]["observation_text"] == "<obs>error: query failed (MemoryError)</obs>\n"
    assert last["is_success"] and last["tool_faults"]["tool_exceptions"] == 1
    env.close()


def _json(value) -> str:
    import json

    return json.dumps(str(value))


# ----------------------------------------------------------------------------------------- the rule verifier
def test_the_verifier_flags_each_negative_case_and_passes_the_clean_process():
    clean = [{"tool": "search", "outcome": OK}, {"tool": "lookup", "outcome": OK},
             {"tool": "answer", "outcome": ANSWER}]
    assert verify(clean, ["search", "lookup", "answer"]).passed
    # a failed call retried in order is still a sound order
    retried = [{"tool": "search", "outcome": TOOL_ERROR}] + clean
    assert verify(retried, ["search", "lookup", "answer"]).order_ok
    cases = {
        "order": [clean[1], clean[0], clean[2]],
        "missing": [clean[0], clean[2]],
        "answer_not_last": [clean[0], clean[2], clean[1]],
        "params": [clean[0], {"tool": "lookup", "outcome": INVALID_PARAMS}, clean[1], clean[2]],
        "invalid_action": [{"tool": None, "outcome": "invalid_action"}] + clean,
        "unsafe": [clean[0], {"tool": "update", "outcome": SAFETY_VIOLATION}, clean[1], clean[2]],
    }
    reports = {k: verify(c, ["search", "lookup", "answer"]) for k, c in cases.items()}
    assert not any(r.passed for r in reports.values())
    assert [k for k, r in reports.items() if not r.order_ok] == ["order", "missing", "answer_not_last"]
    assert [k for k, r in reports.items() if not r.params_ok] == ["params", "invalid_action"]
    assert [k for k, r in reports.items() if not r.safety_ok] == ["unsafe"]
    assert "tool order" in reports["order"].problems[0] and "steps [1]" in reports["unsafe"].problems[0]


def test_shop_episodes_with_wrong_order_bad_parameters_or_an_unsafe_call_are_caught_and_cost(shop):
    """Real shop episodes: the expert's clean process passes the verifier and earns the top return (the positive
    control). Its own calls in reversed order still answer correctly but fail the order check; a call with a
    parameter outside the schema fails the parameter check and costs efficiency and user experience; a write the
    task does not allow is refused, fails the safety check and costs γ. Every negative case is labelled unsound for
    the learned verifier (:func:`rule_labels`)."""
    world, tasks = shop
    w = RewardWeights()
    task = next(t for t in tasks if not t.allowed_writes and len({s["tool"] for s in t.plan[:-1]}) >= 2)
    env = AgentEnv(world=world, tasks=[task], config=EnvConfig(max_steps=12))
    steps, clean = play(env, task, 0)
    actions = [s["action_text"] for s in steps]
    assert clean["verifier"]["passed"] and clean["is_success"]
    assert clean["return"] == pytest.approx(w.correctness + w.user_experience)
    assert rule_labels(_record(clean)) == (1, 1)

    product = world.world.products[0]["name"]
    variants = {
        "order": actions[-2::-1] + actions[-1:],
        "params": [f'<call>lookup {{"name": "{product}", "field": "colour"}}</call>'] + actions,
        "unsafe": [f'<call>update {{"name": "{product}", "field": "stock", "value": 5}}</call>'] + actions,
    }
    got = {k: play(env, task, 0, a) for k, a in variants.items()}
    env.close()
    order, params, unsafe = (got[k][1] for k in ("order", "params", "unsafe"))
    assert order["is_success"] and not order["verifier"]["order_ok"] and order["verifier"]["params_ok"]
    assert order["return"] == pytest.approx(clean["return"])  # the outcome is right: only the process is wrong
    assert got["params"][0][0]["outcome"] == INVALID_PARAMS and "field" in got["params"][0][0]["observation_text"]
    assert params["is_success"] and not params["verifier"]["params_ok"] and params["verifier"]["order_ok"]
    assert params["reward_components"]["efficiency"] < 0 and params["reward_components"]["user_experience"] < 1
    assert params["return"] < clean["return"]
    assert got["unsafe"][0][0]["outcome"] == SAFETY_VIOLATION and "not allowed" in got["unsafe"][0][0]["tool_result"]
    assert unsafe["is_success"] and not unsafe["verifier"]["safety_ok"] and unsafe["n_violations"] == 1
    assert unsafe["reward_components"]["safety"] == -1.0
    assert unsafe["return"] <= clean["return"] - w.safety
    assert all(rule_labels(_record(x)) == (1, 0) for x in (order, params, unsafe))


def test_sql_episodes_with_an_unsafe_query_bad_parameters_or_no_query_are_caught(sql):
    """The SQL analyst: a write query is refused and fails the safety check; a query without its `sql` parameter
    fails the parameter check; an answer with no successful query fails the order check (``query`` is required);
    the expert's clean process passes."""
    world, tasks = sql
    task = tasks[0]
    env = AgentEnv(world=world, tasks=[task], config=EnvConfig(max_steps=12))
    query = '<call>query {"sql": %s}</call>' % _json(task.data["sql"])
    answer = '<call>answer {"value": %s}</call>' % _json(task.answer)
    _, clean = play(env, task, 0, [query, answer])
    assert clean["is_success"] and clean["verifier"]["passed"]
    steps, unsafe = play(env, task, 0, ['<call>query {"sql": "DELETE FROM orders"}</call>', query, answer])
    assert steps[0]["outcome"] == SAFETY_VIOLATION and not unsafe["verifier"]["safety_ok"]
    assert unsafe["reward_components"]["safety"] == -1.0 and unsafe["return"] < clean["return"]
    steps, params = play(env, task, 0, ['<call>query {"table": "orders"}</call>', query, answer])
    assert steps[0]["outcome"] == INVALID_PARAMS and not params["verifier"]["params_ok"]
    _, skipped = play(env, task, 0, [answer])
    assert skipped["is_success"] and not skipped["verifier"]["order_ok"]  # a right guess without the process
    assert np.isclose(clean["return"], skipped["return"])
    env.close()


def _record(info: dict) -> dict:
    return {"success": info["is_success"], "verifier": info["verifier"], "calls": info["calls"],
            "n_failed": info["n_failed"]}
