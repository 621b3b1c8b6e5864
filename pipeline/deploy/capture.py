"""Capture of served traffic: each request `agentrl serve` answers, and the feedback callers send on it, appended to
segments in one folder (``deploy.serve.capture``).

Records (one JSON object per line):

- ``{"kind": "request", "request_id", "time", "model_uri", "model_version", "model_alias", "request", "seed",
  "outcome", "error", "answer", "success", "trajectory", "calls", "n_calls", "n_violations", "truncated", "cached",
  "batch_size", "latency_ms"}``: ``request`` is the task as the caller sent it, ``outcome`` "answered" (a 200) or
  "model_failure" (a 500: ``error`` says why, the episode fields are null), ``trajectory`` the episode's ``steps``
  (each ``{"action", "observation"}``), ``calls`` its call log (tool, parameters, outcome), ``success`` None when the
  request carried no ground truth, ``role`` "champion", or "challenger" for a canary's answer;
- ``{"kind": "shadow", ...}``: the same fields for the answer of the other model to a copy of a request (a shadow
  challenger's, or the champion's to a canary request), never returned to a caller, with the caller's
  ``request_id`` and the ``role`` of the model that played it (:mod:`pipeline.deploy.live`);
- ``{"kind": "feedback", "request_id", "time", "rating", "label", "text"}`` (:mod:`pipeline.deploy.feedback`).

Segments. The writer appends to ``<start>-<pid>-<n>.jsonl.open`` and renames it to ``<start>-<pid>-<n>.jsonl``
(sealed) once it holds ``segment_max_bytes`` or has been open ``segment_max_s``, and when the server stops. Each
record is one ``os.write`` of a whole line on a file opened with ``O_APPEND``, made before the answer is returned:
a process killed at any instant (SIGKILL included) leaves only whole lines, and every answered request is in the
page cache, so nothing a caller has seen is lost; only the request in flight (not yet answered) is. The next start
seals what a dead writer left open, cutting a partial last line should one exist (a machine that lost power may
leave one: records are not fsynced one by one, which would cost a disk flush per request; a segment is fsynced when
it is sealed).

Redaction (``capture.redact``): before a record is written, the value of every key named there is replaced by
``"[redacted]"`` at any depth (request fields, tool-call parameters, feedback fields), and each such string value of
4 characters or more is also scrubbed from every other string of the record, so a name copied into a question, an
action or an observation goes too. Shorter values are only replaced where they stand: scrubbing a 2-character value
from all text would destroy the record and protect nothing.

Retention: at start and at each seal, sealed segments whose last write is older than ``retention_days`` are deleted,
then the oldest ones while the folder holds more than ``retention_bytes``.

Deliberately left out: compression, and a remote store (ship sealed segments with the tool of the platform: a sealed
segment never changes, so any copier is safe).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from pipeline.core.errors import AgentRLError
from pipeline.core.traffic import OPEN, SEALED, SEGMENT_NAME, read_records, segment_files, utc_now
from pipeline.core.lock import pid_alive

REDACTED = "[redacted]"
MIN_SCRUB_CHARS = 4


# ------------------------------------------------------------------------------------------------------- redaction
class Redactor:
    """Replace the values of the named fields, and scrub their string values from every other string of a record.

    >>> Redactor(["email"]).redact({"request": {"question": "mail bob@x.org", "email": "bob@x.org"}})
    {'request': {'question': 'mail [redacted]', 'email': '[redacted]'}}
    >>> Redactor([]).redact({"a": 1})
    {'a': 1}
    """

    def __init__(self, fields: Iterable[str]):
        self.fields = frozenset(fields)

    def redact(self, record: dict) -> dict:
        if not self.fields:
            return record
        found: set[str] = set()
        out = self._replace(record, found)
        needles = sorted({v for f in found for v in (f, json.dumps(f)[1:-1])}, key=len, reverse=True)
        return self._scrub(out, needles) if needles else out

    def _replace(self, obj, found: set):
        if isinstance(obj, dict):
            out = {}
            for k, v in obj.items():
                if k in self.fields:
                    self._collect(v, found)
                    out[k] = REDACTED
                else:
                    out[k] = self._replace(v, found)
            return out
        if isinstance(obj, list):
            return [self._replace(v, found) for v in obj]
        return obj

    def _collect(self, value, found: set) -> None:
        if isinstance(value, (dict, list)):
            for v in value.values() if isinstance(value, dict) else value:
                self._collect(v, found)
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            text = str(value)
            if len(text) >= MIN_SCRUB_CHARS:
                found.add(text)

    def _scrub(self, obj, needles: list[str]):
        if isinstance(obj, str):
            for n in needles:
                if n in obj:
                    obj = obj.replace(n, REDACTED)
            return obj
        if isinstance(obj, dict):
            return {k: self._scrub(v, needles) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._scrub(v, needles) for v in obj]
        return obj


# -------------------------------------------------------------------------------------------------------- segments
def check_folder(cfg) -> Path:
    """The capture folder, created when missing; an AgentRLError naming it when it cannot be created or written
    (`agentrl serve` checks it before the model loads)."""
    folder = Path(cfg.dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise AgentRLError(f"serve: cannot create the capture folder {folder} (deploy.serve.capture.dir): "
                           f"{exc.strerror or exc}") from None
    return folder


class CaptureStore:
    """The writer of one server process (see the module docstring); ``append`` is safe from any thread."""

    def __init__(self, cfg, clock=time.time):
        self.cfg, self.clock = cfg, clock
        self.dir = check_folder(cfg)
        self.redactor = Redactor(cfg.redact)
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.path: Path | None = None
        self.seq, self.size, self.opened = 0, 0, 0.0
        self.recover()
        self.enforce_retention()
        self.known = {r["request_id"] for r in read_records(self.dir, "request") if "request_id" in r}

    # -- writing
    def append(self, record: dict) -> None:
        """Redact and append one record as one line, sealing the segment first when it is full or old."""
        line = (json.dumps(self.redactor.redact(record), ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self.lock:
            now = self.clock()
            if self.fd is not None and (self.size >= self.cfg.segment_max_bytes
                                        or now - self.opened >= self.cfg.segment_max_s):
                self._seal()
                self.enforce_retention()
            if self.fd is None:
                self._open(now)
            view = memoryview(line)
            while view:  # a regular file takes the whole line unless the disk is full
                view = view[os.write(self.fd, view):]
            self.size += len(line)
            if record.get("kind") == "request":
                self.known.add(record["request_id"])

    def _open(self, now: float) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        while True:  # a name no segment has: another writer of this process (a restart) may have used it this second
            self.seq += 1
            self.path = self.dir / f"{stamp}-{os.getpid()}-{self.seq:06d}{OPEN}"
            if not self.path.exists() and not self.path.with_name(self.path.name[:-len(".open")]).exists():
                break
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size, self.opened = 0, now

    def _seal(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.path, self.path.with_name(self.path.name[:-len(".open")]))
        self.fd, self.path = None, None

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                self._seal()

    # -- recovery and retention
    def recover(self) -> None:
        """Seal the open segments of writers that are gone, cut to their last whole line (an empty one is removed)."""
        for path in segment_files(self.dir):
            m = SEGMENT_NAME.match(path.name)
            if not m.group(4) or pid_alive(int(m.group(2))):
                continue
            data = path.read_bytes()
            keep = data[:data.rfind(b"\n") + 1]
            if not keep:
                path.unlink()
                continue
            if len(keep) != len(data):
                with open(path, "r+b") as f:
                    f.truncate(len(keep))
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(path, path.with_name(path.name[:-len(".open")]))

    def enforce_retention(self) -> list[Path]:
        """Delete sealed segments past the age limit, then the oldest beyond the size limit; returns those deleted."""
        now, deleted = self.clock(), []
        sealed = [(p, p.stat()) for p in segment_files(self.dir, include_open=False)]
        kept = []
        for p, st in sealed:
            if now - st.st_mtime > self.cfg.retention_days * 86400:
                p.unlink(missing_ok=True)
                deleted.append(p)
            else:
                kept.append((p, st))
        total = sum(st.st_size for _, st in kept) + self.size
        for p, st in kept:
            if total <= self.cfg.retention_bytes:
                break
            p.unlink(missing_ok=True)
            deleted.append(p)
            total -= st.st_size
        return deleted


def request_record(request_id: str, request: dict, seed, result: dict, latency_s: float, cached: bool,
                   model: dict, error: str | None = None) -> dict:
    """The capture record of one request (`result`: the response without request_id; empty with an `error`)."""
    return {"kind": "request", "request_id": request_id, "time": utc_now(), **model, "request": request,
            "seed": seed, "outcome": "model_failure" if error else "answered", "error": error,
            "answer": result.get("answer"), "success": result.get("success"),
            "trajectory": result.get("trajectory"), "calls": result.get("calls"), "n_calls": result.get("n_calls"),
            "n_violations": result.get("n_violations"), "truncated": result.get("truncated"), "cached": cached,
            "batch_size": result.get("batch_size"), "latency_ms": round(latency_s * 1000.0, 3)}


def model_identity(model_uri: str) -> dict:
    """``{"model_uri", "model_version", "model_alias"}`` of a served URI: ``models:/name@alias`` resolved to its
    version in the registry now (the server loaded it moments before), ``models:/name/3`` read as version 3; other
    URIs, or a registry that cannot be asked, leave the version None."""
    m = re.match(r"\Amodels:/([^/@]+)(?:@([^/]+)|/(\d+))\Z", model_uri or "")
    out = {"model_uri": model_uri or None, "model_version": None, "model_alias": None}
    if m is None:
        return out
    name, alias, version = m.groups()
    out["model_alias"], out["model_version"] = alias, version
    if alias:
        try:
            from pipeline.deploy.registry import ModelRegistry

            out["model_version"] = ModelRegistry(name).alias_version(alias)
        except Exception:  # noqa: BLE001 - the record says "unknown" rather than the server refusing to start
            pass
    return out


__all__ = ["CaptureStore", "REDACTED", "Redactor", "check_folder", "model_identity", "request_record"]
