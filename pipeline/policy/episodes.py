"""Evaluate a policy on a task file: success, return, reward components, tool calls and safety, overall and per level.

`run_episode` drives one episode of the pipeline's runner (:class:`pipeline.envs.runner.AgentEnv`) with a policy that maps (observation, info) to action text;
`summarize` turns episode records into the metrics every phase reports. The language-model policy of later phases
produces the same episode records from its batched rollout engine and reuses `summarize`.

Entry point: ``agentrl eval --policy expert|random|MODEL_DIR --tasks FILE --out FILE.json`` (a model directory is
evaluated greedily through the batched rollout engine, with the `rollout` section's settings). The task file is read by
:func:`pipeline.envs.taskfile.load_task_file`, so it is checked (the pipeline's task keys and the environment's own
Great Expectations suite) before any episode runs. The environment is `env.name` of the params file, its world read
from `--world`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.core.atomic import check_target, write_json
from pipeline.core.config import load_section
from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import Environment
from pipeline.envs.registry import open_environment
from pipeline.envs.runner import AgentEnv
from pipeline.envs.taskfile import load_task_file, read_task_records
from pipeline.core.errors import AgentRLError
from pipeline.policy.record import EpisodeRecord

COMPONENTS = ("correctness", "efficiency", "safety", "user_experience")
POLICIES = ("expert", "random")


def run_episode(env: AgentEnv, policy, task, seed: int) -> EpisodeRecord:
    """Play one episode; returns its record (the trajectory as text and as calls, reward components, outcome; the
    keys :data:`pipeline.policy.record.EPISODE_KEYS`)."""
    obs, info = env.reset(seed=seed, options={"task": task})
    policy.reset(task)
    steps, terminated, truncated = [], False, False
    while not (terminated or truncated):
        action = policy.act(obs, info)
        obs, _, terminated, truncated, info = env.step(action)
        steps.append({"action": info["action_text"], "observation": info["observation_text"]})
    return {
        "task_id": task.task_id, "env": info["env"], "level": task.level, "family": task.family,
        "template_seen": task.template_seen,
        "success": bool(info["is_success"]), "return": float(info["return"]), "truncated": bool(truncated),
        "components": dict(info["reward_components"]), "n_calls": info["n_calls"],
        "n_violations": info["n_violations"], "n_failed": info["n_failed"], "verifier": info["verifier"],
        "answer": info["answer"], "ground_truth": info["ground_truth"], "steps": steps, "calls": info["calls"],
    }


def _stats(records: list[dict]) -> dict:
    n = len(records)
    solved = [r for r in records if r["success"]]
    return {
        "n": n,
        "success_rate": sum(r["success"] for r in records) / n,
        "mean_return": float(np.mean([r["return"] for r in records])),
        **{f"mean_{c}": float(np.mean([r["components"][c] for r in records])) for c in COMPONENTS},
        "mean_tool_calls": float(np.mean([r["n_calls"] for r in records])),
        "mean_tool_calls_solved": float(np.mean([r["n_calls"] for r in solved])) if solved else None,
        # every call made, failed episodes' included, per task solved: what a success costs in calls
        "tool_calls_per_success": float(sum(r["n_calls"] for r in records)) / len(solved) if solved else None,
        "safety_violations": int(sum(r["n_violations"] for r in records)),
        "verifier_pass_rate": sum(r["verifier"]["passed"] for r in records) / n,
        "truncated_rate": sum(r["truncated"] for r in records) / n,
    }


def summarize(records: list[dict]) -> dict:
    """Overall and per-level metrics of episode records (also split by seen/unseen template when both occur, and
    by environment, overall and per level, when the records come from more than one: a mixed run)."""
    if not records:
        raise ValueError("no episodes to summarize")
    out = {"overall": _stats(records), "per_level": {}}
    for lv in sorted({r["level"] for r in records}):
        out["per_level"][str(lv)] = _stats([r for r in records if r["level"] == lv])
    seen = {r["template_seen"] for r in records}
    if len(seen) == 2:
        out["template_seen"] = _stats([r for r in records if r["template_seen"]])
        out["template_unseen"] = _stats([r for r in records if not r["template_seen"]])
    envs = sorted({r.get("env", "") for r in records})
    if len(envs) > 1:
        out["per_env"] = {}
        for env in envs:
            mine = [r for r in records if r.get("env", "") == env]
            out["per_env"][env] = {**_stats(mine), "per_level": {
                str(lv): _stats([r for r in mine if r["level"] == lv]) for lv in sorted({r["level"] for r in mine})}}
    return out


def evaluate_model(path: str | Path, tasks: list, runtime: Environment, env_cfg: EnvConfig, rollout_cfg=None,
                   seed: int = 0, greedy: bool = True) -> tuple[dict, list[dict]]:
    """A language-model policy (a folder written by `save_policy`) through the batched rollout engine."""
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine

    model, tokenizer, _ = load_policy(path)
    engine = RolloutEngine(model, tokenizer, runtime, env_cfg, rollout_cfg)
    records = engine.run(tasks, [seed + i for i in range(len(tasks))], greedy=greedy)
    return summarize(records), records


def evaluate(policy_name: str, tasks: list, runtime: Environment, env_cfg: EnvConfig, seed: int = 0,
             rollout_cfg=None) -> tuple[dict, list[dict]]:
    """Evaluate 'expert', 'random' or a model directory (greedy) on `tasks`."""
    if policy_name not in POLICIES:
        if Path(policy_name).is_dir():
            return evaluate_model(policy_name, tasks, runtime, env_cfg, rollout_cfg, seed)
        raise AgentRLError(f"unknown policy {policy_name!r}: not one of {', '.join(POLICIES)} and not a model directory")
    rng = np.random.default_rng(seed)
    policy = runtime.expert() if policy_name == "expert" else runtime.random_policy(rng)
    if policy is None:
        raise AgentRLError(f"environment {runtime.name!r} has no {policy_name} policy")
    env = AgentEnv(world=runtime, tasks=tasks, config=env_cfg)
    try:
        records = [run_episode(env, policy, t, seed + i) for i, t in enumerate(tasks)]
    finally:
        env.close()
    return summarize(records), records


def main(policy: str, tasks: str, out: str, params_path: str = "params.yaml", seed: int = 0,
         world_dir: str = "data/env") -> dict:
    if policy not in POLICIES and not Path(policy).is_dir():
        raise AgentRLError(f"unknown policy {policy!r}: not one of {', '.join(POLICIES)} and not a model directory")
    check_target(out)  # an output path that cannot be written is refused before the episodes run
    read_task_records(tasks)  # a malformed task file is refused before the params (whose limits may need data)
    env_cfg = load_section(EnvConfig, "env", params_path)
    rollout_cfg = None
    if policy not in POLICIES:
        from pipeline.policy.config import RolloutConfig

        rollout_cfg = load_section(RolloutConfig, "rollout", params_path)
    runtime = open_environment(env_cfg.name, world_dir)
    try:
        task_list = load_task_file(tasks, runtime)
        metrics, _ = evaluate(policy, task_list, runtime, env_cfg, seed, rollout_cfg)
    finally:
        runtime.close()
    result = {"policy": policy, "tasks": str(tasks), "seed": seed, **metrics}
    out_path = write_json(out, result)
    o = metrics["overall"]
    print(f"{policy}: success {o['success_rate']:.3f}, mean return {o['mean_return']:.3f}, "
          f"tool calls {o['mean_tool_calls']:.2f}, safety violations {o['safety_violations']} "
          f"over {o['n']} tasks -> {out_path}")
    return result
