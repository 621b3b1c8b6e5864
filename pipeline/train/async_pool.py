"""The asynchronous rollout pool (docs/design.md §1.4): rollout threads that generate the next batch with a
snapshot of the weights while the learner trains on the current one.

It leaves out what a batch is for: the loop (:mod:`pipeline.train.loop`) decides when to sync the snapshot and drops
batches older than `train.max_staleness`; the learner corrects the rest with truncated importance weights.
"""

from __future__ import annotations

import copy
import queue
import threading
import time

import torch

from pipeline.envs.contract import TaskFields as Task


class AsyncRollouts:
    """Rollout threads that generate with a weight snapshot while the learner trains.

    The snapshot is one copy of the policy shared by `n_workers` threads, each with its own rollout engine and its
    share of the batch: decoding releases the GIL inside torch, and a slow tool (`env.tool_latency_s`) sleeps in one
    thread while the others decode, so tool latency overlaps with generation and with learning. `sync` copies the
    learner's weights into the snapshot between batches (never while one is being generated). Batches carry the
    snapshot's version, so the learner knows their staleness; the first snapshot is `version` (the updates `policy`
    has learned: 0, or where a resumed run starts), so a resumed run's first batch is as fresh as its policy.
    """

    def __init__(self, make_engine, policy: torch.nn.Module, n_workers: int = 1, version: int = 0):
        self.snapshot = copy.deepcopy(policy).eval()
        for p in self.snapshot.parameters():
            p.requires_grad_(False)
        self.version = version
        self.n = n_workers
        self.requests = [queue.Queue() for _ in range(n_workers)]
        self.results = [queue.Queue() for _ in range(n_workers)]
        self.threads = [threading.Thread(target=self._loop, args=(make_engine(self.snapshot), i), daemon=True,
                                         name=f"rollout-worker-{i}") for i in range(n_workers)]
        for t in self.threads:
            t.start()

    def _loop(self, engine, i: int) -> None:
        while True:
            item = self.requests[i].get()
            if item is None:
                return
            tasks, seeds, version = item
            try:
                records = engine.run(tasks, seeds, greedy=False, policy_version=version) if tasks else []
                self.results[i].put((records, None))
            except Exception as exc:  # surfaced in the learner's thread
                self.results[i].put((None, exc))

    def submit(self, tasks: list[Task], seeds: list[int]) -> None:
        """Start generating one episode per (task, seed), split over the threads (each takes every n-th)."""
        self._t0 = time.perf_counter()
        for i in range(self.n):
            self.requests[i].put((tasks[i::self.n], seeds[i::self.n], self.version))

    def collect(self) -> tuple[list[dict], float]:
        """The submitted batch's records in the order of its tasks, and the seconds since `submit`."""
        parts = []
        for q in self.results:
            records, exc = q.get()
            if exc is not None:
                raise exc
            parts.append(records)
        seconds = time.perf_counter() - self._t0
        out = [None] * sum(len(p) for p in parts)  # undo the interleaved split: episode order is the plan's order
        for i, p in enumerate(parts):
            out[i::self.n] = p
        return out, seconds

    def sync(self, policy: torch.nn.Module, version: int) -> None:
        self.snapshot.load_state_dict(policy.state_dict())
        self.version = version

    def close(self) -> None:
        for q in self.requests:
            q.put(None)
        for t in self.threads:
            t.join(timeout=60)
