"""Real production-style services on loopback ports, started and stopped by the tests and `bench/scale_out.py`:
PostgreSQL (a fresh cluster in a temporary folder), an S3-compatible object store (moto's server) and an MLflow
tracking server on either.

PostgreSQL: `initdb`, `pg_ctl` and `postgres` are looked up on PATH, then in Debian's /usr/lib/postgresql/*/bin. initdb
refuses to run as root, so as root the cluster is created and run through runuser by an unprivileged user that
already exists (`postgres` when the package made one, else `nobody`); no user is ever created. Its folder is a
fresh one under the system temporary directory, handed to that user (a pytest tmp_path of root's is not readable by
it). `postgres_missing()` names what stops a cluster from starting here, for the tests' skip reason. Authentication
is `trust` on 127.0.0.1 only.

S3: `moto_server` (from `moto[server]`) keeps its buckets in memory; any access key works. Clients reach it by an
endpoint URL: `AWS_ENDPOINT_URL` / `MLFLOW_S3_ENDPOINT_URL` for boto3 and MLflow, `dvc remote modify NAME endpointurl`
for DVC.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
S3_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
PG_USERS = ("postgres", "nobody")  # the unprivileged users, in order, that run the cluster when we are root

# The environment of every `mlflow server` the tests start: no telemetry, and none of MLflow 3's GenAI job execution
# (on by default: eight huey consumer processes beside each server, 14 s more CPU per start on the 2-core machine,
# and a store folder in /dev/shm that the server never removes). Nothing here uses those jobs.
SERVER_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 90.0, proc: subprocess.Popen | None = None) -> None:
    """Until `url` answers 200, or raise (also when `proc` exits first)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """End a process started with start_new_session=True and everything it started (SIGTERM, then SIGKILL)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()


# ------------------------------------------------------------------------------------------------------- PostgreSQL
def postgres_bin(name: str) -> str | None:
    """A PostgreSQL program: on PATH, else the newest /usr/lib/postgresql/<version>/bin; None when not installed."""
    found = shutil.which(name)
    if found:
        return found
    cands = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[-3]))
    return cands[-1] if cands else None


def _pg_user() -> str | None:
    """The existing unprivileged user that runs the cluster when this process is root (None: run it as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in PG_USERS:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError(f"running as root and none of the users {', '.join(PG_USERS)} exists to run PostgreSQL")


def postgres_missing() -> str | None:
    """Why a PostgreSQL cluster cannot start on this machine (None when it can): the reason a test skips with."""
    if postgres_bin("initdb") is None or postgres_bin("pg_ctl") is None:
        return "PostgreSQL's initdb/pg_ctl are not installed (PATH, /usr/lib/postgresql/*/bin)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root (initdb refuses root) and runuser is not installed to drop to an unprivileged user"
    try:
        _pg_user()
    except RuntimeError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def postgres(database: str = "mlflow"):
    """A fresh PostgreSQL cluster on a free loopback port with an empty `database`: yields its SQLAlchemy URL
    (``postgresql+psycopg://agentrl@127.0.0.1:PORT/DATABASE``); stopped and removed on exit."""
    import psycopg

    initdb, pg_ctl = postgres_bin("initdb"), postgres_bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise RuntimeError("PostgreSQL's initdb/pg_ctl not found on PATH or in /usr/lib/postgresql/*/bin")
    user = _pg_user()
    as_user = ["runuser", "-u", user, "--"] if user else []
    root = Path(tempfile.mkdtemp(prefix="agentrl-pg-"))
    if user:
        ent = pwd.getpwnam(user)
        os.chown(root, ent.pw_uid, ent.pw_gid)
    data, log, port = root / "data", root / "postgres.log", free_port()
    started = False
    try:
        run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True,  # noqa: E731
                                          timeout=120, cwd=root)
        run(initdb, "-D", str(data), "-U", "agentrl", "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        try:
            run(pg_ctl, "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "60", "start")
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"pg_ctl start failed: {exc.stderr or exc.stdout}; log: "
                               f"{log.read_text()[-2000:] if log.exists() else ''}") from None
        started = True
        with psycopg.connect(f"host=127.0.0.1 port={port} user=agentrl dbname=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        yield f"postgresql+psycopg://agentrl@127.0.0.1:{port}/{database}"
    finally:
        if started:
            subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], capture_output=True,
                           timeout=60, cwd=root)
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------- S3
@contextlib.contextmanager
def s3_server(*buckets: str):
    """moto's S3-compatible server on a free loopback port with `buckets` created: yields its endpoint URL. The
    process's environment gets the dummy credentials (S3_KEYS) while it runs."""
    import boto3

    port = free_port()
    proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    before = {k: os.environ.get(k) for k in S3_KEYS}
    os.environ.update(S3_KEYS)
    try:
        wait_http(f"{endpoint}/moto-api/", proc=proc)
        s3 = boto3.client("s3", endpoint_url=endpoint)
        for bucket in buckets:
            s3.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        stop(proc)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_keys(endpoint: str, bucket: str, prefix: str = "") -> list[str]:
    """Every object key under `prefix` in `bucket`."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


# ----------------------------------------------------------------------------------------------------------- MLflow
@contextlib.contextmanager
def mlflow_server(backend: str, artifacts: str, root: Path, s3_endpoint: str | None = None):
    """`mlflow server` with the `backend` store URI and artefacts proxied to `artifacts` (``s3://bucket/prefix`` or a
    ``file://`` URI) on a free loopback port: yields its tracking URI. With `s3_endpoint`, the server reaches S3 there
    (MLFLOW_S3_ENDPOINT_URL); clients need only HTTP to the server."""
    port = free_port()
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **SERVER_ENV}
    if s3_endpoint:
        env.update({**S3_KEYS, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint})
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", backend, "--artifacts-destination", artifacts,
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log = open(root / f"mlflow-server-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        log.close()
