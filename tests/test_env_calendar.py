"""The booking calendar (pipeline.envs.calendar): a deterministic world, held-out people and wordings, the write
guard (every unrequested write refused and never executed), correctness judged on the episode's final state, the
scripted expert and its flaws through the pipeline's runner, the Great Expectations suites, and a tiny run of the
command line from build-env to evaluate."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml

from env_support import MAX_ACTION_CHARS, all_tasks, digest, drive, parse
from pipeline.envs.contract import BuildRequest, SafetyViolation, Task, ToolError
from pipeline.envs.calendar import CalendarOptions, CalendarWorld
from pipeline.envs.calendar.tasks import FAMILIES
from pipeline.envs.calendar.world import CORPUS_NAME, DB_NAME, META_NAME, ROOM_NAMES, SMALLEST_ROOM

SMALL = CalendarOptions(n_people=60, weeks=2)
SIZES = {"train": 80, "validation": 24, "test": 40}
MIX = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}


def build(out: Path, seed: int = 0, sizes=SIZES, options=SMALL, mix=MIX):
    out.mkdir(parents=True, exist_ok=True)
    return CalendarWorld.build(out, BuildRequest(seed, dict(sizes), dict(mix), options))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("calendarworld")
    result = build(out)
    env = CalendarWorld.load(out)
    yield out, result, env
    env.close()


def of_family(result, family: str, split: str = "train") -> Task:
    return next(t for t in result.tasks[split] if t.family == family)


def bookings(ep) -> dict:
    return {r[0]: r[1:] for r in ep.conn.execute("SELECT * FROM bookings")}


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


def test_counts_sizes_levels_and_families(world):
    _, result, env = world
    assert {s: len(ts) for s, ts in result.tasks.items()} == SIZES
    assert result.counts["rooms"] == len(ROOM_NAMES) and result.counts["people"] == 60
    assert result.counts["bookings"] > 200 and len(env.days) == 10
    assert {t.level for t in all_tasks(result)} == {1, 2, 3, 4}
    assert {t.family for t in all_tasks(result)} == {f.name for f in FAMILIES}
    assert {t.min_calls for t in all_tasks(result)} <= {4, 5, 6, 7}
    by_level = {lv: {t.min_calls for t in all_tasks(result) if t.level == lv} for lv in (1, 2, 3, 4)}
    assert by_level[1] == {4} and by_level[2] <= {4, 5} and by_level[3] == {6} and by_level[4] == {7}


def test_task_ids_unique_and_held_out_people_disjoint_across_splits(world):
    out, result, env = world
    ids = [t.task_id for t in all_tasks(result)]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(rf"cal-{t.split}-\d{{6}}", t.task_id) for t in all_tasks(result))
    people = {s: {p for t in ts for p in t.data["heldout"]["person"]} for s, ts in result.tasks.items()}
    assert not people["test"] & (people["train"] | people["validation"]) and not people["validation"] & people["train"]
    part = json.loads((out / META_NAME).read_text())["partition"]["person"]
    for split, ts in result.tasks.items():
        for t in ts:
            assert set(t.data["heldout"]["person"]) <= set(part[split]) and all(p in t.question
                                                                                for p in t.data["heldout"]["person"])
    assert not any(env.leaks_heldout(t) for t in result.tasks["train"])
    assert all(env.leaks_heldout(t) for t in result.tasks["test"] + result.tasks["validation"])
    assert not any(env.heldout_slices(t) for t in result.tasks["train"])
    assert all(env.heldout_slices(t) == ["people"] for t in result.tasks["test"])


def test_held_out_wording_only_in_test(world):
    _, result, _ = world
    seen = {t.data["template_id"] for s in ("train", "validation") for t in result.tasks[s]}
    assert all(t.template_seen for s in ("train", "validation") for t in result.tasks[s])
    unseen = [t for t in result.tasks["test"] if not t.template_seen]
    assert unseen and all(t.data["template_id"].endswith("/3") for t in unseen) and not seen & {
        t.data["template_id"] for t in unseen}


def test_bad_requests_and_worlds_are_refused(tmp_path, world):
    with pytest.raises(ValueError, match="level_mix"):
        CalendarWorld.build(tmp_path, BuildRequest(0, {"train": 2}, {5: 1.0}, SMALL))
    with pytest.raises(ValueError, match="unknown splits"):
        CalendarWorld.build(tmp_path, BuildRequest(0, {"dev": 2}, MIX, SMALL))
    with pytest.raises(ValueError, match="could not draw 5000 distinct test tasks"):
        build(tmp_path / "big", sizes={"train": 1, "validation": 1, "test": 5000}, mix={4: 1.0})
    with pytest.raises(FileNotFoundError, match="world.sqlite"):
        CalendarWorld.load(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(world[0], broken)
    (broken / META_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CalendarWorld.load(broken)
    with pytest.raises(ValueError, match="data.goal"):
        world[2].task_from_dict({**world[1].tasks["train"][0].to_dict(), "data": {}})


def test_task_records_round_trip_and_plans_reach_their_goals(world):
    _, result, env = world
    for task in result.tasks["test"]:
        assert env.task_from_dict(json.loads(json.dumps(task.to_dict()))) == task
    assert all(env.verify_task(t) for t in all_tasks(result))
    task = result.tasks["train"][0]
    assert not env.verify_task(Task.from_dict({**task.to_dict(), "answer": "1000"}))


# ----------------------------------------------------------------------------------------------------- the tools
def test_tool_schemas_are_strict_and_writes_marked(world):
    tools = world[2].tools()
    assert [t.name for t in tools] == ["find_bookings", "free_slots", "free_rooms", "book", "move_booking",
                                       "cancel_booking", "answer"]
    assert {t.name for t in tools if t.writes} == {"book", "move_booking", "cancel_booking"}
    for t in tools:
        jsonschema.Draft202012Validator.check_schema(t.parameters)
        assert t.parameters["additionalProperties"] is False
    book = jsonschema.Draft202012Validator(next(t for t in tools if t.name == "book").parameters)
    good = {"room": "Elm", "date": "2026-03-03", "start": "10:00", "owner": "Mia Holt", "attendees": 4}
    assert book.is_valid(good) and not book.is_valid({**good, "x": 1}) and not book.is_valid({**good, "start": "10:30"})
    cancel = jsonschema.Draft202012Validator(next(t for t in tools if t.name == "cancel_booking").parameters)
    assert not cancel.is_valid({"booking_id": 12}) and not cancel.is_valid({"booking_id": "4821"})


def test_read_tools_and_recoverable_errors(world):
    _, result, env = world
    task = of_family(result, "move_day")
    (_, find), (_, rooms), (_, move) = task.data["plan"]
    ep = env.open_episode(task, np.random.default_rng(0))
    listed = ep.call("find_bookings", find)
    assert str(move["booking_id"]) in listed and "people)" in listed and len(listed) <= 200
    assert move["room"] in ep.call("free_rooms", rooms) and len(ep.call("free_rooms", rooms)) <= 200
    assert ep.call("free_slots", {"room": "elm", "date": find["date"]}).startswith("Elm (6 seats) on ")
    for tool, args, message in (("find_bookings", {"person": "Mia", "date": find["date"]}, "no person named"),
                                ("free_slots", {"room": "Attic", "date": find["date"]}, "no room named"),
                                ("free_slots", {"room": "Elm", "date": "2026-03-07"}, "not a working day"),
                                ("move_booking", {**move, "room": SMALLEST_ROOM}, "seats 2"),
                                ("cancel_booking", {"booking_id": 1000}, "no booking 1000")):
        with pytest.raises(ToolError, match=message) as caught:
            ep.call(tool, args)
        assert not isinstance(caught.value, SafetyViolation)
    ep.close()


def test_a_taken_room_is_a_conflict_and_nothing_is_written(world):
    _, result, env = world
    task = of_family(result, "swap_times")
    (_, f1), _, _, (_, m1), (_, m2), (_, m3) = task.data["plan"]
    ep = env.open_episode(task, np.random.default_rng(0))
    before = bookings(ep)
    with pytest.raises(ToolError, match="^conflict: .* is taken at .* \\(booking \\d{4}\\)"):
        ep.call("move_booking", m3)  # onto the other meeting, before it has moved away
    assert bookings(ep) == before
    for step in (m1, m2, m3):
        ep.call("move_booking", step)
    assert ep.correct(task.answer)
    ep.close()


# ----------------------------------------------------------------------------------------------------- the guard
def _unrequested(env, result):
    """(task, tool, params) of every kind of write the guard must refuse."""
    move = of_family(result, "move_time")
    named = move.data["allowed"]["move"][0]
    someone_else = next(b for b, row in env.initial.items() if row[3] != move.data["allowed"]["requester"])
    book = of_family(result, "book_after")
    _, _, (_, booking) = book.data["plan"]
    return {
        "cancel_other": (move, "cancel_booking", {"booking_id": someone_else}),
        "move_other": (move, "move_booking", {"booking_id": someone_else, "room": "Atrium", "date": env.days[0],
                                              "start": "09:00"}),
        "cancel_named_for_move": (move, "cancel_booking", {"booking_id": named}),
        "book_for_someone_else": (book, "book", {**booking, "owner": next(
            p for p in env.people if p != book.data["allowed"]["requester"])}),
        "book_when_not_asked": (move, "book", {"room": "Atrium", "date": env.days[0], "start": "09:00",
                                               "owner": move.data["allowed"]["requester"], "attendees": 3}),
    }


@pytest.mark.parametrize("kind", ["cancel_other", "move_other", "cancel_named_for_move", "book_for_someone_else",
                                  "book_when_not_asked"])
def test_the_guard_refuses_every_unrequested_write_and_executes_none(world, kind):
    out, result, env = world
    task, tool, params = _unrequested(env, result)[kind]
    before_file = digest(out / DB_NAME)
    ep = env.open_episode(task, np.random.default_rng(0))
    before = bookings(ep)
    with pytest.raises(SafetyViolation):
        ep.call(tool, params)
    assert bookings(ep) == before and digest(out / DB_NAME) == before_file
    for step_tool, step in task.data["plan"]:  # the episode goes on: the requested writes are allowed
        ep.call(step_tool, step)
    assert ep.correct(task.answer)
    ep.close()


def test_writes_stay_in_their_episode_and_own_bookings_may_be_undone(world):
    _, result, env = world
    task = of_family(result, "book_after")
    (_, find), (_, rooms), (_, booking) = task.data["plan"]
    ep, other = env.open_episode(task), env.open_episode(task)
    made = ep.call("book", {**booking, "start": "16:00" if booking["start"] != "16:00" else "09:00"})
    new_id = int(made.split()[1].rstrip(":"))
    assert new_id == 9001 and ep.call("cancel_booking", {"booking_id": new_id}) == "cancelled 9001"
    assert ep.call("book", booking).startswith("booked 9001: ")
    assert ep.correct(task.answer) and not other.correct(task.answer) and 9001 not in env.initial
    ep.close()
    other.close()


# -------------------------------------------------------------------------------------------- correctness on state
def test_correctness_is_judged_on_the_final_state(world):
    _, result, env = world
    task = of_family(result, "replace")
    ep = env.open_episode(task)
    assert not ep.correct(task.answer)  # the right receipt, nothing done
    for tool, params in task.data["plan"][:2]:
        ep.call(tool, params)
    assert not ep.correct(task.answer)  # cancelled, not yet booked
    for tool, params in task.data["plan"][2:]:
        ep.call(tool, params)
    assert ep.correct(task.answer) and ep.correct(task.answer.replace(", ", " and #"))
    assert not ep.correct("done") and not ep.correct(task.answer.split(", ")[0])  # a receipt missing a booking
    ep.close()

    move = of_family(result, "move_time")
    ep = env.open_episode(move)
    (_, _), (_, _), (_, step) = move.data["plan"]
    free = ep.call("free_slots", {"room": step["room"], "date": step["date"]}).split("free at ")[-1].split(", ")
    wrong = next((h for h in free if h != step["start"]), None)
    if wrong is not None:  # the right booking moved to the wrong hour: the receipt is right, the state is not
        ep.call("move_booking", {**step, "start": wrong})
        assert not ep.correct(move.answer)
        ep.call("move_booking", step)
    assert ep.correct(move.answer)
    ep.close()


def test_an_extra_unrelated_change_makes_it_wrong(world):
    _, result, env = world
    task = of_family(result, "replace")
    ep = env.open_episode(task)
    for tool, params in task.data["plan"]:
        ep.call(tool, params)
    assert ep.correct(task.answer)
    extra = ep.call("book", {**task.data["plan"][-1][1], "date": env.days[-1], "start": "16:00", "room": "Atrium"}) \
        if not any(r[1:3] == (env.days[-1], "16:00") and r[0] == "Atrium" for r in env.initial.values()) else None
    if extra is None:  # Atrium taken then: any free room of the last day
        free = ep.call("free_rooms", {"date": env.days[-1], "start": "16:00", "attendees": 3}).split(": ")[1]
        extra = ep.call("book", {**task.data["plan"][-1][1], "date": env.days[-1], "start": "16:00",
                                 "room": free.split(" (")[0]})
    assert extra.startswith("booked 9002")
    assert not ep.correct(task.answer) and not ep.correct(task.answer + ", 9002")
    ep.close()


# ----------------------------------------------------------------------------------------------------- experts
def test_expert_solves_every_task_in_exactly_min_calls(world):
    _, result, env = world
    for task in all_tasks(result):
        calls, ok, actions = drive(env, task, env.expert())
        assert ok and len(calls) == task.min_calls and all(o in ("ok", "answer") for _, o in calls), (task.task_id,
                                                                                                       calls)
        assert max(map(len, actions)) <= MAX_ACTION_CHARS


def test_flawed_experts_behave_as_documented(world):
    _, result, env = world
    assert set(env.flaws) == {"redundant_call", "wrong_order", "wrong_value"}
    rng = np.random.default_rng(0)
    for task in result.tasks["validation"]:
        calls, ok, _ = drive(env, task, env.expert("redundant_call", rng))
        tools = [c for c, _ in calls]
        assert ok and len(calls) == task.min_calls + 1 and all(o in ("ok", "answer") for _, o in calls)
        assert any(a == b and a.startswith(("find_", "free_")) for a, b in zip(tools, tools[1:]))

        calls, ok, _ = drive(env, task, env.expert("wrong_order", rng))
        assert ok and len(calls) == task.min_calls + 1
        failed = [c for c in calls if c[1] != "ok" and c[1] != "answer"]
        assert len(failed) == 1 and failed[0][0] in ("book", "move_booking") and failed[0][1] == "tool_error"

        calls, ok, _ = drive(env, task, env.expert("wrong_value", rng))
        assert not ok and len(calls) == task.min_calls
    with pytest.raises(ValueError, match="unknown flaw"):
        env.expert("sloppy")


def test_expert_reaches_the_top_return_through_the_pipeline_runner(world):
    from pipeline.envs.runner import AgentEnv

    _, result, env = world
    tasks = result.tasks["test"][:16]
    gym_env = AgentEnv(env, tasks, {"name": "calendar"})
    for task in tasks:
        obs, info = gym_env.reset(options={"task": task})
        expert = env.expert()
        expert.reset(task)
        done = False
        while not done:
            obs, _, terminated, truncated, info = gym_env.step(expert.act(obs, info))
            done = terminated or truncated
        assert info["is_success"] and info["n_calls"] == task.min_calls and info["verifier"]["passed"], task.task_id
        assert abs(info["return"] - 1.1) < 1e-9
    gym_env.close()


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


def test_contract_extras(world):
    _, result, env = world
    task = of_family(result, "swap_times")
    expert = env.expert()
    expert.reset(task)
    plan = [parse(expert.act({}, {})) for _ in range(task.min_calls)]
    assert env.reference_calls(task) == plan
    assert env.required_tools(task) == ["move_booking"] * 3
    assert env.same_answer("#9001, 4821", "4821, 9001") and not env.same_answer("4821", "4821, 9001")
    assert {"Atrium", "10:00", env.days[0]} <= set(env.vocabulary())
    assert env.open_episode(task, np.random.default_rng(0), randomize_values=True).truth == task.answer
    fresh = env.sample_tasks("test", 10, MIX, seed=5, options=SMALL)
    assert len(fresh) == 10 and all(env.verify_task(t) for t in fresh)
    made = env.generate_tasks({"family": "swap_times"}, 4, seed=1)
    assert made and all(t.family == "swap_times" and not env.leaks_heldout(t) and env.verify_task(t) for t in made)
    with pytest.raises(ValueError, match="held out of training"):
        env.generate_tasks({"template_id": "swap_times/3"}, 2, seed=1)


def test_random_policy_writes_well_formed_calls(world):
    env = world[2]
    validators = {t.name: jsonschema.Draft202012Validator(t.parameters) for t in env.tools()}
    task = world[1].tasks["train"][0]
    for rng in (np.random.default_rng(3), None):
        policy = env.random_policy(rng)
        policy.reset(task)
        ep = env.open_episode(task, np.random.default_rng(0))
        tools = set()
        for _ in range(120):
            tool, params = parse(policy.act({"context": task.question}, {}))
            assert validators[tool].is_valid(params), (tool, params)
            tools.add(tool)
            if tool != "answer":
                try:
                    ep.call(tool, params)
                except ToolError:  # refused writes and the world's refusals alike: the episode goes on
                    pass
        ep.close()
        assert tools == set(validators)


# ------------------------------------------------------------------------------------------ suites and drift
@pytest.mark.slow
def test_suites_pass_and_name_a_broken_row(world, tmp_path):
    out, result, env = world
    reports = env.validate_world(out)
    assert [r.suite for r in reports] == ["calendar_rooms", "calendar_people", "calendar_bookings"]
    assert all(r.success for r in reports), [r.describe() for r in reports]
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    conn = sqlite3.connect(broken / DB_NAME)
    first, second = conn.execute("SELECT booking_id FROM bookings WHERE room != 'Nook' ORDER BY booking_id "
                                 "LIMIT 2").fetchall()
    conn.execute("UPDATE bookings SET attendees = 99 WHERE booking_id = ?", first)
    conn.execute("UPDATE bookings SET day = '2026-03-07' WHERE booking_id = ?", second)
    conn.commit()
    conn.close()
    bad = {r.suite: r for r in env.validate_world(broken)}
    text = bad["calendar_bookings"].describe()
    assert f"booking_id={first[0]}" in text and "fits_room" in text and f"booking_id={second[0]}" in text
    assert bad["calendar_rooms"].success and bad["calendar_people"].success

    records = {s: [json.loads(json.dumps(t.to_dict())) for t in ts] for s, ts in result.tasks.items()}
    reports = env.validate(out, records, None)
    assert all(r.success for r in reports), [r.describe() for r in reports if not r.success]
    assert [r.suite for r in reports][-4:] == ["calendar_tasks"] * 3 + ["calendar_splits"]
    leaked = {**records, "test": [dict(records["test"][0], data={**records["test"][0]["data"],
                                                                 "heldout": records["train"][0]["data"]["heldout"]})]}
    assert "cal-test-000000" in env.validate(out, leaked, None)[-1].describe()
    report = env.check_task_records([dict(records["train"][0], min_calls=9, answer="1234")], "incoming.jsonl")
    assert not report.success and "min_calls_matches_plan" in report.describe() and "receipt" in report.describe()
    numbered = dict(records["train"][0], data={**records["train"][0]["data"], "template_id": 7})  # a number, not text
    report = env.check_task_records([numbered], "incoming.jsonl")
    assert not report.success and "template_id" in report.describe()


def test_drift_features_from_calls(world):
    f = world[2].drift_features({"calls": [
        {"tool": "find_bookings", "outcome": "ok"}, {"tool": "move_booking", "outcome": "tool_error"},
        {"tool": "cancel_booking", "outcome": "safety_violation"}, {"tool": "free_rooms", "outcome": "ok"},
        {"tool": "move_booking", "outcome": "ok"}, {"tool": "answer", "outcome": "answer"}]})
    assert f == {"calendar_lookups": 2.0, "calendar_writes": 1.0, "calendar_refused": 1.0,
                 "calendar_write_errors": 1 / 3}


def test_corpus_names_rooms_and_no_person(world):
    out, _, env = world
    text = (out / CORPUS_NAME).read_text()
    assert all(r in text for r in ROOM_NAMES) and not any(p in text for p in env.people)


# -------------------------------------------------------------------------------------------- the command line
@pytest.mark.slow
def test_a_tiny_calendar_project_runs_build_env_to_evaluate(tmp_path):
    from test_flow import ROOT, agentrl, clean_env, merge, tiny_params

    params = merge(tiny_params(), {"env": {"name": "calendar", "max_steps": 8},
                                   "adapt": {"eval": {"max_tasks": 2}}, "train": {"eval_tasks": 2, "test_tasks": 2},
                                   "evaluate": {"train_tasks": 2, "max_tasks": 2, "diversity_tasks": 1}})
    params["build_env"] = {**params["build_env"], "options": {"n_people": 40, "weeks": 1},
                           "tasks_per_split": {"train": 24, "validation": 6, "test": 6},
                           "probes": {**params["build_env"]["probes"], "tasks": 8}}
    root = tmp_path / "project"
    shutil.copytree(ROOT / "configs", root / "configs")
    (root / "data" / "incoming").mkdir(parents=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = clean_env(root)
    for phase, out in (("build-env", "data/tasks/test.jsonl"), ("adapt", "models/adapted/policy.json"),
                       ("train", "models/policy/policy.json"), ("evaluate", "metrics/evaluate.json")):
        proc = agentrl(root, phase, env=env, timeout=300)
        assert proc.returncode == 0, phase + "\n" + proc.stdout[-2000:] + proc.stderr[-3000:]
        assert (root / out).is_file(), phase
    built = json.loads((root / "metrics" / "build_env.json").read_text())
    assert built["environment"] == "calendar" and built["baselines"]["test/expert"]["success_rate"] == 1.0
    assert all(p["passed"] for p in built["reward_hacking_probes"]["probes"].values())
