"""The folder of captured traffic, read side: segment names, whole records, and the episodes people labelled.

`agentrl serve` writes it (:mod:`pipeline.deploy.capture`, whose docstring describes the records and the segments);
the `reward_model` stage reads the labelled episodes from it. The reader lives here, below both, because a phase
never imports another phase.

From feedback to a label (:func:`success_label`): the feedback's ``label`` ("success" or "failure") when given, else
``rating >= success_rating`` (``reward_model.feedback_success_rating``, 4 by default: on the 1-5 scale, 4 and 5 mean
"it did what I asked"). The label says whether the episode succeeded in the eyes of the person who asked; it says
nothing about the process, so it trains the reward model's success head only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from pipeline.core.errors import AgentRLError

SEALED, OPEN = ".jsonl", ".jsonl.open"
EPISODES = "episodes.jsonl"  # a snapshot's episodes (pipeline.deploy.snapshot)
SEGMENT_NAME = re.compile(r"\A(\d{8}T\d{6}Z)-(\d+)-(\d+)\.jsonl(\.open)?\Z")  # <start>-<pid>-<n>.jsonl[.open]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def segment_files(folder: str | Path, include_open: bool = True) -> list[Path]:
    """The folder's segments, oldest first (sealed ones and, with `include_open`, open ones)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir()
             if SEGMENT_NAME.match(p.name) and (include_open or p.name.endswith(SEALED))]
    return sorted(files, key=lambda p: SEGMENT_NAME.match(p.name).group(1, 3, 2))


def read_records(folder: str | Path, kind: str | None = None, include_open: bool = True) -> Iterator[dict]:
    """Every whole record of the folder's segments (with `include_open`, of the open ones too), oldest segment first;
    `kind` keeps only "request" or "feedback" records. A last line without its newline (an open segment's record being
    written) is skipped; any other line that is not a JSON object is an AgentRLError naming the file and the line."""
    for path in segment_files(folder, include_open):
        lines = path.read_bytes().split(b"\n")
        if lines[-1]:
            lines = lines[:-1]  # no newline yet: the record in flight
        for i, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise AgentRLError(f"capture segment {path}, line {i}: not a JSON record ({exc})") from None
            if not isinstance(rec, dict):
                raise AgentRLError(f"capture segment {path}, line {i}: not a JSON object")
            if kind is None or rec.get("kind") == kind:
                yield rec


def success_label(feedback: dict, success_rating: float) -> int:
    """1 when the person judged the answer a success (see the module docstring), else 0.

    >>> success_label({"rating": 4, "label": None}, 4), success_label({"rating": 5, "label": "failure"}, 4)
    (1, 0)
    """
    if feedback.get("label") is not None:
        return int(feedback["label"] == "success")
    return int(feedback["rating"] >= success_rating)


def labelled_episodes(folder: str | Path, success_rating: float) -> list[dict]:
    """Captured requests that got feedback, each ``{"request_id", "task_id", "steps", "label", "rule_success",
    "source": "feedback"}``; the last feedback on a request wins; ``rule_success`` is the environment's verdict when
    the request carried ground truth, else None; ``task_id`` is the request id (the held-out split hashes it).

    `folder` is a snapshot (``data/production/snapshot``: its :data:`EPISODES` file, feedback already joined) or a
    folder of capture segments (the capture folder itself, or copies of its segments)."""
    episodes = Path(folder) / EPISODES
    if episodes.is_file():
        from pipeline.core.jsonl import iter_numbered_jsonl

        fb = {"rating": None, "label": None}
        return [{"request_id": e["request_id"], "task_id": e["request_id"], "steps": e["steps"],
                 "label": success_label({**fb, **{k: e.get(k) for k in fb}}, success_rating),
                 "rule_success": e.get("success"), "source": "feedback"}
                for _, e in iter_numbered_jsonl(episodes, "production episodes")
                if e.get("rating") is not None or e.get("label") is not None]
    requests, feedback = {}, {}
    for rec in read_records(folder):
        if rec.get("kind") == "request" and isinstance(rec.get("trajectory"), list):
            requests[rec.get("request_id")] = rec
        elif rec.get("kind") == "feedback":
            feedback[rec.get("request_id")] = rec
    out = []
    for rid, fb in feedback.items():
        req = requests.get(rid)
        if req is None:  # its request is past retention, or the feedback came first from another writer
            continue
        out.append({"request_id": rid, "task_id": rid, "steps": req["trajectory"],
                    "label": success_label(fb, success_rating), "rule_success": req.get("success"),
                    "source": "feedback"})
    return out


__all__ = ["EPISODES", "OPEN", "SEALED", "SEGMENT_NAME", "labelled_episodes", "read_records", "segment_files", "success_label",
           "utc_now"]
