#!/usr/bin/env python
"""What the production stores and a second node add to a run, each measured beside the local default in the same
invocation, on tiny configurations. Starts and stops every service itself (tests/services.py); prints one table.

    python bench/scale_out.py                        # every part, about 8 minutes on 2 loaded cores
    python bench/scale_out.py --parts mlflow,dvc     # some of them
    python bench/scale_out.py --deploys 3 --dvc-mb 64

Parts (each row: the default, the scale-out setup, their ratio):
- mlflow: one `deploy` of a tiny policy (variants measured, pyfunc logged, version registered, gate, aliases) with a
  local SQLite store and file artefacts (MLFLOW_TRACKING_URI=sqlite:///...), with an `mlflow server` on SQLite and
  local files (what the server alone adds), and with an `mlflow server` on PostgreSQL with artefacts proxied to S3;
  then loading ``models:/NAME@champion``. The PostgreSQL + S3 + server start is shown apart.
- dvc: `dvc push` and `dvc pull` (after wiping the cache and the workspace copies) of a tiny project's data and models
  plus `--dvc-mb` MB of random bytes, to the default local remote and to an S3 bucket.
- prefect: one run of the retraining flow (nothing to retrain: the orchestration's own cost) with `agentrl schedule
  --once` (a temporary local Prefect server in the process), against a deployment run picked up by a `process`
  worker from a `prefect server` (trigger to completion).
- deepspeed: a tiny RL training (`--updates` updates) on 2 ranks by one launcher, against 2 "nodes" of 1 rank each
  over loopback (two launchers, `--no_ssh --node_rank K`, the gloo transport between them).

Timings only; nothing is asserted. The machine's load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
BIN = Path(sys.executable).parent

from services import S3_KEYS, free_port, mlflow_server, postgres, s3_server, stop, wait_http  # noqa: E402

ROWS: list[tuple[str, str, float, str, float]] = []


def row(what: str, base_name: str, base: float, other_name: str, other: float) -> None:
    ROWS.append((what, base_name, base, other_name, other))
    print(f"  {what}: {base_name} {base:.2f} s, {other_name} {other:.2f} s", flush=True)


def timed(fn, *args, **kw) -> float:
    t = time.perf_counter()
    fn(*args, **kw)
    return time.perf_counter() - t


# ----------------------------------------------------------------------------------------------------------- MLflow
def part_mlflow(work: Path, deploys: int) -> None:
    import mlflow.pyfunc

    from deploy_support import ENV, ROLL, build_project, deploy_config, nudged_policy, tracking_uri
    from pipeline.deploy.main import deploy

    project = build_project(work / "project")
    policies = [nudged_policy(project, work / f"p{i}", 1e-6 * (i + 1)) for i in range(deploys)]

    def deploys_on(name: str) -> tuple[float, float]:
        took = []
        for policy in policies:
            cfg = deploy_config(project, name, precisions=["fp32", "int8"], policy=policy)
            took.append(timed(deploy, cfg, ENV, ROLL, project / "metrics", project / "metrics" / "deploy.json"))
        load = timed(mlflow.pyfunc.load_model, f"models:/{name}@champion")
        return sum(took) / len(took), load

    with tracking_uri(f"sqlite:///{work / 'local' / 'mlflow.db'}"):
        (work / "local").mkdir()
        local = deploys_on("bench-local")
    with mlflow_server(f"sqlite:///{work / 'served' / 'mlflow.db'}", (work / "served" / "artifacts").as_uri(),
                       work / "served") as uri, tracking_uri(uri):
        served = deploys_on("bench-served")
    t0 = time.perf_counter()
    with postgres() as db, s3_server("agentrl-mlflow") as s3, \
            mlflow_server(db, "s3://agentrl-mlflow/artifacts", work / "logs", s3_endpoint=s3) as uri:
        started = time.perf_counter() - t0
        with tracking_uri(uri):
            remote = deploys_on("bench-remote")
    print(f"  PostgreSQL + S3 + mlflow server start (once): {started:.1f} s")
    row(f"mlflow: one deploy (mean of {deploys})", "sqlite+files", local[0], "server+sqlite+files", served[0])
    row(f"mlflow: one deploy (mean of {deploys})", "server+sqlite+files", served[0], "server+pg+s3", remote[0])
    row(f"mlflow: one deploy (mean of {deploys})", "sqlite+files", local[0], "server+pg+s3", remote[0])
    row("mlflow: load models:/NAME@champion", "sqlite+files", local[1], "server+pg+s3", remote[1])


# -------------------------------------------------------------------------------------------------------------- DVC
def part_dvc(work: Path, mb: int) -> None:
    from deploy_support import build_project

    root = build_project(work / "dvcproj")
    (root / "data" / "blob.bin").write_bytes(os.urandom(mb * 2**20))
    env = {**os.environ, **S3_KEYS}
    dvc = lambda *a: subprocess.run([sys.executable, "-m", "dvc", *a], cwd=root, env=env, check=True,  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    for cmd in (["git", "init", "-q"],):
        subprocess.run(cmd, cwd=root, check=True)
    dvc("init", "-q")
    dvc("add", "-q", "data", "models")
    dvc("remote", "add", "local", str(work / "dvc-remote"))

    def round_trip(remote: str) -> tuple[float, float]:
        push = timed(dvc, "push", "-q", "-r", remote)
        for d in ("data", "models", ".dvc/cache"):
            shutil.rmtree(root / d)
        pull = timed(dvc, "pull", "-q", "-r", remote)
        return push, pull

    local = round_trip("local")
    with s3_server("agentrl-dvc") as s3:
        dvc("remote", "add", "s3", "s3://agentrl-dvc/cache")
        dvc("remote", "modify", "s3", "endpointurl", s3)
        remote = round_trip("s3")
    size = sum(p.stat().st_size for d in ("data", "models") for p in (root / d).rglob("*") if p.is_file())
    row(f"dvc push ({size / 2**20:.1f} MiB)", "local remote", local[0], "s3", remote[0])
    row(f"dvc pull ({size / 2**20:.1f} MiB)", "local remote", local[1], "s3", remote[1])


# ---------------------------------------------------------------------------------------------------------- Prefect
def part_prefect(work: Path) -> None:
    from test_flow import clean_env, make_project

    root = make_project(work / "flowproj")
    env = clean_env(root)
    env["PREFECT_HOME"] = str(work / "prefect-home-once")
    agentrl = lambda *a, e=env: subprocess.run([str(BIN / "agentrl"), *a], cwd=root, env=e, check=True,  # noqa: E731
                                               capture_output=True, text=True, timeout=600)
    agentrl("schedule", "--once")  # first use: migrations of the temporary server's database
    once = timed(agentrl, "schedule", "--once")
    port = free_port()
    env = {**clean_env(root), "PREFECT_HOME": str(work / "prefect-home"), "PWD": str(root),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_WORKER_QUERY_SECONDS": "2"}
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True)
    worker = None
    prefect = lambda *a: subprocess.run([str(BIN / "prefect"), *a], cwd=root, env=env, check=True,  # noqa: E731
                                        capture_output=True, text=True, timeout=600)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", proc=server)
        prefect("work-pool", "create", "agentrl", "--type", "process")
        prefect("--no-prompt", "deploy", "--name", "nightly-retrain")
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "agentrl"], cwd=work, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        run = ("deployment", "run", "agentrl-retrain/nightly-retrain", "--watch", "--watch-timeout", "300")
        prefect(*run)  # the worker's first run
        on_worker = timed(prefect, *run)
    finally:
        for proc in (worker, server):
            if proc is not None:
                stop(proc)
    row("prefect: one retraining decision", "schedule --once", once, "server+worker", on_worker)


# -------------------------------------------------------------------------------------------------------- DeepSpeed
def part_deepspeed(work: Path, updates: int) -> None:
    from pipeline.train.distributed import child_env
    from pipeline.train.main import launcher_command
    from pipeline.train.nodes import nodes_from_env
    from test_train import make_project

    base = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def one_node() -> None:
        proj = make_project(work / "ds1", ranks=2, updates=updates)
        cmd = launcher_command("params.yaml", 2, free_port())
        subprocess.run(cmd, cwd=proj, env=child_env(base), check=True, capture_output=True, timeout=900)

    def two_nodes() -> None:
        node0 = make_project(work / "ds2" / "node0", ranks=2, updates=updates)
        node1 = work / "ds2" / "node1"
        shutil.copytree(node0, node1, ignore=shutil.ignore_patterns("models"))
        (node0 / "checkpoints").mkdir()
        for shared in ("models", "checkpoints"):
            (node1 / shared).symlink_to(node0 / shared)
        hosts = work / "ds2" / "hostfile"
        hosts.write_text("node-0 slots=1\nnode-1 slots=1\n")
        port, procs = free_port(), []
        for k, root in enumerate((node0, node1)):
            env = child_env({**base, "AGENTRL_HOSTFILE": str(hosts), "AGENTRL_NODE_RANK": str(k),
                             "AGENTRL_MASTER_ADDR": "127.0.0.1", "AGENTRL_MASTER_PORT": str(port)})
            cmd = launcher_command("params.yaml", 2, 0, None, nodes_from_env(2, env))
            procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=900) for p in procs]
        if codes != [0, 0]:
            raise RuntimeError(f"two-node launch exited with {codes}")

    row(f"deepspeed: {updates} updates, 2 ranks", "1 node x 2", timed(one_node), "2 nodes x 1", timed(two_nodes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="mlflow,dvc,prefect,deepspeed")
    ap.add_argument("--deploys", type=int, default=2, help="deploys per store (mlflow part)")
    ap.add_argument("--dvc-mb", type=int, default=32, help="MB of random bytes added to the pushed data (dvc part)")
    ap.add_argument("--updates", type=int, default=4, help="RL updates (deepspeed part)")
    args = ap.parse_args(argv)
    parts = {"mlflow": lambda w: part_mlflow(w, args.deploys), "dvc": lambda w: part_dvc(w, args.dvc_mb),
             "prefect": part_prefect, "deepspeed": lambda w: part_deepspeed(w, args.updates)}
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in parts]
    if unknown:
        print(f"error: --parts: unknown part(s) {', '.join(unknown)} (known: {', '.join(parts)})", file=sys.stderr)
        return 2
    os.environ.update({"MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1"})
    load0 = os.getloadavg()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory(prefix="agentrl-scale-out-") as tmp:
        for name in chosen:
            print(f"{name} ...", flush=True)
            with contextlib.chdir(tmp):
                parts[name](Path(tmp) / name)
    load1 = os.getloadavg()
    print("\n| what | default | s | scale-out | s | ratio |\n|---|---|---:|---|---:|---:|")
    for what, bn, b, on, o in ROWS:
        print(f"| {what} | {bn} | {b:.2f} | {on} | {o:.2f} | {o / b:.2f}x |")
    print(f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
