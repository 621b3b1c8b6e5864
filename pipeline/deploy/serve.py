"""HTTP serving of a registered policy: dynamic batching, an identical-request cache, health, readiness and limits.

API (JSON):

- ``POST /solve`` with one task -- ``{"question": "...", "task_id"?, "allowed_writes"?, "answer"?, "seed"?}`` or a
  complete task record -- returns ``{"task_id", "answer", "success", "trajectory", "calls", "n_calls",
  "n_violations", "truncated", "cached", "batch_size"}`` (see :mod:`pipeline.deploy.pyfunc`).
- ``GET /health``: 200 while the process serves HTTP (liveness; never needs the API key). ``GET /ready``: 200 once
  the model is loaded and the batcher runs, else 503 (readiness). ``GET /stats``: batches, mean batch size, cache hits
  and misses, rejections.
- ``POST /feedback`` and ``GET /metrics`` (Prometheus text), and the capture of answered requests (``request_id`` in
  each answer when it is on): :mod:`pipeline.deploy.production`.
- a challenger in shadow or as a canary, and ``GET /challenger``: :mod:`pipeline.deploy.live`.

Request handling, in order; every refusal happens before the model sees anything (the checks of steps 2-4 are
:mod:`pipeline.deploy.serve_validation`, which says why each exists):
1. rate limit per client address (token bucket, ``rate_limit_per_s`` and ``rate_burst``): 429 with Retry-After;
2. the API key, when ``$<api_key_env>`` holds one (required to bind a non-loopback address): 401 without it;
3. body larger than ``max_body_bytes`` (declared or counted, chunked too): 413, which the client reads even while it
   is still sending (uvicorn discards the rest of the body);
4. not JSON: 400; not a valid task (a field of the wrong JSON type or out of range -- ``seed`` outside [0, 2**32-1],
   an empty or over-long question --, unknown fields, malformed ``allowed_writes``): 422, each with
   ``{"error": reason}`` naming the field;
5. the cache: an identical request (same task and seed: greedy decoding makes the answer a function of them) is
   answered from an LRU of ``cache_size`` responses; an identical request already waiting shares its future;
6. the queue: more than ``max_queue`` waiting requests gives 503 with ``Retry-After: retry_after_s``;
7. the batcher collects waiting requests into one generation batch, up to ``max_batch_size``, waiting at most
   ``max_wait_ms`` after the first; the batch runs in one worker thread through the rollout engine (itself continuously
   batched: a finished episode's slot takes the next task). Requests that arrive while a batch runs form the next one.

Why a hand-written batcher rather than LitServe (0.2.19 installs cleanly here): LitServe's batching is the same
"up to N requests or T ms" policy, but it runs the model in a separate worker process behind a queue, so the cache
and the validation would either sit in the worker (a cache hit would wait for a batch slot) or need a second layer in
front of it; the whole batcher here is one small class, and the model stays in the process that validated the request.

A request that still fails inside the model fails its whole batch with 500 ("model failure"): that is a bug of the
validation above, and the soak benchmark (bench/serve_soak.py) counts such answers.

Deliberately left out: TLS (terminate it in a proxy), per-client keys, multi-process workers (one model, one engine
thread; scale out with more processes behind a proxy), and streaming of partial trajectories.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations in this namespace
from fastapi.responses import JSONResponse

from pipeline.core.errors import AgentRLError
from pipeline.deploy.config import ServeConfig
from pipeline.deploy.live import add_live
from pipeline.deploy.production import add_production
from pipeline.deploy.serve_validation import Refusal, authorized, parse_json, read_body, serving_key, \
    validate_request


# ------------------------------------------------------------------------------------------------------ components
class TokenBucket:
    """Per-key token buckets: `rate` tokens per second up to `burst`; ``take`` spends one or says no."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.state: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> bool:
        now = self.clock()
        tokens, last = self.state.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self.state[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self.state) > 100_000:  # forget the idlest clients rather than grow without bound
            for k in list(self.state)[:50_000]:
                del self.state[k]
        return ok


class LRUCache:
    def __init__(self, size: int):
        self.size, self.data = size, OrderedDict()

    def get(self, key):
        if key in self.data:
            self.data.move_to_end(key)
            return self.data[key]
        return None

    def put(self, key, value) -> None:
        if self.size <= 0:
            return
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.size:
            self.data.popitem(last=False)


@dataclass
class Stats:
    requests: int = 0
    batches: int = 0
    batched_requests: int = 0
    cache_hits: int = 0
    coalesced: int = 0
    rejected: dict = field(default_factory=dict)
    max_batch: int = 0

    def to_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches, "batched_requests": self.batched_requests,
                "mean_batch_size": self.batched_requests / self.batches if self.batches else 0.0,
                "max_batch_size": self.max_batch, "cache_hits": self.cache_hits, "coalesced": self.coalesced,
                "rejected": dict(self.rejected)}


class Batcher:
    """Collects submitted tasks into batches for ``solve(tasks, seeds, truth) -> responses`` (one worker thread)."""

    def __init__(self, solve, max_batch_size: int, max_wait_s: float, max_queue: int, stats: Stats):
        self.solve, self.max_batch, self.max_wait, self.max_queue = solve, max_batch_size, max_wait_s, max_queue
        self.stats = stats
        self.queue: asyncio.Queue | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentrl-model")
        self.task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)

    def full(self) -> bool:
        return self.queue is None or self.queue.qsize() >= self.max_queue

    def submit(self, task, seed: int, truth: bool) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((task, seed, truth, fut))
        return fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch:
                if not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), remaining))
                except TimeoutError:
                    break
            batch = [b for b in batch if not b[3].cancelled()]
            if not batch:
                continue
            self.stats.batches += 1
            self.stats.batched_requests += len(batch)
            self.stats.max_batch = max(self.stats.max_batch, len(batch))
            try:
                results = await loop.run_in_executor(
                    self.executor, self.solve, [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
            except Exception as exc:  # noqa: BLE001 - a failing batch fails its requests, not the server
                for b in batch:
                    if not b[3].done():
                        b[3].set_exception(exc)
                continue
            for b, res in zip(batch, results):
                if not b[3].done():
                    b[3].set_result({**res, "batch_size": len(batch)})


# ------------------------------------------------------------------------------------------------------------ app
def create_app(solver, cfg: ServeConfig | None = None, model_uri: str = "", api_key: bytes | None = None,
               challenger=None, alarm=None):
    """The FastAPI app around a loaded :class:`~pipeline.deploy.pyfunc.PolicySolver` (or any object with
    ``solve_tasks(tasks, seeds, truth)``, ``seed`` and ``runtime``); with `api_key`, every endpoint but /health needs
    it (:func:`~pipeline.deploy.serve_validation.serving_key`); `challenger`: a second loaded solver, served as
    ``cfg.challenger`` says (:mod:`pipeline.deploy.live`); `alarm`: ``deploy.snapshot``, the thresholds of the drift
    alarm at /metrics (its defaults when None)."""
    cfg = cfg or ServeConfig()
    stats = Stats()
    batcher = Batcher(solver.solve_tasks, cfg.max_batch_size, cfg.max_wait_ms / 1000.0, cfg.max_queue, stats)
    service = Service(solver, cfg, model_uri, api_key, stats, batcher, LRUCache(cfg.cache_size),
                      TokenBucket(cfg.rate_limit_per_s, cfg.rate_burst))

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        service.prod.start()
        yield
        service.live.close()
        await batcher.stop()
        service.prod.close()

    app = FastAPI(title="agentrl policy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.stats, app.state.batcher = stats, batcher
    service.prod = add_production(app, cfg, model_uri, service.locked, stats, alarm)  # capture, /feedback, /metrics
    service.live = add_live(app, cfg.challenger, challenger, batcher, service.prod.store, cfg.max_batch_size,
                            service.prod.model, service.locked, cfg.monitor.window)  # shadow, canary, /challenger
    service.prod.gauges.append(service.live.gauges)  # the challenger beside the champion at /metrics
    app.get("/health")(service.health)
    app.get("/ready")(service.ready)
    app.get("/stats")(service.get_stats)
    app.post("/solve")(service.solve)
    return app


@dataclass
class Service:
    """The endpoints of :func:`create_app` and what they share: the solver, the settings, the statistics, the
    batcher, the response cache, the rate limiter and the requests in flight (an identical request shares its
    future)."""

    solver: object
    cfg: ServeConfig
    model_uri: str
    api_key: bytes | None
    stats: Stats
    batcher: Batcher
    cache: LRUCache
    bucket: TokenBucket
    pending: dict[str, asyncio.Future] = field(default_factory=dict)
    prod: Any = None  # capture, feedback and monitoring (pipeline.deploy.production), set by create_app
    live: Any = None  # the challenger in shadow or as a canary (pipeline.deploy.live), set by create_app

    def refuse(self, status: int, reason: str, kind: str, headers: dict | None = None) -> JSONResponse:
        self.stats.rejected[kind] = self.stats.rejected.get(kind, 0) + 1
        return JSONResponse({"error": reason}, status_code=status, headers=headers)

    def locked(self, request: Request) -> JSONResponse | None:
        """None when the request may pass (no key set, or the right one sent); else the 401 answer."""
        if authorized(request.headers, self.api_key):
            return None
        return self.refuse(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "unauthorized",
                           {"WWW-Authenticate": "Bearer"})

    async def health(self):
        return {"status": "ok"}

    async def ready(self, request: Request):
        if (denied := self.locked(request)) is not None:
            return denied
        if self.batcher.running:
            return {"status": "ready", "model_uri": self.model_uri,
                    "precision": getattr(self.solver, "precision", None)}
        return JSONResponse({"status": "not ready"}, status_code=503)

    async def get_stats(self, request: Request):
        if (denied := self.locked(request)) is not None:
            return denied
        return {**self.stats.to_dict(), "cache_entries": len(self.cache.data), "queued": self.batcher.queue.qsize()
                if self.batcher.queue else 0}

    async def solve(self, request: Request):
        """Steps 1-4 of the module docstring (rate limit, key, body, task), then :meth:`answer`."""
        started = time.perf_counter()
        cfg = self.cfg
        self.stats.requests += 1
        client = request.client.host if request.client else "unknown"
        if not self.bucket.take(client):
            return self.refuse(429, f"rate limit: at most {cfg.rate_limit_per_s:g} requests/s (burst "
                                    f"{cfg.rate_burst}) per client", "rate_limit",
                               {"Retry-After": str(math.ceil(1 / cfg.rate_limit_per_s))})
        if (denied := self.locked(request)) is not None:
            return denied
        try:
            obj = parse_json(await read_body(request, cfg))
            task, seed, truth = validate_request(obj, cfg.max_question_chars, self.solver.runtime, self.solver.seed)
        except Refusal as r:
            return self.refuse(r.status, r.message, r.kind)
        return await self.answer(task, seed, truth, obj, started)

    async def answer(self, task, seed, truth, obj, started: float):
        """Steps 5-7: from the cache, from an identical request in flight, or from a new batch slot (503 when the
        queue is full)."""
        key = json.dumps([task.to_dict(), seed, truth], sort_keys=True)
        live = self.live
        if live.routes(key) and (result := await live.answer(task, int(seed), truth)) is not None:  # a canary
            response = self.prod.answered(obj, seed, result, started, cached=False, model=live.model,
                                          role="challenger")
            live.compare(key, task, int(seed), truth, obj, response, by="challenger",
                         latency_s=time.perf_counter() - started)
            return response
        hit = self.cache.get(key)
        if hit is not None:
            self.stats.cache_hits += 1
            return self.prod.answered(obj, seed, hit, started, cached=True)
        fut = self.pending.get(key)
        if fut is not None:
            self.stats.coalesced += 1
        else:
            if self.batcher.full():
                return self.refuse(503, f"server busy: {self.cfg.max_queue} requests already waiting "
                                        "(deploy.serve.max_queue)", "busy",
                                   {"Retry-After": str(self.cfg.retry_after_s)})
            fut = self.batcher.submit(task, int(seed), truth)
            self.pending[key] = fut
        try:
            result = await asyncio.shield(fut)
        except Exception as exc:  # noqa: BLE001
            error = f"model failure: {type(exc).__name__}: {exc}"
            return JSONResponse(self.prod.failed(obj, seed, error, started), status_code=500)
        finally:
            if self.pending.get(key) is fut and fut.done():
                del self.pending[key]
        self.cache.put(key, result)
        response = self.prod.answered(obj, seed, result, started, cached=False)
        live.compare(key, task, int(seed), truth, obj, response, by="champion",
                     latency_s=time.perf_counter() - started)  # shadow: a copy to the challenger
        return response


def serve(model_uri: str, cfg: ServeConfig, host: str | None = None, port: int | None = None,
          ready_message: bool = True, alarm=None) -> None:
    """Load `model_uri` (an AgentRLError when it does not resolve) and serve it until interrupted (`alarm`:
    ``deploy.snapshot``, the drift alarm's thresholds). Before anything loads: binding a non-loopback `host` without
    an API key, or an address that cannot be listened on, is an AgentRLError (one ``error:`` line from the CLI)."""
    import uvicorn

    host, port = host or cfg.host, cfg.port if port is None else port
    api_key = serving_key(host, cfg)  # before the model loads: a refused start costs nothing
    check_listen(host, port)

    from pipeline.deploy.pyfunc import load_solver  # imports mlflow.pyfunc, which warns on stderr: after the checks

    solver = load_solver(model_uri)
    challenger = load_solver(cfg.challenger.uri) if cfg.challenger.mode != "off" else None
    app = create_app(solver, cfg, model_uri, api_key, challenger, alarm)
    if ready_message:
        print(f"serving {model_uri} ({solver.precision}) on http://{host}:{port} (POST /solve, GET /health, /ready); "
              f"API key {'required ($' + cfg.api_key_env + ')' if api_key else 'off (loopback only)'}"
              + (f"; capture to {cfg.capture.dir}/" if cfg.capture.enabled else "")
              + (f"; challenger {cfg.challenger.uri} as {cfg.challenger.mode}" if challenger else ""), flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        solver.close()
        if challenger is not None:
            challenger.close()


def check_listen(host: str, port: int) -> None:
    """An AgentRLError naming the address when `host`:`port` cannot be listened on (in use, not this machine's, not
    resolvable); checked before the model loads, where uvicorn would only log it and exit after the load."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            s.bind(addr)
    except OSError as exc:
        raise AgentRLError(f"serve: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


class ThreadedServer:
    """Run an app with uvicorn in a background thread (tests and benchmarks); ``with ThreadedServer(app, port):``."""

    def __init__(self, app, port: int, host: str = "127.0.0.1"):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://{host}:{port}"

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("uvicorn did not start within 30 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


__all__ = ["Batcher", "LRUCache", "Stats", "ThreadedServer", "TokenBucket", "check_listen", "create_app", "serve"]
