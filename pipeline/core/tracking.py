"""One tracking front end for every phase, with MLflow behind it.

    tracker = Tracker()
    with tracker.run("build_env", params={"env": env_cfg.model_dump()}) as run:
        run.log_metrics({"data/n_tasks": 4800})
        run.log_artifact("metrics/build_env.json")

Where runs go:
- the tracking URI is ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<repo>/mlflow.db``;
- every run lands in the experiment ``agentrl``; when this module creates that experiment in a SQLite store, its
  artifact location is the ``mlartifacts/`` folder next to the database (``<repo>/mlartifacts`` by default): MLflow's
  own default is a folder relative to the process's cwd, which scatters artefacts;
- when ``AGENTRL_PARENT_RUN_ID`` is set (the Prefect flow sets it for the stages it launches), the phase run is a
  nested child of that run;
- when ``AGENTRL_TRACKING=off``, nowhere: :meth:`Tracker.run` yields a :class:`NullRun`, MLflow is not imported and no
  store is touched, and a phase says so once on its log. This is for machines without a tracking store or without
  MLflow installed (a GPU box that only trains, a quick local try); the metrics files under ``metrics/`` are written as
  always. What needs the store for its result refuses with a clear error instead of running half-tracked
  (:func:`require_tracking`): the model registry (``deploy``, ``promote``, ``rollback``, serving by alias) and the
  Prefect flows, whose parent run ties the phases together. Values: ``on`` (the default), ``off``; anything else is
  an error that names the variable.

Conventions enforced here rather than in every phase: nested params are flattened with dots (``env.reward.safety``);
metric keys are namespaced (``data/n_tasks``; a key without a ``/`` gets the phase name as its namespace, and nested
metric dicts are joined with ``/``); a run that raises is marked FAILED.

A tracking server that stops answering: MLflow's client retries each HTTP request on connection errors and on 429/5xx
answers with exponential back-off. MLflow's own defaults (7 retries, back-off factor 2, 120 s per request) wait about
4 minutes per request before giving up; every :func:`mlflow_client` sets, unless the environment already does,
``MLFLOW_HTTP_REQUEST_MAX_RETRIES=5``, ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1`` and ``MLFLOW_HTTP_REQUEST_TIMEOUT=60``
(:data:`HTTP_RETRY_DEFAULTS`): waits of 2, 4, 8 and 16 s, so a server restart of up to about half a minute is ridden
out, and a server that is gone fails a request after about 30 s (plus the timeout of a request that hangs). What then
fails is one ``error:`` line (:func:`store_failure` recognises it), never a half-registered model version
(:mod:`pipeline.deploy.registry`). SQLite stores make no HTTP requests and are not affected.

Where that happens in a phase's run (:meth:`Tracker.run`): a store that does not answer when the run opens stops the
phase there, before it does anything, with one ``error:`` line. One that stops answering in the body raises out of
the run as it is (the run is not marked, which would cost another round of retries): a caller that knows what it
leaves says so (`deploy`), and the command line turns the rest into one ``error:`` line (`flows/cli.py`; a phase's
outputs are published whole or not at all, :mod:`pipeline.core.atomic`). A tracker made with
``on_outage="continue"`` rides it out instead: the first logging call that fails prints one ``warning:`` line
naming the run, and the run goes on untracked; later logging calls do nothing, and the run is not marked finished
(it stays RUNNING in the store, with what it logged before). `train` does that, so an hour of training is not thrown
away for its curves; its metrics files hold everything the run would have logged.

Deliberately left out: MLflow's fluent API (``mlflow.start_run``) keeps the active run in module-level state, which
breaks when Prefect calls phases repeatedly in one process; every call here goes through an explicit ``MlflowClient``
and a run id. MLflow itself is imported inside the methods, because importing it costs about a second.
:class:`NullTracker` has the same methods and does nothing (logging from rank > 0, tests, dry runs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline import repo_root
from pipeline.core.errors import AgentRLError

logger = logging.getLogger(__name__)

EXPERIMENT = "agentrl"
PARENT_RUN_ENV = "AGENTRL_PARENT_RUN_ID"
TRACKING_ENV = "AGENTRL_TRACKING"
PHASE_TAG = "agentrl.phase"
_BATCH = 100  # MLflow accepts at most 100 params (and 1000 metrics) per log_batch call.


def flatten(mapping: Mapping[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into one level, joining keys with `sep`.

    >>> flatten({"env": {"reward": {"safety": 1.0}, "max_steps": 8}})
    {'env.reward.safety': 1.0, 'env.max_steps': 8}
    """
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, sep, name))
        else:
            flat[name] = value
    return flat


def namespaced(metrics: Mapping[str, Any], namespace: str) -> dict[str, float]:
    """Metric keys with a namespace: nested dicts join with '/', a bare key gets `namespace/` in front.

    >>> namespaced({"n_tasks": 3, "data": {"rows": 2}, "env/sps": 1.5}, "build_env")
    {'build_env/n_tasks': 3.0, 'data/rows': 2.0, 'env/sps': 1.5}
    """
    out: dict[str, float] = {}
    for key, value in flatten(metrics, sep="/").items():
        if "/" not in key:
            key = f"{namespace}/{key}"
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)):
            try:
                value = float(value)  # numpy scalars, 0-d tensors
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}") from None
        out[key] = float(value)
    return out


def tracking_enabled() -> bool:
    """Whether phase runs go to MLflow: ``$AGENTRL_TRACKING`` is ``on`` (or unset) or ``off``.

    Raises :class:`~pipeline.core.errors.AgentRLError` for any other value, naming the variable and the values it takes.
    """
    raw = os.environ.get(TRACKING_ENV, "on").strip().lower()
    if raw in ("on", "1", "true", ""):
        return True
    if raw in ("off", "0", "false"):
        return False
    raise AgentRLError(f"{TRACKING_ENV}={os.environ[TRACKING_ENV]!r}: expected 'on' (the default) or 'off'")


def require_tracking(what: str) -> None:
    """Raise :class:`~pipeline.core.errors.AgentRLError` when tracking is off: `what` needs the MLflow store for its result."""
    if not tracking_enabled():
        raise AgentRLError(f"{what} needs the MLflow tracking store, and {TRACKING_ENV}=off turns it off: unset "
                           f"{TRACKING_ENV} (or set it to 'on') and run again; nothing was changed")


# MLflow's client reads these for every request (see the module docstring); the environment's own values win.
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}


def configure_http_retries() -> dict[str, str]:
    """Set :data:`HTTP_RETRY_DEFAULTS` where the environment has no value of its own (children inherit them);
    returns the values in force."""
    for key, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in HTTP_RETRY_DEFAULTS}


def store_failure(exc: BaseException, uri: str | None = None) -> str | None:
    """One line saying that the tracking store (at `uri`, else ``$MLFLOW_TRACKING_URI``) did not answer, when `exc`
    (or an exception it was raised from) is that: a connection refused, reset or timed out, or retries used up on
    429/5xx answers; None for anything else (a bad request is a bug or bad input, not the store's absence)."""
    markers = ("Max retries exceeded", "failed with exception", "failed with error code 5",
               "failed with error code 429", "Connection refused", "Connection aborted", "Read timed out")
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        text = str(current)
        if name in ("ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "MaxRetryError",
                    "NewConnectionError", "ProtocolError") or any(m in text for m in markers):
            uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "the tracking store")
            detail = text.splitlines()[0] if text else name
            return f"the MLflow tracking server at {uri} did not answer (retried per MLFLOW_HTTP_REQUEST_*: " \
                   f"{detail[:300]})"
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def store_errors(what: str, left: str = "", uri: str | None = None) -> Iterator[None]:
    """Turn a tracking store that did not answer (:func:`store_failure`) into one AgentRLError line, ``what: why``
    followed by `left` (what the caller knows about the state it leaves); anything else passes unchanged."""
    try:
        yield
    except AgentRLError:
        raise
    except Exception as exc:
        why = store_failure(exc, uri)
        if why is None:
            raise
        raise AgentRLError(f"{what}: {why}{'; ' + left if left else ''}") from exc


def mlflow_client(tracking_uri: str, registry_uri: str | None = None) -> Any:
    """An ``MlflowClient``; where MLflow cannot be imported, an :class:`~pipeline.core.errors.AgentRLError` that says how
    to install it or how to run without it, instead of an ImportError traceback. Applies
    :func:`configure_http_retries` first."""
    configure_http_retries()
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise AgentRLError(f"MLflow cannot be imported here ({exc}): install the project (`pip install -e .`), or set "
                           f"{TRACKING_ENV}=off to run a phase without tracking") from None
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)


_said_off: set[str] = set()


def _say_off(phase: str) -> None:
    if phase not in _said_off:
        _said_off.add(phase)
        logger.warning("%s=off: the %s run is not tracked (nothing is written to MLflow)", TRACKING_ENV, phase)


def _git_commit(root: Path) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None  # not a git repository, or no commit yet
    return proc.stdout.strip() or None


ON_OUTAGE = ("fail", "continue")  # what a run does when its store stops answering (see the module docstring)


class RunHandle:
    """The run a phase logs into; obtained from :meth:`Tracker.run`, never built by hand."""

    def __init__(self, client: Any, run_id: str, phase: str, on_outage: str = "fail",
                 tracking_uri: str | None = None) -> None:
        self._client = client
        self._uri = tracking_uri
        self.run_id = run_id
        self.phase = phase
        self._on_outage = on_outage
        self.lost: str | None = None  # why the store stopped answering, once it did (on_outage="continue")

    def _send(self, call: Any, *args: Any, **kwargs: Any) -> None:
        """One request to the store; with on_outage="continue", a store that does not answer (after its retries)
        turns this and every later call of the run into nothing, said once."""
        if self.lost is not None:
            return
        if self._on_outage == "fail":
            call(*args, **kwargs)
            return
        try:
            call(*args, **kwargs)
        except Exception as exc:
            why = store_failure(exc, self._uri)
            if why is None:
                raise
            self.lost = why
            print(f"warning: {self.phase}: {why}; the run {self.run_id} keeps what it logged so far and is not "
                  f"tracked from here on (it stays RUNNING in the store); the {self.phase} phase goes on and writes "
                  f"its outputs and metrics files as always", file=sys.stderr, flush=True)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params; nested mappings are flattened with dots (``env.reward.safety``)."""
        from mlflow.entities import Param

        flat = [Param(k, str(v)) for k, v in flatten(params).items()]
        for i in range(0, len(flat), _BATCH):
            self._send(self._client.log_batch, self.run_id, params=flat[i : i + _BATCH])

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log numeric metrics at `step` (0 when omitted); see :func:`namespaced` for the key rules. NaN is logged as is."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(k, v, now, step or 0) for k, v in namespaced(metrics, self.phase).items()]
        for i in range(0, len(entries), 1000):
            self._send(self._client.log_batch, self.run_id, metrics=entries[i : i + 1000])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file or a whole directory into the run's artefacts (under `artifact_path` when given)."""
        path = Path(path)
        if path.is_dir():
            self._send(self._client.log_artifacts, self.run_id, str(path), artifact_path)
        elif path.is_file():
            self._send(self._client.log_artifact, self.run_id, str(path), artifact_path)
        else:
            raise FileNotFoundError(f"cannot log artifact {path}: no such file or directory")

    def log_dict(self, obj: Any, name: str) -> None:
        """Store a JSON- or YAML-serialisable object as the artefact `name` (``.json``/``.yaml`` picks the format)."""
        self._send(self._client.log_dict, self.run_id, obj, name)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        entries = [RunTag(k, str(v)) for k, v in flatten(tags).items()]
        for i in range(0, len(entries), _BATCH):
            self._send(self._client.log_batch, self.run_id, tags=entries[i : i + _BATCH])


class Tracker:
    """Opens MLflow runs for phases; holds only its configuration, so one instance can open any number of runs."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = EXPERIMENT,
        root: str | Path | None = None,
        on_outage: str = "fail",
    ) -> None:
        if on_outage not in ON_OUTAGE:
            raise ValueError(f"on_outage must be one of {ON_OUTAGE}, not {on_outage!r}")
        self.root = Path(root).resolve() if root is not None else repo_root()
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.root / 'mlflow.db'}"
        self.experiment = experiment
        self.on_outage = on_outage  # "continue": a store lost in a run's body is said once and the run goes on

    @property
    def artifact_location(self) -> str | None:
        """Where a newly created experiment keeps artefacts: `mlartifacts/` next to a SQLite store, else the server's choice."""
        prefix = "sqlite:///"
        if self.tracking_uri.startswith(prefix):
            db = Path(self.tracking_uri[len(prefix) :])
            if not db.is_absolute():
                db = Path.cwd() / db
            return (db.parent / "mlartifacts").resolve().as_uri()
        return None

    def client(self) -> Any:
        return mlflow_client(self.tracking_uri)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Tag an existing run (one this tracker did not open, e.g. a flow's parent run); nested keys as in
        :meth:`RunHandle.set_tags`."""
        RunHandle(self.client(), run_id, "").set_tags(tags)

    def child_runs(self, parent_run_id: str) -> list[tuple[str, dict[str, str]]]:
        """(run id, tags) of every run nested directly under `parent_run_id`, in its experiment."""
        client = self.client()
        exp_id = client.get_run(parent_run_id).info.experiment_id
        runs = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
        return [(r.info.run_id, dict(r.data.tags)) for r in runs]

    def experiment_id(self, client: Any) -> str:
        """The id of the tracker's experiment, created (or restored from deletion) on first use."""
        from mlflow.exceptions import MlflowException

        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return client.create_experiment(self.experiment, artifact_location=self.artifact_location)
            except MlflowException:  # another process created it in between
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    @contextlib.contextmanager
    def run(
        self,
        phase: str,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
    ) -> Iterator[RunHandle]:
        """Open a run named `phase`, log `params` and `tags`, and close it FINISHED (or FAILED/KILLED if the body raises).

        The run is a child of `parent_run_id`, or of ``$AGENTRL_PARENT_RUN_ID`` when that is set. With
        ``AGENTRL_TRACKING=off`` it yields a :class:`NullRun` instead and touches no store.
        """
        if not tracking_enabled():
            _say_off(phase)
            yield NullRun(phase)
            return
        # a store that does not answer here stops the phase before it has done anything
        with store_errors(f"{phase}: cannot open its MLflow run", f"nothing was run; start the tracking server (or "
                          f"set {TRACKING_ENV}=off for a phase that can run untracked)", self.tracking_uri):
            client = self.client()
            exp_id = self.experiment_id(client)
            parent = parent_run_id or os.environ.get(PARENT_RUN_ENV) or None
            run_tags = {PHASE_TAG: phase, "mlflow.runName": phase, "mlflow.source.type": "LOCAL"}
            commit = _git_commit(self.root)
            if commit:
                run_tags["mlflow.source.git.commit"] = commit
            if parent:
                run_tags["mlflow.parentRunId"] = parent
            run = client.create_run(exp_id, run_name=phase, tags=run_tags)
            handle = RunHandle(client, run.info.run_id, phase, self.on_outage, self.tracking_uri)
        status, lost = "FAILED", None
        try:
            if params:
                handle.log_params(params)
            if tags:
                handle.set_tags(tags)
            yield handle
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except Exception as exc:  # the store gone in the body: raised as it is, the caller says what it leaves
            lost = None if isinstance(exc, AgentRLError) else store_failure(exc, self.tracking_uri)
            raise
        finally:
            if handle.lost is None and lost is None:  # a store that is gone is not asked again (another 30 s)
                try:
                    client.set_terminated(handle.run_id, status)
                except Exception as exc:  # a store gone in the body fails here too: its first error is the one
                    if status == "FINISHED":
                        raise
                    logger.warning("could not mark the %s run %s: %s", phase, status, str(exc).splitlines()[0][:200])


class NullRun:
    """A run that records nothing; same methods as :class:`RunHandle`."""

    run_id: str | None = None

    def __init__(self, phase: str = "") -> None:
        self.phase = phase

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_dict(self, obj: Any, name: str) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass


class NullTracker:
    """A tracker that records nothing (non-zero ranks, tests, dry runs); same interface as :class:`Tracker`."""

    @contextlib.contextmanager
    def run(
        self,
        phase: str,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
    ) -> Iterator[NullRun]:
        yield NullRun(phase)


def make_tracker(enabled: bool = True, **kwargs: Any) -> Tracker | NullTracker:
    """A real :class:`Tracker` when `enabled` (e.g. on rank 0), else a :class:`NullTracker`."""
    return Tracker(**kwargs) if enabled else NullTracker()


__all__ = ["EXPERIMENT", "HTTP_RETRY_DEFAULTS", "ON_OUTAGE", "PARENT_RUN_ENV", "TRACKING_ENV", "NullRun", "NullTracker",
           "RunHandle", "Tracker", "configure_http_retries", "flatten", "make_tracker", "mlflow_client", "namespaced",
           "require_tracking", "store_errors", "store_failure", "tracking_enabled"]
