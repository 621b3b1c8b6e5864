"""How an ``agentrl`` command takes the signals that stop it.

A SIGTERM (``kill``, a scheduler, a container stopping) ends a command as Ctrl-C does: as KeyboardInterrupt, so
context managers release the repository lock and the exit handlers run. Without it, Python dies at once and the
temporary Prefect server that ``agentrl run`` starts (an uvicorn child stopped by an exit handler) stays behind.

A stage of ``agentrl run`` is stopped with SIGINT (:func:`flows.pipeline_flow.stop_stage`). A shell starts a script's
background commands (``agentrl run &``) with SIGINT ignored and their children inherit that, so the stage ran on until
the run killed it a minute later: a stage command takes SIGINT back. Any other command leaves SIGINT as it found it.

A handler the host process installed is kept; only the main thread can install one. Everything changed is put back
when the command ends (:func:`restore`), so a process that calls ``flows.cli.main`` keeps its own handling.
"""

from __future__ import annotations

import signal
import threading


def interrupt_on_stop(stage: bool) -> dict:
    """Turn SIGTERM (and, for a stage of a run, an ignored SIGINT) into KeyboardInterrupt; returns what to restore."""
    changed: dict = {}
    if threading.current_thread() is not threading.main_thread():
        return changed
    if stage and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        changed[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        changed[signal.SIGTERM] = signal.signal(signal.SIGTERM, signal.default_int_handler)
    return changed


def restore(changed: dict) -> None:
    """Put back the handlers :func:`interrupt_on_stop` replaced."""
    for signum, handler in changed.items():
        signal.signal(signum, handler)
