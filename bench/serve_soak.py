"""Soak benchmark: `agentrl serve` (a real subprocess) under N concurrent clients sending a mixed stream of valid,
malformed, invalid and oversized requests for a fixed time.

What it prints: the request mix, the status counts per kind of request, p50/p99 latency of the valid requests that
were answered 200, the server's resident memory (RSS) after the warm-up and at the end, and the number of 5xx answers
and broken connections, which must both be 0 (the exit status is 1 otherwise). Every malformed, invalid or oversized
request must get a 4xx; a valid one a 200 (or 429/503 when the server sheds load). Figures only: nothing here asserts
a timing (tests/test_serve.py runs a short soak and asserts the statuses and a generous RSS bound).

The model: ``--tiny`` builds a tiny project (the real build_env, an untrained tiny policy: tests/deploy_support.py),
registers it with the real deploy phase in a temporary SQLite MLflow store and serves its champion, so it runs
anywhere in about a minute plus the soak; else ``--model-uri`` (default ``models:/<deploy.model_name>@champion`` of
params.yaml, in the store of ``--tracking-uri`` or MLFLOW_TRACKING_URI). The serve settings are params.yaml's
``deploy.serve`` (the tiny model's: its defaults) with the per-client rate limit lifted: every client here shares
one address.

    python bench/serve_soak.py --tiny [--clients 32] [--seconds 120]
    python bench/serve_soak.py --tiny --capture compare --seconds 60   # capture's cost: p50/p99 and RSS, off vs on
    python bench/serve_soak.py --model-uri models:/agentrl-policy@champion --tracking-uri sqlite:///mlflow.db \\
        --tasks data/tasks/test.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIX = {"valid": 0.5, "malformed_json": 0.15, "invalid_field": 0.25, "oversized": 0.1}
MALFORMED = [b"{not json", b"", b'{"question": "unterminated', b'{"question": NaN}', b"[" * 5000,
             b'{"question": "x", "answer": ' + b"9" * 5000 + b"}", b"\xff\xfe{}", b'{"question": "x",}']


def invalid_bodies(question: str, max_chars: int) -> list[dict | list | str]:
    """Well-formed JSON that is not a valid request: each must be a 422 naming the field."""
    return [{"question": question, "seed": -1}, {"question": question, "seed": 10**40},
            {"question": question, "seed": "7"}, {"question": question, "seed": True}, {"question": ""},
            {"question": "   "}, {"question": 7}, {"question": "q" * (max_chars + 1)}, {"task_id": "no question"},
            {"question": question, "tool": "update"}, {"question": question, "task_id": []},
            {"question": question, "answer": {"x": 1}}, {"question": question, "allowed_writes": "all"},
            {"question": question, "task_id": "x" * 300}, [1, 2], 5, {"question": "\ud800"},
            {"question": question, "answer": [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}]


def make_request(kind: str, rng: random.Random, tasks: list[dict], max_body: int, max_chars: int):
    """(body bytes or a chunk iterator, headers) of one request of `kind`."""
    headers = {"content-type": "application/json"}
    if kind == "valid":
        task = rng.choice(tasks)
        body = dict(task) if rng.random() < 0.3 else {"question": task["question"]}
        body["seed"] = rng.randrange(64)  # 64 seeds x the tasks: cache hits, misses and evictions
        return json.dumps(body).encode(), headers
    if kind == "malformed_json":
        return rng.choice(MALFORMED), headers
    if kind == "invalid_field":
        body = rng.choice(invalid_bodies(rng.choice(tasks)["question"], max_chars))
        return json.dumps(body).encode("utf-8", "surrogatepass"), headers
    blob = b'{"question": "' + b"q" * (max_body * rng.choice([2, 16, 64])) + b'"}'
    if rng.random() < 0.5:  # chunked: no Content-Length, counted while it streams in
        return (blob[i:i + 65536] for i in range(0, len(blob), 65536)), headers
    return blob, headers


def rss_bytes(pid: int) -> int:
    import psutil  # a dependency of deepspeed

    return psutil.Process(pid).memory_info().rss


def run_soak(base: str, pid: int, clients: int, seconds: float, warmup_s: float, tasks: list[dict],
             max_body: int, max_chars: int, headers: dict | None = None, seed: int = 0) -> dict:
    """Drive `clients` threads against `base` for `warmup_s` then `seconds`; the report (a dict) of the measured
    part: counts per kind and status, latencies of valid 200s, transport errors, RSS after warm-up and at the end."""
    import httpx

    counts: dict[str, Counter] = defaultdict(Counter)
    latencies: list[float] = []
    errors: Counter = Counter()
    lock = threading.Lock()
    phase = {"measure": False, "stop": False}
    kinds, weights = list(MIX), list(MIX.values())

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(timeout=120, headers=headers or {}) as http:
            while not phase["stop"]:
                kind = rng.choices(kinds, weights)[0]
                content, hdrs = make_request(kind, rng, tasks, max_body, max_chars)
                t = time.perf_counter()
                try:
                    r = http.post(f"{base}/solve", content=content, headers=hdrs)
                    status, dt = r.status_code, time.perf_counter() - t
                except httpx.TransportError as exc:
                    status, dt = f"transport error ({type(exc).__name__})", None
                if not phase["measure"]:
                    continue
                with lock:
                    counts[kind][status] += 1
                    if isinstance(status, str):
                        errors[kind] += 1
                    elif kind == "valid" and status == 200:
                        latencies.append(dt)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    rss_start = rss_bytes(pid)
    phase["measure"] = True
    t0 = time.perf_counter()
    time.sleep(seconds)
    phase["measure"] = False
    elapsed = time.perf_counter() - t0
    phase["stop"] = True
    for t in threads:
        t.join(timeout=180)
    rss_end = rss_bytes(pid)
    n5xx = sum(n for c in counts.values() for s, n in c.items() if isinstance(s, int) and s >= 500)
    return {"counts": {k: dict(v) for k, v in counts.items()}, "latencies": latencies, "transport_errors": dict(errors),
            "rss_start": rss_start, "rss_end": rss_end, "n5xx": n5xx, "seconds": elapsed, "clients": clients}


def print_report(rep: dict) -> None:
    import numpy as np

    total = sum(sum(c.values()) for c in rep["counts"].values())
    print(f"{rep['clients']} clients for {rep['seconds']:.0f} s: {total} requests ({total / rep['seconds']:.1f}/s); "
          f"mix drawn with weights {MIX}")
    print(f"{'kind':<16} {'requests':>8} {'share':>6}  statuses")
    for kind in MIX:
        c = rep["counts"].get(kind, {})
        n = sum(c.values())
        statuses = ", ".join(f"{s}: {k}" for s, k in sorted(c.items(), key=lambda x: str(x[0])))
        print(f"{kind:<16} {n:>8} {n / max(total, 1):>6.1%}  {statuses}")
    lat = rep["latencies"]
    if lat:
        print(f"valid requests answered 200: {len(lat)}; latency p50 {1000 * np.percentile(lat, 50):.1f} ms, "
              f"p99 {1000 * np.percentile(lat, 99):.1f} ms")
    growth = rep["rss_end"] / rep["rss_start"] - 1
    print(f"server RSS after warm-up {rep['rss_start'] / 2**20:.1f} MiB, at the end {rep['rss_end'] / 2**20:.1f} MiB "
          f"({growth:+.1%})")
    print(f"5xx answers: {rep['n5xx']} (must be 0); broken connections: {sum(rep['transport_errors'].values())} "
          f"(must be 0)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tiny_champion(tmp: Path):
    """A tiny project registered as champion in a SQLite store under `tmp`: (tracking URI, model URI, tasks file,
    serve config)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from deploy_support import ENV, ROLL, build_project, deploy_config, tracking_uri

    from pipeline.deploy.main import deploy

    project = build_project(tmp / "project")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with tracking_uri(uri):
        cfg = deploy_config(project, "soak-tiny", precisions=["fp32", "int8"])
        out = deploy(cfg, ENV, ROLL, project / "metrics", project / "metrics" / "deploy.json")
        if not out["decision"].passed:
            raise SystemExit("the tiny model was not promoted; nothing to serve")
    yield uri, f"models:/{cfg.model_name}@champion", project / "data/tasks/test.jsonl", cfg


def soak_server(params: Path, model_uri: str, tracking: str | None, tasks: list[dict], serve_cfg, args,
                log_path: Path) -> dict:
    """Start `agentrl serve` with `params`, soak it, stop it; the report of :func:`run_soak`."""
    import httpx

    port = free_port()
    env = {**os.environ, **({"MLFLOW_TRACKING_URI": tracking} if tracking else {})}
    log = open(log_path, "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(params),
                             "--model-uri", model_uri, "--port", str(port)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise SystemExit(f"error: `agentrl serve` on {model_uri} did not become ready: {tail[0]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    break
            time.sleep(0.3)
        print(f"model {model_uri}; serve: max_batch_size {serve_cfg.max_batch_size}, max_wait_ms "
              f"{serve_cfg.max_wait_ms}, max_body_bytes {serve_cfg.max_body_bytes}, max_queue "
              f"{serve_cfg.max_queue}, cache_size {serve_cfg.cache_size}, capture "
              f"{'on' if serve_cfg.capture.enabled else 'off'}; {len(tasks)} tasks; warm-up {args.warmup:.0f} s",
              flush=True)
        return run_soak(base, proc.pid, args.clients, args.seconds, args.warmup, tasks, serve_cfg.max_body_bytes,
                        serve_cfg.max_question_chars)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a server that exited on its own has no group left
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def print_capture_cost(off: dict, on: dict, folder: Path) -> None:
    """Capture off against on, side by side: p50/p99 of the valid 200s, RSS at the end, what capture wrote."""
    import numpy as np

    from pipeline.core.traffic import segment_files

    def row(rep):
        lat = rep["latencies"] or [float("nan")]
        return 1000 * np.percentile(lat, 50), 1000 * np.percentile(lat, 99), rep["rss_end"] / 2**20, len(lat)

    (p50a, p99a, rssa, na), (p50b, p99b, rssb, nb) = row(off), row(on)
    size = sum(p.stat().st_size for p in segment_files(folder))
    print(f"{'capture':<8} {'p50 ms':>8} {'p99 ms':>8} {'RSS MiB':>8} {'answered':>8}")
    print(f"{'off':<8} {p50a:>8.1f} {p99a:>8.1f} {rssa:>8.1f} {na:>8}")
    print(f"{'on':<8} {p50b:>8.1f} {p99b:>8.1f} {rssb:>8.1f} {nb:>8}")
    print(f"on/off: p50 {p50b / p50a - 1:+.1%}, p99 {p99b / p99a - 1:+.1%}, RSS {rssb / rssa - 1:+.1%}; capture "
          f"wrote {size / 2**20:.1f} MiB in {len(segment_files(folder))} segments")
    per = append_cost(folder, folder.parent / "traffic-replay")
    print(f"capture's own work per answer (redact, encode, write; the records above written again): "
          f"{per * 1e6:.0f} us = {per * 1000 / p50a:.3%} of the p50 latency with capture off")


def append_cost(folder: Path, scratch: Path, redact: tuple[str, ...] = ("task_id",)) -> float:
    """Seconds per record of CaptureStore.append (with one redacted field) on the records in `folder`: the part of
    a captured answer's latency that capture adds, without the soak's noise (the machine is shared)."""
    from pipeline.core.traffic import read_records
    from pipeline.deploy.capture import CaptureStore
    from pipeline.deploy.config import CaptureConfig

    records = list(read_records(folder, "request"))
    store = CaptureStore(CaptureConfig(enabled=True, dir=str(scratch), redact=list(redact)))
    t = time.perf_counter()
    for rec in records:
        store.append(rec)
    store.close()
    return (time.perf_counter() - t) / max(len(records), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of load before RSS is first measured")
    ap.add_argument("--tiny", action="store_true", help="build and register a tiny model in a temporary store")
    ap.add_argument("--model-uri", default=None)
    ap.add_argument("--tracking-uri", default=None, help="MLflow store of --model-uri (default: MLFLOW_TRACKING_URI)")
    ap.add_argument("--tasks", default=str(ROOT / "data/tasks/test.jsonl"), help="task records the valid requests use")
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--capture", choices=("off", "on", "compare"), default="off",
                    help="capture of answered requests (deploy.serve.capture) off, on, or one soak each, side by side")
    args = ap.parse_args()

    import yaml

    from pipeline.core.config import load_section
    from pipeline.deploy.config import DeployConfig

    with tempfile.TemporaryDirectory() as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        if args.tiny:
            tracking, model_uri, tasks_file, cfg = stack.enter_context(tiny_champion(tmp))
        else:
            cfg = load_section(DeployConfig, "deploy", args.params)
            tracking = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            model_uri, tasks_file = args.model_uri or f"models:/{cfg.model_name}@champion", Path(args.tasks)
        tasks = [json.loads(line) for line in tasks_file.read_text().splitlines() if line.strip()]
        reports = {}
        for mode in (("off", "on") if args.capture == "compare" else (args.capture,)):
            capture = cfg.serve.capture.model_copy(update={"enabled": mode == "on", "dir": str(tmp / "traffic")})
            serve_cfg = cfg.serve.model_copy(update={"rate_limit_per_s": 1e6, "rate_burst": 1_000_000,
                                                     "capture": capture})
            params = tmp / f"params-{mode}.yaml"
            params.write_text(yaml.safe_dump({"deploy": cfg.model_copy(update={"serve": serve_cfg}).model_dump()}))
            reports[mode] = soak_server(params, model_uri, tracking, tasks, serve_cfg, args, tmp / f"serve-{mode}.log")
            print_report(reports[mode])
        if args.capture == "compare":
            print_capture_cost(reports["off"], reports["on"], tmp / "traffic")
    if any(rep["n5xx"] or rep["transport_errors"] for rep in reports.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
