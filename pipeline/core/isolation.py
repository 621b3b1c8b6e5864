"""Run a part of a phase in a child process, so that the memory it leaves behind goes back to the OS when it ends.

Why: a PyTorch training loop on the CPU leaves its process's resident size far above its live tensors (glibc keeps
the fragmented heap; :func:`pipeline.policy.model.release_free_memory` returns only the free pages at the top of
each arena). In adapt, continued pre-training left the process at a high-water mark of 1,961 MiB and SFT then grew
it to 3,764 MiB (pipeline run 14), while SFT alone from a fresh process peaks far lower. A child process's pages
are all returned when it exits, whatever holds them.

The child is started with ``spawn`` (a fresh interpreter: no copy of the parent's heap, no threads inherited from a
fork), so the function and its arguments must be picklable and importable by module path; the result comes back
pickled. Both cross as plain pickled bytes: handed to ``multiprocessing`` as objects, torch tensors would instead be
moved into shared memory (``/dev/shm``, 64 MiB in a default Docker container), the parent's own parameters included,
and the child would then write into the parent's model. An exception raised in the child is raised again in the parent with its type; a child that dies without
one (killed, out of memory) becomes an :class:`~pipeline.core.errors.AgentRLError` naming the part.

The child does not outlive its parent: a parent stopped by a signal (``kill``, Ctrl-C of a whole run, a scheduler's
timeout) gets no chance to shut the pool down, and its child used to go on training on every core until it finished,
with nobody to read its result. The child watches its parent (:func:`_end_with_parent`: the kernel's parent-death
signal on Linux, and a thread that polls the parent's pid everywhere) and exits when the parent is gone.

Memory accounting: while the child runs, the parent waits and keeps its own pages, so the process tree's peak is
at least the parent's resident size when the child started plus the child's own high-water mark.
:func:`tree_peak_mib` reports the larger of that sum (over every child run so far) and this process's high-water
mark; the stage's recorded peak (``flows.cli``) and ``metrics/adapt.json`` use it, so moving work into a child
cannot hide memory from the figures.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from pipeline.core.errors import AgentRLError

_KIB = 1 if sys.platform != "darwin" else 1 / 1024  # ru_maxrss is KiB on Linux, bytes on macOS
_tree_peak_mib = 0.0  # the largest parent-resident-plus-child-peak sum seen in this process


def self_peak_mib() -> float:
    """This process's high-water resident size so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB / 1024


def children_peak_mib() -> float:
    """The largest high-water resident size of any descendant this process has waited for, in MiB (one process's,
    not a sum: ``RUSAGE_CHILDREN``)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * _KIB / 1024


def current_rss_mib() -> float:
    """This process's resident size now, in MiB (``VmRSS``); its high-water mark where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return self_peak_mib()


def child_runs_peak_mib() -> float:
    """The largest sum, over the :func:`run_in_child` calls so far, of this process's resident size when the child
    started and the child's own peak, in MiB; 0 before any."""
    return _tree_peak_mib


def tree_peak_mib() -> float:
    """Peak resident size of this process together with the children run through :func:`run_in_child`, in MiB."""
    return max(self_peak_mib(), _tree_peak_mib)


def _own_peak_mib() -> float:
    """The child's own high-water resident size (``VmHWM``). Not ``ru_maxrss``: Linux carries the high-water mark of
    the forked image across ``exec``, so a spawned child's ``ru_maxrss`` starts at its parent's resident size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return self_peak_mib()


PARENT_POLL_S = 0.5  # how often a child checks that its parent is still there


def _end_with_parent(parent_pid: int) -> None:
    """The child pool's initializer: exit as soon as the process that started it (`parent_pid`) is gone."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed with the parent
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    if os.getppid() != parent_pid:  # the parent was gone before the signal was asked for
        os._exit(1)
    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def _call(payload: bytes) -> tuple[bytes, float]:
    fn, args, kwargs = pickle.loads(payload)
    return pickle.dumps(fn(*args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL), _own_peak_mib()


def run_in_child(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned child process; returns its result. `what` names the part in errors."""
    global _tree_peak_mib
    parent_mib = current_rss_mib()
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise AgentRLError(f"{what}: cannot be sent to a child process ({type(exc).__name__}: {exc})") from None
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_end_with_parent, initargs=(os.getpid(),)) as pool:
        try:
            result, child_peak = pool.submit(_call, payload).result()
        except BrokenProcessPool:
            raise AgentRLError(f"{what}: its child process ended without a result (killed, for example by the kernel "
                               f"when memory ran out)") from None
        except BaseException:  # interrupted (Ctrl-C; `agentrl` turns SIGTERM into the same): the child stops too,
            for proc in list((getattr(pool, "_processes", None) or {}).values()):  # or leaving the pool would
                proc.kill()                                                          # wait for it to finish
            raise
    _tree_peak_mib = max(_tree_peak_mib, parent_mib + child_peak)
    return pickle.loads(result)


__all__ = ["child_runs_peak_mib", "children_peak_mib", "current_rss_mib", "run_in_child", "self_peak_mib",
           "tree_peak_mib"]
