"""The read-only SQL analyst (pipeline.envs.sql): a deterministic world, held-out splits, reference SQL that gives each
task's answer, the query guard (authorizer, one statement, time and row limits), the scripted expert and its flaws
driven through the environment's own episodes, and the Great Expectations suites of the tables."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sqlite3
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from env_support import MAX_ACTION_CHARS, all_tasks, digest, drive, parse
from pipeline.envs.contract import BuildRequest, SafetyViolation, Task, ToolError
from pipeline.envs.sql import SqlAnalyst, SqlOptions, answers_match
from pipeline.envs.sql.tasks import FAMILIES
from pipeline.envs.sql.tools import QueryLimits, QueryRunner
from pipeline.envs.sql.wordings import GRAMMAR_BASE
from pipeline.envs.sql.world import CORPUS_NAME, DB_NAME, HELDOUT_DIMENSIONS, META_NAME, TABLES, connect_ro

SMALL = SqlOptions(n_customers=200, n_products=96, n_orders=1500, query_timeout_s=0.3, max_rows=5)
SIZES = {"train": 60, "validation": 24, "test": 40}
MIX = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}


def build(out: Path, seed: int = 0, sizes=SIZES, options=SMALL, mix=MIX):
    out.mkdir(parents=True, exist_ok=True)
    return SqlAnalyst.build(out, BuildRequest(seed, dict(sizes), dict(mix), options))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("sqlworld")
    result = build(out)
    env = SqlAnalyst.load(out)
    yield out, result, env
    env.close()


# ---------------------------------------------------------------------------------------------------- the world
def test_build_is_byte_identical_for_a_seed_and_differs_across_seeds(tmp_path, world):
    out, result, _ = world
    again = build(tmp_path / "a")
    for name in (DB_NAME, META_NAME, CORPUS_NAME):
        assert digest(out / name) == digest(tmp_path / "a" / name), name
    assert {s: [t.to_dict() for t in ts] for s, ts in again.tasks.items()} == \
           {s: [t.to_dict() for t in ts] for s, ts in result.tasks.items()}
    assert sorted(p.name for p in result.files) == sorted([DB_NAME, META_NAME, CORPUS_NAME])
    other = build(tmp_path / "b", seed=1)
    assert digest(tmp_path / "b" / DB_NAME) != digest(out / DB_NAME)
    assert [t.question for t in other.tasks["train"]] != [t.question for t in result.tasks["train"]]


def test_counts_and_sizes_follow_the_request(world):
    out, result, env = world
    assert {s: len(ts) for s, ts in result.tasks.items()} == SIZES
    assert result.counts["customers"] == 200 and result.counts["products"] == 96 and result.counts["orders"] == 1500
    assert result.counts["order_lines"] >= 1500
    assert {t.level for t in all_tasks(result)} == {1, 2, 3, 4}
    assert set(env.describe_texts) == set(TABLES)


def test_task_ids_are_unique_and_held_out_values_disjoint_across_splits(world):
    _, result, _ = world
    ids = [t.task_id for t in all_tasks(result)]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(rf"sql-{t.split}-\d{{6}}", t.task_id) for t in all_tasks(result))
    values = {s: {(dim, v) for t in ts for dim, v in t.data["heldout"].items()} for s, ts in result.tasks.items()}
    assert all(values.values())
    assert not values["test"] & (values["train"] | values["validation"])
    assert not values["validation"] & values["train"]
    meta = json.loads((world[0] / META_NAME).read_text())
    for split, ts in result.tasks.items():  # each task filters only on its own split's partition
        for t in ts:
            for dim, v in t.data["heldout"].items():
                assert v in meta["partition"][dim][split], (t.task_id, dim, v)
                assert f"'{v}" in t.question and f"'{v}" in t.data["sql"]  # a month also as a date range's prefix
    assert set(meta["partition"]) == set(HELDOUT_DIMENSIONS)


def test_held_out_wording_only_in_test(world):
    _, result, _ = world
    train_templates = {t.data["template_id"] for s in ("train", "validation") for t in result.tasks[s]}
    assert all(t.template_seen for s in ("train", "validation") for t in result.tasks[s])
    unseen = [t for t in result.tasks["test"] if not t.template_seen]
    assert unseen and not {t.data["template_id"] for t in unseen} & train_templates
    assert all(t.data["template_id"].endswith("/4") for t in unseen)
    # train and validation also take the wording grammar's frames (ids from GRAMMAR_BASE); test only the fixed five
    index = lambda t: int(t.data["template_id"].rpartition("/")[2])  # noqa: E731
    assert {t.family for t in result.tasks["train"] if index(t) >= GRAMMAR_BASE} == {f.name for f in FAMILIES}
    assert all(index(t) < GRAMMAR_BASE for t in result.tasks["test"])


# sha256 of this module's seed-0 test split (its tasks' records, keys sorted), as the code made it before train and
# validation took the wording grammar: a change to how those splits are worded must leave test's figures comparable
TEST_SPLIT = "3e51ddedf612e238915bf109aa9d2479408e516d9f709ac25480f195a86a4930"


def test_the_test_split_is_byte_for_byte_what_it_was(world):
    _, result, _ = world
    records = json.dumps([t.to_dict() for t in result.tasks["test"]], sort_keys=True)
    assert hashlib.sha256(records.encode()).hexdigest() == TEST_SPLIT


def test_every_reference_sql_gives_the_answer(world):
    out, result, env = world
    conn = sqlite3.connect(out / DB_NAME)
    try:
        for task in all_tasks(result):
            rows = conn.execute(task.data["sql"]).fetchall()
            if task.data["kind"] == "names":
                assert ", ".join(r[0] for r in rows) == task.answer, task.task_id
            else:
                assert abs(float(rows[0][0]) - float(task.answer)) <= 0.005, task.task_id
            assert task.min_calls == len(task.data["tables"]) + 2
    finally:
        conn.close()


def test_too_many_tasks_for_the_value_space_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not draw 1000 distinct test tasks"):  # level 4 holds ~500 questions
        build(tmp_path, sizes={"train": 1, "validation": 1, "test": 1000}, mix={4: 1.0})


def test_bad_requests_and_worlds_are_refused(tmp_path, world):
    with pytest.raises(ValueError, match="level_mix"):
        SqlAnalyst.build(tmp_path, BuildRequest(0, {"train": 2}, {5: 1.0}, SMALL))
    with pytest.raises(ValueError, match="unknown splits"):
        SqlAnalyst.build(tmp_path, BuildRequest(0, {"dev": 2}, MIX, SMALL))
    with pytest.raises(FileNotFoundError, match="world.sqlite"):
        SqlAnalyst.load(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(world[0], broken)
    (broken / META_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        SqlAnalyst.load(broken)
    with pytest.raises(ValueError, match="reference SQL"):
        world[2].task_from_dict({**world[1].tasks["train"][0].to_dict(), "data": {}})


def test_task_records_round_trip_through_json(world):
    _, result, env = world
    for task in result.tasks["test"]:
        assert env.task_from_dict(json.loads(json.dumps(task.to_dict()))) == task


# ----------------------------------------------------------------------------------------------------- the tools
def test_tool_schemas_are_strict(world):
    tools = world[2].tools()
    assert [t.name for t in tools] == ["list_tables", "describe_table", "query", "answer"]
    for t in tools:
        jsonschema.Draft202012Validator.check_schema(t.parameters)
        assert t.parameters["additionalProperties"] is False and not t.writes
    query = next(t for t in tools if t.name == "query").parameters
    assert not jsonschema.Draft202012Validator(query).is_valid({"sql": "SELECT 1", "x": 1})
    assert not jsonschema.Draft202012Validator(query).is_valid({"sql": "   "})


def test_schema_tools(world):
    env = world[2]
    ep = env.open_episode(world[1].tasks["train"][0], np.random.default_rng(0))
    assert ep.call("list_tables", {}).startswith("customers (200 rows), products (96 rows)")
    assert ep.call("describe_table", {"table": "Orders"}).startswith("orders: order_id INTEGER, customer_id INTEGER")
    with pytest.raises(ToolError, match="no such table 'order'"):
        ep.call("describe_table", {"table": "order"})
    ep.close()


REFUSED = {
    "insert": "INSERT INTO products VALUES (999, 'X', 'toys', 1.0, 1)",
    "update": "UPDATE orders SET total = 0",
    "delete": "DELETE FROM order_lines",
    "drop": "DROP TABLE customers",
    "create": "CREATE TABLE t (x)",
    "create_temp": "CREATE TEMP TABLE t (x)",
    "pragma": "PRAGMA table_info(orders)",
    "pragma_function": "SELECT * FROM pragma_table_info('orders')",
    "attach": "ATTACH DATABASE ':memory:' AS other",
    "vacuum_into": "VACUUM INTO '/tmp/sql-analyst-copy.db'",
    "load_extension": "SELECT load_extension('/tmp/evil.so')",
    "two_statements": "SELECT 1; DELETE FROM orders",
    "readfile": "SELECT readfile('/etc/passwd')",
    "writefile": "SELECT writefile('/tmp/sql-analyst-x', 'data')",
    "edit": "SELECT name, edit(name) FROM customers",
    "cte_delete": "WITH x AS (SELECT 1) DELETE FROM orders",
    "comment_then_delete": "/* hello */ DELETE FROM orders",
    "transaction": "BEGIN",
    "zeroblob": "SELECT zeroblob(100000000)",
}


@pytest.mark.parametrize("sql", REFUSED.values(), ids=REFUSED.keys())
def test_the_guard_refuses_anything_but_one_read_only_select(world, sql):
    out, result, env = world
    before = digest(out / DB_NAME)
    ep = env.open_episode(result.tasks["train"][0], np.random.default_rng(0))
    with pytest.raises(SafetyViolation, match="^refused: "):
        ep.call("query", {"sql": sql})
    assert ep.call("query", {"sql": "SELECT COUNT(*) FROM orders"}) == "1500"  # the episode goes on
    ep.close()
    assert digest(out / DB_NAME) == before
    assert not Path("/tmp/sql-analyst-copy.db").exists() and not Path("/tmp/sql-analyst-x").exists()


AUTHORIZER = {  # statement -> what the guard names (the text pre-check is bypassed: the authorizer alone must deny)
    "INSERT INTO products VALUES (999, 'X', 'toys', 1.0, 1)": "INSERT on products",
    "UPDATE orders SET total = 0": "UPDATE on orders",
    "DELETE FROM order_lines": "DELETE on order_lines",
    "DROP TABLE customers": "changing the schema",
    "CREATE TABLE t (x)": "changing the schema",
    "CREATE TEMP TABLE t (x)": "changing the schema",
    "PRAGMA table_info(orders)": "PRAGMA on table_info",
    "ATTACH DATABASE ':memory:' AS other": "ATTACH",
    "SELECT load_extension('/tmp/evil.so')": "function load_extension()",
}


@pytest.mark.parametrize("sql", AUTHORIZER, ids=range(len(AUTHORIZER)))
def test_the_authorizer_alone_denies_everything_but_reads(world, sql):
    runner = QueryRunner(connect_ro(world[0] / DB_NAME), QueryLimits())
    try:
        with pytest.raises(sqlite3.DatabaseError):
            runner.conn.execute(sql)
        assert runner.guard.denied is not None and runner.guard.denied.startswith(AUTHORIZER[sql])
    finally:
        runner.close()


def test_the_connection_is_read_only_even_without_the_guard(world):
    conn = connect_ro(world[0] / DB_NAME)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("UPDATE orders SET total = 0")
    finally:
        conn.close()


def test_ordinary_errors_are_tool_errors_not_violations(world):
    ep = world[2].open_episode(world[1].tasks["train"][0], np.random.default_rng(0))
    for sql, message in (("SELECT nope FROM orders", "no such column"),
                         ("SELECT cout(*) FROM orders", "no such function"), ("SELECT FROM", "syntax error")):
        with pytest.raises(ToolError, match=message) as caught:
            ep.call("query", {"sql": sql})
        assert not isinstance(caught.value, SafetyViolation)
    ep.close()


def test_a_runaway_recursive_query_times_out(world):
    ep = world[2].open_episode(world[1].tasks["train"][0], np.random.default_rng(0))
    sql = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT COUNT(*) FROM r"
    with pytest.raises(ToolError, match=r"query timed out after 0.3 s") as caught:
        ep.call("query", {"sql": sql})
    assert not isinstance(caught.value, SafetyViolation)
    endless = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT x FROM r"
    assert ep.call("query", {"sql": endless}).startswith("more than 10000 rows, first 5 shown\nx\n1\n2")
    assert ep.call("query", {"sql": "SELECT COUNT(*) FROM customers"}) == "200"
    ep.close()


def test_row_limit_truncates_with_a_note(world):
    ep = world[2].open_episode(world[1].tasks["train"][0], np.random.default_rng(0))
    lines = ep.call("query", {"sql": "SELECT name, city FROM customers ORDER BY customer_id"}).splitlines()
    assert lines[0] == "200 rows, first 5 shown" and lines[1] == "name | city" and len(lines) == 7
    assert ep.call("query", {"sql": "SELECT 1 AS a, 2.456 AS b"}) == "a | b\n1 | 2.46"
    assert ep.call("query", {"sql": "SELECT * FROM orders WHERE 0"}) == "(no rows)"
    ep.close()


def test_episodes_from_several_threads_do_not_interfere(world):
    _, result, env = world
    tasks = result.tasks["test"][:16]
    outcomes = {}

    def work(i: int, task: Task) -> None:
        calls, ok, _ = drive(env, task, env.expert())
        outcomes[i] = ok and len(calls) == task.min_calls

    threads = [threading.Thread(target=work, args=(i, t)) for i, t in enumerate(tasks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert outcomes == {i: True for i in range(len(tasks))}


# ---------------------------------------------------------------------------------------------------- answers
def test_correct_compares_numbers_with_tolerance_and_names_in_order(world):
    assert answers_match("1234.567", "1234.57") and answers_match("1,234.57", "1234.57")
    assert not answers_match("1234.58", "1234.57") and not answers_match("", "0") and not answers_match("x", "1")
    assert answers_match(" blue lamp ,  RED   mug", "Blue Lamp, Red Mug", "names")
    assert not answers_match("Red Mug, Blue Lamp", "Blue Lamp, Red Mug", "names")
    assert not answers_match("Blue Lamp", "Blue Lamp, Red Mug", "names")
    names = next(t for t in world[1].tasks["train"] if t.data["kind"] == "names")
    ep = world[2].open_episode(names, np.random.default_rng(0))
    assert ep.truth == names.answer and ep.correct(names.answer.upper()) and not ep.correct("nobody")


# ----------------------------------------------------------------------------------------------------- experts
def test_expert_solves_every_task_in_exactly_min_calls(world):
    _, result, env = world
    seen_families = set()
    for task in all_tasks(result):
        calls, ok, actions = drive(env, task, env.expert())
        assert ok, (task.task_id, task.question, actions)
        assert len(calls) == task.min_calls and all(o in ("ok", "answer") for _, o in calls), (task.task_id, calls)
        assert max(map(len, actions)) <= MAX_ACTION_CHARS
        seen_families.add(task.family)
    assert seen_families == {f.name for f in FAMILIES}


def test_flawed_experts_behave_as_documented(world):
    _, result, env = world
    assert set(env.flaws) == {"redundant_call", "wrong_order", "wrong_value"}
    rng = np.random.default_rng(0)
    for task in result.tasks["validation"]:
        calls, ok, _ = drive(env, task, env.expert("redundant_call", rng))
        assert ok and len(calls) == task.min_calls + 1 and all(o in ("ok", "answer") for _, o in calls)
        tools = [c for c, _ in calls]
        assert any(a == b for a, b in zip(tools, tools[1:]))  # the repeated call follows itself

        calls, ok, _ = drive(env, task, env.expert("wrong_order", rng))
        assert ok and len(calls) == task.min_calls + 1
        assert calls[0] == ("query", "tool_error") and all(o in ("ok", "answer") for _, o in calls[1:])

        calls, ok, _ = drive(env, task, env.expert("wrong_value", rng))
        assert not ok and len(calls) == task.min_calls
    with pytest.raises(ValueError, match="unknown flaw"):
        env.expert("sloppy")


def test_expert_retries_a_plan_step_that_failed_transiently(world):
    _, result, env = world
    task = result.tasks["train"][0]
    expert = env.expert()
    expert.reset(task)
    first = expert.act({"context": task.question}, {})
    assert expert.act({}, {"tool_result": "temporarily unavailable", "outcome": "tool_error"}) == first


def test_expert_reaches_the_top_return_through_the_pipeline_runner(world):
    from pipeline.envs.runner import AgentEnv

    _, result, env = world
    tasks = result.tasks["test"][:12]
    gym_env = AgentEnv(env, tasks, {})
    for task in tasks:
        obs, info = gym_env.reset(options={"task": task})
        expert = env.expert()
        expert.reset(task)
        done = False
        while not done:
            obs, _, terminated, truncated, info = gym_env.step(expert.act(obs, info))
            done = terminated or truncated
        assert info["is_success"] and info["n_calls"] == task.min_calls and info["verifier"]["passed"], task.task_id
    gym_env.close()


def test_contract_extras(world):
    _, result, env = world
    task = result.tasks["train"][0]
    expert = env.expert()
    expert.reset(task)
    plan = [parse(expert.act({}, {})) for _ in task.data["tables"]] + [parse(expert.act({}, {}))]
    assert env.reference_calls(task) == [*plan, ("answer", {"value": task.answer})]
    assert env.required_tools(task) == ["query"]
    assert all(env.verify_task(t) for t in all_tasks(result))
    assert not env.verify_task(Task.from_dict({**task.to_dict(), "answer": "-1"}))
    assert not any(env.leaks_heldout(t) for t in result.tasks["train"])
    assert all(env.leaks_heldout(t) for t in result.tasks["test"] + result.tasks["validation"])
    assert not any(env.heldout_slices(t) for t in result.tasks["train"])
    assert all(env.heldout_slices(t) == sorted(t.data["heldout"]) for t in result.tasks["test"])
    assert env.same_answer("12.001", "12") and env.same_answer("a , b", "A, B") and not env.same_answer("b, a", "a, b")
    vocabulary = env.vocabulary()
    assert {"order_lines", "order_date", "unit_price", "cancelled", "web", "enterprise"} <= set(vocabulary)
    assert isinstance(env.open_episode(task, np.random.default_rng(0), randomize_values=True).truth, str)


def test_random_policy_writes_well_formed_calls(world):
    env = world[2]
    validators = {t.name: jsonschema.Draft202012Validator(t.parameters) for t in env.tools()}
    policy = env.random_policy(np.random.default_rng(3))
    task = world[1].tasks["train"][0]
    policy.reset(task)
    ep = env.open_episode(task, np.random.default_rng(0))
    tools = set()
    for _ in range(60):
        tool, params = parse(policy.act({"context": task.question}, {}))
        assert validators[tool].is_valid(params), (tool, params)
        tools.add(tool)
        if tool != "answer":
            try:
                ep.call(tool, params)
            except SafetyViolation:
                pytest.fail(f"a random call was refused: {tool} {params}")
            except ToolError:
                pass  # a wrong table name on purpose
    ep.close()
    assert tools == set(validators)


# ------------------------------------------------------------------------------------------ suites and drift
@pytest.mark.slow
def test_world_suites_pass_and_name_a_broken_row(world, tmp_path):
    out, _, env = world
    reports = env.validate_world(out)
    assert [r.suite for r in reports] == ["sql_customers", "sql_products", "sql_orders", "sql_order_lines"]
    assert all(r.success for r in reports), [r.describe() for r in reports]
    assert env.validate_world(out)[0].success  # registering again is harmless
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    conn = sqlite3.connect(broken / DB_NAME)
    conn.execute("UPDATE orders SET total = total + 1 WHERE order_id = 7")
    conn.execute("UPDATE customers SET country = 'Spain' WHERE customer_id = 3 AND country != 'Spain'")
    conn.commit()
    conn.close()
    bad = {r.suite: r for r in env.validate_world(broken)}
    assert "order_id=7" in bad["sql_orders"].describe() and "total_matches_lines" in bad["sql_orders"].describe()
    assert "customer_id=3" in bad["sql_customers"].describe()
    assert bad["sql_products"].success and bad["sql_order_lines"].success

    records = {s: [json.loads(json.dumps(t.to_dict())) for t in ts] for s, ts in world[1].tasks.items()}
    reports = env.validate(out, records, None)
    assert all(r.success for r in reports), [r.describe() for r in reports if not r.success]
    assert [r.suite for r in reports][-4:] == ["sql_tasks", "sql_tasks", "sql_tasks", "sql_splits"]
    leaked = {**records, "test": [dict(records["test"][0], data={**records["test"][0]["data"],
                                                                 "heldout": records["train"][0]["data"]["heldout"]})]}
    assert "sql-test-000000" in env.validate(out, leaked, None)[-1].describe()
    broken_task = dict(records["train"][0], min_calls=9)
    report = env.check_task_records([broken_task], "incoming.jsonl")
    assert not report.success and "min_calls_matches_plan" in report.describe()
    numbered = dict(records["train"][0], data={**records["train"][0]["data"], "template_id": 7})  # a number, not text
    report = env.check_task_records([numbered], "incoming.jsonl")
    assert not report.success and "template_id" in report.describe()


def test_drift_features_from_calls(world):
    env = world[2]
    record = {"calls": [
        {"tool": "describe_table", "params": {"table": "orders"}, "outcome": "ok"},
        {"tool": "query", "params": {"sql": "DELETE FROM orders"}, "outcome": "safety_violation"},
        {"tool": "query", "params": {"sql": "SELECT 1 FROM orders JOIN customers USING (customer_id)"},
         "outcome": "ok"},
        {"tool": "answer", "params": {"value": "1"}, "outcome": "answer"},
    ]}
    f = env.drift_features(record)
    assert f["sql_queries"] == 2 and f["sql_refused"] == 1.0 and f["sql_failed_share"] == 0.5
    assert f["sql_mean_joins"] == 0.5 and f["sql_mean_chars"] == (18 + 55) / 2
    assert env.drift_features({"calls": []}) == {"sql_queries": 0.0, "sql_refused": 0.0, "sql_failed_share": 0.0,
                                                 "sql_mean_chars": 0.0, "sql_mean_joins": 0.0}


def test_corpus_holds_the_schema_and_no_values(world):
    docs = [json.loads(line) for line in (world[0] / CORPUS_NAME).read_text().splitlines()]
    assert [d["title"] for d in docs] == list(TABLES)
    assert docs[0]["text"].startswith("customers: customer_id INTEGER") and "Lyon" not in json.dumps(docs)
