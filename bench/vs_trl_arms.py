"""The runs of bench/vs_trl.py, one per child process (``python bench/vs_trl_arms.py ARM SPEC OUT``):

- ``start``: the adapted model scored once (every curve starts there: same weights, tasks and seeds, greedy);
- ``project-rl``: this project's learner, pure RL (:func:`vs_trl_shared.pure_rl`), on the plan;
- ``trl``: TRL's ``GRPOTrainer`` on the same plan, its rollouts by this project's engine;
- ``project-default``: the train stage's recipe as ``params.yaml`` sets it (its own task sampling, behaviour cloning,
  expert-guided groups), on one rank.

A learning run plays ``steps`` optimizer steps and, after each step in ``marks``, stops its clock and scores the
policy twice on the first ``eval_tasks`` test tasks with the evaluate stage's seeds, greedy: its raw weights and the
WiSE-FT average ``adapted + merge_alpha * (trained - adapted)``. OUT gets ``{"points": [{"step", "t", "episodes",
"raw", "wise"}, ...], "final": {"raw": [...], "wise": [...]}, "config": {...}, "rollout_success": [...],
"first_batch": DIGEST}``: ``t`` is training wall clock (trainer construction included, evaluations excluded),
``final`` every test task's success at the last mark (the bench's intervals resample them), ``first_batch`` a digest
of the tokens sampled at the first step (:func:`vs_trl_shared.sampled_digest`: equal in the two pure-RL arms of a
learning rate and seed, which play the same episodes from the same weights). Why each setting is what it is:
bench/vs_trl.py's docstring.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl_shared import (engine_rollout_func, grpo_args, load_project, make_plan, plain_forward,  # noqa: E402
                           pure_rl, rl_rollout, sampled_digest)

# TRL's estimator set to the project's: advantages r - group mean (no std scaling; RLOO's leave-one-out baseline is
# the same advantage times G/(G-1)), loss averaged over every action token of the optimizer step's batch ("dapo",
# the project's token-mean)
TRL_ESTIMATOR = {"scale_rewards": "none", "loss_type": "dapo"}


class Clock:
    """Training wall clock that stops while an evaluation runs."""

    def __init__(self):
        self.start, self.paused, self.eval_s = time.perf_counter(), None, 0.0

    def elapsed(self) -> float:
        now = self.paused if self.paused is not None else time.perf_counter()
        return now - self.start - self.eval_s

    def pause(self) -> None:
        self.paused = time.perf_counter()

    def resume(self) -> None:
        self.eval_s += time.perf_counter() - self.paused
        self.paused = None


def eval_seed(spec: dict) -> int:
    """The evaluate stage's seed: test episode i gets seed + i, as ``agentrl evaluate`` plays them."""
    from pipeline.core.config import load_section
    from pipeline.evaluate.config import EvaluateConfig

    return load_section(EvaluateConfig, "evaluate", Path(spec["project"]) / "params.yaml").seed


class Scorer:
    """Greedy success on the first ``eval_tasks`` test tasks, of a model's raw weights and of its WiSE-FT average
    with the adapted weights (``alpha``), each a list of 0/1 per task."""

    def __init__(self, spec: dict, tok, runtime, env_cfg, rollout_cfg, test_tasks, dist, policy, alpha: float):
        import torch

        from pipeline.policy.rollout import RolloutEngine
        from pipeline.train.validation import WeightEnsemble

        self.new_engine = lambda m: RolloutEngine(m, tok, runtime, env_cfg, rollout_cfg)
        self.tasks, self.dist, self.seed = test_tasks[:spec["eval_tasks"]], dist, eval_seed(spec)
        start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        self.ensemble = WeightEnsemble(start, policy, self.new_engine, alpha)
        self.no_grad = torch.no_grad

    def outcomes(self, model) -> list[int]:
        from pipeline.train.validation import evaluate_greedy

        records: list[dict] = []
        with self.no_grad(), plain_forward(model):
            evaluate_greedy(self.new_engine(model), self.tasks, self.dist, self.seed, records_out=records)
        by_id = {r["task_id"]: int(bool(r["success"])) for r in records}
        return [by_id[t.task_id] for t in self.tasks]

    def both(self, policy) -> dict[str, list[int]]:
        was_training = policy.training
        policy.eval()
        raw = self.outcomes(policy)
        self.ensemble.refresh(policy)
        wise = self.outcomes(self.ensemble.model)
        policy.train(was_training)
        return {"raw": raw, "wise": wise}


def mark(points: list, final: dict, step: int, t: float, episodes: int, scores: dict[str, list[int]],
         last: bool, name: str) -> None:
    """Record one evaluation (and, at the last mark, every task's outcome)."""
    points.append({"step": step, "t": t, "episodes": episodes,
                   **{k: sum(v) / len(v) for k, v in scores.items()}})
    if last:
        final.update(scores)
    print(f"{name}: step {step} {t:.0f}s raw {points[-1]['raw']:.3f} wise {points[-1]['wise']:.3f}",
          file=sys.stderr, flush=True)


def run_config(spec: dict, default: bool):
    """The project's sections with this run's learning rate and seed (``project-default``: its own ``train.lr``)."""
    env_cfg, rollout_cfg, cfg, runtime, tasks = load_project(spec)
    cfg = cfg.model_copy(update={"seed": spec["seed"], **({} if default else {"lr": spec["lr"]})})
    cfg = cfg.model_copy(update={"num_ranks": 1, "incoming_tasks": None, "production_tasks": None}) if default \
        else pure_rl(cfg, learn_all=True)
    return env_cfg, rollout_cfg, cfg, runtime, tasks


# ------------------------------------------------------------------------------------------------------ start point
def start_arm(spec: dict) -> dict:
    from pipeline.policy.model import load_policy
    from pipeline.train.distributed import Dist

    env_cfg, rollout_cfg, cfg, runtime, tasks = load_project(spec)
    model, tok, _ = load_policy(Path(spec["project"]) / "models" / "adapted")
    scorer = Scorer(spec, tok, runtime, env_cfg, rollout_cfg, tasks["test"], Dist(), model, cfg.merge_alpha)
    raw = scorer.outcomes(model.eval())
    return {"points": [{"step": 0, "t": 0.0, "episodes": 0, "raw": sum(raw) / len(raw), "wise": sum(raw) / len(raw)}],
            "final": {"raw": raw, "wise": raw}, "config": {}, "rollout_success": []}


# ----------------------------------------------------------------------------------------------------- project arms
def project_arm(spec: dict, default: bool) -> dict:
    """The train loop's own pieces (:func:`pipeline.train.loop.setup`, the engine's ``run``, ``observe``,
    ``learn_or_drop``) for ``steps`` updates: on the plan (``project-rl``), or on the loop's own task sampling
    (``project-default``: :func:`pipeline.train.loop.plan`, levels weighted by failure, goal sampling)."""
    from pipeline.policy.model import load_policy
    from pipeline.train.distributed import init_dist
    from pipeline.train.loop import Hooks, learn_or_drop, observe, plan, setup

    env_cfg, rollout_cfg, cfg, runtime, tasks = run_config(spec, default)
    project = Path(spec["project"])
    cfg = cfg.model_copy(update={"deepspeed_config": str(project / cfg.deepspeed_config)})
    demos = None
    if cfg.bc_coef > 0:  # as pipeline.train.worker prepares them
        from pipeline.policy.demos import demo_examples, load_demos, prompt_signatures

        _, tok, _ = load_policy(project / "models" / "adapted")
        demos = demo_examples(tok, [d for d in load_demos(project / "data" / "demos" / "train.jsonl") if d["success"]],
                              {t.task_id: t.question for t in tasks["train"]}, env_cfg.history_window,
                              signatures=prompt_signatures(runtime, tasks["train"], env_cfg.context_actions))
    dist = init_dist()
    fixed = None if default else make_plan(tasks["train"], cfg, spec["steps"], cfg.seed)
    clock = Clock()
    loop = setup(cfg, env_cfg, rl_rollout(rollout_cfg, cfg), policy_dir=project / "models" / "adapted",
                 train_tasks=tasks["train"], val_tasks=tasks["validation"], runtime=runtime,
                 ckpt_dir=Path(spec["tmp"]) / "ckpt", dist=dist, run=None, demo_examples=demos,
                 hooks=Hooks(log=lambda s: print(s, file=sys.stderr)))
    if loop.extensions:
        raise SystemExit("vs_trl_arms: the bench plays the train loop without extensions; params.yaml turns some on")
    setup_s = clock.elapsed()
    clock.pause()
    scorer = Scorer(spec, loop.rollout.tokenizer, runtime, env_cfg, rollout_cfg, tasks["test"], dist, loop.policy,
                    cfg.merge_alpha)
    clock.resume()
    points, final, success = [], {}, []
    for u in range(spec["steps"]):
        ep_tasks, seeds = plan(loop, u) if default else fixed[u]
        records = loop.rollout.run(ep_tasks, seeds, greedy=False, policy_version=u)
        if u == 0:
            first = sampled_digest((r["token_ids"], r["action_mask"]) for r in records)
        observe(loop, records, u)
        learn_or_drop(loop, records, u, 0)
        success.append(sum(r["success"] for r in records) / len(records))
        if u + 1 in spec["marks"]:
            t = clock.elapsed()
            clock.pause()
            mark(points, final, u + 1, t, (u + 1) * len(records), scorer.both(loop.policy), u + 1 == spec["steps"],
                 spec["name"])
            clock.resume()
    dist.close()
    config = {k: getattr(cfg, k) for k in ("algorithm", "lr", "lr_warmup_steps", "tasks_per_update", "group_size",
                                           "micro_batches", "rollout_temperature", "loss_agg",
                                           "skip_zero_variance_groups", "bc_coef", "guide_failed_groups",
                                           "merge_alpha", "max_grad_norm", "seed")}
    return {"points": points, "final": final, "rollout_success": success, "setup_s": setup_s, "first_batch": first,
            "config": config | {"max_new_tokens": rollout_cfg.max_new_tokens}}


# ---------------------------------------------------------------------------------------------------------- TRL arm
def trl_arm(spec: dict) -> dict:
    """TRL's GRPOTrainer on the plan, one generation round of ``tasks_per_update x group_size`` episodes per
    optimizer step, its rollouts played by this project's engine on the model TRL trains."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.policy.episode_drivers import EnvEpisode
    from pipeline.policy.model import load_policy
    from pipeline.train.distributed import Dist

    env_cfg, rollout_cfg, cfg, runtime, tasks = run_config(spec, default=False)
    rl_cfg = rl_rollout(rollout_cfg, cfg)
    plan = make_plan(tasks["train"], cfg, spec["steps"], cfg.seed)
    context = {}
    for ep_tasks, _ in plan:
        for t in ep_tasks:
            context.setdefault(t.task_id, EnvEpisode(runtime, env_cfg, t, 0).context)
    dataset = Dataset.from_list([{"prompt": context[t.task_id]} for ep_tasks, _ in plan
                                 for t in ep_tasks[::cfg.group_size]])
    stats = {"episodes": 0, "successes": 0, "rounds": 0}
    success: list[float] = []

    def next_episodes(prompts: list[str]) -> tuple[list, list[int]]:
        ep_tasks, seeds = plan[stats["rounds"]]
        if prompts != [context[t.task_id] for t in ep_tasks]:
            raise RuntimeError(f"TRL's generation round {stats['rounds']} asked for other prompts than the plan's")
        stats["rounds"] += 1
        stats["before"] = stats["successes"]
        return ep_tasks, seeds

    # the evaluator's group of one, without a process group: with one initialised (and the rank variables set)
    # accelerate would take the run for a distributed one
    dist = Dist()
    clock = Clock()
    model, tok, _ = load_policy(Path(spec["project"]) / "models" / "adapted")
    clock.pause()
    scorer = Scorer(spec, tok, runtime, env_cfg, rollout_cfg, tasks["test"], dist, model, cfg.merge_alpha)
    clock.resume()
    model.train()
    play = engine_rollout_func(tok, runtime, env_cfg, rl_cfg, next_episodes, stats)

    def rollout_func(prompts, trainer):
        out = play(prompts, trainer)
        stats.setdefault("first_batch", sampled_digest(zip(out["completion_ids"], out["env_mask"])))
        success.append((stats["successes"] - stats["before"]) / len(out["env_mask"]))
        return out

    points, final = [], {}

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stats["setup_s"] = clock.elapsed()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in spec["marks"]:
                t = clock.elapsed()
                clock.pause()
                policy = trainer.accelerator.unwrap_model(trainer.model)
                mark(points, final, state.global_step, t, stats["episodes"], scorer.both(policy),
                     state.global_step == spec["steps"], spec["name"])
                clock.resume()
            return control

    args = GRPOConfig(**grpo_args(spec, cfg, rl_cfg, spec["steps"], **TRL_ESTIMATOR))
    trainer = GRPOTrainer(model=model, reward_funcs=lambda prompts, completions, env_return, **kw: list(env_return),
                          args=args, train_dataset=dataset, processing_class=tok, rollout_func=rollout_func,
                          callbacks=[Marks()])
    trainer.train()
    config = {k: getattr(args, k) for k in ("loss_type", "scale_rewards", "learning_rate", "warmup_steps",
                                            "lr_scheduler_type", "num_generations", "per_device_train_batch_size",
                                            "gradient_accumulation_steps", "temperature", "bf16",
                                            "gradient_checkpointing", "beta", "epsilon", "max_grad_norm", "seed")}
    return {"points": points, "final": final, "rollout_success": success, "setup_s": stats["setup_s"],
            "first_batch": stats["first_batch"], "config": {k: getattr(v, "value", v) for k, v in config.items()}
            | {"max_new_tokens": rl_cfg.max_new_tokens, "merge_alpha": cfg.merge_alpha}}


RUNS = {"start": start_arm, "project-rl": lambda s: project_arm(s, default=False),
        "project-default": lambda s: project_arm(s, default=True), "trl": trl_arm}


def main(arm: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    out = RUNS[arm](spec)
    out.update(arm=arm, child_s=time.perf_counter() - t0,
               peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
