"""`agentrl` stopped with SIGTERM ends as Ctrl-C ends it: one "interrupted" line, exit 130, and the process's exit
handlers run (the temporary Prefect server of `agentrl run` is stopped by one; without them it stays behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a command that registers an exit handler (as Prefect does for its temporary server), says it is ready and waits
SLEEPER = """
import atexit, sys, time
from pathlib import Path
from flows import cli
from flows.commands import Command

def wait(args):
    atexit.register(lambda: Path(sys.argv[1]).write_text("stopped"))
    print("ready", flush=True)
    time.sleep(600)
    return 0

cli.COMMANDS["wait"] = Command("wait", "wait", "wait", run=wait, arguments=(), passes=())
sys.exit(cli.main(["wait"]))
"""


def test_sigterm_interrupts_a_command_and_runs_its_exit_handlers(tmp_path):
    marker = tmp_path / "exit-handler-ran"
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, str(marker)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert marker.read_text() == "stopped"


# starts the rest of its command line with SIGINT ignored, as a shell starts a script's background command
IGNORING_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def _sleeper_ignoring_sigint(marker: Path, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", IGNORING_SIGINT, "-c", SLEEPER, str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_stage_started_with_sigint_ignored_still_stops_on_the_runs_sigint(tmp_path):
    """`agentrl run` stops its running stage with SIGINT. Started in the background of a script, the run and every
    stage command inherit SIGINT ignored; a stage command (the run sets AGENTRL_STAGE_TIMES for it) takes SIGINT
    back (flows/stop_signals.py), so it ends at once as interrupted instead of being killed a minute later. Any other
    command keeps it ignored."""
    from flows.cli import STAGE_TIMES_ENV

    marker = tmp_path / "exit-handler-ran"
    proc = _sleeper_ignoring_sigint(marker, {STAGE_TIMES_ENV: str(tmp_path / "times.jsonl")})
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert marker.read_text() == "stopped"

    other = _sleeper_ignoring_sigint(tmp_path / "other", {})
    try:
        other.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):  # ignored, as the shell asked
            other.communicate(timeout=2)
        other.send_signal(signal.SIGTERM)
        other.communicate(timeout=60)
    finally:
        other.kill()
    assert other.returncode == 130


def test_a_process_that_calls_main_gets_its_sigterm_handling_back():
    import signal as sig

    from flows import cli

    assert sig.getsignal(sig.SIGTERM) == sig.SIG_DFL
    cli.main(["envs"])
    assert sig.getsignal(sig.SIGTERM) == sig.SIG_DFL


def test_a_process_that_calls_main_as_a_stage_gets_its_sigint_ignored_again(monkeypatch, tmp_path):
    """A test process (or any host) that ignores SIGINT and calls main with the stage variable set gets SIGINT back
    as it was: what it starts afterwards still inherits it ignored."""
    from flows import cli

    monkeypatch.setenv(cli.STAGE_TIMES_ENV, str(tmp_path / "times.jsonl"))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        cli.main(["envs"])
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
