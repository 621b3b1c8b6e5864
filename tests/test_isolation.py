"""pipeline.core.isolation: a part of a phase run in a spawned child process, its errors and its memory accounting."""

from __future__ import annotations

import os

import pytest

from pipeline.core import isolation
from pipeline.core.errors import AgentRLError


def _fill(mib: int) -> int:
    block = b"\x01" * (mib * 2**20)  # written, so every page is resident
    return len(block) // 2**20


def _refuse(path: str) -> None:
    raise AgentRLError(f"{path}: line 3 is not JSON")


def _die() -> None:
    os._exit(3)


def test_the_result_comes_back_and_the_child_memory_counts_on_top_of_the_parent(monkeypatch):
    # the figure is a maximum over this process's child runs: start from none (earlier tests, such as adapt's, ran
    # children while this process was larger)
    monkeypatch.setattr(isolation, "_tree_peak_mib", 0.0)
    assert isolation.child_runs_peak_mib() == 0.0
    before = isolation.current_rss_mib()
    assert isolation.run_in_child("filling", _fill, 300) == 300
    # the parent's pages while the child ran, plus the child's own 300 MiB block and its interpreter (tens of MiB);
    # the bound above keeps the figure from being anything larger, such as this process's own high-water mark
    counted = isolation.child_runs_peak_mib()
    assert before + 300 <= counted < before + 300 + 200
    assert isolation.tree_peak_mib() == max(counted, isolation.self_peak_mib())


def test_an_error_in_the_child_is_raised_again_with_its_type_and_message():
    with pytest.raises(AgentRLError, match="tasks.jsonl: line 3 is not JSON"):
        isolation.run_in_child("reading", _refuse, "tasks.jsonl")


def test_a_child_that_dies_without_a_result_is_a_clear_error_naming_the_part():
    with pytest.raises(AgentRLError, match="adapt: continued pre-training: its child process ended without a result"):
        isolation.run_in_child("adapt: continued pre-training", _die)


def _double_in_place(t):
    t.mul_(2)
    return t


def test_tensors_cross_as_copies_and_the_parent_keeps_its_own():
    """Not through shared memory: the child's in-place writes stay in the child, and the parent's storage is not moved
    to /dev/shm (where a container may have little room)."""
    import torch

    t = torch.arange(4.0)
    back = isolation.run_in_child("doubling", _double_in_place, t)
    assert torch.equal(back, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert torch.equal(t, torch.arange(4.0)) and not t.is_shared()


def test_arguments_that_cannot_cross_to_a_child_are_a_clear_error_before_any_child_starts():
    with pytest.raises(AgentRLError, match=r"pre-training \(set it off\): cannot be sent to a child process"):
        isolation.run_in_child("pre-training (set it off)", _fill, lambda: 1)


def test_a_commands_recorded_stage_peak_counts_its_child_runs(tmp_path, monkeypatch, capsys):
    """What `agentrl <command>` appends to AGENTRL_STAGE_TIMES (the flow's per-stage peak) includes the parts it ran
    in child processes on top of its own pages."""
    import json
    from pathlib import Path

    from flows import cli
    isolation.run_in_child("filling", _fill, 300)
    times = tmp_path / "times.jsonl"
    monkeypatch.setenv(cli.STAGE_TIMES_ENV, str(times))
    assert cli.main(["stages", "--dvc-yaml", str(Path(__file__).resolve().parents[1] / "dvc.yaml")]) == 0
    record = json.loads(times.read_text())
    assert record["command"] == "stages" and record["rc"] == 0
    assert record["peak_rss_mib"] >= round(isolation.child_runs_peak_mib(), 1) > 300


def _sleep_forever(pid_file: str) -> None:
    import time
    from pathlib import Path

    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "interrupted"])
def test_the_child_ends_when_its_parent_is_killed(tmp_path, how):
    """A parent stopped by a signal cannot shut its pool down: the child must notice and exit on its own, not go on
    computing on every core with nobody to read its result. A parent interrupted (KeyboardInterrupt: Ctrl-C, or
    SIGTERM under `agentrl`, which turns it into one) stops its child and exits at once, instead of waiting for the
    child to finish its work as leaving the pool would."""
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_isolation as t; "
            "from pipeline.core import isolation; isolation.run_in_child('sleeping', t._sleep_forever, sys.argv[2])")
    if how == "interrupted":
        code = "import signal; signal.signal(signal.SIGTERM, signal.default_int_handler); " + code
    parent = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__), str(pid_file)])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "the child never started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        os.kill(child, 0)  # running
        parent.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the child {child} outlived its parent killed by {how}")
    finally:
        parent.kill()
