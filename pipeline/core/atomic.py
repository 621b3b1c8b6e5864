"""Atomic writes: every output file and folder of a phase appears whole or not at all.

A phase can die at any instant (SIGKILL, the OOM killer, a full disk). Each writer here builds its output beside the
target, in the same folder (so on the same file system), and swaps it in with :func:`os.replace` / ``rename``, which
POSIX makes atomic: a reader, DVC, or a rerun sees either the previous file or the complete new one, never a prefix.
A temporary name starts with ``.`` and carries the writer's pid, so two writers never share one and a leftover from a
killed process is a hidden file the next successful write of that target ignores (and that `.dvcignore`-style globs
skip). Files are flushed and fsynced before the rename, so the rename never publishes data still in the page cache.

A write that fails because the disk (or the process's file-size limit, or a quota) is full raises
:class:`DiskFullError`, an :class:`~pipeline.core.errors.AgentRLError` naming the path, after removing its temporary
file: the CLI prints one ``error:`` line and the previous output stays as it was. :func:`disk_errors` gives the same
treatment to a block that writes through libraries (SQLite, safetensors, ``torch.save``) into a staging folder.

Deliberately left out: fsync of the containing folder after the rename (it makes the rename itself survive a power
cut, which no test here can produce, at the cost of a sync per file); file locking (DVC and the flow run one writer
per output).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from pipeline.core.errors import AgentRLError

# errno values that mean "no room left" rather than "this path is wrong": a full disk, the process's file-size limit
# (RLIMIT_FSIZE, as `ulimit -f` sets it), an exhausted quota.
DISK_ERRNOS = {errno.ENOSPC: "disk full", errno.EFBIG: "file too large", errno.EDQUOT: "disk quota exceeded"}
# Libraries that are not Python report the same conditions in their own words: Rust's io::Error (safetensors,
# tokenizers) as "(os error N)", SQLite by its result codes SQLITE_FULL and SQLITE_IOERR_WRITE, and torch's zip
# writer (``torch.save``, which DeepSpeed's checkpoints go through) as a RuntimeError without an errno: the C++ stream
# that failed ("basic_ios::clear: iostream error"), then the archive that came out shorter than written ("unexpected
# pos N vs M"), or "PytorchStreamWriter failed writing file ...: file write failed".
_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_TORCH_WRITE = re.compile(r"unexpected pos \d+ vs \d+|basic_ios::clear: iostream error|PytorchStreamWriter failed "
                          r"writing|file write failed")
WRITE_FAILED = "write failed (disk full, file too large or a failing disk)"  # a writer that does not say which


class DiskFullError(AgentRLError):
    """A write failed for lack of space (or the file-size limit); the message names the path, the previous output is
    unchanged."""


def disk_problem(exc: BaseException) -> str | None:
    """What `exc` (or an exception it was raised from or while handling) says about the disk ("disk full", "file too
    large", ...) when it is a failed write for lack of room, else None. Call it on a write's failure only: torch's
    failed writes carry no errno, so any of them counts (:data:`WRITE_FAILED`)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:  # torch.save into a Python file: the OSError is context
        seen.add(id(current))
        problem = _own_disk_problem(current)
        if problem is not None:
            return problem
        current = current.__cause__ or current.__context__
    return None


def _own_disk_problem(exc: BaseException) -> str | None:
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return DISK_ERRNOS[exc.errno]
    if isinstance(exc, sqlite3.OperationalError):  # SQLite keeps the errno to itself; its result code tells
        code = getattr(exc, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL:
            return DISK_ERRNOS[errno.ENOSPC]
        if code == sqlite3.SQLITE_IOERR_WRITE:  # what a write past the file-size limit (EFBIG) becomes
            return WRITE_FAILED
    if isinstance(exc, RuntimeError) and _TORCH_WRITE.search(str(exc)):
        return WRITE_FAILED
    m = _OS_ERROR.search(str(exc))
    if m and int(m.group(1)) in DISK_ERRNOS:
        return DISK_ERRNOS[int(m.group(1))]
    return None


def _disk_full(path: Path, problem: str) -> DiskFullError:
    return DiskFullError(f"{path}: cannot write it: {problem}; the previous version, if any, is unchanged")


@contextlib.contextmanager
def disk_errors(path: str | Path) -> Iterator[None]:
    """Turn a disk-full failure inside the block into a :class:`DiskFullError` naming `path` (what was being
    written); any other exception passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a disk-full failure
        problem = disk_problem(exc)
        if problem is None:
            raise
        raise _disk_full(Path(path), problem) from None


def check_target(path: str | Path, *, folder: bool = False) -> Path:
    """Refuse, before anything is computed or written, an output path that cannot be written: a folder where a file
    is to go (or a file where a folder is to go), or a parent that is a file. :class:`AgentRLError` naming it."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise AgentRLError(f"{path}: is a {'file' if folder else 'folder'}; the output is a "
                           f"{'folder' if folder else 'file'} (give another path)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise AgentRLError(f"{path}: cannot be written, {parent} is a file, not a folder")
            break
    return path


def _tmp_name(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, newline: str | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing (`mode` "w" or "wb"); on a clean exit it is fsynced and
    renamed onto `path`; on an exception it is removed and `path` is untouched."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path, "tmp")
    try:
        with disk_errors(path):
            with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": newline})) as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    with atomic_open(path) as fh:
        fh.write(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_open(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2, default: Callable | None = None) -> Path:
    """`obj` as JSON (keys sorted, a final newline), atomically: the format of every metrics file."""
    return write_text(path, json.dumps(obj, indent=indent, sort_keys=True, default=default) + "\n")


def write_jsonl(path: str | Path, records: Any) -> Path:
    """One JSON object per line (keys sorted), atomically."""
    with atomic_open(path) as fh:
        for rec in records:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
    return Path(path)


def replace_dir(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Build a folder with ``write(tmp)`` beside `path`, then swap it in by renames: `path` holds either the old
    folder or the complete new one, never a half-written one.

    Between the two renames (old folder aside, new one in) `path` is briefly absent; a process killed exactly there
    leaves the old folder under a hidden ``.NAME.old-*`` name and no `path`, which a rerun of the phase rebuilds (and
    DVC restores from its cache). A failure of `write` removes the temporary folder and leaves `path` as it was; a
    disk-full failure is a :class:`DiskFullError` naming `path`."""
    path = check_target(path, folder=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = _tmp_name(path, "tmp"), _tmp_name(path, "old")
    try:
        with disk_errors(path):
            write(tmp)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            old.rename(path)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


__all__ = ["DISK_ERRNOS", "WRITE_FAILED", "DiskFullError", "atomic_open", "check_target", "disk_errors", "disk_problem",
           "replace_dir", "write_bytes", "write_json", "write_jsonl", "write_text"]
