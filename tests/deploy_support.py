"""Shared pieces of tests/test_deploy.py and tests/test_serve.py: a real MLflow tracking server on a loopback port
(SQLite store, file artefacts), a tiny world and policy, and the metrics files of the stages deploy reads.

The metrics files stand in for the outputs of the adapt, train and check_drift stages (their formats are the ones those
phases write); the policy is a real (untrained, tiny) model and every episode is played by the real rollout engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from services import SERVER_ENV, free_port, wait_http  # noqa: F401  (re-exported: tests import them from here)

from pipeline.deploy.config import DeployConfig
from pipeline.envs.config import EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.policy.config import ModelConfig, RolloutConfig

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_positions=512, vocab_size=400, dtype="fp32")
ENV = EnvConfig(max_steps=3)
ROLL = RolloutConfig(max_new_tokens=12, batch_size=16, num_threads=1)
N_TEST = 24


@contextlib.contextmanager
def mlflow_server(root: Path, port: int | None = None, started: list | None = None):
    """`mlflow server` with a SQLite backend and file artefacts on a loopback port (`port`, else a free one); stopped on
    exit. A server started again on the same `root` and `port` serves the same store. `started` collects the
    server's process (a test that stops it on purpose)."""
    port = port or free_port()
    root.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--default-artifact-root", (root / "artifacts").as_uri(), "--no-serve-artifacts",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV},
                            start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    if started is not None:
        started.append(proc)
    try:
        wait_http(f"{uri}/health", proc=proc)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):  # stopped already by the test
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


@contextlib.contextmanager
def tracking_uri(uri: str):
    before = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        yield uri
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


def build_project(root: Path) -> Path:
    """A tiny project folder: data/ (world, splits) by the real build_env, models/policy (a tiny untrained model with
    a tokenizer trained on the world's text), and metrics/ for train, adapt and drift with passing verdicts."""
    from pipeline.build_env.main import build
    from pipeline.policy.model import build_policy, save_policy
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer

    from pipeline.envs.shop import ShopWorld

    cfg = BuildEnvConfig(options={"n_products": 40, "n_suppliers": 12},
                         tasks_per_split={"train": 40, "validation": 8, "test": N_TEST},
                         demos={"level_coverage": {1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2}})
    build(cfg, EnvConfig(), root / "data", root / "metrics" / "build_env.json")
    world = ShopWorld.load(root / "data" / "env")
    signatures = [s.signature() for s in world.tools()]
    world.close()
    tok = train_tokenizer(corpus_texts(root / "data", signatures), TINY.vocab_size)
    save_policy(build_policy(TINY, tok), tok, root / "models" / "policy", {"phase": "train", "step": 0})
    write_metrics(root / "metrics")
    return root


def write_metrics(metrics: Path, adapt_passed: bool | None = True, drift_passed: bool = True,
                  consistency: str = "pass") -> None:
    metrics.mkdir(parents=True, exist_ok=True)
    (metrics / "train.json").write_text(json.dumps({"algorithm": "rloo", "updates": 0}))
    (metrics / "adapt.json").write_text(json.dumps({"gate": {"enabled": adapt_passed is not None,
                                                             "passed": adapt_passed, "min": {}, "shortfalls": []}}))
    (metrics / "drift.json").write_text(json.dumps({
        "passed": drift_passed, "verdict": "pass" if drift_passed else "fail",
        "failed_checks": [] if drift_passed else ["task_drift"],
        "checks": {"consistency": {"status": consistency}, "task_drift": {"status": "pass" if drift_passed else "fail"}}}))


def deploy_config(root: Path, name: str, **over) -> DeployConfig:
    base = dict(policy=str(root / "models" / "policy"), world_dir=str(root / "data" / "env"),
                test_tasks=str(root / "data" / "tasks" / "test.jsonl"), model_name=name, latency_tasks=4,
                gate={"min_paired_tasks": 10},
                served_check={"enabled": False})  # it starts `agentrl serve`: tests/test_served_check.py turns it on
    base.update(over)
    return DeployConfig(**base)


def write_params(root: Path, cfg: DeployConfig) -> Path:
    import yaml

    path = root / "params.yaml"
    path.write_text(yaml.safe_dump({"deploy": cfg.model_dump(), "env": ENV.model_dump(), "rollout": ROLL.model_dump()}))
    return path


def snapshot(registry) -> dict:
    """Everything the gate could change: aliases, the history, every version's tags."""
    if not registry.exists():
        return {}
    rm = registry.client.get_registered_model(registry.name)
    versions = registry.client.search_model_versions(f"name='{registry.name}'")
    return {"aliases": dict(rm.aliases), "tags": dict(rm.tags),
            "versions": {v.version: dict(v.tags) for v in versions}}


def nudged_policy(project: Path, dest: Path, delta: float, source: str | Path | None = None) -> str:
    """A copy of the project's policy (or of the policy folder `source`) with one weight moved by `delta`: other
    weights (another weights.sha256) that play the same greedy episodes when `delta` is tiny."""
    import torch

    from pipeline.policy.model import load_policy, save_policy

    model, tok, meta = load_policy(Path(source) if source else project / "models" / "policy")
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += delta
    save_policy(model, tok, dest, {k: v for k, v in meta.items() if k in ("phase", "step")})
    return str(dest)


def parse_prometheus(text: str) -> dict:
    """{(name, frozenset(labels)): value} by prometheus_client's own parser (it raises on malformed text)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}
