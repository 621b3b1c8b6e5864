"""Benchmark: the served-model consistency check (pipeline.deploy.served_check) on a trained policy, and what it
measures when the served version has other weights.

Registers the policy of ``--root`` (its models/policy, data/env and data/tasks/test.jsonl; default: this
repository) as a pyfunc in a temporary SQLite MLflow store, runs the check exactly as the deploy phase does
(`agentrl serve` on the version in a subprocess, episodes over loopback HTTP, replay in the training environment),
and prints its figures: hidden-state MSE of the served int8 model against the fp32 training model, action agreement
(training path vs served, fp32 vs int8), latency per action served over HTTP and in-process, and the check's own
seconds. With ``--perturb S`` it also registers a copy whose every weight got Gaussian noise of S times that tensor's
standard deviation and checks *that* version against the unperturbed training path (the figures of "a different
model is served"). Nothing of ``--root`` is written. Settings are this repository's params.yaml.

    python bench/served_check.py [--root DIR] [--tasks 8] [--perturb 0.05]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def figures(result: dict) -> dict:
    keep = ("status", "reasons", "tasks", "states", "prompts_identical", "tokens_identical", "replay_identical",
            "hidden_mse", "action_agreement", "episodes_identical", "latency", "seconds")
    return {k: result.get(k) for k in keep}


def perturbed_copy(policy: Path, out: Path, scale: float, seed: int = 0) -> Path:
    import torch

    from pipeline.policy.model import load_policy, save_policy

    model, tok, meta = load_policy(policy)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * p.float().std() * scale)
    save_policy(model, tok, out, {**meta, "phase": "perturbed"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="project folder with models/policy, data/env, data/tasks")
    ap.add_argument("--tasks", type=int, default=None, help="tasks to play (default: deploy.served_check.tasks)")
    ap.add_argument("--perturb", type=float, default=None, help="also check a version with noisy weights")
    args = ap.parse_args()

    from pipeline.core.config import load_section
    from pipeline.core.tracking import Tracker
    from pipeline.deploy.config import DeployConfig
    from pipeline.deploy.gate import GateInputs
    from pipeline.deploy.pyfunc import save_pyfunc, serving_settings
    from pipeline.deploy.registry import ModelRegistry
    from pipeline.deploy.served_check import check_served
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy

    params = ROOT / "params.yaml"
    root = Path(args.root)
    env_cfg, roll = load_section(EnvConfig, "env", params), load_section(RolloutConfig, "rollout", params)
    cfg = load_section(DeployConfig, "deploy", params)
    over = {"policy": str(root / "models/policy"), "world_dir": str(root / "data/env"),
            "test_tasks": str(root / "data/tasks/test.jsonl"), "model_name": "bench-served"}
    if args.tasks:
        over["served_check"] = {**cfg.served_check.model_dump(), "tasks": args.tasks}
    cfg = DeployConfig(**{**cfg.model_dump(), **over})
    runtime = open_environment(env_cfg.name, cfg.world_dir)
    tasks = load_task_file(cfg.test_tasks, runtime)
    model, tok, _ = load_policy(cfg.policy)
    settings = serving_settings(env_cfg, roll, cfg.serve_precision, cfg.quantization, cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        tracker, registry = Tracker(tracking_uri=uri, root=tmp), ModelRegistry(cfg.model_name, uri)
        arms = [("served = trained", Path(cfg.policy))]
        if args.perturb:
            arms.append((f"served = weights + {args.perturb:g} sd noise",
                         perturbed_copy(Path(cfg.policy), tmp / "perturbed", args.perturb)))
        empty = GateInputs(adapt={}, drift={}, quantization={}, test_results=[])
        for name, policy in arms:
            with tracker.run("bench-served") as run:
                save_pyfunc(tmp / name.split()[-1] / "model", policy, cfg.world_dir, settings)
                version = registry.register(run.run_id, tmp / name.split()[-1] / "model", empty)
            result = check_served(registry.model_uri(version), uri, cfg, env_cfg, roll, tasks, model, tok, runtime)
            print(f"== {name} ({cfg.policy}, {result['tasks']} tasks)")
            print(json.dumps(figures(result), indent=1))
    runtime.close()


if __name__ == "__main__":
    from pipeline.core.config import ConfigError
    from pipeline.core.errors import AgentRLError

    try:
        main()
    except (AgentRLError, ConfigError) as exc:  # a missing project or model: one line, as the CLI prints it
        sys.exit(f"error: {exc}")
