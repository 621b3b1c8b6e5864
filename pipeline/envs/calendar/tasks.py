"""Tasks of the booking calendar: requests at four levels whose success is a state of the world, not a string.

A task is a request from one person (the *requester*) to book, move, cancel or swap meetings. Its `data` holds:

- ``goal``: the changes the request asks for (:mod:`pipeline.envs.calendar.judge` checks them on the episode's
  private copy): ``{"op": "book", "owner", "day", "start", "attendees", "room"}``, ``{"op": "move", "booking_id",
  "day", "start", "room", "min_capacity"}`` or ``{"op": "cancel", "booking_id"}``; ``room`` null means any room that
  seats the meeting;
- ``allowed``: what the guard lets the agent write (``requester``, ``book``, the ids it may ``move`` / ``cancel``);
- ``plan``: the expert's calls with their true parameters (``answer`` excluded); ``min_calls`` = len(plan) + 1;
- ``heldout``: ``{"person": [names]}``, the people the request names; ``template_id``: ``family/wording``.

The answer is a receipt: the ids of every booking the request changes or creates, ascending, comma-separated
(``4821, 9001``). Bookings made in an episode are numbered from 9001, so the expert's answer is known at build time.

=====  ===============  =======================================================================  =========
level  family           request (and the trap in it)                                             min_calls
=====  ===============  =======================================================================  =========
1      move_time        move a meeting to the first hour from t when its room is free             4
                        (t itself is often taken)
1      move_day         move a meeting to another day, same hour, its room if free there, else    4
                        any room that fits (reschedule with conflict: its room is often taken)
1      book_after       book a room for n people for the hour after the requester's last          4
                        meeting that day
2      replace          cancel a meeting and book a room for n people at another day and hour     5
2      book_next_free   book a room for n at t, or the first later hour when one is free          4-5
                        (t, and sometimes t+1, have no free room that fits)
3      move_both        move both of the requester's meetings of a day to another day             6
4      swap_times       swap the hours of two people's meetings in one room (a free hour is       7
                        needed as a stepping stone: moving one onto the other conflicts)
=====  ===============  =======================================================================  =========

Each task draws a level by `level_mix`, a family of the level uniformly, then retries that family's draw (up
to 200 times) until one is usable, so every family keeps its share. Draws are skipped unless the request is feasible and unambiguous: the people it names have no meeting where it moves
theirs, a room that fits is free where it books, a requester with two meetings that day for ``move_both``, and for
``move_time`` the first free hour of the room is one the requester is free at. Meetings in the 2-seat ``Nook`` are
never the subject of a task (the expert's ``wrong_order`` flaw relies on it being too small for any of them).

Wordings: four per family; index 3 is held out (test only, ``template_seen`` False); train and validation draw from
the first `train_wordings` (1-3). Held-out people: see :mod:`pipeline.envs.calendar.world`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.envs.contract import Task
from pipeline.envs.calendar.world import CAPACITY, FIRST_NEW_ID, HOURS, ROOM_NAMES, SMALLEST_ROOM, SPLITS

HELDOUT_TEMPLATE = 3
TRAIN_TEMPLATES = (0, 1, 2)
SIZES = (4, 6, 8, 10, 12)
BIG_SIZES = (10, 12, 16, 20)
FAMILY_TRIES = 200  # draws of one chosen family before the level and family are drawn again


@dataclass(frozen=True)
class Family:
    name: str
    level: int
    wordings: tuple[str, ...]  # four; index 3 is held out


FAMILIES: tuple[Family, ...] = (
    Family("move_time", 1, (
        "Move {p}'s {h0} meeting on {d} to the first hour from {t} when its room is free.",
        "{p} wants the {h0} meeting on {d} moved to the earliest free hour of its room from {t} on.",
        "Please shift {p}'s meeting at {h0} on {d} to its room's first free hour starting at {t}.",
        "On {d}, {p}'s {h0} meeting should go to the first hour at or after {t} that its room has free.")),
    Family("move_day", 1, (
        "Move {p}'s {h0} meeting on {d} to {d2} at the same hour, in its room if free, else any room that fits.",
        "{p} needs the {h0} meeting of {d} on {d2} instead, same hour; keep the room if it is free, otherwise "
        "take any room that seats it.",
        "Reschedule {p}'s meeting at {h0} on {d} to {h0} on {d2}; same room when free, else a room that fits.",
        "Put {p}'s {d} meeting at {h0} on {d2} at {h0}, in the same room or, if that is taken, one big enough.")),
    Family("book_after", 1, (
        "{p} needs a room for {n} people on {d} for the hour after their last meeting that day.",
        "Book {p} a room for {n} on {d}, right after their last meeting of the day.",
        "Find {p} a room seating {n} on {d} for the hour following their final meeting and book it.",
        "For the hour after {p}'s last meeting on {d}, book them a room where {n} people fit.")),
    Family("replace", 2, (
        "Cancel {p}'s {h0} meeting on {d} and book them a room for {n} people on {d2} at {t} instead.",
        "{p} drops the {h0} meeting of {d}; book a room for {n} on {d2} at {t} in its place.",
        "Replace {p}'s meeting at {h0} on {d} with one for {n} people on {d2} at {t}.",
        "Instead of the {h0} meeting on {d}, {p} wants a room for {n} at {t} on {d2}; cancel the old one.")),
    Family("book_next_free", 2, (
        "{p} needs a room for {n} people on {d} at {t}, or else at the first later hour when one is free.",
        "Book {p} a room seating {n} on {d} at {t}; if none is free then, the next hour that has one.",
        "Find {p} a room for {n} on {d} at {t} or, failing that, at the earliest later hour with a free room.",
        "On {d}, {p} wants {n} people in a room from {t}: the first hour from {t} on with a room free.")),
    Family("move_both", 3, (
        "Move both of {p}'s meetings on {d} to {d2} at the same hours, each in its room if free, else any room "
        "that fits.",
        "{p}'s two meetings of {d} go to {d2}, same hours; keep their rooms where free, otherwise rooms that fit.",
        "Reschedule {p}'s two meetings from {d} to {d2} at their hours, same rooms when free, else rooms big enough.",
        "Shift both meetings {p} has on {d} to {d2}, hours unchanged, each in its room or one that seats it.")),
    Family("swap_times", 4, (
        "Swap the hours of {p}'s {h0} meeting and {q}'s {t} meeting in {r} on {d}; both agreed.",
        "{p} and {q} agreed to trade hours on {d}: the {h0} and the {t} meeting in {r}.",
        "In {r} on {d}, give {p}'s {h0} meeting the {t} hour and {q}'s {t} meeting the {h0} hour.",
        "Exchange the {h0} slot of {p} and the {t} slot of {q} in {r} on {d}; they both said yes.")),
)
BY_NAME = {f.name: f for f in FAMILIES}
FAMILY_NAMES = tuple(BY_NAME)


class Schedule:
    """Indexes of the built bookings that the draws read (never written)."""

    def __init__(self, bookings: dict[int, tuple], days: tuple[str, ...]):
        self.rows, self.days = bookings, tuple(days)
        self.slot = {(r, d, h): b for b, (r, d, h, _, _) in bookings.items()}
        self.owner_at = {(o, d, h): b for b, (_, d, h, o, _) in bookings.items()}
        self.of: dict[tuple[str, str], list[int]] = {}
        for b, (_, d, h, o, _) in sorted(bookings.items(), key=lambda kv: kv[1][2]):
            self.of.setdefault((o, d), []).append(b)
        self.by_person: dict[str, list[int]] = {}
        for b, (r, _, _, o, _) in bookings.items():
            if r != SMALLEST_ROOM:
                self.by_person.setdefault(o, []).append(b)

    def free_rooms(self, day: str, hour: str, n: int, ignore: tuple[int, ...] = ()) -> list[str]:
        return sorted((r for r in ROOM_NAMES if CAPACITY[r] >= n and self.slot.get((r, day, hour)) in (None, *ignore)),
                      key=lambda r: (CAPACITY[r], r))

    def person_free(self, person: str, day: str, hour: str, ignore: tuple[int, ...] = ()) -> bool:
        return self.owner_at.get((person, day, hour)) in (None, *ignore)

    def room_free(self, room: str, day: str, hour: str, ignore: tuple[int, ...] = ()) -> bool:
        return self.slot.get((room, day, hour)) in (None, *ignore)


def _move(b: int, room: str, day: str, hour: str) -> list:
    return ["move_booking", {"booking_id": b, "room": room, "date": day, "start": hour}]


def _book(room: str, day: str, hour: str, owner: str, n: int) -> list:
    return ["book", {"room": room, "date": day, "start": hour, "owner": owner, "attendees": n}]


def _move_goal(b: int, room: str | None, day: str, hour: str, n: int) -> dict:
    return {"op": "move", "booking_id": b, "room": room, "day": day, "start": hour, "min_capacity": n}


def _book_goal(owner: str, room: str | None, day: str, hour: str, n: int) -> dict:
    return {"op": "book", "owner": owner, "room": room, "day": day, "start": hour, "attendees": n}


def draw(family: str, s: Schedule, people: list[str], rng: np.random.Generator) -> dict | None:
    """One draw of `family` naming only `people`: {"slots", "plan", "goal", "allowed", "answer_ids", "people"} or
    None when the draw is infeasible or ambiguous (see the module docstring)."""
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    p = pick(people)
    owned = s.by_person.get(p)
    if family in ("book_after", "book_next_free"):
        return (_book_after if family == "book_after" else _book_next_free)(s, p, rng, pick)
    if not owned:
        return None
    b = pick(owned)  # the requester's meeting the request starts from
    from_booking = _FROM_A_BOOKING.get(family)
    if from_booking is None:
        raise ValueError(f"unknown family {family!r}; families are {list(FAMILY_NAMES)}")
    return from_booking(s, p, b, people, pick)


def _move_time(s: Schedule, p: str, b: int, people: list[str], pick) -> dict | None:
    room, day, h0, _, n = s.rows[b]
    i0 = HOURS.index(h0)
    if i0 == len(HOURS) - 1:
        return None
    t = pick(HOURS[i0 + 1:])
    free = [h for h in HOURS[HOURS.index(t):] if s.room_free(room, day, h)]
    if not free or not s.person_free(p, day, free[0]):
        return None
    h = free[0]
    plan = [["find_bookings", {"person": p, "date": day}], ["free_slots", {"room": room, "date": day}],
            _move(b, room, day, h)]
    return {"slots": {"p": p, "h0": h0, "d": day, "t": t}, "plan": plan, "goal": [_move_goal(b, room, day, h, n)],
            "allowed": {"move": [b]}, "answer_ids": [b], "people": [p]}


def _move_day(s: Schedule, p: str, b: int, people: list[str], pick) -> dict | None:
    room, day, h0, _, n = s.rows[b]
    d2 = pick([d for d in s.days if d != day])
    rooms = s.free_rooms(d2, h0, n)
    if not rooms or not s.person_free(p, d2, h0):
        return None
    keep = room in rooms
    target = room if keep else rooms[0]
    plan = [["find_bookings", {"person": p, "date": day}], ["free_rooms", {"date": d2, "start": h0, "attendees": n}],
            _move(b, target, d2, h0)]
    return {"slots": {"p": p, "h0": h0, "d": day, "d2": d2}, "plan": plan,
            "goal": [_move_goal(b, room if keep else None, d2, h0, n)], "allowed": {"move": [b]},
            "answer_ids": [b], "people": [p]}


def _replace(s: Schedule, p: str, b: int, people: list[str], pick) -> dict | None:
    _, day, h0, _, _ = s.rows[b]
    d2, t, n2 = pick(s.days), pick(HOURS), pick(SIZES)
    if (d2, t) == (day, h0) or not s.person_free(p, d2, t, ignore=(b,)):
        return None
    rooms = s.free_rooms(d2, t, n2, ignore=(b,))
    if not rooms:
        return None
    plan = [["find_bookings", {"person": p, "date": day}], ["cancel_booking", {"booking_id": b}],
            ["free_rooms", {"date": d2, "start": t, "attendees": n2}], _book(rooms[0], d2, t, p, n2)]
    return {"slots": {"p": p, "h0": h0, "d": day, "d2": d2, "t": t, "n": n2}, "plan": plan,
            "goal": [{"op": "cancel", "booking_id": b}, _book_goal(p, None, d2, t, n2)],
            "allowed": {"cancel": [b], "book": True}, "answer_ids": [b, FIRST_NEW_ID], "people": [p]}


def _move_both(s: Schedule, p: str, b: int, people: list[str], pick) -> dict | None:
    day = s.rows[b][1]
    mine = s.of.get((p, day), [])
    if len(mine) != 2 or any(s.rows[x][0] == SMALLEST_ROOM for x in mine):
        return None
    d2 = pick([d for d in s.days if d != day])
    plan, goal, moves = [["find_bookings", {"person": p, "date": day}]], [], []
    for x in mine:
        r, _, h, _, nx = s.rows[x]
        rooms = s.free_rooms(d2, h, nx)
        if not rooms or not s.person_free(p, d2, h):
            return None
        keep = r in rooms
        plan.append(["free_rooms", {"date": d2, "start": h, "attendees": nx}])
        moves.append(_move(x, r if keep else rooms[0], d2, h))
        goal.append(_move_goal(x, r if keep else None, d2, h, nx))
    return {"slots": {"p": p, "d": day, "d2": d2}, "plan": plan + moves, "goal": goal,
            "allowed": {"move": sorted(mine)}, "answer_ids": sorted(mine), "people": [p]}


def _swap_times(s: Schedule, p: str, b: int, people: list[str], pick) -> dict | None:
    room, day, h0, _, n = s.rows[b]
    others = [s.slot[(room, day, h)] for h in HOURS if h != h0 and (room, day, h) in s.slot]
    partners = [x for x in others if s.rows[x][3] != p and s.rows[x][3] in people]
    if not partners:
        return None
    c = pick(partners)
    q, hc = s.rows[c][3], s.rows[c][2]
    if not (s.person_free(p, day, hc, ignore=(b,)) and s.person_free(q, day, h0, ignore=(c,))):
        return None
    temp = [h for h in HOURS if s.room_free(room, day, h) and s.person_free(p, day, h, ignore=(b,))]
    if not temp:
        return None
    plan = [["find_bookings", {"person": p, "date": day}], ["find_bookings", {"person": q, "date": day}],
            ["free_slots", {"room": room, "date": day}], _move(b, room, day, temp[0]), _move(c, room, day, h0),
            _move(b, room, day, hc)]
    return {"slots": {"p": p, "q": q, "h0": h0, "t": hc, "r": room, "d": day}, "plan": plan,
            "goal": [_move_goal(b, room, day, hc, n), _move_goal(c, room, day, h0, s.rows[c][4])],
            "allowed": {"move": sorted([b, c])}, "answer_ids": sorted([b, c]), "people": [p, q]}


# The families that start from one of the requester's meetings (drawn by `draw`), each a function of
# (schedule, requester, booking id, people, pick).
_FROM_A_BOOKING = {"move_time": _move_time, "move_day": _move_day, "replace": _replace, "move_both": _move_both,
                   "swap_times": _swap_times}


def _book_after(s: Schedule, p: str, rng, pick) -> dict | None:
    days = [d for d in s.days if (p, d) in s.of]
    if not days:
        return None
    day = pick(days)
    last = s.rows[s.of[(p, day)][-1]][2]
    if last == HOURS[-1]:
        return None
    h, n = HOURS[HOURS.index(last) + 1], pick(SIZES)
    rooms = s.free_rooms(day, h, n)
    if not rooms:
        return None
    plan = [["find_bookings", {"person": p, "date": day}], ["free_rooms", {"date": day, "start": h, "attendees": n}],
            _book(rooms[0], day, h, p, n)]
    return {"slots": {"p": p, "d": day, "n": n}, "plan": plan, "goal": [_book_goal(p, None, day, h, n)],
            "allowed": {"book": True}, "answer_ids": [FIRST_NEW_ID], "people": [p]}


def _book_next_free(s: Schedule, p: str, rng, pick) -> dict | None:
    day, t, n = pick(s.days), pick(HOURS[:-2]), pick(BIG_SIZES)
    i = HOURS.index(t)
    tried = []
    for h in HOURS[i:i + 3]:
        tried.append(h)
        if s.free_rooms(day, h, n):
            break
    else:
        return None
    h = tried[-1]
    if len(tried) < 2 or not all(s.person_free(p, day, x) for x in tried):
        return None
    plan = [["free_rooms", {"date": day, "start": x, "attendees": n}] for x in tried]
    plan.append(_book(s.free_rooms(day, h, n)[0], day, h, p, n))
    return {"slots": {"p": p, "d": day, "t": t, "n": n}, "plan": plan, "goal": [_book_goal(p, None, day, h, n)],
            "allowed": {"book": True}, "answer_ids": [FIRST_NEW_ID], "people": [p]}


def make_task(family: Family, template: int, drawn: dict, split: str, index: int) -> Task:
    """The task of one draw (ids ``cal-{split}-{index:06d}``)."""
    allowed = {"requester": drawn["people"][0], "book": bool(drawn["allowed"].get("book", False)),
               "move": list(drawn["allowed"].get("move", [])), "cancel": list(drawn["allowed"].get("cancel", []))}
    return Task(
        task_id=f"cal-{split}-{index:06d}", split=split, level=family.level,
        question=family.wordings[template].format(**drawn["slots"]),
        answer=", ".join(str(i) for i in sorted(drawn["answer_ids"])), family=family.name,
        min_calls=len(drawn["plan"]) + 1, template_seen=template != HELDOUT_TEMPLATE,
        data={"goal": drawn["goal"], "allowed": allowed, "plan": drawn["plan"],
              "heldout": {"person": list(drawn["people"])}, "template_id": f"{family.name}/{template}"})


def generate_tasks(schedule: Schedule, partition: dict, split: str, n: int, level_mix: dict[int, float], seed: int,
                   train_wordings: int = 3) -> list[Task]:
    """`n` distinct tasks of `split` naming only its own people; ValueError when the request space is too small."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits are {list(SPLITS)}")
    if not 1 <= train_wordings <= len(TRAIN_TEMPLATES):
        raise ValueError(f"train_wordings must be 1-{len(TRAIN_TEMPLATES)}, got {train_wordings}")
    levels = sorted(lv for lv, w in level_mix.items() if w > 0)
    weights = np.array([level_mix[lv] for lv in levels], dtype=float)
    weights /= weights.sum()
    by_level = {lv: [f for f in FAMILIES if f.level == lv] for lv in levels}
    people = list(partition["person"][split])
    templates = (*TRAIN_TEMPLATES, HELDOUT_TEMPLATE) if split == "test" else TRAIN_TEMPLATES[:train_wordings]
    rng = np.random.default_rng([seed, 22, SPLITS.index(split)])
    tasks: list[Task] = []
    seen: set[str] = set()
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > 20 * n + 500:
            raise ValueError(f"could not draw {n} distinct {split} tasks (found {len(tasks)}); the request space is "
                             "too small for this many: lower tasks_per_split or the level-3/4 weights, or raise "
                             "n_people, weeks or heldout_fraction")
        level = levels[int(rng.choice(len(levels), p=weights))]
        family = by_level[level][int(rng.integers(len(by_level[level])))]
        template = templates[int(rng.integers(len(templates)))]
        for _ in range(FAMILY_TRIES):  # retry the chosen family, so a family with rare feasible draws keeps its share
            drawn = draw(family.name, schedule, people, rng)
            if drawn is not None:
                break
        else:
            continue
        task = make_task(family, template, drawn, split, len(tasks))
        if task.question in seen:
            continue
        seen.add(task.question)
        tasks.append(task)
    return tasks
