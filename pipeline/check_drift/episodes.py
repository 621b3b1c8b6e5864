"""Episode files of the phase `check_drift`, read in chunks so that memory does not grow with the records.

A trajectory file can hold a million episodes (about 1.2 KB of JSON each, ten times that as Python dicts). Holding
them all, and validating them as one DataFrame, took 1.4 GiB at 100k and would take over 10 GiB at 1M. Instead the
file is streamed in chunks of :data:`CHUNK` records: each chunk goes through the environment's suite (so every
record is still validated, and the first failing chunk's report is the error) and is then reduced to what the
checks use:

- the behaviour-drift test needs one row of features per episode (:func:`trajectory_features`): kept, the same
  values as the whole-file extraction (tested), with repeated strings shared;
- the consistency probes and the hidden-state contexts need whole records, but a fixed-seed sample of them: those
  functions read the file again (iterating an :class:`EpisodeFile` re-reads it, already validated), so what they draw
  is what they drew from the list.

So memory is one chunk plus the feature rows (tens of bytes per episode), whatever the file's length.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from pipeline.core.errors import AgentRLError

CHUNK = 20_000  # records validated at once: large enough that GX's ~7 ms per expectation is amortised
SHARED = ("tool_sequence", "success")  # string features with few distinct values: one object per value


class EpisodeFile:
    """A validated episode file: its length, its trajectory features, and its records (re-read on iteration).

    Passed where the checks take a sequence of episode records (`trajectory_drift`, `probes_from_episodes`,
    `observation_contexts`), it behaves as that list did."""

    def __init__(self, path: Path, what: str, n: int, features: dict[str, pd.Series]):
        self.path, self.what, self.n, self.features = path, what, n, features

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[dict]:
        from pipeline.core.jsonl import iter_jsonl

        return iter_jsonl(self.path, self.what)

    def trajectory_features(self) -> dict[str, pd.Series]:
        """The features of every record, in file order (:func:`pipeline.check_drift.features.trajectory_features`)."""
        return self.features

    def __repr__(self) -> str:
        return f"EpisodeFile({str(self.path)!r}, {self.n} {self.what})"


def load_episode_file(path: str | Path, what: str, env_cfg, world, suite: str | None = "trajectories",
                      chunk_size: int = CHUNK) -> EpisodeFile:
    """Stream `path` in chunks of `chunk_size` records, validate each with the environment's `suite` check (None:
    not checked, e.g. demonstrations) and keep their trajectory features. A missing, empty or non-JSON file, or a
    chunk that breaks the suite, raises AgentRLError naming the file (and the lines of the failing chunk)."""
    from pipeline.core.jsonl import iter_numbered_jsonl

    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    path = Path(path)
    parts: list[dict[str, pd.Series]] = []
    shared: dict = {}
    chunk: list[dict] = []
    first = last = 0
    n = 0
    for line, rec in iter_numbered_jsonl(path, what):  # AgentRLError naming the file and line: missing, not JSON
        if not chunk:
            first = line
        chunk.append(rec)
        last = line
        if len(chunk) == chunk_size:
            parts.append(_reduce(chunk, path, first, last, env_cfg, world, suite, shared))
            n += len(chunk)
            chunk = []
    if chunk:
        parts.append(_reduce(chunk, path, first, last, env_cfg, world, suite, shared))
        n += len(chunk)
    if not n:
        raise AgentRLError(f"{path}: no {what} in file")
    features = {k: pd.concat([p[k] for p in parts], ignore_index=True) if len(parts) > 1 else parts[0][k]
                for k in parts[0]}
    return EpisodeFile(path, what, n, features)


def _reduce(chunk: list[dict], path: Path, first: int, last: int, env_cfg, world, suite: str | None,
            shared: dict) -> dict[str, pd.Series]:
    """Validate one chunk (lines `first`-`last` of `path`) and return its trajectory features."""
    from pipeline.check_drift.features import trajectory_features
    from pipeline.core.validation import DataValidationError

    if suite is not None:
        report = world.check_episodes(chunk, suite, f"{path} lines {first}-{last}", env_cfg)
        try:
            if report is not None:
                report.raise_if_failed()
        except DataValidationError as exc:
            raise AgentRLError(str(exc)) from None
    feats = trajectory_features(chunk)
    for k in SHARED:
        feats[k] = pd.Series([shared.setdefault(v, v) for v in feats[k]], dtype=object)
    return feats


__all__ = ["CHUNK", "EpisodeFile", "load_episode_file"]
