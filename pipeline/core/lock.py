"""One writer per repository: the lock that `agentrl run`, every stage command, `promote` and `rollback` take.

Two commands that write the same repository's outputs at once interleave their writes: two `agentrl run` raced on
DVC's own lock, and the second failed with DVC's text naming a stage that was not the busy one; `agentrl promote`
during a deploy could judge a version whose aliases were still moving. :func:`repo_lock` takes an exclusive
``fcntl.flock`` on ``<root>/.agentrl/lock`` (ignored by git), writes who holds it (command, pid, host, start time)
into the file, and refuses a second taker at once with one :class:`LockHeld` line naming the holder: the CLI prints
it as ``error: ...`` and exits 2. Refusing rather than waiting is deliberate: a run takes from minutes to hours, and a
command that silently waits that long looks hung; the message says what to wait for.

Nested commands: the holder exports its token in ``AGENTRL_LOCK``; the stage commands that the pipeline flow
launches (``dvc repro`` -> ``agentrl <stage>``) inherit it and find the same token in the lock file, so they run
inside their parent's lock instead of deadlocking on it. A token whose holder is gone (the lock is free again)
counts for nothing: the command then takes the lock itself.

A holder that dies, even by SIGKILL, releases the lock with its process: the kernel drops an flock when the last file
descriptor of it closes, so no stale lock is left to clear by hand (the file keeps the last holder's text, which only
a refused command reads, and only while the lock is held). The descriptor is not inherited by child processes
(Python's default), so a child that outlives its parent does not hold the lock on.

Scope: one repository (the folder of the params.yaml a command reads) on one host's file system. Two repositories
sharing one MLflow registry are not serialised by it (their alias moves are, by the registry lease kept in the
registry itself: pipeline.deploy.lease), nor are flock-less network file systems.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from pipeline.core.errors import AgentRLError

LOCK_PATH = Path(".agentrl") / "lock"
LOCK_ENV = "AGENTRL_LOCK"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal still exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LockHeld(AgentRLError):
    """Another command holds the repository's lock; `holder` is what it wrote into the lock file."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


def lock_path(root: str | Path) -> Path:
    return Path(root).resolve() / LOCK_PATH


def read_holder(path: str | Path) -> dict:
    """What the holder wrote into the lock file; {} while it is still writing it (or never did)."""
    try:
        doc = json.loads(Path(path).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def describe(holder: dict) -> str:
    if not holder:
        return "a command that is just starting"
    return (f"`agentrl {holder.get('command', '?')}` (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
            f"started {holder.get('started', '?')})")


@contextlib.contextmanager
def repo_lock(root: str | Path, command: str) -> Iterator[dict]:
    """Hold the repository lock of `root` for the block; `command` names the holder in the refusal others get.

    Yields the holder's record (``command``, ``pid``, ``host``, ``started``, ``token``); inside a holder's lock (a
    stage launched by the flow, see the module docstring) it yields the holder's record and takes nothing. Raises
    :class:`LockHeld` at once when another command holds it."""
    path = lock_path(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise AgentRLError(f"cannot open the repository lock {path} ({exc.strerror}); the repository must be "
                           f"writable for a command that writes its outputs") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(path)
            inherited = os.environ.get(LOCK_ENV)
            if inherited and holder.get("token") == inherited:
                yield holder  # a command launched inside the holder's run
                return
            raise LockHeld(f"this repository is locked by {describe(holder)} ({path}); it writes the same outputs or "
                           f"registry aliases, so `agentrl {command}` is refused: run it again when that one has "
                           f"finished", holder) from None
        holder = {"command": command, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "token": f"{os.getpid()}-{uuid.uuid4().hex}"}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder, sort_keys=True) + "\n").encode(), 0)
        before = os.environ.get(LOCK_ENV)
        os.environ[LOCK_ENV] = holder["token"]  # the stage commands this one launches inherit it
        try:
            yield holder
        finally:
            if before is None:
                os.environ.pop(LOCK_ENV, None)
            else:
                os.environ[LOCK_ENV] = before
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


__all__ = ["LOCK_ENV", "LOCK_PATH", "LockHeld", "describe", "lock_path", "read_holder", "repo_lock"]
