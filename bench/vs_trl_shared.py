"""What the arms of bench/vs_trl.py (learning) and bench/vs_trl_throughput.py (throughput) share: the project's
sections and task splits, the plan every arm plays (the same tasks and episode seeds at every step), the train config
with the recipe's aids off, and TRL's ``rollout_func`` two ways (this project's rollout engine, or
``model.generate`` re-encoding each episode every turn). The decisions behind them: the two benches' docstrings.

**Multi-turn through ``rollout_func``, not ``environment_factory``.** TRL 1.16's environment support cannot play
this environment faithfully with this model: (1) its tool loop (``GRPOTrainer._tool_call_loop``,
``trl/trainer/grpo_trainer.py`` line 1957, ``while idxs_with_tool and iteration_num <
self.max_tool_calling_iterations``) ends an episode only when the model writes no tool call, while here the
environment ends it (the ``answer`` tool, ``env.max_steps``) and pays its verifier reward then; (2) it renders and
parses tool calls through a chat template with tools (``supports_tool_calling``, line 650), which the built-in
tokenizer does not have, and the adapted model was trained on the protocol's text (``<call>tool {json}</call>``,
``<obs>...</obs>``): a template written for the bench would re-implement the protocol in Jinja, and any difference
would handicap TRL; (3) the environment folds turns older than ``env.history_window`` into a ``State:`` line, which
an append-only conversation cannot express. So TRL's documented custom-rollout hook plays the project's own
environment (:class:`pipeline.policy.episode_drivers.EnvEpisode`): the prompt is the environment's first context
(TRL's "standard" text format), observations go into the completion with ``env_mask`` 0 (out of the loss, as TRL
masks tool results) and the reward function returns the environment's return.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_child(script: Path, arm: str, spec: dict, folder: Path, label: str) -> dict:
    """One arm's run as ``python SCRIPT ARM SPEC OUT`` in a child process of its own, in the project folder, with
    `folder` (new, inside the bench's temporary folder) for its files and the temporary folder's MLflow store; what
    the child wrote to OUT. A failed child ends the bench with its output's tail."""
    folder.mkdir()
    spec_path, out = folder / "spec.json", folder / "out.json"
    spec_path.write_text(json.dumps({**spec, "tmp": str(folder)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TRL_EXPERIMENTAL_SILENCE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{folder.parent / 'mlflow.db'}"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), arm, str(spec_path), str(out)], cwd=spec["project"], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"{label} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def sampled_digest(streams) -> str:
    """A digest of the tokens sampled in a batch: for each episode in order, its token ids where its action mask is
    1, given as ``(token_ids, action_mask)`` pairs. Equal digests: the same episodes generated the same actions."""
    h = hashlib.sha256()
    for ids, mask in streams:
        h.update(json.dumps([t for t, m in zip(ids, mask) if m]).encode())
    return h.hexdigest()[:16]


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
             for s in ("train", "validation", "test")}
    return env_cfg, rollout_cfg, cfg, runtime, tasks


def make_plan(tasks: list, cfg, n_steps: int, seed: int) -> list[tuple[list, list[int]]]:
    """Per step, the episodes' tasks (``tasks_per_update`` distinct training tasks drawn without replacement, each
    ``group_size`` times in a row, as the train loop lays them out) and their seeds; the same in every arm."""
    import numpy as np

    rng = np.random.default_rng([seed, 56_001])
    plan = []
    for s in range(n_steps):
        pick = rng.choice(len(tasks), size=cfg.tasks_per_update, replace=False)
        ep_tasks = [tasks[int(i)] for i in pick for _ in range(cfg.group_size)]
        plan.append((ep_tasks, [seed * 1_000_003 + s * 7919 + k for k in range(len(ep_tasks))]))
    return plan


def pure_rl(cfg, learn_all: bool):
    """The train config with the recipe's aids off (behaviour cloning, expert-guided groups, KL to a reference) and
    one rank: the work of an RL step and nothing else. `learn_all`: zero-variance groups stay in the loss (their
    advantages are 0, but their tokens count in the token mean's denominator, as in TRL)."""
    update = {"bc_coef": 0.0, "guide_failed_groups": False, "kl_coef": 0.0, "num_ranks": 1, "incoming_tasks": None,
              "production_tasks": None}
    if learn_all:
        update["skip_zero_variance_groups"] = False
    return cfg.model_copy(update=update)


def rl_rollout(rollout_cfg, cfg):
    """The rollout config RL samples with (``train.rollout_temperature`` where set), as the train loop uses it."""
    t = cfg.rollout_temperature
    return rollout_cfg if t is None else rollout_cfg.model_copy(update={"temperature": t})


def sampled(records_or_masks) -> int:
    return sum(sum(m) for m in records_or_masks)


@contextlib.contextmanager
def plain_forward(model):
    """The model's own ``forward`` for the duration. With TRL's ``bf16=True`` accelerate wraps ``forward`` in bf16
    autocast (and casts its outputs to fp32), so every forward of the model runs under it, generation included; the
    rollout engine applies its own precision policy (``rollout.dtype``: fp32 decode steps here, bf16 only for chunk
    prefills where that is faster), and the project's arm runs it that way, so the engine arm does too."""
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


def engine_rollout_func(tok, runtime, env_cfg, rollout_cfg, next_episodes, stats: dict):
    """A ``rollout_func`` that plays the episodes with this project's rollout engine (KV cache kept across turns,
    shared prompt prefix, continuous batching) on the model TRL trains. The engine's record becomes TRL's fields:
    the first prompt is ``prompt_ids``, the rest of the token stream ``completion_ids`` with the action mask as
    ``env_mask`` (observations 0). An episode whose context the environment re-based (a fold; a new token segment)
    keeps the re-based prompt inside its completion, masked 0, as TRL's append-only completion can only hold it.
    The engine runs on the model's own forward (:func:`plain_forward`), as in the project's arm."""
    from trl.models.utils import unwrap_model_for_generation

    from pipeline.policy.rollout import RolloutEngine

    def rollout_func(prompts: list[str], trainer) -> dict:
        ep_tasks, seeds = next_episodes(prompts)
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                         generation_kwargs=trainer.generation_kwargs,
                                         gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
                                         ) as m, plain_forward(m):
            records = RolloutEngine(m, tok, runtime, env_cfg, rollout_cfg).run(
                ep_tasks, seeds, greedy=False, policy_version=trainer.state.global_step)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "env_mask": [],
               "env_return": [r["return"] for r in records]}
        for r in records:
            p = r["action_mask"].index(1) if 1 in r["action_mask"] else len(r["token_ids"]) - 1
            out["prompt_ids"].append(r["token_ids"][:p])
            out["completion_ids"].append(r["token_ids"][p:])
            out["env_mask"].append(r["action_mask"][p:])
        stats["episodes"] += len(records)
        stats["successes"] += sum(r["success"] for r in records)
        return out

    return rollout_func


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


def grpo_args(spec: dict, cfg, rl_cfg, n_steps: int, **estimator) -> dict:
    """``GRPOConfig``'s arguments: TRL's defaults except the work both arms share (bench/vs_trl_throughput.py) and
    `estimator` (bench/vs_trl.py sets ``scale_rewards`` and ``loss_type``)."""
    from pipeline.policy.model import supports_bf16

    return dict(
        output_dir=str(Path(spec["tmp"]) / "trl"), use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=cfg.seed, learning_rate=cfg.lr, max_steps=n_steps,
        lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.lr_warmup_steps,
        num_generations=cfg.group_size, per_device_train_batch_size=cfg.tasks_per_update * cfg.group_size
        // cfg.micro_batches, gradient_accumulation_steps=cfg.micro_batches, shuffle_dataset=False,
        max_completion_length=rl_cfg.max_new_tokens, temperature=rl_cfg.temperature, bf16=supports_bf16(),
        gradient_checkpointing=False, max_grad_norm=cfg.max_grad_norm, **estimator)
