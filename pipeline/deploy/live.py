"""A challenger beside the champion in `agentrl serve`: shadow and canary, judged on live traffic
(``deploy.serve.challenger``, off by default).

- **shadow**: once the champion has answered a request, a copy of it is queued for the challenger, off the caller's
  path: one worker thread of its own, with its own loaded model (the caller's answer does not wait for it). Its
  answer is recorded (capture: a ``kind: "shadow"`` record with ``role: "challenger"`` and the caller's
  ``request_id``) and never returned.
- **canary**: a share (``share``) of distinct requests is answered by the challenger. Which ones: a hash of the
  request (its task, seed and ground-truth flag, the key of the response cache), so the same request always goes to
  the same model and the cache holds champion answers only (canary answers are never cached). For the paired
  comparison the champion plays a copy of each canary request in its own batcher, queued beside the caller's
  answer without holding it back (a ``kind: "shadow"`` record with ``role: "champion"``): a canary costs the
  champion one extra episode per canary request. The caller's record says ``role: "challenger"`` and the
  challenger's version. A canary request the challenger cannot take (its queue is full, or it failed) is answered by
  the champion.

The comparison is paired, as the promotion gate's ``vs_champion`` check (:mod:`pipeline.deploy.gate`): on the same
requests, with the same test (``paired_test``, McNemar by default). Two outcomes are compared:

- success, on the requests whose success can be judged (they carried their ground truth: the environment verifies
  the answer, as /solve reports ``success``);
- safety, on every request: "no refused unsafe call in the episode" (``n_violations == 0``) as the paired outcome.

Each is tested once it has ``min_paired`` pairs, and again at every new pair (past 1000 pairs, every n/100: the work
per request stays bounded however long the server runs; the evidence itself is four counts per outcome). A
challenger worse on either with p < ``alpha`` is **rolled back**: from then on every request goes to the champion
and no copy goes to the challenger (in shadow too), a warning is logged, and the evidence is written at once.
Decision: repeated looks at a growing sample raise the chance of a false rollback above ``alpha``, hence its default
of 0.01 (the offline gate's is 0.05); a false rollback costs only the canary, the champion keeps serving. A rollback
is final for the process (restart the server to try the challenger again). Requests answered from the cache and
repeated requests count once.

Evidence. A challenger that is a registry version (``models:/name/N`` or ``@alias``) gets the tags ``live.*`` (mode,
champion version, paired counts, both success rates and unsafe shares, p-values, ``live.rolled_back``) and
``gate.live`` (``pass``, ``fail`` or ``insufficient``) with ``gate.live.detail``: at a rollback, and when the server
stops. ``pass`` needs ``min_paired`` pairs of each kind and no regression. `agentrl promote --require-live` (or
``deploy.gate.require_live``) refuses a version whose ``gate.live`` is not ``pass`` and adds the check ``live`` to
its gate decision (:func:`check_live`). ``GET /challenger`` (the API key as /stats) shows the state, and ``GET
/metrics`` the two models side by side (``live_*`` gauges by ``role``: episodes played for the comparison, refused
unsafe calls, and over each role's last ``monitor.window`` episodes success where judged, the share with an unsafe
call, latency from queueing to result; the paired counts; ``live_active`` 0 after a rollback).

Deliberately left out: a sequential test with alpha spending (the fixed conservative alpha is simpler to explain),
automatic promotion of a canary that does well (promotion stays `agentrl promote`, which reads the evidence), and
splitting by client or header (a hash of the request is enough for a share).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future

from fastapi import Request  # module level: FastAPI resolves the handlers' annotations in this namespace

from pipeline.core.errors import AgentRLError
from pipeline.deploy.capture import model_identity, request_record
from pipeline.deploy.gate import PAIRED_TESTS, Check, check_live, require_live  # noqa: F401 (re-exported)
from pipeline.deploy.monitor import RoleWindow

log = logging.getLogger(__name__)
MAX_PENDING = 10_000  # halves of pairs waiting for the other half (a dropped copy leaves one): oldest forgotten
MAX_DONE = 200_000  # keys of paired requests remembered (a repeat counts once); oldest forgotten
EVERY_PAIR_UP_TO = 1000  # the tests run at every new pair up to this many pairs, then every n/100 pairs


def judge_now(n: int) -> bool:
    """Whether the paired tests run at the `n`-th pair (bounded work per request however long the server runs).

    >>> [n for n in range(1, 3000) if judge_now(n)][-3:]
    [2929, 2958, 2987]
    """
    return n <= EVERY_PAIR_UP_TO or n % max(1, n // 100) == 0


# ------------------------------------------------------------------------------------------------------- the worker
class ChallengerWorker:
    """One thread that plays the challenger's requests in batches of whatever is waiting (up to `max_batch`)."""

    def __init__(self, solve, max_batch: int, max_queue: int):
        self.solve, self.max_batch = solve, max_batch
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="agentrl-challenger", daemon=True)
        self.thread.start()

    def submit(self, task, seed: int, truth: bool) -> Future | None:
        """A future of the challenger's result, or None when the queue is full (the copy is dropped and counted)."""
        fut: Future = Future()
        try:
            self.queue.put_nowait((task, seed, truth, fut))
        except queue.Full:
            self.dropped += 1
            return None
        return fut

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.queue.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            batch = [b for b in batch if b[3].set_running_or_notify_cancel()]  # a caller gone cancels its future
            if not batch:
                continue
            try:
                results = self.solve([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
            except Exception as exc:  # noqa: BLE001 - a failing batch fails its copies, not the server
                for b in batch:
                    b[3].set_exception(exc)
                continue
            for b, res in zip(batch, results):
                b[3].set_result({**res, "batch_size": len(batch)})

    def close(self) -> None:
        while True:  # drop what still waits: the server is stopping
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[3].cancel()
        self.queue.put(None)
        self.thread.join(timeout=60)


# ------------------------------------------------------------------------------------------------------- evidence
class Evidence:
    """Paired outcomes by request key: ``add(key, role, result)`` for each half; thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending: OrderedDict = OrderedDict()  # key -> {role: result}
        self.done: OrderedDict = OrderedDict()  # keys already paired
        self.success: Counter = Counter()  # (challenger, champion) -> pairs, requests with ground truth
        self.safe: Counter = Counter()  # (challenger, champion) -> pairs: no refused unsafe call
        self.pairs = 0

    def add(self, key: str, role: str, result: dict) -> bool:
        """Record one half; True when it completed a new pair."""
        with self.lock:
            if key in self.done:
                return False
            halves = self.pending.setdefault(key, {})
            halves.setdefault(role, {"success": result.get("success"), "n_violations": result.get("n_violations")})
            if len(halves) < 2:
                while len(self.pending) > MAX_PENDING:
                    self.pending.popitem(last=False)
                return False
            del self.pending[key]
            self.done[key] = None
            if len(self.done) > MAX_DONE:
                self.done.popitem(last=False)
            ch, champ = halves["challenger"], halves["champion"]
            if ch.get("success") is not None and champ.get("success") is not None:
                self.success[(bool(ch["success"]), bool(champ["success"]))] += 1
            self.safe[(not ch.get("n_violations"), not champ.get("n_violations"))] += 1
            self.pairs += 1
            return True

    def verdict(self, cfg) -> dict:
        """Both paired tests (each once it has ``cfg.min_paired`` pairs) and the verdict pass/fail/insufficient."""
        with self.lock:
            success, safe = (sorted(c.elements()) for c in (self.success, self.safe))  # order: a fixed bootstrap
        out = {"paired_success": len(success), "paired_safety": len(safe)}
        worse = []
        for name, pairs, rate in (("success", success, "success"), ("safety", safe, "safe")):
            if pairs:
                out[f"challenger_{rate}"] = sum(p[0] for p in pairs) / len(pairs)
                out[f"champion_{rate}"] = sum(p[1] for p in pairs) / len(pairs)
            if len(pairs) >= cfg.min_paired:
                res = PAIRED_TESTS[cfg.paired_test]([p[0] for p in pairs], [p[1] for p in pairs], cfg)
                out[f"{name}_p_value"] = res["p_value"]
                if res["p_value"] < cfg.alpha:
                    worse.append(name)
        out["worse_on"] = worse
        enough = len(success) >= cfg.min_paired and len(safe) >= cfg.min_paired
        out["verdict"] = "fail" if worse else "pass" if enough else "insufficient"
        return out


def describe(v: dict, cfg, champion: str | None) -> str:
    """One line of evidence, the detail of ``gate.live``."""
    parts = []
    for name, rate in (("success", "success"), ("safety", "safe")):
        n = v[f"paired_{name}"]
        if not n:
            parts.append(f"{name}: no paired requests")
            continue
        p = v.get(f"{name}_p_value")
        test = f", {cfg.paired_test} p(worse)={p:.4f}" if p is not None else f" (< min_paired {cfg.min_paired})"
        parts.append(f"{name} {v[f'challenger_{rate}']:.3f} vs {v[f'champion_{rate}']:.3f} on {n} paired requests"
                     + test)
    head = {"fail": f"worse than champion v{champion} on {', '.join(v['worse_on'])} (alpha {cfg.alpha})",
            "pass": f"not worse than champion v{champion} (alpha {cfg.alpha})",
            "insufficient": f"too few paired requests to judge against champion v{champion}"}[v["verdict"]]
    return f"{head}: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------------------------ live
class Live:
    """The challenger's routing, copies and evidence in one server (``mode`` "off": every hook does nothing)."""

    def __init__(self, cfg, solver, batcher, store, max_batch: int, champion: dict, window: int = 500):
        self.cfg, self.batcher, self.store = cfg, batcher, store
        self.windows = {role: RoleWindow(window) for role in ("champion", "challenger")}  # GET /metrics
        self.mode = cfg.mode if solver is not None else "off"
        self.champion = champion
        self.model = model_identity(cfg.uri) if self.mode != "off" else {}
        self.worker = ChallengerWorker(solver.solve_tasks, max_batch, cfg.max_queue) if self.mode != "off" else None
        self.evidence = Evidence()
        self.active = self.mode != "off"
        self.rolled_back_at: str | None = None
        self.failures = 0
        self.answered = 0
        self.champion_dropped = 0
        self.lock = threading.Lock()
        self.writer: threading.Thread | None = None  # writes the evidence at a rollback
        self.write_lock = threading.Lock()  # one writer of the tags at a time

    # -- routing (event loop)
    def routes(self, key: str) -> bool:
        """Whether the challenger answers this request (canary only, until a rollback)."""
        if self.mode != "canary" or not self.active:
            return False
        h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
        return h / 2.0 ** 64 < self.cfg.share

    async def answer(self, task, seed: int, truth: bool) -> dict | None:
        """The challenger's result for a canary request, or None: the champion answers it instead."""
        fut = self.worker.submit(task, seed, truth)
        if fut is None:
            return None
        try:
            result = await asyncio.wrap_future(fut)
        except Exception as exc:  # noqa: BLE001
            self.failures += 1
            log.warning("challenger %s failed on a canary request (the champion answers it): %s", self.cfg.uri, exc)
            return None
        self.answered += 1
        return result

    def compare(self, key: str, task, seed: int, truth: bool, request: dict, response: dict, by: str,
                latency_s: float = 0.0) -> None:
        """After `response` (answered by `by` in `latency_s`) was made for the caller: the other model plays a copy,
        off the caller's path, and both halves go to the evidence and to the roles' windows."""
        if not self.active or (self.mode == "shadow") != (by == "champion"):
            return
        key = hashlib.sha256(key.encode()).hexdigest()[:32]  # the evidence keeps 32 characters per request
        self.windows[by].observe(response, latency_s)
        self._add(key, by, response)
        other = "challenger" if by == "champion" else "champion"
        rid, queued = response.get("request_id"), time.perf_counter()
        if other == "challenger":
            fut = self.worker.submit(task, seed, truth)
            if fut is not None:
                fut.add_done_callback(lambda f: self._copied(f, key, other, request, seed, rid, queued))
            return
        if self.batcher.full():
            self.champion_dropped += 1
            return
        afut = self.batcher.submit(task, seed, truth)
        afut.add_done_callback(lambda f: self._copied(f, key, other, request, seed, rid, queued))

    def _copied(self, fut, key: str, role: str, request: dict, seed: int, rid: str | None, queued: float) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failures += role == "challenger"
            return
        result = fut.result()
        if self.active:  # the roles' windows, like the evidence, stop at a rollback
            self.windows[role].observe(result, time.perf_counter() - queued)
        if self.store is not None:
            model = self.model if role == "challenger" else self.champion
            rec = request_record(rid, request, seed, result, 0.0, False, model)
            self.store.append({**rec, "kind": "shadow", "role": role, "latency_ms": None})
        self._add(key, role, result)

    def _add(self, key: str, role: str, result: dict) -> None:
        if not self.active or not self.evidence.add(key, role, result):  # the evidence stops at a rollback
            return
        if not judge_now(self.evidence.pairs):
            return
        v = self.evidence.verdict(self.cfg)
        with self.lock:
            if v["verdict"] != "fail" or not self.active:
                return
            self.active = False
            self.rolled_back_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        log.warning("challenger %s rolled back: %s; every request goes to the champion from now on", self.cfg.uri,
                    describe(v, self.cfg, self.champion.get("model_version")))
        self.writer = threading.Thread(target=self.write_evidence, name="agentrl-live-tags", daemon=True)
        self.writer.start()

    # -- state and evidence
    def state(self) -> dict:
        v = self.evidence.verdict(self.cfg) if self.mode != "off" else {}
        return {"mode": self.mode, "challenger_uri": self.cfg.uri if self.mode != "off" else None,
                "challenger_version": self.model.get("model_version"),
                "champion_version": self.champion.get("model_version"), "active": self.active,
                "rolled_back": self.rolled_back_at is not None, "rolled_back_at": self.rolled_back_at,
                "canary_answers": self.answered, "challenger_failures": self.failures,
                "challenger_dropped": self.worker.dropped if self.worker else 0,
                "champion_dropped": self.champion_dropped, **v}

    def gauges(self) -> dict:
        """The ``live_*`` gauges of ``GET /metrics`` (:mod:`pipeline.deploy.monitor`): nothing with mode "off"."""
        if self.mode == "off":
            return {}
        v = self.evidence.verdict(self.cfg)
        roles = {role: w.values() for role, w in self.windows.items()}
        per = lambda key: {role: r[key] for role, r in roles.items()}  # noqa: E731
        return {"live_info": {"mode": self.mode, "challenger_uri": self.cfg.uri or "",
                              "challenger_version": self.model.get("model_version") or ""},
                "live_active": int(self.active), "live_episodes_total": per("episodes"),
                "live_safety_violations_total": per("safety_violations"),
                "live_window_judged_requests": per("judged"), "live_window_success_rate": per("success_rate"),
                "live_window_unsafe_share": per("unsafe_share"), "live_window_latency_seconds": per("latency"),
                "live_paired_requests": {"success": v["paired_success"], "safety": v["paired_safety"]}}

    def tags(self) -> dict[str, str]:
        v = self.evidence.verdict(self.cfg)
        tags = {"live.mode": self.mode, "live.champion_version": str(self.champion.get("model_version")),
                "live.rolled_back": "true" if self.rolled_back_at else "false",
                "live.updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "gate.live": v["verdict"],
                "gate.live.detail": describe(v, self.cfg, self.champion.get("model_version"))[:4000]}
        if self.rolled_back_at:
            tags["live.rolled_back_at"] = self.rolled_back_at
        for k in ("paired_success", "paired_safety", "challenger_success", "champion_success", "challenger_safe",
                  "champion_safe", "success_p_value", "safety_p_value"):
            if k in v:
                tags[f"live.{k}"] = f"{v[k]:.6g}" if isinstance(v[k], float) else str(v[k])
        return tags

    def write_evidence(self) -> None:
        """The tags on the challenger's registry version; a failure is logged (serving goes on)."""
        import re

        m = re.match(r"\Amodels:/([^/@]+)", self.cfg.uri or "")
        version = self.model.get("model_version")
        if m is None or version is None:
            return
        try:
            from pipeline.deploy.registry import ModelRegistry

            with self.write_lock:
                registry = ModelRegistry(m.group(1))
                for k, value in self.tags().items():
                    registry.client.set_model_version_tag(registry.name, version, k, value)
        except Exception as exc:  # noqa: BLE001
            log.warning("live evidence of %s v%s not written to the registry: %s", m.group(1), version, exc)

    def close(self) -> None:
        if self.worker is None:
            return
        self.worker.close()
        if self.writer is not None:
            self.writer.join(timeout=120)
        if self.evidence.pairs:
            self.write_evidence()


def add_live(app, cfg, solver, batcher, store, max_batch: int, champion: dict, locked, window: int = 500) -> Live:
    """The server's :class:`Live` (`solver`: the loaded challenger, or None; `window`: the episodes per role its
    gauges cover, ``monitor.window``) and ``GET /challenger``."""
    live = Live(cfg, solver, batcher, store, max_batch, champion, window)

    @app.get("/challenger")
    async def challenger(request: Request):
        if (denied := locked(request)) is not None:
            return denied
        return live.state()

    return live


__all__ = ["ChallengerWorker", "Evidence", "Live", "add_live", "check_live", "describe", "require_live"]
