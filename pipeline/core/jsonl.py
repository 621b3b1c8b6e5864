"""The one reader of JSON Lines files (tasks, demonstrations, episodes, corpora).

Every phase reads its JSONL inputs through :func:`read_jsonl` (or :func:`iter_jsonl` for a file too large to hold),
so a missing file, a line that is not UTF-8, not JSON (or nested too deeply to parse) or not a JSON object is refused
the same way everywhere: an :class:`~pipeline.core.errors.AgentRLError` whose message names the file, the line and
what is wrong. What the records
must hold is not checked here: that is the job of the Great Expectations suite of the data they carry.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.errors import AgentRLError


def iter_jsonl(path: str | Path, what: str = "records", *, hint: str = "") -> Iterator[dict]:
    """Yield the JSON objects of `path` one line at a time (blank lines skipped).

    `what` names the data in messages ("task file", "demonstrations"); `hint` is appended to the not-found message
    (for example the command that writes the file).
    """
    for _, rec in iter_numbered_jsonl(path, what, hint=hint):
        yield rec


def iter_numbered_jsonl(path: str | Path, what: str = "records", *, hint: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for every non-blank line of `path`, for callers whose own messages name the line."""
    path = Path(path)
    if not path.is_file():
        raise AgentRLError(f"{path}: {what} not found" + (f"; {hint}" if hint else ""))
    with path.open("rb") as fh:
        for i, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise AgentRLError(f"{path}:{i}: not UTF-8 text (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line.rstrip("\r\n"))  # a column past the end names this line, not the next
            except json.JSONDecodeError as exc:
                raise AgentRLError(f"{path}:{i}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise AgentRLError(f"{path}:{i}: JSON nested too deeply to read") from None
            if not isinstance(rec, dict):
                raise AgentRLError(f"{path}:{i}: expected a JSON object, got {type(rec).__name__}")
            yield i, rec


def read_jsonl(path: str | Path, what: str = "records", *, hint: str = "", allow_empty: bool = False) -> list[dict]:
    """All JSON objects of `path` (see :func:`iter_jsonl`); an empty file is an error unless `allow_empty`."""
    records = list(iter_jsonl(path, what, hint=hint))
    if not records and not allow_empty:
        raise AgentRLError(f"{path}: no {what} in file")
    return records


__all__ = ["iter_jsonl", "iter_numbered_jsonl", "read_jsonl"]
