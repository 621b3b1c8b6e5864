"""Builds that several test modules read, made once per test run and shared by its xdist workers.

A whole-phase setup (a tiny project through build_env, adapt and reward_model; an uninterrupted training run) costs
tens of seconds, and a module-scoped fixture builds it once per *module*: two modules that need the same one built it
twice, on two workers. `built_once(name, build)` builds it once per *run*: the first process to ask builds it in the
run's shared folder (``AGENTRL_TEST_SHARED``, set by tests/conftest.py in the process that starts the run and
inherited by its workers) while holding an flock on ``<name>.lock``; a process that asks meanwhile waits on the lock
and then reads the finished build. A build that fails leaves no ``done`` mark: the next process to ask builds it again
(and fails the same way, in its own test), so a failure is never read as a build.

What `built_once` returns is shared and must stay as it is: a test that changes files copies the folder first
(``shutil.copytree(..., symlinks=True)``), as tests/test_kills.py does. Only setup is shared: a test about a phase
still runs that phase itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def shared_folder() -> Path:
    """The run's shared folder (tests/conftest.py); a temporary one when a test module is imported outside pytest."""
    folder = os.environ.get("AGENTRL_TEST_SHARED")
    if not folder:
        folder = os.environ["AGENTRL_TEST_SHARED"] = tempfile.mkdtemp(prefix="agentrl-test-shared-")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies while building
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def built_once(name: str, build: Callable[[Path], dict | None]) -> tuple[Path, dict]:
    """The folder `name` in the run's shared folder, made by `build(folder)` by the first process that asks; the
    JSON-able dict `build` returns (facts about the build, such as timings) comes back with it to every caller."""
    base = shared_folder()
    out, done = base / name, base / f"{name}.done.json"
    with _locked(base / f"{name}.lock"):
        if not done.is_file():
            if out.exists():  # what an earlier, failed build left
                shutil.rmtree(out)
            out.mkdir(parents=True)
            facts = build(out) or {}
            done.write_text(json.dumps(facts))
    return out, json.loads(done.read_text())
