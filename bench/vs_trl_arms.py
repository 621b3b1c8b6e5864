"""The two arms of bench/vs_trl.py, each run in a child process of its own (``python bench/vs_trl_arms.py ARM SPEC
OUT``): the project's RL loop (:func:`pipeline.train.loop.train`) and TRL's ``GRPOTrainer`` with a ``rollout_func``
that plays the project's environment. Both write ``{"points": [{"t", "update", "episodes", "success"}, ...], ...}``
to OUT: validation success after ``t`` seconds of training wall clock (evaluation time excluded), measured by the
same evaluator, :func:`pipeline.train.validation.evaluate_greedy` on the first ``eval_tasks`` validation tasks with
the validation seeds (``VAL_SEED``), the rollout engine the train stage validates with.

The decisions behind each arm's configuration are in bench/vs_trl.py's docstring.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Clock:
    """Training wall clock that stops while an evaluation runs (evaluation time is excluded from both arms)."""

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


class Schedule:
    """Evaluate at the first update ending after each of ``marks`` seconds of training; the last mark is the budget."""

    def __init__(self, marks: list[float]):
        self.marks, self.next = list(marks), 0

    def due(self, t: float) -> bool:
        if self.next < len(self.marks) and t >= self.marks[self.next]:
            while self.next < len(self.marks) and t >= self.marks[self.next]:
                self.next += 1
            return True
        return False

    def over(self, t: float) -> bool:
        return t >= self.marks[-1]


def load_project(spec: dict):
    """The project's sections, the world and the task splits, as the train stage reads them."""
    from pipeline.core.config import load_section
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.config import RolloutConfig
    from pipeline.train.config import TrainConfig

    project = Path(spec["project"])
    params = project / "params.yaml"
    env_cfg = load_section(EnvConfig, "env", params)
    rollout_cfg = load_section(RolloutConfig, "rollout", params)
    cfg = load_section(TrainConfig, "train", params)
    runtime = open_environment(env_cfg.name, project / "data" / "env")
    tasks = {s: load_task_file(project / "data" / "tasks" / f"{s}.jsonl", runtime, validate=False)
             for s in ("train", "validation")}
    return env_cfg, rollout_cfg, cfg, runtime, tasks


def evaluator(spec: dict, runtime, env_cfg, rollout_cfg, val_tasks, dist):
    """(model, tokenizer) -> validation summary (``summarize``): the train stage's greedy validation of the first
    ``eval_tasks`` validation tasks."""
    import torch

    from pipeline.policy.rollout import RolloutEngine
    from pipeline.train.validation import VAL_SEED, evaluate_greedy

    tasks = val_tasks[:spec["eval_tasks"]]

    def score(model, tok) -> dict:
        with torch.no_grad():
            return evaluate_greedy(RolloutEngine(model, tok, runtime, env_cfg, rollout_cfg), tasks, dist, VAL_SEED)

    return score


def start_point(spec: dict, score) -> tuple[dict, dict]:
    """The adapted model's validation point at t = 0, the same for both arms (measured in each child, off the clock),
    and its summary."""
    from pipeline.policy.model import load_policy

    model, tok, _ = load_policy(Path(spec["project"]) / "models" / "adapted")
    summary = score(model, tok)
    return {"t": 0.0, "update": 0, "episodes": 0, "success": summary["overall"]["success_rate"]}, summary


# ----------------------------------------------------------------------------------------------------- project arm
def project_arm(spec: dict) -> dict:
    """The train stage's loop on one rank, with its params.yaml except what the budget needs (updates unbounded, no
    early stopping, no periodic checkpoints, no incoming tasks: TRL gets the training split alone)."""
    from pipeline.core.tracking import NullTracker
    from pipeline.train.distributed import init_dist
    from pipeline.train.loop import Hooks, train

    env_cfg, rollout_cfg, cfg, runtime, tasks = load_project(spec)
    project = Path(spec["project"])
    cfg = cfg.model_copy(update={"updates": 1_000_000, "num_ranks": 1, "eval_every": 1,
                                 "eval_tasks": spec["eval_tasks"], "checkpoint_every": 1_000_000,
                                 "early_stopping_patience": None, "incoming_tasks": None,
                                 "deepspeed_config": str(project / cfg.deepspeed_config)})
    dist = init_dist()
    score = evaluator(spec, runtime, env_cfg, rollout_cfg, tasks["validation"], dist)
    first, summary = start_point(spec, score)
    points = [first]
    demos = None
    if cfg.bc_coef > 0:  # as pipeline.train.worker prepares them
        from pipeline.policy.demos import demo_examples, load_demos, prompt_signatures
        from pipeline.policy.model import load_policy

        _, tok, _ = load_policy(project / "models" / "adapted")
        demos = demo_examples(tok, [d for d in load_demos(project / "data" / "demos" / "train.jsonl") if d["success"]],
                              {t.task_id: t.question for t in tasks["train"]}, env_cfg.history_window,
                              signatures=prompt_signatures(runtime, tasks["train"], env_cfg.context_actions))
    rl_rollout_cfg = (rollout_cfg if cfg.rollout_temperature is None
                      else rollout_cfg.model_copy(update={"temperature": cfg.rollout_temperature}))
    schedule, state = Schedule(spec["marks"]), {"update": 0, "last": summary}
    hooks = Hooks(log=lambda s: print(s, file=sys.stderr, flush=True))

    def before_learn(update: int) -> None:
        state["update"] = update

    def evaluate(rollout, val, d, seed):
        """Called after every update (eval_every 1); runs the real evaluation only when the schedule says so, and
        otherwise hands the loop the last summary (no improvement, nothing kept)."""
        from pipeline.train.validation import evaluate_greedy

        t = clock.elapsed()
        if not schedule.due(t):
            return state["last"]
        clock.pause()
        summary = evaluate_greedy(rollout, val, d, seed)
        clock.resume()
        u = state["update"]
        points.append({"t": t, "update": u, "episodes": u * cfg.tasks_per_update * cfg.group_size,
                       "success": summary["overall"]["success_rate"]})
        print(f"project: {t:.0f}s update {u} val {points[-1]['success']:.3f}", file=sys.stderr, flush=True)
        if schedule.over(t):
            hooks.stop_after = 0  # the loop ends before its next update
        state["last"] = summary
        return summary

    hooks.before_learn, hooks.evaluate = before_learn, evaluate
    tmp = Path(spec["tmp"])
    with NullTracker().run("train") as run:
        clock = Clock()
        train(cfg, env_cfg, rl_rollout_cfg, policy_dir=project / "models" / "adapted", train_tasks=tasks["train"],
              val_tasks=tasks["validation"], runtime=runtime, out_dir=tmp / "policy", ckpt_dir=tmp / "ckpt",
              dist=dist, run=run, demo_examples=demos, hooks=hooks)
    dist.close()
    return {"points": points, "config": {k: getattr(cfg, k) for k in (
        "algorithm", "lr", "tasks_per_update", "group_size", "rollout_temperature", "merge_alpha", "bc_coef",
        "guide_failed_groups", "micro_batches", "kl_coef")} | {"max_new_tokens": rollout_cfg.max_new_tokens}}


# --------------------------------------------------------------------------------------------------------- TRL arm
def grpo_kwargs(spec: dict, cfg, max_new_tokens: int, bf16: bool) -> dict:
    """The TRL arm's ``GRPOConfig`` arguments: TRL's defaults except the values both arms share, and the learning
    rate ``spec["trl_lr"]`` (``--trl-lr``; the shared ``train.lr`` when the spec has none)."""
    lr = spec.get("trl_lr")
    return dict(
        output_dir=str(Path(spec["tmp"]) / "trl"), use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=cfg.seed,
        learning_rate=cfg.lr if lr is None else lr,
        # the values both arms share
        num_generations=cfg.group_size, per_device_train_batch_size=cfg.group_size,
        gradient_accumulation_steps=cfg.tasks_per_update, max_completion_length=max_new_tokens,
        bf16=bf16, max_steps=spec["max_steps"])


def naive_rollout_func(tok, max_new_tokens: int, episodes_for, stats: dict):
    """The TRL arm's ``rollout_func``: ``episodes_for(prompts)`` gives one
    :class:`~pipeline.policy.episode_drivers.EnvEpisode` per prompt; `stats` counts episodes, successes and turns."""
    import torch
    from trl.models.utils import unwrap_model_for_generation

    from pipeline.policy.tokenizer import CALL_CLOSE, EOS, encode_context, encode_observation, marker_ids

    ids = marker_ids(tok)

    def rollout_func(prompts: list[str], trainer) -> dict:
        """Play one episode per prompt in the project's environment, generating each action with TRL's own
        generation path (``unwrap_model_for_generation`` + ``model.generate`` with the trainer's generation config),
        batched over the episodes still running; actions end at ``</call>`` or eos. The completion is every action
        (mask 1) and observation (``env_mask`` 0, left out of the loss) after the prompt, as TRL's tool loop
        builds it."""
        gen = trainer.generation_config.__class__(**trainer.generation_config.to_dict())
        gen.eos_token_id, gen.max_new_tokens = [ids[CALL_CLOSE], ids[EOS]], max_new_tokens
        eps = episodes_for(prompts)
        prompt_ids = [encode_context(tok, e.context) for e in eps]
        comp, mask, records = [[] for _ in eps], [[] for _ in eps], [None] * len(eps)
        live = list(range(len(eps)))
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                         generation_kwargs=trainer.generation_kwargs,
                                         gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
                                         ) as m, torch.no_grad():
            while live:
                rows = [prompt_ids[i] + comp[i] for i in live]
                width = max(map(len, rows))
                input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
                attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
                out = m.generate(input_ids=input_ids, attention_mask=attention, generation_config=gen)[:, width:]
                still = []
                for row, i in enumerate(live):
                    act = out[row].tolist()
                    ends = [k for k, t in enumerate(act) if t in (ids[CALL_CLOSE], ids[EOS])]
                    act = act[:ends[0] + 1] if ends else act
                    comp[i] += act
                    mask[i] += [1] * len(act)
                    stats["turns"] += 1
                    done, obs_text, _folded, _ = eps[i].step(
                        tok.decode(act, skip_special_tokens=False, clean_up_tokenization_spaces=False))
                    if done:
                        records[i] = eps[i].record()
                        continue
                    # the history stays verbatim (TRL's completion only grows); the environment's own context
                    # folds turns older than env.history_window, which an episode of env.max_steps rarely reaches
                    obs = encode_observation(tok, obs_text)
                    comp[i] += obs
                    mask[i] += [0] * len(obs)
                    still.append(i)
                live = still
        stats["episodes"] += len(records)
        stats["successes"] += sum(r["success"] for r in records)
        return {"prompt_ids": prompt_ids, "completion_ids": comp, "logprobs": None, "env_mask": mask,
                "env_return": [r["return"] for r in records]}

    return rollout_func


def trl_arm(spec: dict) -> dict:
    """TRL's GRPOTrainer: its defaults, except the values both arms share (see bench/vs_trl.py)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.policy.episode_drivers import EnvEpisode
    from pipeline.policy.model import load_policy, supports_bf16
    from pipeline.train.distributed import init_dist

    env_cfg, rollout_cfg, cfg, runtime, tasks = load_project(spec)
    dist = init_dist()
    score = evaluator(spec, runtime, env_cfg, rollout_cfg, tasks["validation"], dist)
    points = [start_point(spec, score)[0]]
    model, tok, _ = load_policy(Path(spec["project"]) / "models" / "adapted")
    model.train()
    # a prompt is the environment's first context of a task (TRL's "standard", text-only format: the built-in
    # tokenizer has no chat template); rollout_func gets the prompts only, so it finds the task by its prompt
    task_of: dict[str, object] = {}
    for t in tasks["train"]:
        task_of.setdefault(EnvEpisode(runtime, env_cfg, t, 0).context, t)
    dataset = Dataset.from_list([{"prompt": p} for p in task_of])
    stats = {"episodes": 0, "successes": 0, "turns": 0, "seed": 0}

    def episodes_for(prompts: list[str]) -> list:
        """One episode per prompt: its task found by the prompt, seeds counted up over the run."""
        eps = []
        for p in prompts:
            eps.append(EnvEpisode(runtime, env_cfg, task_of[p], stats["seed"]))
            stats["seed"] += 1
        return eps

    rollout_func = naive_rollout_func(tok, rollout_cfg.max_new_tokens, episodes_for, stats)

    def env_reward(prompts, completions, env_return, **kwargs) -> list[float]:
        """The environment's verifier reward of each episode (its return, the reward the project trains on)."""
        return list(env_return)

    schedule = Schedule(spec["marks"])
    steps = {"n": 0}

    class Budget(TrainerCallback):
        """Evaluate on the schedule (clock paused) and stop at the budget."""

        def on_step_end(self, args, state, control, **kwargs):
            steps["n"] = state.global_step
            t = clock.elapsed()
            if schedule.due(t):
                clock.pause()
                s = score(trainer.accelerator.unwrap_model(trainer.model), tok)["overall"]["success_rate"]
                clock.resume()
                points.append({"t": t, "update": state.global_step, "episodes": stats["episodes"], "success": s})
                print(f"trl: {t:.0f}s step {state.global_step} val {s:.3f} (rollout success "
                      f"{stats['successes'] / max(1, stats['episodes']):.3f})", file=sys.stderr, flush=True)
            if schedule.over(t):
                control.should_training_stop = True
            return control

    bf16 = supports_bf16()
    args = GRPOConfig(**grpo_kwargs(spec, cfg, rollout_cfg.max_new_tokens, bf16))
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=args, train_dataset=dataset,
                          processing_class=tok, rollout_func=rollout_func, callbacks=[Budget()])
    trainer.train()
    return {"points": points, "config": {
        "loss_type": args.loss_type, "beta": args.beta, "epsilon": args.epsilon, "scale_rewards": args.scale_rewards,
        "temperature": args.temperature, "learning_rate": args.learning_rate, "lr_scheduler_type": str(
            args.lr_scheduler_type), "num_generations": args.num_generations,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_completion_length": args.max_completion_length, "bf16": bf16,
        "gradient_checkpointing": args.gradient_checkpointing, "num_iterations": args.num_iterations},
        "rollout_success": stats["successes"] / max(1, stats["episodes"]), "turns": stats["turns"]}


ARMS = {"project": project_arm, "trl": trl_arm}

if __name__ == "__main__":
    arm, spec_path, out_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    result = ARMS[arm](spec)
    last = result["points"][-1]
    result.update(arm=arm, train_s=last["t"], episodes=last["episodes"], child_s=time.perf_counter() - t0)
    Path(out_path).write_text(json.dumps(result))
