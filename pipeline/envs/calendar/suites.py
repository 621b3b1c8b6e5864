"""Great Expectations suites of the booking calendar, registered under names prefixed ``calendar_``.

- ``calendar_rooms``, ``calendar_people``: names unique, capacities and floors in range, teams known;
- ``calendar_bookings``: each booking exported with the counts its rules need (:data:`EXPORTS`), so a broken row is
  named by its id: its room and owner exist, its day is a working day of the world and its hour on the grid, 3 people
  up to the room's seats (the 2-seat ``Nook`` holds 2), no other booking in its room at its hour, no other booking of
  its owner at its hour, a 4-digit id below the first new one, a Monday-Friday within the build's eight weeks at
  most (the world's own weeks are in ``world.json``);
- ``calendar_tasks``: task records (id pattern, known family and level, ``min_calls`` = plan + 1, the goal's changes
  of a known kind, the receipt naming exactly the goal's bookings and the new ones from 9001, the requester among the
  people the task names);
- :func:`check_splits`: across splits, ids unique, held-out people disjoint, the held-out wording only in test.

:func:`register_suites` is idempotent; :func:`validate_world` registers and runs the table suites on
``world.sqlite``. Deliberately left out: the demonstrations (the pipeline's own suite checks those).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd

from pipeline.core import validation as V
from pipeline.envs.calendar.tasks import FAMILY_NAMES
from pipeline.envs.calendar.world import (DB_NAME, FIRST_DAY, FIRST_NEW_ID, HOURS, MIN_ATTENDEES, ROOM_NAMES,
                                          SPLITS, TEAMS, connect_ro)

EXPORTS = {
    "rooms": "SELECT * FROM rooms ORDER BY name",
    "people": "SELECT * FROM people ORDER BY name",
    "bookings": "SELECT b.*, (SELECT capacity FROM rooms r WHERE r.name = b.room) AS seats, "
                "(SELECT COUNT(*) FROM people p WHERE p.name = b.owner) AS n_owner, "
                "(SELECT COUNT(*) FROM bookings o WHERE o.room = b.room AND o.day = b.day AND o.start = b.start) "
                "AS in_slot, (SELECT COUNT(*) FROM bookings o WHERE o.owner = b.owner AND o.day = b.day "
                "AND o.start = b.start) AS owner_in_slot FROM bookings b ORDER BY booking_id",
}


def working_day(day: object) -> bool:
    """A Monday-Friday of the longest calendar a build may make (8 weeks from the first day).

    >>> working_day("2026-03-02"), working_day("2026-03-07"), working_day("2026-02-27"), working_day("3 March")
    (True, False, False, False)
    """
    try:
        d = dt.date.fromisoformat(str(day))
    except ValueError:
        return False
    return d.weekday() < 5 and FIRST_DAY <= d < FIRST_DAY + dt.timedelta(weeks=8)


def _derive_bookings(df: pd.DataFrame) -> dict[str, list]:
    seats, n, owner, attendees = (V.column_values(df, c) for c in ("seats", "n_owner", "owner_in_slot", "attendees"))
    slot, day = V.column_values(df, "in_slot"), V.column_values(df, "day")
    return {
        "room_exists": [isinstance(s, int) for s in seats],
        "owner_exists": [x == 1 for x in n],
        "room_free_otherwise": [x == 1 for x in slot],
        "owner_free_otherwise": [x == 1 for x in owner],
        "fits_room": [isinstance(s, int) and isinstance(a, int) and min(MIN_ATTENDEES, s) <= a <= s
                      for s, a in zip(seats, attendees)],
        "working_day": [working_day(d) for d in day],
    }


def rooms_suite() -> list:
    """Rows of the calendar's `rooms` table."""
    import great_expectations.expectations as gxe

    return [*V.non_empty_table(gxe), *V.one_of(gxe, "name", ROOM_NAMES), *V.text(gxe, "name", unique=True),
            *V.number(gxe, "capacity", 2, 50), *V.number(gxe, "floor", 1, 9)]


def people_suite() -> list:
    """Rows of the calendar's `people` table."""
    import great_expectations.expectations as gxe

    return [*V.non_empty_table(gxe), *V.text(gxe, "name", unique=True, max_len=40), *V.one_of(gxe, "team", TEAMS)]


def bookings_suite() -> list:
    """Rows of the calendar's `bookings` table (with their room's seats and the counts of their slot)."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.number(gxe, "booking_id", 1001, FIRST_NEW_ID - 1, unique=True),
        *V.one_of(gxe, "room", ROOM_NAMES),
        *V.all_true(gxe, "room_exists"),
        *V.all_true(gxe, "owner_exists"),
        *V.one_of(gxe, "start", HOURS),
        *V.all_true(gxe, "working_day"),
        *V.all_true(gxe, "fits_room"),
        *V.all_true(gxe, "room_free_otherwise"),
        *V.all_true(gxe, "owner_free_otherwise"),
    ]


TABLE_SUITES = {  # table -> (suite name, id column, builder, derive)
    "rooms": ("calendar_rooms", "name", rooms_suite, None),
    "people": ("calendar_people", "name", people_suite, None),
    "bookings": ("calendar_bookings", "booking_id", bookings_suite, _derive_bookings),
}


def register_suites() -> list[str]:
    """Register every ``calendar_`` suite the registry lacks (calling it again does nothing); their names."""
    specs = [*TABLE_SUITES.values(), ("calendar_tasks", "task_id", tasks_suite, _derive_tasks)]
    for name, id_column, build, derive in specs:
        if name not in V.SUITES:
            V.register_suite(name, id_column=id_column, derive=derive)(build)
    return [s[0] for s in specs]


def table_records(world_dir: Path, table: str) -> list[dict]:
    """The rows of `table` as exported for its suite (:data:`EXPORTS`)."""
    conn = connect_ro(Path(world_dir) / DB_NAME)
    try:
        cur = conn.execute(EXPORTS[table])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur]
    finally:
        conn.close()


def validate_world(world_dir: Path) -> list[V.ValidationReport]:
    """One report per table of ``world_dir/world.sqlite``."""
    register_suites()
    reports = []
    for table, (suite, *_rest) in TABLE_SUITES.items():
        records = table_records(world_dir, table)
        reports.append(V.validate_records(records, suite, dataset=f"{Path(world_dir) / DB_NAME}:{table}"))
    return reports


# ------------------------------------------------------------------------------------------------------- tasks
def _receipt_ok(data: object, answer: object) -> bool:
    if not isinstance(data, dict) or not isinstance(data.get("goal"), list) or not isinstance(answer, str):
        return False
    named = sorted(g.get("booking_id") for g in data["goal"] if isinstance(g, dict) and g.get("op") != "book")
    new = [FIRST_NEW_ID + i for i, g in enumerate(g for g in data["goal"] if isinstance(g, dict)
                                                      and g.get("op") == "book")]
    return answer == ", ".join(str(i) for i in sorted(named + new))


def _derive_tasks(df: pd.DataFrame) -> dict[str, list]:
    datas, min_calls, answers = (V.column_values(df, c) for c in ("data", "min_calls", "answer"))

    def get(d, key):
        return d.get(key) if isinstance(d, dict) else None

    plans = [get(d, "plan") for d in datas]
    return {
        "min_calls_matches_plan": [isinstance(p, list) and m == len(p) + 1 for p, m in zip(plans, min_calls)],
        "template_id": [get(d, "template_id") for d in datas],  # the wording, "family/index", kept in `data`
        "goal_well_formed": [isinstance(get(d, "goal"), list) and bool(get(d, "goal")) and all(
            isinstance(g, dict) and g.get("op") in ("book", "move", "cancel") for g in get(d, "goal")) for d in datas],
        "receipt_matches_goal": [_receipt_ok(d, a) for d, a in zip(datas, answers)],
        "requester_named": [isinstance(get(d, "allowed"), dict) and isinstance(get(d, "heldout"), dict)
                            and get(get(d, "allowed"), "requester") in (get(get(d, "heldout"), "person") or [])
                            for d in datas],
    }


def tasks_suite(split: str | None = None) -> list:
    """Task records of the calendar (data/tasks/{split}.jsonl); `split` pins the `split` column."""
    import great_expectations.expectations as gxe

    return [
        *V.non_empty_table(gxe),
        *V.text(gxe, "task_id", unique=True),
        gxe.ExpectColumnValuesToMatchRegex(column="task_id", regex=r"^cal-(train|validation|test)-\d{6}$"),
        *V.one_of(gxe, "split", [split] if split else SPLITS),
        *V.one_of(gxe, "family", FAMILY_NAMES),
        *V.one_of(gxe, "level", [1, 2, 3, 4], V.INT_TYPES),
        *V.text(gxe, "question", max_len=300),
        *V.text(gxe, "answer", max_len=40),
        *V.number(gxe, "min_calls", 4, 8),
        *V.present(gxe, "template_seen", V.BOOL_TYPES),
        *V.text(gxe, "template_id"),  # a non-blank string of the task's `data` (a number there is refused)
        *V.all_true(gxe, "min_calls_matches_plan"),
        *V.all_true(gxe, "goal_well_formed"),
        *V.all_true(gxe, "receipt_matches_goal"),
        *V.all_true(gxe, "requester_named"),
    ]


def check_splits(splits: dict[str, list[dict]]) -> V.ValidationReport:
    """Across splits: task ids unique; no person a validation or test task names in an earlier split's tasks
    (validation against train, test against train and validation); train and validation use seen wordings only."""
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    rows, value_rows = [], []
    people: dict[str, set[str]] = {s: set() for s in SPLITS}
    for split, records in splits.items():
        for i, r in enumerate(records):
            rows.append((split, i, r.get("task_id"), r.get("template_seen")))
            held = (r.get("data") or {}).get("heldout") if isinstance(r.get("data"), dict) else None
            for p in (held or {}).get("person") or []:
                people.setdefault(split, set()).add(p)
                value_rows.append((split, i, r.get("task_id"), p))
    tasks = pd.DataFrame(rows, columns=[V.SPLIT, V.ROW, "task_id", "template_seen"], dtype=object)
    index = [V.SPLIT, V.ROW, "task_id"]
    results = V.run_expectations(tasks, [
        gxe.ExpectColumnValuesToBeUnique(column="task_id"),
        gxe.ExpectColumnValuesToBeInSet(column="template_seen", value_set=[True],
                                        row_condition=Column(V.SPLIT) != "test"),
    ], index, name="calendar_splits")
    frame = pd.DataFrame(value_rows, columns=[V.SPLIT, V.ROW, "task_id", "person"], dtype=object)
    for split, earlier in (("validation", people["train"]), ("test", people["train"] | people["validation"])):
        part = frame[frame[V.SPLIT] == split]
        if len(part):
            results += V.run_expectations(part, [gxe.ExpectColumnValuesToNotBeInSet(
                column="person", value_set=sorted(earlier))], index, name=f"calendar_heldout_{split}")
    return V.ValidationReport("splits", "calendar_splits", len(tasks), results)


def validate_tasks(records: list[dict], dataset: str, split: str | None = None) -> V.ValidationReport:
    """The ``calendar_tasks`` report on task records (as read back from a file)."""
    register_suites()
    return V.validate_records(records, "calendar_tasks", dataset=dataset, split=split)
