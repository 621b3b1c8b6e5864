"""The arms of bench/vs_trl_throughput.py, one per child process (``python bench/vs_trl_throughput_arms.py ARM SPEC
OUT``): ``project`` (this project's learner, rollouts by its engine), ``project-all`` (the same, learning every group
as TRL does), ``trl-naive`` (TRL's ``GRPOTrainer`` with bench/vs_trl_shared.py's naive ``rollout_func``: ``model.generate``
re-encoding each episode every turn) and ``trl-engine`` (TRL's ``GRPOTrainer`` with a ``rollout_func`` that calls
this project's :class:`~pipeline.policy.rollout.RolloutEngine`, so its generation is arm ``project``'s code).

Every arm plays the same plan (:func:`vs_trl_shared.make_plan`): the same tasks and episode seeds at every step, ``warmup`` steps
and then ``steps`` timed ones. OUT gets one row per step: seconds in rollout and in the whole step, episodes, sampled
tokens (mask 1), rows the learner forwarded; and the process's CPU seconds (``time.process_time``, all its threads)
in rollout and in the whole step. Why each setting is what it is: bench/vs_trl_throughput.py.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl_shared import (engine_rollout_func, grpo_args, load_project, make_plan, naive_rollout_func,  # noqa: E402
                           pure_rl, rl_rollout, sampled)

ARMS = ("project", "project-all", "trl-naive", "trl-engine")


# ----------------------------------------------------------------------------------------------------- project arm
def project_arm(spec: dict, arm: str, profiler) -> tuple[list[dict], dict]:
    """The train loop's own pieces (:func:`pipeline.train.loop.setup`, the engine's ``run``,
    :func:`~pipeline.train.loop.observe`, :func:`~pipeline.train.loop.learn_or_drop`), on the plan's tasks."""
    from pipeline.train.distributed import init_dist
    from pipeline.train.loop import Hooks, learn_or_drop, observe, setup

    env_cfg, rollout_cfg, cfg, runtime, tasks = load_project(spec)
    project = Path(spec["project"])
    cfg = pure_rl(cfg, arm == "project-all").model_copy(
        update={"deepspeed_config": str(project / cfg.deepspeed_config)})
    plan = make_plan(tasks["train"], cfg, spec["warmup"] + spec["steps"], cfg.seed)
    dist = init_dist()
    loop = setup(cfg, env_cfg, rl_rollout(rollout_cfg, cfg), policy_dir=project / "models" / "adapted",
                 train_tasks=tasks["train"], val_tasks=tasks["validation"], runtime=runtime,
                 ckpt_dir=Path(spec["tmp"]) / "ckpt", dist=dist, run=None, demo_examples=None,
                 hooks=Hooks(log=lambda s: print(s, file=sys.stderr)))
    rows = []
    for u, (ep_tasks, seeds) in enumerate(plan):
        if profiler is not None and u == spec["warmup"]:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        records = loop.rollout.run(ep_tasks, seeds, greedy=False, policy_version=u)
        t1, c1 = time.perf_counter(), time.process_time()
        observe(loop, records, u)
        m = learn_or_drop(loop, records, u, 0)
        t2, c2 = time.perf_counter(), time.process_time()
        rows.append({"rollout_s": t1 - t0, "step_s": t2 - t0, "rollout_cpu_s": c1 - c0, "step_cpu_s": c2 - c0,
                     "episodes": len(records),
                     "sampled_tokens": sampled(r["action_mask"] for r in records),
                     "rows_learned": int(m["train/rows_forwarded"]),
                     "success": sum(r["success"] for r in records) / len(records)})
    dist.close()
    config = {k: getattr(cfg, k) for k in ("algorithm", "lr", "tasks_per_update", "group_size", "micro_batches",
                                           "rollout_temperature", "skip_zero_variance_groups", "bc_coef",
                                           "guide_failed_groups")}
    return rows, config | {"max_new_tokens": rollout_cfg.max_new_tokens}


# --------------------------------------------------------------------------------------------------------- TRL arms
def step_clock(rows: list[dict], timers: dict, stats: dict, profiler, warmup: int):
    """A ``TrainerCallback`` that adds one row per optimizer step to `rows`, with `timers` (reset each step) and the
    step's seconds: from one ``on_step_begin`` to the next (the last: to the end of training), so TRL's logging and
    data loading between steps count as the step's. It starts `profiler` at the first step after `warmup`."""
    from transformers import TrainerCallback

    marks: list[float] = []
    cpu_mark = [0.0]

    def close_step():
        if rows and "step_s" not in rows[-1]:
            rows[-1].update(step_s=time.perf_counter() - marks.pop(), step_cpu_s=time.process_time() - cpu_mark[0],
                            rows_learned=rows[-1]["episodes"], **timers)

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            close_step()
            if profiler is not None and state.global_step == warmup:
                profiler.enable()
            marks.append(time.perf_counter())
            cpu_mark[0] = time.process_time()
            rows.append({"successes_before": stats["successes"]})
            timers.update(rollout_s=0.0, rollout_cpu_s=0.0, gen_score_s=0.0, optimizer_s=0.0)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_optimizer_step(self, args, state, control, **kw):
            timers["optimizer_s"] += time.perf_counter() - marks.pop()

        def on_train_end(self, args, state, control, **kw):
            close_step()

    return StepClock()


def trl_arm(spec: dict, arm: str, profiler) -> tuple[list[dict], dict]:
    """TRL's GRPOTrainer on the plan: one generation round of ``tasks_per_update x group_size`` episodes per
    optimizer step, in ``micro_batches`` accumulation steps as this project's learner; gradient checkpointing off."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.policy.episode_drivers import EnvEpisode
    from pipeline.policy.model import load_policy

    env_cfg, rollout_cfg, cfg, runtime, tasks = load_project(spec)
    cfg, rl_cfg = pure_rl(cfg, arm == "project-all"), rl_rollout(rollout_cfg, cfg)
    n_steps = spec["warmup"] + spec["steps"]
    plan = make_plan(tasks["train"], cfg, n_steps, cfg.seed)
    context = {}  # a task's first context (TRL's prompt, the "standard" text format)
    for ep_tasks, _ in plan:
        for t in ep_tasks:
            context.setdefault(t.task_id, EnvEpisode(runtime, env_cfg, t, 0).context)
    # one dataset row per task of a step, in the plan's order; unshuffled, TRL's sampler repeats each group_size times
    dataset = Dataset.from_list([{"prompt": context[t.task_id]} for ep_tasks, _ in plan
                                 for t in ep_tasks[::cfg.group_size]])
    stats = {"episodes": 0, "successes": 0, "turns": 0, "rounds": 0}
    timers = {"rollout_s": 0.0, "rollout_cpu_s": 0.0, "gen_score_s": 0.0, "optimizer_s": 0.0}

    def next_episodes(prompts: list[str]) -> tuple[list, list[int]]:
        ep_tasks, seeds = plan[stats["rounds"]]
        if prompts != [context[t.task_id] for t in ep_tasks]:
            raise RuntimeError(f"TRL's generation round {stats['rounds']} asked for other prompts than the plan's")
        stats["rounds"] += 1
        return ep_tasks, seeds

    model, tok, _ = load_policy(Path(spec["project"]) / "models" / "adapted")
    model.train()
    if arm == "trl-naive":
        play = naive_rollout_func(tok, rl_cfg.max_new_tokens, lambda prompts: [
            EnvEpisode(runtime, env_cfg, t, s) for t, s in zip(*next_episodes(prompts))], stats)
    else:
        play = engine_rollout_func(tok, runtime, env_cfg, rl_cfg, next_episodes, stats)

    def rollout_func(prompts, trainer):
        t0, c0 = time.perf_counter(), time.process_time()
        out = play(prompts, trainer)
        timers["rollout_s"] += time.perf_counter() - t0
        timers["rollout_cpu_s"] += time.process_time() - c0
        rows[-1]["episodes"], rows[-1]["sampled_tokens"] = len(out["env_mask"]), sampled(out["env_mask"])
        rows[-1]["success"] = (stats["successes"] - rows[-1].pop("successes_before")) / len(out["env_mask"])
        return out

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timers["gen_score_s"] += time.perf_counter() - t0
            return out

    rows: list[dict] = []
    args = GRPOConfig(**grpo_args(spec, cfg, rl_cfg, n_steps))
    trainer = Timed(model=model, reward_funcs=lambda prompts, completions, env_return, **kw: list(env_return),
                    args=args, train_dataset=dataset, processing_class=tok, rollout_func=rollout_func,
                    callbacks=[step_clock(rows, timers, stats, profiler, spec["warmup"])])
    trainer.train()
    config = {k: getattr(args, k) for k in ("loss_type", "learning_rate", "num_generations",
                                            "per_device_train_batch_size", "gradient_accumulation_steps",
                                            "temperature", "bf16", "gradient_checkpointing", "beta")}
    return rows, config | {"max_new_tokens": rl_cfg.max_new_tokens, "rollout": arm.split("-", 1)[1]}


def profile_lines(profiler, top: int = 25) -> list[str]:
    """The profiled functions with the most time of their own (tottime), as pstats prints them."""
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    return text[text.find("   ncalls"):].rstrip().splitlines()


def main(arm: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    profiler = cProfile.Profile() if spec.get("profile") else None
    run = project_arm if arm.startswith("project") else trl_arm
    rows, config = run(spec, arm, profiler)
    if profiler is not None:
        profiler.disable()
    out = {"arm": arm, "steps": rows[spec["warmup"]:], "warmup_steps": rows[:spec["warmup"]], "config": config,
           "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if profiler is not None:
        out["profile"] = profile_lines(profiler)
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
