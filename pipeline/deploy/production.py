"""The production side of `agentrl serve`, kept beside the server rather than in it (as Seldon and KServe keep request
logging and detectors around the model server): capture of answered requests (:mod:`pipeline.deploy.capture`),
``POST /feedback`` (:mod:`pipeline.deploy.feedback`) and ``GET /metrics`` (:mod:`pipeline.deploy.monitor`).

The server calls :func:`add_production` once with its app, and :meth:`Production.answered` with each answer it is
about to return; the routes need the API key as /stats does. With capture off (the default) nothing is written,
answers carry no ``request_id`` and ``POST /feedback`` is a 409; /metrics is always there.
"""

from __future__ import annotations

import threading
import time
import uuid

from fastapi import Request  # module level: FastAPI resolves the handlers' annotations in this namespace
from fastapi.responses import JSONResponse, PlainTextResponse

from pipeline.deploy.capture import CaptureStore, model_identity, request_record
from pipeline.deploy.feedback import FeedbackError, feedback_record
from pipeline.deploy.monitor import Monitor, Reference, prometheus_text
from pipeline.deploy.serve_validation import Refusal, parse_json, read_body

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Production:
    """Capture (when on), the monitor, and the MLflow logger of the monitor (when ``log_every_s`` > 0)."""

    def __init__(self, cfg, model_uri: str, alarm=None):
        self.cfg = cfg
        self.model = model_identity(model_uri)
        self.store = CaptureStore(cfg.capture) if cfg.capture.enabled else None
        self.monitor = Monitor(cfg.monitor, Reference.load(cfg.monitor), self.model, alarm)
        self.gauges: list = []  # more gauges for /metrics and the MLflow log: callables returning {name: value}
        self._stop = threading.Event()
        self._logger: threading.Thread | None = None

    def answered(self, request: dict, seed, result: dict, started: float, cached: bool, model: dict | None = None,
                 role: str = "champion") -> dict:
        """The response to send for `result` (`started`: time.perf_counter() at the request's arrival): observed by
        the monitor and, with capture on, written before it is returned and given its ``request_id``. A canary's
        answer (:mod:`pipeline.deploy.live`) gives the challenger's `model` identity and `role` "challenger"."""
        latency = time.perf_counter() - started
        self.monitor.observe(request, result, latency)
        response = {**result, "cached": cached}
        if self.store is None:
            return response
        rid = uuid.uuid4().hex
        self.store.append({**request_record(rid, request, seed, result, latency, cached, model or self.model),
                           "role": role})
        return {**response, "request_id": rid}

    def failed(self, request: dict, seed, error: str, started: float) -> dict:
        """The body of a 500 (the model failed on the request's batch): counted by the monitor and, with capture on,
        recorded with outcome "model_failure" and given its ``request_id``."""
        latency = time.perf_counter() - started
        with self.monitor.lock:
            self.monitor.failures += 1
        body = {"error": error}
        if self.store is None:
            return body
        rid = uuid.uuid4().hex
        self.store.append(request_record(rid, request, seed, {}, latency, False, self.model, error=error))
        return {**body, "request_id": rid}

    def extra(self) -> dict:
        """The gauges of :attr:`gauges` (the live comparison's, when a challenger is served)."""
        out: dict = {}
        for gauges in self.gauges:
            out.update(gauges())
        return out

    def start(self) -> None:
        if self.cfg.monitor.log_every_s > 0:
            self._logger = threading.Thread(target=self._log_loop, name="agentrl-monitor-log", daemon=True)
            self._logger.start()

    def close(self) -> None:
        self._stop.set()
        if self._logger is not None:
            self._logger.join(timeout=30)
        if self.store is not None:
            self.store.close()

    def _log_loop(self) -> None:
        """Log the monitor's gauges to the MLflow run ``serve-monitor`` until the server stops (last values at stop).
        A store that fails is logged once and the server keeps serving: monitoring must not take serving down."""
        import logging

        from pipeline.core.tracking import Tracker

        try:
            with Tracker().run("serve-monitor", params={"deploy.serve.monitor": self.cfg.monitor.model_dump()},
                               tags={k: v for k, v in self.model.items() if v}) as run:
                step = 0
                while True:
                    stopped = self._stop.wait(self.cfg.monitor.log_every_s)
                    run.log_metrics(self.monitor.flat(self.extra()), step=step)
                    step += 1
                    if stopped:
                        return
        except Exception as exc:  # noqa: BLE001
            logging.getLogger(__name__).warning("serve-monitor: logging to MLflow stopped: %s", exc)


def add_production(app, cfg, model_uri: str, locked, stats, alarm=None) -> Production:
    """Add ``POST /feedback`` and ``GET /metrics`` to `app` (`locked(request)`: the server's API-key check, a
    response when refused; `stats`: its counters, for the refusals; `alarm`: ``deploy.snapshot``, the thresholds of
    the drift alarm) and return the hooks the server calls."""
    prod = Production(cfg, model_uri, alarm)

    @app.post("/feedback")
    async def feedback(request: Request):
        if (denied := locked(request)) is not None:
            return denied
        if prod.store is None:
            return JSONResponse({"error": "feedback needs capture: deploy.serve.capture.enabled is false"},
                                status_code=409)
        try:
            obj = parse_json(await read_body(request, cfg))
            record = feedback_record(obj, prod.store.known, cfg.capture.feedback_max_chars)
        except Refusal as r:
            return JSONResponse({"error": r.message}, status_code=r.status)
        except FeedbackError as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)
        prod.store.append(record)
        with prod.monitor.lock:
            prod.monitor.feedback += 1
        return {"status": "recorded", "request_id": record["request_id"]}

    @app.get("/metrics")
    async def metrics(request: Request):
        if (denied := locked(request)) is not None:
            return denied
        values = {**prod.monitor.values(), "requests_refused_total": dict(stats.rejected),
                  "model_info": {k: v or "" for k, v in prod.model.items()}, **prod.extra()}
        return PlainTextResponse(prometheus_text(values), media_type=PROMETHEUS_TYPE)

    return prod


__all__ = ["Production", "add_production"]
