"""Benchmark: `agentrl serve` throughput with 32 concurrent clients against one client at a time, latency
percentiles, and the effect of the identical-request cache.

The server runs as its own process (``agentrl serve --model-uri <pyfunc folder>``, the int8 serving precision of
params.yaml's deploy section) on a loopback port; the clients are threads of this process (httpx). Phases, each on
tasks no earlier phase sent (so nothing is cached until the cache phase):

1. one client, one request at a time (`--sequential` test tasks);
2. `--clients` concurrent clients sending `--concurrent` tasks in all (the batcher groups them);
3. the same requests as phase 2 again: every one is a cache hit.

Goal: throughput at 32 clients at least 8x one client at a time. The policy is models/policy (else
models/adapted, else the built-in default size with random weights, said in the output: every action then runs to
max_new_tokens and every episode to max_steps, ~400 generated tokens per request). Quote ratios: the machine is shared.

``--prefix-cache on|off`` overrides params.yaml's ``rollout.prefix_cache`` (the shared-prompt-prefix KV cache of the
rollout engine): run it both ways to see what the prefix cache does to each phase.

    python bench/serve.py [--clients 32] [--sequential 12] [--concurrent 96] [--threads 1] [--prefix-cache on|off]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def timed_requests(client, url: str, bodies: list[dict], clients: int) -> tuple[float, list[float], list[dict]]:
    def one(body):
        t = time.perf_counter()
        r = client.post(url, json=body)
        r.raise_for_status()
        return time.perf_counter() - t, r.json()

    t0 = time.perf_counter()
    if clients == 1:
        out = [one(b) for b in bodies]
    else:
        with ThreadPoolExecutor(clients) as pool:
            out = list(pool.map(one, bodies))
    return time.perf_counter() - t0, [o[0] for o in out], [o[1] for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--sequential", type=int, default=12)
    ap.add_argument("--concurrent", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--prefix-cache", choices=["on", "off"], default=None, help="default: params.yaml")
    args = ap.parse_args()

    import httpx
    import yaml

    from deploy import load_model  # bench/deploy.py: the same policy choice
    from pipeline.core.config import load_section
    from pipeline.deploy.config import DeployConfig
    from pipeline.deploy.pyfunc import save_pyfunc, serving_settings
    from pipeline.envs.config import EnvConfig
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import save_policy

    params = ROOT / "params.yaml"
    env_cfg = load_section(EnvConfig, "env", params)
    cfg = load_section(DeployConfig, "deploy", params)
    roll = load_section(RolloutConfig, "rollout", params)
    roll = roll.model_copy(update={"num_threads": args.threads, "batch_size": max(args.clients, 1),
                                   "prefix_cache": roll.prefix_cache if args.prefix_cache is None
                                   else args.prefix_cache == "on"})
    serve_cfg = cfg.serve.model_copy(update={"max_batch_size": args.clients, "rate_limit_per_s": 1e6,
                                             "rate_burst": 1_000_000})
    tasks = [json.loads(l) for l in (ROOT / "data/tasks/test.jsonl").read_text().splitlines()]
    need = args.sequential + args.concurrent + 2
    if len(tasks) < need:
        raise SystemExit(f"need {need} test tasks, data/tasks/test.jsonl has {len(tasks)}")
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, source = load_model(args.policy)
        save_policy(model, tok, Path(tmp) / "policy", {"phase": "bench"})
        del model
        save_pyfunc(Path(tmp) / "model", Path(tmp) / "policy", ROOT / "data/env",
                    serving_settings(env_cfg, roll, cfg.serve_precision, cfg.quantization, cfg.seed))
        p = Path(tmp) / "params.yaml"
        p.write_text(yaml.safe_dump({"deploy": cfg.model_copy(update={"serve": serve_cfg}).model_dump()}))
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.Popen([str(Path(sys.executable).parent / "agentrl"), "serve", "--params", str(p),
                                 "--model-uri", str(Path(tmp) / "model"), "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=args.clients + 4)) as client:
                for _ in range(600):
                    try:
                        if client.get(f"{base}/ready").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if proc.poll() is not None:
                        raise SystemExit("the server exited before it was ready")
                    time.sleep(0.2)
                url = f"{base}/solve"
                timed_requests(client, url, tasks[:2], 1)  # warm-up
                seq = tasks[2:2 + args.sequential]
                conc = tasks[2 + args.sequential:need]
                t1, lat1, _ = timed_requests(client, url, seq, 1)
                s0 = client.get(f"{base}/stats").json()
                tc, latc, outc = timed_requests(client, url, conc, args.clients)
                s1 = client.get(f"{base}/stats").json()
                th, lath, outh = timed_requests(client, url, conc, args.clients)
                s2 = client.get(f"{base}/stats").json()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    thr1, thrc, thrh = len(seq) / t1, len(conc) / tc, len(conc) / th
    batches = s1["batches"] - s0["batches"]
    actions = sum(o["n_calls"] for o in outc) / len(outc)
    print(f"policy: {source}; serving precision {cfg.serve_precision}; prefix cache "
          f"{'on' if roll.prefix_cache else 'off'}; {args.threads} model thread(s); "
          f"{actions:.1f} actions per request; max_batch_size {args.clients}, max_wait {serve_cfg.max_wait_ms} ms")
    print(f"{'phase':<28} {'requests':>8} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9}")
    for name, n, thr, lat in [("1 client, one at a time", len(seq), thr1, lat1),
                              (f"{args.clients} concurrent clients", len(conc), thrc, latc),
                              (f"{args.clients} clients, cache hits", len(conc), thrh, lath)]:
        print(f"{name:<28} {n:>8} {thr:>8.2f} {1000 * percentile(lat, 50):>9.1f} {1000 * percentile(lat, 99):>9.1f}")
    print(f"batches in the concurrent phase: {batches} for {len(conc)} requests (mean batch "
          f"{len(conc) / max(batches, 1):.1f}); cache hits in the repeat phase: {s2['cache_hits'] - s1['cache_hits']}"
          f"/{len(conc)}, all identical to the first answers: {outh == [{**o, 'cached': True} for o in outc]}")
    print(f"goal throughput {args.clients} clients >= 8 x one at a time: {thrc / thr1:.1f}x -> "
          f"{'MET' if thrc / thr1 >= 8 else 'NOT MET'}; cache: {thrh / thrc:.0f}x the uncached concurrent throughput, "
          f"p50 {1000 * percentile(lath, 50):.1f} ms vs {1000 * percentile(latc, 50):.1f} ms")


if __name__ == "__main__":
    main()
