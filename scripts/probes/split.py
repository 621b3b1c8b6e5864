"""What the probes share: a split's tasks with the seeds the train stage plays them with, and the world and configs
they need, read from the repository root. A missing or unreadable input stops the probe with a message that names it.
"""

from __future__ import annotations

from pathlib import Path

# the seeds of the train stage: validation in pipeline.train.trainer.train (10,000 + i), test in pipeline.train.worker.compare
# (20,000 + i); train 30,000 + i is the probes' own choice, used by no stage
SPLIT_SEED = {"validation": 10_000, "test": 20_000, "train": 30_000}


def load_split(split: str, n_tasks: int):
    """(tasks, seeds, runtime, env_cfg, rollout_cfg) for the first `n_tasks` of `split` (data/tasks/<split>.jsonl)."""
    from pipeline.core.config import load_section
    from pipeline.env.config import EnvConfig
    from pipeline.env.core import WorldRuntime, load_tasks
    from pipeline.env.world import load_world
    from pipeline.core.errors import AgentRLError
    from pipeline.policy.config import RolloutConfig

    if n_tasks < 1:
        raise SystemExit(f"--tasks {n_tasks}: must be at least 1")
    path = Path(f"data/tasks/{split}.jsonl")
    if not path.is_file() or not Path("data/env").is_dir():
        raise SystemExit(f"{path} or data/env missing: run from the repository root after `dvc repro build_env` "
                         f"(or `dvc pull`)")
    try:
        tasks = load_tasks(path)[:n_tasks]
        runtime = WorldRuntime(load_world(Path("data/env")))
        env, rollout = (load_section(EnvConfig, "env", "params.yaml"),
                        load_section(RolloutConfig, "rollout", "params.yaml"))
    except (AgentRLError, FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"probe inputs: {exc}") from None
    seeds = [SPLIT_SEED[split] + i for i in range(len(tasks))]
    return tasks, seeds, runtime, env, rollout


def check_policy_folders(*folders) -> None:
    for folder in folders:
        if folder is not None and not (Path(folder) / "policy.json").is_file():
            raise SystemExit(f"{folder}: not a policy folder (no policy.json)")


def add_split_args(ap, split: str = "test") -> None:
    """The probes' `--split` and `--tasks` options (the first `--tasks` tasks of the split, see :func:`load_split`)."""
    ap.add_argument("--split", default=split, choices=tuple(SPLIT_SEED))
    ap.add_argument("--tasks", type=int, default=400)


def greedy_episodes(folder, tasks, seeds, runtime, env, rollout) -> list[dict]:
    """The episode records of the policy in `folder` playing `tasks` greedily with `seeds`, as the train stage plays
    its validation and test tasks."""
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine

    model, tok, _ = load_policy(folder)
    return RolloutEngine(model, tok, runtime, env, rollout).run(tasks, seeds, greedy=True)
