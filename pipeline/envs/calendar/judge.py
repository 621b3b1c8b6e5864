"""State-based correctness: whether an episode's private copy is in the state its request asks for.

:func:`judge` compares the bookings at the episode's start with those at its end:

- the cancelled ids must be exactly the ``cancel`` goals' ids;
- the changed ids must be exactly the ``move`` goals' ids, each now at the goal's day and hour, in the goal's room
  (or, where the goal's room is null, in a room seating at least ``min_capacity``), with its owner and attendees
  unchanged;
- the new bookings must be exactly one per ``book`` goal, each with the goal's owner, day, hour and attendees, in the
  goal's room or (null) a room that seats them;
- nothing else may differ: an extra booking, a cancelled or changed booking the request does not name (even one the
  guard let through, such as a booking the agent made and moved) makes the state wrong.

The answer is the receipt (:mod:`pipeline.envs.calendar.tasks`): :func:`receipt_ids` reads every 4-digit number in it,
and it must name exactly the ids the request changed or created in this episode (the new bookings' actual ids).
So a right answer over a wrong state is wrong, and so is a right state with a wrong receipt.
"""

from __future__ import annotations

import re

from pipeline.envs.calendar.world import CAPACITY

_ID = re.compile(r"(?<!\d)\d{4}(?!\d)")


def receipt_ids(answer: object) -> set[int]:
    """The booking ids an answer names.

    >>> sorted(receipt_ids("4821, 9001")), sorted(receipt_ids("#4821 and #9001.")), receipt_ids("done")
    ([4821, 9001], [4821, 9001], set())
    """
    return {int(m) for m in _ID.findall(str(answer))}


def _room_ok(room: str, goal_room: str | None, seats: int) -> bool:
    return room == goal_room if goal_room else CAPACITY.get(room, 0) >= seats


def judge(before: dict[int, tuple], after: dict[int, tuple], goals: list[dict]) -> tuple[bool, str, set[int]]:
    """(whether the state holds, why not, the ids the request changed or created). Rows are (room, day, start, owner,
    attendees) by booking id, as :func:`pipeline.envs.calendar.world.bookings` reads them."""
    removed = set(before) - set(after)
    added = set(after) - set(before)
    changed = {b for b in set(before) & set(after) if before[b] != after[b]}
    cancels = {g["booking_id"] for g in goals if g["op"] == "cancel"}
    moves = {g["booking_id"]: g for g in goals if g["op"] == "move"}
    books = [g for g in goals if g["op"] == "book"]
    touched = removed | changed | added
    if removed != cancels:
        return False, f"cancelled {sorted(removed)}, the request cancels {sorted(cancels)}", touched
    if changed != set(moves):
        return False, f"changed {sorted(changed)}, the request moves {sorted(moves)}", touched
    for b, g in moves.items():
        room, day, start, owner, n = after[b]
        if (day, start) != (g["day"], g["start"]) or not _room_ok(room, g["room"], g["min_capacity"]) \
                or (owner, n) != before[b][3:]:
            return False, f"booking {b} is at {room} {day} {start}, not where the request moves it", touched
    if len(added) != len(books):
        return False, f"{len(added)} new bookings, the request asks for {len(books)}", touched
    for b, g in zip(sorted(added), books):
        room, day, start, owner, n = after[b]
        if (owner, day, start, n) != (g["owner"], g["day"], g["start"], g["attendees"]) \
                or not _room_ok(room, g["room"], g["attendees"]):
            return False, f"new booking {b} ({room} {day} {start}, {owner}, {n}) is not the one requested", touched
    return True, "", touched
