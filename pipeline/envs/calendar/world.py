"""The booking calendar's world: rooms, people and a few weeks of one-hour bookings, in real SQLite.

Everything is drawn from one seeded `numpy.random.Generator` (``default_rng([seed, 21])``) and inserted in a fixed
order, so a seed gives a byte-identical ``world.sqlite`` and ``world.json``.

- **Rooms** are a fixed list of 16 (:data:`ROOMS`), from ``Nook`` (2 seats) to ``Atrium`` (20 seats), on four
  floors. They are shared by every split: a task may send a meeting to any room that fits.
- **People** are drawn from first x last names (``Mia Holt``), each in a team. Their names are the held-out
  dimension: `heldout_fraction` of them are held out of training (half to validation, the rest to test) before any
  task exists, and a task names only people of its own split's part, as requester or as the other party of a swap.
- **Bookings** fill working days (Monday to Friday, `weeks` of them from :data:`FIRST_DAY`) at the eight start hours
  09:00-16:00; a booking lasts one hour. Whether a room is booked at an hour is drawn with the chance `occupancy`
  shaped by the hour (mornings and early afternoons are busier) and by the room (small rooms are busier). Each
  booking has a 4-digit id (drawn without replacement from 1001-8999; new bookings made in an episode get 9001 on),
  an owner who has no other booking at that hour, and 3 people up to the room's capacity.

Invariants (the world suite checks them): one booking per room and hour, one booking per person and hour, attendees
between 3 and the room's capacity, days and hours on the calendar's grid.

Deliberately left out: meetings longer than an hour, recurring series, time zones, invitations of other attendees
(a booking counts people, it does not name them) and anything a task does not need.
"""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from pathlib import Path

import numpy as np

SPLITS = ("train", "validation", "test")
TABLES = ("rooms", "people", "bookings")
DB_NAME, META_NAME, CORPUS_NAME = "world.sqlite", "world.json", "corpus.jsonl"
FORMAT_VERSION = 1
FIRST_DAY = dt.date(2026, 3, 2)  # a Monday
HOURS = tuple(f"{h:02d}:00" for h in range(9, 17))  # start hours; every booking lasts one hour
HOUR_LOAD = (0.6, 1.3, 1.3, 0.9, 0.7, 1.2, 1.1, 0.8)  # relative occupancy per start hour
MIN_ATTENDEES = 3
FIRST_NEW_ID = 9001  # bookings made in an episode are numbered from here; the world's are 1001-8999
# name, seats, floor
ROOMS = (("Nook", 2, 1), ("Alder", 4, 1), ("Birch", 4, 1), ("Cedar", 4, 2), ("Dune", 6, 2), ("Elm", 6, 2),
         ("Fern", 6, 3), ("Grove", 8, 3), ("Harbor", 8, 3), ("Iris", 8, 4), ("Juniper", 10, 4), ("Kestrel", 10, 2),
         ("Lagoon", 12, 3), ("Maple", 12, 4), ("Summit", 16, 4), ("Atrium", 20, 1))
ROOM_NAMES = tuple(r[0] for r in ROOMS)
CAPACITY = {name: seats for name, seats, _ in ROOMS}
SMALLEST_ROOM = min(ROOM_NAMES, key=lambda r: (CAPACITY[r], r))
TEAMS = ("design", "sales", "finance", "legal", "support", "research", "ops", "people")
FIRST_NAMES = ("Mia", "Leo", "Ada", "Eli", "Ivy", "Max", "Zoe", "Sam", "Ava", "Noah", "Lea", "Finn", "Ines", "Omar",
               "Ruth", "Theo", "Nina", "Axel", "Cleo", "Hugo", "Iris", "Jude", "Kai", "Lina", "Milo", "Nora", "Otto",
               "Pia", "Rhea", "Tom")
LAST_NAMES = ("Holt", "Park", "Roth", "Lind", "Vance", "Moss", "Kerr", "Dunn", "Ford", "Hale", "Blom", "Cruz", "Falk",
              "Gray", "Hart", "Ives", "Koch", "Lowe", "Marsh", "Nash", "Pike", "Quinn", "Reed", "Sand", "Tate",
              "Wolf", "Yates", "Abel", "Birk", "Cole")

SCHEMA = """
CREATE TABLE rooms (
    name TEXT PRIMARY KEY,
    capacity INTEGER NOT NULL CHECK (capacity > 0),
    floor INTEGER NOT NULL
);
CREATE TABLE people (
    name TEXT PRIMARY KEY,
    team TEXT NOT NULL
);
CREATE TABLE bookings (
    booking_id INTEGER PRIMARY KEY,
    room TEXT NOT NULL REFERENCES rooms(name),
    day TEXT NOT NULL,
    start TEXT NOT NULL,
    owner TEXT NOT NULL REFERENCES people(name),
    attendees INTEGER NOT NULL
);
CREATE INDEX bookings_slot ON bookings(day, start);
CREATE INDEX bookings_owner ON bookings(owner, day);
"""


def working_days(weeks: int) -> tuple[str, ...]:
    """The calendar's days: Monday to Friday of `weeks` weeks from :data:`FIRST_DAY`, ISO formatted."""
    return tuple((FIRST_DAY + dt.timedelta(days=7 * w + d)).isoformat() for w in range(weeks) for d in range(5))


def partition(values: tuple[str, ...], rng: np.random.Generator, heldout: float) -> dict[str, list[str]]:
    """Split `values` into train / validation / test: `heldout` of them held out (at least one each), validation
    getting half of the held-out ones (rounded down). Each list keeps the values' own order."""
    n_hold = max(2, int(round(len(values) * heldout)))
    if n_hold >= len(values):
        raise ValueError(f"heldout_fraction={heldout} leaves no training people among {len(values)}")
    order = rng.permutation(len(values))
    rank = {int(idx): r for r, idx in enumerate(order)}
    n_val = n_hold // 2
    split_of = {v: "validation" if rank[i] < n_val else "test" if rank[i] < n_hold else "train"
                for i, v in enumerate(values)}
    return {s: [v for v in values if split_of[v] == s] for s in SPLITS}


def generate(seed: int, n_people: int, weeks: int, occupancy: float, heldout_fraction: float) -> dict:
    """All rows of the world and the held-out partition: {"rows": {table: [tuple, ...]}, "partition": {...}}."""
    rng = np.random.default_rng([seed, 21])
    pool = [f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES]
    if n_people > len(pool):
        raise ValueError(f"n_people={n_people} exceeds the {len(pool)} distinct names")
    names = [pool[int(i)] for i in rng.choice(len(pool), size=n_people, replace=False)]
    people = [(name, TEAMS[int(rng.integers(len(TEAMS)))]) for name in names]
    part = {"person": partition(tuple(names), rng, heldout_fraction)}
    days = working_days(weeks)
    room_load = {name: 1.25 if seats <= 6 else 1.0 if seats <= 12 else 0.7 for name, seats, _ in ROOMS}
    ids = [int(i) for i in rng.permutation(np.arange(1001, 9000))]
    busy: set[tuple[str, str, str]] = set()  # (person, day, hour)
    weights = rng.gamma(1.5, size=n_people)  # some people book far more than others
    weights /= weights.sum()
    bookings = []
    for day in days:
        for h, hour in enumerate(HOURS):
            for name, seats, _ in ROOMS:
                if rng.random() >= min(0.95, occupancy * HOUR_LOAD[h] * room_load[name]):
                    continue
                for _ in range(8):  # an owner free at this hour
                    owner = names[int(rng.choice(n_people, p=weights))]
                    if (owner, day, hour) not in busy:
                        break
                else:
                    continue
                busy.add((owner, day, hour))
                attendees = int(rng.integers(MIN_ATTENDEES, seats + 1)) if seats >= MIN_ATTENDEES else seats
                bookings.append([name, day, hour, owner, attendees])
    if len(bookings) > len(ids):
        raise ValueError(f"{len(bookings)} bookings exceed the {len(ids)} four-digit ids; lower weeks or occupancy")
    rows = sorted((ids[i], *b) for i, b in enumerate(bookings))
    return {"rows": {"rooms": list(ROOMS), "people": people, "bookings": rows}, "partition": part, "days": days}


def write(world: dict, out_dir: Path, meta: dict) -> list[Path]:
    """Write `world.sqlite` (rows in key order, one transaction) and `world.json` (partition, days and `meta`)."""
    db_path, meta_path = out_dir / DB_NAME, out_dir / META_NAME
    if db_path.exists():
        db_path.unlink()
    conn = sqlite3.connect(db_path)
    try:
        conn.executescript(SCHEMA)
        for table in TABLES:
            rows = world["rows"][table]
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
        conn.commit()
    finally:
        conn.close()
    counts = {t: len(world["rows"][t]) for t in TABLES}
    doc = {"format_version": FORMAT_VERSION, "partition": world["partition"], "days": list(world["days"]),
           "counts": counts, **meta}
    meta_path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return [db_path, meta_path]


def write_corpus(out_dir: Path) -> Path:
    """``corpus.jsonl``: one document per room (its seats and floor) and one on the calendar's rules; no person's
    name, so no held-out name enters training text through it."""
    path = out_dir / CORPUS_NAME
    docs = [{"doc_id": f"room-{name}", "title": name, "text": f"{name} seats {seats}, floor {floor}."}
            for name, seats, floor in ROOMS]
    docs.append({"doc_id": "rules", "title": "rules", "text": "Bookings last one hour and start on the hour from "
                 f"{HOURS[0]} to {HOURS[-1]}, Monday to Friday. A room holds one booking an hour and a person "
                 "attends one meeting an hour."})
    path.write_text("".join(json.dumps(d, sort_keys=True) + "\n" for d in docs))
    return path


def read_meta(world_dir: Path) -> dict:
    """The metadata of a written world; FileNotFoundError / ValueError naming what is wrong."""
    world_dir = Path(world_dir)
    missing = [str(world_dir / n) for n in (DB_NAME, META_NAME) if not (world_dir / n).is_file()]
    if missing:
        raise FileNotFoundError(f"calendar world files missing: {', '.join(missing)} (run `agentrl build-env` first)")
    path = world_dir / META_NAME
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION or "partition" not in meta \
            or not isinstance(meta.get("days"), list):
        raise ValueError(f"{path}: not a calendar world description (format_version {FORMAT_VERSION} with a "
                         "partition and days)")
    return meta


def connect_ro(db_path: Path) -> sqlite3.Connection:
    """A read-only connection to the world file (URI ``mode=ro``), usable from any thread."""
    uri = Path(db_path).resolve().as_uri() + "?mode=ro"
    return sqlite3.connect(uri, uri=True, check_same_thread=False)


def load_master(db_path: Path) -> sqlite3.Connection:
    """An in-memory copy of the world file (the master every episode copies); ValueError if it lacks a table."""
    src = connect_ro(db_path)
    master = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        src.backup(master)
        for table in TABLES:
            if not master.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                  (table,)).fetchone():
                raise ValueError(f"{db_path}: table {table!r} is missing (tables must be {', '.join(TABLES)})")
    except sqlite3.DatabaseError as exc:
        master.close()
        raise ValueError(f"{db_path}: not a valid calendar database ({exc})") from None
    finally:
        src.close()
    return master


def bookings(conn: sqlite3.Connection) -> dict[int, tuple]:
    """{booking_id: (room, day, start, owner, attendees)} of every booking on `conn`."""
    return {r[0]: tuple(r[1:]) for r in conn.execute(
        "SELECT booking_id, room, day, start, owner, attendees FROM bookings ORDER BY booking_id")}
