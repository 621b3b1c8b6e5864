"""Phases killed at a random point of their work: the rerun gives the uninterrupted result.

`adapt`, `reward_model`, `evaluate` and `check_drift` each run as `agentrl <phase>` in a tiny project (the one of
tests/test_flow.py: this repository's code and graph with tiny params, its own git and DVC) and get SIGKILL, to the
whole process group (the command and any child it started, as a container stop or a killed job does), at a point
drawn from a seeded generator: a fraction between 0.1 and 0.7 of the phase's own uninterrupted time, counted from the
moment the phase holds the repository lock (it has read and checked its params and is doing its work). The test
asserts that the process died of the signal (not that it finished first), that nothing half-written is visible (each
output is absent, as DVC leaves it before a stage runs, or whole), and that the rerun publishes what the
uninterrupted run published: model folders byte for byte, metrics files figure for figure (timings and memory peaks
aside).

The uninterrupted runs are the reference project, built once per test run (tests/shared_builds.py; the
tracking-server test of tests/test_outages.py reads it too): build_env, adapt, reward_model, then
evaluate and check_drift with ``models/policy`` a copy of ``models/adapted`` (training is tested for its own kill and
resume in tests/test_train.py; what is tested here is the kill, not the policy). Each phase's time under the lock is
measured there and the kill point is a fraction of it, so a slower machine moves the point with it. `build_env` (under
`agentrl run`) is in tests/test_faults.py, `deploy` at each registry write in tests/test_deploy_kill.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
# phase -> (command, what it publishes)
PHASES = {
    "adapt": ("adapt", ("models/adapted", "metrics/adapt.json")),
    "reward_model": ("reward-model", ("models/reward_model", "metrics/reward_model.json")),
    "evaluate": ("evaluate", ("metrics/evaluate.json", "metrics/evaluate_success.csv")),
    "check_drift": ("check-drift", ("metrics/drift.json",)),
}
VOLATILE = {"seconds", "peak_rss_mib"}  # keys of a metrics file that measure the run, not its result


def env_of(root: Path) -> dict[str, str]:
    from test_flow import clean_env

    return {**clean_env(root), "AGENTRL_TRACKING": "off", "PYTHONWARNINGS": "ignore"}


def holds_lock(root: Path, pid: int) -> bool:
    from pipeline.core.lock import lock_path, read_holder

    try:
        return read_holder(lock_path(root)).get("pid") == pid
    except (OSError, ValueError):
        return False


def run_phase(root: Path, command: str, kill_after: float | None = None) -> tuple[int, float, str]:
    """`agentrl <command>` in `root`: its exit status, the seconds from taking the repository lock to its end (or
    to the kill), its output. With `kill_after`, SIGKILL to its process group that many seconds after it took the
    lock."""
    log = root.parent / f"{root.name}-{command}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "agentrl"), command], cwd=root, env=env_of(root), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while not holds_lock(root, proc.pid) and proc.poll() is None:
                assert time.monotonic() < deadline, f"agentrl {command} did not take the lock within 600 s"
                time.sleep(0.02)
            started = time.monotonic()
            if kill_after is not None:
                while proc.poll() is None and time.monotonic() - started < kill_after:
                    time.sleep(0.01)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return proc.returncode, time.monotonic() - started, log.read_text()


def stable(obj):
    """A metrics file's content without what measures the run (times, memory, throughput)."""
    if isinstance(obj, dict):
        return {k: stable(v) for k, v in obj.items() if k not in VOLATILE and not k.endswith("_per_s")}
    if isinstance(obj, list):
        return [stable(v) for v in obj]
    return obj


def published(root: Path, path: str):
    """What the output `path` holds: a folder's files (sha256 by name, hidden temporaries of a killed writer left
    out), a JSON file's stable figures, another file's bytes; None when it is absent."""
    target = root / path
    if target.is_dir():
        return {p.relative_to(target).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(target.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    if not target.exists():
        return None
    if target.suffix == ".json":
        return stable(json.loads(target.read_text()))
    return target.read_bytes()


def remove(root: Path, path: str) -> None:
    target = root / path
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)


def build_reference(folder: Path) -> dict:
    """The tiny project in `folder`/reference after every phase ran once, uninterrupted: each phase's seconds under
    the lock."""
    from test_flow import make_project

    root = make_project(folder / "reference")
    seconds = {}
    for phase in ("build_env", "adapt", "reward_model", "evaluate", "check_drift"):
        if phase == "evaluate":  # the policy to evaluate and watch: the adapted one (train is not what is tested)
            shutil.copytree(root / "models" / "adapted", root / "models" / "policy")
        command = PHASES[phase][0] if phase in PHASES else "build-env"
        rc, seconds[phase], out = run_phase(root, command)
        assert rc == 0, out[-4000:]
    return {"seconds": seconds}


@pytest.fixture(scope="module")
def reference():
    """The reference project (read only: a test copies it) and each phase's seconds under the lock; built once per
    test run for this module and tests/test_outages.py (tests/shared_builds.py)."""
    from shared_builds import built_once

    folder, facts = built_once("kills-reference", build_reference)
    return folder / "reference", facts["seconds"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_a_phase_killed_at_a_random_point_reruns_to_the_uninterrupted_result(phase, reference, tmp_path):
    ref, seconds = reference
    command, outs = PHASES[phase]
    root = tmp_path / "project"
    shutil.copytree(ref, root, symlinks=True, ignore=shutil.ignore_patterns(".agentrl"))
    expected = {path: published(ref, path) for path in outs}
    assert all(v is not None for v in expected.values()), expected.keys()
    for path in outs:  # as DVC leaves a stage's outputs before it runs the stage
        remove(root, path)

    fraction = random.Random(f"kill {phase}").uniform(0.1, 0.7)
    rc, ran, out = run_phase(root, command, kill_after=fraction * seconds[phase])
    assert rc == -signal.SIGKILL, (f"agentrl {command} was to be killed {fraction:.2f} of the way through its "
                                   f"{seconds[phase]:.1f} s, and ended with {rc} after {ran:.1f} s:\n{out[-3000:]}")
    for path in outs:  # nothing half-written is visible: each output is absent or whole
        assert published(root, path) in (None, expected[path]), path

    rc, _, out = run_phase(root, command)
    assert rc == 0, out[-4000:]
    for path in outs:
        assert published(root, path) == expected[path], path
