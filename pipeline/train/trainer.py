"""The RL training loop: rollouts from the rollout engine, advantages and losses from :mod:`pipeline.train.core_algos`,
optimisation inside a DeepSpeed engine. A small loop, not a trainer class that owns everything (STYLE.md).

One update, on every rank:

1. **Sample** (seed 3.2, 3.4): all ranks draw the same task plan from a shared generator: levels from the
   curriculum's success-following weights, stratified; tasks within a level by goal sampling p(g) ∝ 1/(count(g)+1).
   Each rank takes its share of the tasks and plays `group_size` rollouts of each (its groups stay on the rank).
2. **Score**: episode returns, optionally normalised over the last K episodes (R' = (R − μ)/σ); group advantages
   (GRPO/RLOO) or GAE over action tokens with a value head (PPO). Groups with all-equal returns are counted and, by
   default, left out of the loss.
3. **Learn**: π_old and V_old from one no-grad forward of the learner (skipped when the update is a single on-policy
   step: π_old is then the training forward's own, see `_learn`); truncated importance weights
   w = min(c, π_old/π_sample) correct rollouts sampled by an older (or numerically different) policy; the clipped
   surrogate, value loss, adaptive entropy bonus, KL to the reference and behaviour cloning on demonstrations.
   DeepSpeed averages the gradients over ranks and clips them.
4. **Watch** (seed 2.2.1, 3.8.2, 5.1): entropy, advantage variance, reward spread, gradient norm, clip fraction,
   approximate KL, explained variance, zero-variance share, tool usage and its diversity, parameters without
   gradient, samples/s and tokens/s; a warning when entropy, reward spread or advantage variance collapses.

Every `checkpoint_every` updates: the DeepSpeed engine state plus the curriculum, goal sampler, normaliser, entropy
coefficient and RNG states, so a killed run resumes and continues as if it had not stopped. The best policy so far
lives beside them (``<checkpoint folder>/best``) and is copied to `models/policy` when the run completes. With
`merge_alpha` below 1 the policy that validation scores and `best` keeps is the weight-space ensemble
θ_start + α(θ − θ_start) of the RL weights with the adapted ones (WiSE-FT); RL itself trains on θ.

Asynchronous mode (seed 1.4): a rollout thread generates with a snapshot of the weights while the learner trains on
the previous batch; the snapshot is refreshed every `sync_every` updates, and a batch older than `max_staleness`
versions is dropped. Staleness, importance-weight statistics and idle time are logged.
"""

from __future__ import annotations

import copy
import json
import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.env.config import EnvConfig, RewardWeights
from pipeline.env.core import WorldRuntime
from pipeline.env.reward import RewardComponents, composite
from pipeline.env.tasks import Task
from pipeline.core.errors import AgentRLError
from pipeline.policy.episodes import summarize
from pipeline.train import core_algos as A
from pipeline.train.config import TrainConfig
from pipeline.train.early_stopping import EarlyStopping, metric_value
from pipeline.train.sampling import AdaptiveEntropyCoef, Curriculum, GoalSampler, RewardNormalizer

BEST = "best"  # the best policy so far, inside the run's checkpoint folder
# collapse alarms: a diagnostic below its floor logs a warning (the entropy floor is `train.entropy_alarm`)
COLLAPSE = {"reward_spread": 1e-6, "advantage_var": 1e-8}


# ------------------------------------------------------------------------------------------------------------ model
class ActorCritic(torch.nn.Module):
    """The policy LM plus (for PPO) a scalar value head on the last hidden state."""

    def __init__(self, policy: torch.nn.Module, with_value: bool):
        super().__init__()
        self.policy = policy
        hidden = policy.config.get_text_config(decoder=True).hidden_size
        self.value_head = torch.nn.Linear(hidden, 1) if with_value else None
        if self.value_head is not None:
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask,
                          output_hidden_states=self.value_head is not None, use_cache=False)
        values = None
        if self.value_head is not None:
            values = self.value_head(out.hidden_states[-1]).squeeze(-1).float()
        return out.logits, values


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log π(token_t | tokens_<t) at every position t ≥ 1 (position 0 gets 0): (B, T, V), (B, T) -> (B, T)."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return F.pad(lp.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.pad(A.entropy_from_logits(logits[:, :-1] / temperature), (1, 0))


# ------------------------------------------------------------------------------------------------------------ batch
@dataclass
class Batch:
    """Right-padded rows (one per token segment of an episode): all tensors (rows, T)."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    sample_logp: torch.Tensor
    episode: torch.Tensor  # (rows,) index of the episode each row belongs to
    turn: torch.Tensor  # (rows, T) the episode's turn index of each action token (core_algos.turn_ids), else -1

    @property
    def n_rows(self) -> int:
        return self.ids.shape[0]

    def select(self, rows: torch.Tensor) -> "Batch":
        return Batch(self.ids[rows], self.attn[rows], self.mask[rows], self.sample_logp[rows], self.episode[rows],
                     self.turn[rows])


def collate_records(records: list[dict], pad_id: int) -> Batch:
    rows = []
    for e, r in enumerate(records):
        starts = list(r.get("segments") or [0]) + [len(r["token_ids"])]
        turns = A.turn_ids(torch.tensor(r["action_mask"])).tolist()  # over the whole episode, across its segments
        for a, b in zip(starts[:-1], starts[1:]):
            if b > a:
                rows.append((e, r["token_ids"][a:b], r["action_mask"][a:b], r["logprobs"][a:b], turns[a:b]))
    T = max(len(row[1]) for row in rows)
    n = len(rows)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    attn = torch.zeros(n, T, dtype=torch.long)
    mask = torch.zeros(n, T)
    logp = torch.zeros(n, T)
    ep = torch.zeros(n, dtype=torch.long)
    turn = torch.full((n, T), -1, dtype=torch.long)
    for i, (e, t, m, lp, tu) in enumerate(rows):
        ids[i, : len(t)] = torch.tensor(t)
        attn[i, : len(t)] = 1
        mask[i, : len(t)] = torch.tensor(m, dtype=torch.float32)
        logp[i, : len(t)] = torch.tensor(lp, dtype=torch.float32)
        turn[i, : len(t)] = torch.tensor(tu, dtype=torch.long)
        ep[i] = e
    return Batch(ids, attn, mask, logp * mask, ep, turn)


def turn_rewards(records: list[dict], weights: RewardWeights | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each episode's per-turn rewards (the environment's ``step_rewards``), (episodes, turns) with a (episodes,
    turns) mask of real turns. With `weights` (`train.efficiency_weight`) the last turn takes the difference between
    the rescored return and the environment's, so each row still sums to the return RL optimises. An episode whose
    rewards do not match its sampled actions (one per turn of the action mask) is refused: its credit would land on
    the wrong tokens."""
    per_ep = []
    for r in records:
        rewards = r.get("step_rewards")
        n_turns = int(A.turn_ids(torch.tensor(r["action_mask"])).max()) + 1
        if rewards is None or len(rewards) != n_turns:
            raise AgentRLError(f"train.turn_credit: episode of task {r.get('task_id')!r} has "
                               f"{'no step_rewards' if rewards is None else f'{len(rewards)} step rewards'} for "
                               f"{n_turns} sampled actions (rollout records carry one reward per action)")
        rewards = [float(x) for x in rewards]
        if weights is not None:
            rewards[-1] += composite(RewardComponents(**r["components"]), weights) - float(r["return"])
        per_ep.append(rewards)
    width = max(len(x) for x in per_ep)
    out, mask = torch.zeros(len(per_ep), width), torch.zeros(len(per_ep), width)
    for i, x in enumerate(per_ep):
        out[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1.0
    return out, mask


# --------------------------------------------------------------------------------------------------------- sampling
@dataclass
class SamplerState:
    """Everything the task sampling depends on; checkpointed with the engine."""

    curriculum: Curriculum
    goals: GoalSampler
    normalizer: RewardNormalizer | None
    entropy: AdaptiveEntropyCoef
    rng: np.random.Generator

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict(), "goals": self.goals.state_dict(),
                "normalizer": self.normalizer.state_dict() if self.normalizer else None,
                "entropy": self.entropy.state_dict(), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, s: dict) -> None:
        self.curriculum.load_state_dict(s["curriculum"])
        self.goals.load_state_dict(s["goals"])
        if self.normalizer is not None and s["normalizer"] is not None:
            self.normalizer.load_state_dict(s["normalizer"])
        self.entropy.load_state_dict(s["entropy"])
        self.rng.bit_generator.state = s["rng"]


def make_sampler_state(cfg: TrainConfig) -> SamplerState:
    return SamplerState(
        curriculum=Curriculum([1, 2, 3, 4], cfg.curriculum_start_level, cfg.curriculum_threshold,
                              cfg.level_weight_floor, cfg.level_success_window),
        goals=GoalSampler(),
        normalizer=RewardNormalizer(cfg.reward_norm_window) if cfg.reward_norm_window else None,
        entropy=AdaptiveEntropyCoef(cfg.entropy_coef, cfg.entropy_target or 0.0, max_coef=cfg.entropy_coef_max),
        rng=np.random.default_rng([cfg.seed, 7]),
    )


def plan_update(state: SamplerState, tasks_by_level: dict[int, list[Task]], cfg: TrainConfig) -> list[Task]:
    """The update's tasks (same on every rank, since the state is): stratified levels, goal-sampled tasks."""
    levels = state.curriculum.sample_levels(cfg.tasks_per_update, state.rng)
    chosen = []
    for lv in levels:
        pool = tasks_by_level.get(lv) or []
        if not pool:
            raise AgentRLError(f"no training task of level {lv}; the curriculum cannot sample it")
        ids = [t.task_id for t in pool]
        if cfg.goal_sampling:
            tid = state.goals.sample(ids, 1, state.rng)[0]
        else:
            tid = ids[int(state.rng.integers(len(ids)))]
        chosen.append(next(t for t in pool if t.task_id == tid))
    return chosen


# ------------------------------------------------------------------------------------------------------ advantages
def episode_scores(records: list[dict], state: SamplerState, weights: RewardWeights | None = None) -> torch.Tensor:
    """The score of each episode that advantages start from: its return R, or with `weights` R recomputed from its
    reward components (`train.efficiency_weight`), then normalised when reward normalisation is on."""
    if weights is None:
        returns = np.array([r["return"] for r in records], dtype=np.float64)
    else:
        returns = np.array([composite(RewardComponents(**r["components"]), weights) for r in records],
                           dtype=np.float64)
    if state.normalizer is not None:
        scores = state.normalizer.normalize(returns)
        state.normalizer.update(returns)
    else:
        scores = returns
    return torch.tensor(scores, dtype=torch.float32)


def rename_options(tasks: list[Task], seeds: list[int], pool, prob: float) -> list[dict | None]:
    """Reset options of each episode: with probability `prob`, {"rename": {product: fictitious name}} for the
    products a task names (:meth:`pipeline.env.core.ToolTasksEnv._rename`), drawn from the episode's seed, so a
    resumed run draws the same names. Tasks that search the corpus are never renamed (its documents name the real
    products). A fictitious name (`pool`, :class:`pipeline.adapt.sft.NamePool`) is never a real entity's."""
    if prob <= 0:
        return [None] * len(tasks)
    out: list[dict | None] = []
    for task, seed in zip(tasks, seeds):
        rng = np.random.default_rng([int(seed), 17])
        if rng.random() >= prob or any(s.get("tool") == "search" for s in task.plan):
            out.append(None)
            continue
        mapping: dict[str, str] = {}
        for e in task.entities:
            if pool.kind_of.get(e) == "products":
                new = pool.fake("products", rng, set(mapping.values()))
                if new:
                    mapping[e] = new
        out.append({"rename": mapping} if mapping else None)
    return out


def guide_failed_groups(records: list[dict], tasks_by_id: dict[str, Task], engine, version: int,
                        options_of: Callable[[Task, int], dict | None] = lambda task, seed: None
                        ) -> tuple[list[dict], dict]:
    """`train.guide_failed_groups`: a copy of `records` in which the last episode of every group whose episodes all
    failed is replaced by the scripted expert's episode of the same task, seed and reset options
    (:meth:`pipeline.policy.rollout.RolloutEngine.demonstrate`, as policy `version`). A demonstration the expert
    does not solve (an injected tool failure, say) is not used. Returns the records and counts: ``groups`` (groups
    seen), ``guided`` (replaced), ``expert_failed``."""
    from pipeline.env.expert import ExpertPolicy

    out = list(records)
    members: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        members.setdefault(r["group"], []).append(i)
    counts = {"groups": len(members), "guided": 0, "expert_failed": 0}
    for idx in members.values():
        if any(records[i]["success"] for i in idx):
            continue
        last = records[idx[-1]]
        task = tasks_by_id[last["task_id"]]
        demo, = engine.demonstrate([task], [last["seed"]], ExpertPolicy, version, [options_of(task, last["seed"])])
        if not demo["success"]:
            counts["expert_failed"] += 1
            continue
        out[idx[-1]] = {**demo, "group": last["group"]}
        counts["guided"] += 1
    return out, counts


def group_ids_of(records: list[dict]) -> torch.Tensor:
    keys = {}
    return torch.tensor([keys.setdefault(r["group"], len(keys)) for r in records])


# ------------------------------------------------------------------------------------------------------ diagnostics
def tool_usage(records: list[dict]) -> dict:
    counts = Counter(c.get("tool") or "invalid" for r in records for c in r["calls"])
    total = sum(counts.values()) or 1
    probs = np.array([v / total for v in counts.values()])
    out = {f"tools/share_{k}": v / total for k, v in sorted(counts.items())}
    out["tools/entropy"] = float(-(probs * np.log(probs)).sum()) if len(probs) else 0.0
    seqs = Counter(tuple(c.get("tool") for c in r["calls"]) for r in records)
    out["tools/distinct_sequences_share"] = len(seqs) / max(1, len(records))
    return out


def params_without_grad(module: torch.nn.Module) -> int:
    return sum(1 for p in module.parameters() if p.requires_grad and (p.grad is None or not torch.any(p.grad != 0)))


# ------------------------------------------------------------------------------------------------------ async worker
class AsyncRollouts:
    """Rollout threads that generate with a weight snapshot while the learner trains (seed 1.4).

    The snapshot is one copy of the policy shared by `n_workers` threads, each with its own rollout engine and its
    share of the batch: decoding releases the GIL inside torch, and a slow tool (`env.tool_latency_s`) sleeps in one
    thread while the others decode, so tool latency overlaps with generation and with learning. `sync` copies the
    learner's weights into the snapshot between batches (never while one is being generated). Batches carry the
    snapshot's version, so the learner knows their staleness.
    """

    def __init__(self, make_engine, policy: torch.nn.Module, n_workers: int = 1):
        self.snapshot = copy.deepcopy(policy).eval()
        for p in self.snapshot.parameters():
            p.requires_grad_(False)
        self.version = 0
        self.n = n_workers
        self.requests = [queue.Queue() for _ in range(n_workers)]
        self.results = [queue.Queue() for _ in range(n_workers)]
        self.threads = [threading.Thread(target=self._loop, args=(make_engine(self.snapshot), i), daemon=True,
                                         name=f"rollout-worker-{i}") for i in range(n_workers)]
        for t in self.threads:
            t.start()

    def _loop(self, engine, i: int) -> None:
        while True:
            item = self.requests[i].get()
            if item is None:
                return
            tasks, seeds, options, version = item
            try:
                records = (engine.run(tasks, seeds, greedy=False, policy_version=version, options=options)
                           if tasks else [])
                self.results[i].put((records, None))
            except Exception as exc:  # surfaced in the learner's thread
                self.results[i].put((None, exc))

    def submit(self, tasks: list[Task], seeds: list[int], options: list[dict | None] | None = None) -> None:
        self._t0 = time.perf_counter()
        options = options or [None] * len(tasks)
        for i in range(self.n):
            self.requests[i].put((tasks[i::self.n], seeds[i::self.n], options[i::self.n], self.version))

    def collect(self) -> tuple[list[dict], float]:
        parts = []
        for q in self.results:
            records, exc = q.get()
            if exc is not None:
                raise exc
            parts.append(records)
        seconds = time.perf_counter() - self._t0
        out = [None] * sum(len(p) for p in parts)  # undo the interleaved split: episode order is the plan's order
        for i, p in enumerate(parts):
            out[i::self.n] = p
        return out, seconds

    def sync(self, policy: torch.nn.Module, version: int) -> None:
        self.snapshot.load_state_dict(policy.state_dict())
        self.version = version

    def close(self) -> None:
        for q in self.requests:
            q.put(None)
        for t in self.threads:
            t.join(timeout=60)


# ------------------------------------------------------------------------------------------------------------ loop
def _fingerprint(module: torch.nn.Module, meta: dict) -> str:
    import hashlib

    shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in module.state_dict().items())
    base = json.dumps({k: meta.get(k) for k in ("model_config", "tokenizer", "data", "vocab_size")}, sort_keys=True,
                      default=str)
    return hashlib.sha256((shapes + base).encode()).hexdigest()[:16]


def _evaluate(rollout, tasks: list[Task], dist, seed: int) -> dict:
    """Greedy evaluation split over ranks; returns `summarize` of all records (every rank gets the same), with
    ``per_level_template_seen`` (each level's figures on its seen-wording tasks) where the split also holds tasks in
    a held-out wording (:func:`pipeline.train.worker.seen_wording_headroom` reads it)."""
    mine = tasks[dist.rank::dist.world_size]
    seeds = [seed + i for i in range(len(tasks))][dist.rank::dist.world_size]
    records = rollout.run(mine, seeds, greedy=True) if mine else []
    light = [{k: v for k, v in r.items() if k not in ("token_ids", "logprobs", "action_mask", "steps", "actions")}
             for r in records]
    gathered = [r for part in dist.all_gather(light) for r in part]
    out = summarize(gathered)
    if "template_seen" in out:  # a split with held-out wordings (test): each level's seen-wording figures too
        out["per_level_template_seen"] = summarize([r for r in gathered if r["template_seen"]])["per_level"]
    return out


def train(cfg: TrainConfig, env_cfg: EnvConfig, rollout_cfg, *, policy_dir: Path, train_tasks: list[Task],
          val_tasks: list[Task], runtime: WorldRuntime, out_dir: Path, ckpt_dir: Path, dist, run,
          demo_examples: list | None = None, stop_after: int | None = None, log=print, evaluate=None,
          before_learn: Callable[[int], None] | None = None, name_pool=None) -> dict:
    """Train from the adapted policy in `policy_dir`; the best policy (by the validation metric
    `cfg.early_stopping_metric`) goes to `out_dir`, and training stops early after `cfg.early_stopping_patience`
    evaluations without improvement (:mod:`pipeline.train.early_stopping`).

    `stop_after` ends the run after that many updates *of this call* (without a final checkpoint beyond the
    periodic ones): tests use it to stop a run midway and resume it. `evaluate` replaces the greedy validation
    evaluation (same signature and result as `_evaluate`): tests script a validation curve with it.
    `before_learn(update)` is called in every update (numbered from 1) after its rollouts and before it learns: the
    resume test kills the process there (``pipeline.train.worker --kill-at-update``).

    The best policy is kept in ``ckpt_dir/best`` while the run goes and copied to `out_dir` when the run completes, so
    `out_dir` only ever holds a finished run's policy, and a finished run that is started again (its checkpoints are
    complete) restores the policy from there without training: DVC deletes a stage's outputs before it reruns it.
    `name_pool` (:class:`pipeline.adapt.sft.NamePool`) supplies the fictitious names of
    `cfg.rollout_entity_augmentation` (:func:`rename_options`).
    Returns the learning curve and the evaluation history (rank 0 also logs them to `run`).
    """
    if cfg.rollout_entity_augmentation > 0 and name_pool is None:
        raise AgentRLError("train.rollout_entity_augmentation needs a NamePool of fictitious names "
                           "(data/env/entities.json)")
    from pipeline.policy.model import autocast_context, copy_policy, load_policy, release_free_memory, save_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.policy.tokenizer import PAD, marker_ids
    from pipeline.train.distributed import make_engine, resolve_ds_config

    if rollout_cfg.top_p != 1.0:
        raise AgentRLError("rollout.top_p must be 1.0 for RL: the learner's log-probabilities are those of the full "
                           "distribution, and a nucleus-truncated sampler would bias the importance ratios")
    torch.manual_seed(cfg.seed + dist.rank)
    model, tokenizer, meta = load_policy(policy_dir)
    # the adapted weights, for the weight-space ensemble that is validated and kept (`cfg.merge_alpha`); taken before
    # a resumed run loads its checkpoint, so they are always the start's
    start_weights = ({k: v.detach().clone() for k, v in model.state_dict().items()} if cfg.merge_alpha < 1
                     else None)
    pad_id = marker_ids(tokenizer)[PAD]
    actor = ActorCritic(model, with_value=cfg.algorithm == "ppo")
    actor.train()
    ref = None
    if cfg.kl_coef > 0:
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    per_rank_tasks = cfg.tasks_per_update // dist.world_size
    episodes_per_rank = per_rank_tasks * cfg.group_size
    micro = max(1, math.ceil(episodes_per_rank / (cfg.minibatches * cfg.micro_batches)))
    ds_cfg = resolve_ds_config(cfg.deepspeed_config, micro_batch=micro, grad_accum=cfg.micro_batches,
                               world_size=dist.world_size,
                               max_grad_norm=cfg.max_grad_norm, device=dist.device)
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    engine = make_engine(actor, optimizer, ds_cfg, dist, warmup_steps=cfg.lr_warmup_steps)
    policy = engine.module.policy
    new_engine = lambda m: RolloutEngine(m, tokenizer, runtime, env_cfg, rollout_cfg)  # noqa: E731
    score_weights = (None if cfg.efficiency_weight is None
                     else env_cfg.reward.model_copy(update={"efficiency": cfg.efficiency_weight}))
    rollout = new_engine(policy)
    merged = None  # the ensemble θ_start + α(θ − θ_start) that validation scores and `best` keeps, and its engine
    if start_weights is not None:
        merged = copy.deepcopy(policy).eval()
        for p in merged.parameters():
            p.requires_grad_(False)
        merged_rollout = new_engine(merged)
    state = make_sampler_state(cfg)
    fingerprint = _fingerprint(engine.module, meta)
    tasks_by_level: dict[int, list[Task]] = {}
    tasks_by_id = {t.task_id: t for t in train_tasks}
    for t in train_tasks:
        tasks_by_level.setdefault(t.level, []).append(t)

    start, history, evals, best = 0, [], [], {"success": -1.0, "update": None}
    stopper = EarlyStopping(cfg.early_stopping_metric, cfg.early_stopping_patience, cfg.early_stopping_min_delta)
    evaluate = evaluate or _evaluate
    bc_rng = np.random.default_rng([cfg.seed, 11, dist.rank])
    if (ckpt_dir / "latest").is_file():
        try:
            path, client = engine.load_checkpoint(str(ckpt_dir), load_optimizer_states=True)
        except Exception as exc:  # a mismatched checkpoint fails deep inside torch/DeepSpeed
            raise AgentRLError(f"cannot resume from {ckpt_dir}: {str(exc).splitlines()[0][:300]} (a checkpoint from "
                               f"another model? delete {ckpt_dir} to start over)") from None
        if client is None or client.get("fingerprint") != fingerprint:
            raise AgentRLError(f"checkpoint in {ckpt_dir} was written for another model or configuration "
                               f"(fingerprint {client and client.get('fingerprint')} != {fingerprint}); delete it "
                               f"to start over")
        state.load_state_dict(client["sampler"])
        if client.get("bc_rng") is not None:  # which demonstrations behaviour cloning draws next (one per rank)
            bc_rng.bit_generator.state = client["bc_rng"][dist.rank]
        torch.set_rng_state(torch.tensor(client["torch_rng"], dtype=torch.uint8))
        start, history, evals, best = client["update"], client["history"], client["evals"], client["best"]
        stopper.load_state_dict(client["early_stopping"])
        log(f"resumed from {path} at update {start}")

    worker = AsyncRollouts(new_engine, policy, cfg.rollout_workers) if cfg.async_rollouts else None

    def plan(u: int) -> tuple[list[Task], list[int]]:
        tasks = plan_update(state, tasks_by_level, cfg)
        mine = tasks[dist.rank * per_rank_tasks:(dist.rank + 1) * per_rank_tasks]
        ep_tasks = [t for t in mine for _ in range(cfg.group_size)]
        base = (cfg.seed * 1_000_003 + u * 7919) * 64 + dist.rank * episodes_per_rank
        seeds = [base + i for i in range(len(ep_tasks))]
        return ep_tasks, seeds, rename_options(ep_tasks, seeds, name_pool, cfg.rollout_entity_augmentation)

    floors = {**COLLAPSE, "entropy": cfg.entropy_alarm}  # collapse alarms' thresholds
    pending = None
    if worker is not None and start < cfg.updates:
        pending = plan(start)
        worker.submit(*pending)
    done_here = 0
    try:
        for u in range(start, cfg.updates):
            if (stop_after is not None and done_here >= stop_after) or stopper.stopped:
                break
            t0 = time.perf_counter()
            idle = 0.0
            if worker is None:
                ep_tasks, seeds, options = plan(u)
                records = rollout.run(ep_tasks, seeds, greedy=False, policy_version=u, options=options)
                t_rollout = time.perf_counter() - t0
            else:
                records, t_rollout = worker.collect()
                idle = time.perf_counter() - t0
                if u + 1 < cfg.updates:  # next batch is generated while this one trains
                    if (u + 1) % cfg.sync_every == 0:
                        worker.sync(policy, u)
                    pending = plan(u + 1)
                    worker.submit(*pending)
            if before_learn is not None:
                before_learn(u + 1)
            staleness = u - min(r["policy_version"] for r in records)
            for i, r in enumerate(records):
                r["group"] = i // cfg.group_size
            # curriculum sees every rank's outcomes, so the shared sampling state stays identical on all ranks
            outcomes = dist.all_gather([(r["level"], r["success"]) for r in records])
            flat = [o for part in outcomes for o in part]
            state.curriculum.update([lv for lv, _ in flat], [s for _, s in flat])

            t1 = time.perf_counter()
            stale_everywhere = dist.all_gather(staleness > cfg.max_staleness)
            if any(stale_everywhere):  # too old to correct reliably: drop the batch on every rank, count it
                metrics = {"offpolicy/dropped_stale_batch": 1.0}
                if dist.is_main:
                    log(f"update {u + 1}: dropped a batch {staleness} versions old (max_staleness={cfg.max_staleness})")
            else:
                learn_records, guided = records, None
                if cfg.guide_failed_groups:  # after the curriculum saw the policy's own outcomes
                    learn_records, guided = guide_failed_groups(
                        records, tasks_by_id, rollout, u,
                        lambda t, s: rename_options([t], [s], name_pool, cfg.rollout_entity_augmentation)[0])
                metrics = _learn(cfg, engine, ref, learn_records, state, pad_id, rollout_cfg.temperature, u, staleness,
                                 demo_examples, bc_rng, autocast_context, dist, score_weights)
                if guided is not None:
                    total = {k: sum(part[k] for part in dist.all_gather(guided)) for k in guided}
                    metrics.update({"guidance/groups_guided": total["guided"],
                                    "guidance/group_share": total["guided"] / max(1, total["groups"]),
                                    "guidance/expert_failed": total["expert_failed"]})
                release_free_memory()  # the learner's freed activations back to the OS (why: see the function)
            t_learn = time.perf_counter() - t1
            n_tokens = sum(sum(r["action_mask"]) for r in records)
            metrics.update({
                "sys/rollout_s": t_rollout, "sys/learn_s": t_learn, "sys/idle_s": idle,
                "sys/update_s": time.perf_counter() - t0,
                "charts/episodes_per_s": len(records) * dist.world_size / max(1e-9, time.perf_counter() - t0),
                "charts/sampled_tokens_per_s": n_tokens * dist.world_size / max(1e-9, t_rollout),
                "offpolicy/staleness": staleness,
                "rollout/success": float(np.mean([s for _, s in flat])),
                "rollout/return": float(np.mean([r["return"] for r in records])),
                "rollout/reward_spread": float(np.std([r["return"] for r in records])),
                "rollout/tool_calls": float(np.mean([r["n_calls"] for r in records])),
                "curriculum/max_open_level": state.curriculum.max_open,
                **{f"curriculum/weight_l{lv}": w for lv, w in state.curriculum.weights().items()},
                **tool_usage(records),
            })
            for name, key in (("entropy", "policy/entropy"), ("reward_spread", "rollout/reward_spread"),
                              ("advantage_var", "policy/advantage_var")):
                if key in metrics and metrics[key] < floors[name]:
                    metrics[f"alarms/{name}_collapse"] = 1.0
                    if dist.is_main:
                        log(f"warning: update {u}: {name} collapsed ({metrics[key]:.3g} < {floors[name]})")
            history.append({"update": u + 1, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
            if (u + 1) % cfg.eval_every == 0 or u + 1 == cfg.updates:
                if merged is not None:
                    merged.load_state_dict(A.interpolate_weights(start_weights, policy.state_dict(), cfg.merge_alpha))
                    kept, scored = merged, merged_rollout
                else:
                    kept, scored = policy, rollout if worker is None else new_engine(policy)
                summary = evaluate(scored, val_tasks[:cfg.eval_tasks], dist, seed=10_000)
                val = summary["overall"]["success_rate"]
                entry = {"update": u + 1, "val_success": val, **{f"val_success_l{lv}": s["success_rate"]
                                                                 for lv, s in summary["per_level"].items()}}
                decision = stopper.update(metric_value(cfg.early_stopping_metric, summary), u + 1)
                entry[f"val_{cfg.early_stopping_metric}"] = decision.value
                evals.append(entry)
                metrics.update({f"eval/{k}": v for k, v in entry.items() if k != "update"})
                metrics.update({"early_stopping/best_value": decision.best_value,
                                "early_stopping/evals_since_best": decision.evals_since_best,
                                "early_stopping/stopped": decision.stop})
                if dist.is_main and decision.stop:
                    log(f"early stopping: {decision.reason}")
                    run.set_tags({"early_stopping.stopped": True, "early_stopping.reason": decision.reason})
                if decision.improved:
                    best = {"success": val, "update": u + 1, cfg.early_stopping_metric: decision.value}
                    if dist.is_main:
                        save_policy(kept, tokenizer, ckpt_dir / BEST, {
                            **meta, "phase": "train", "step": u + 1, "rl_update": u + 1, "val_success": val,
                            "algorithm": cfg.algorithm, "merge_alpha": cfg.merge_alpha, "train_config": cfg.model_dump(),
                            "parent": {"phase": meta.get("phase"), "step": meta.get("step")}})
                dist.barrier()
            if dist.is_main:
                run.log_metrics(metrics, step=u + 1)
                log(f"update {u + 1}/{cfg.updates}: success {metrics['rollout/success']:.3f} return "
                    f"{metrics['rollout/return']:.3f} loss {metrics.get('losses/total', float('nan')):.4f} "
                    f"rollout {t_rollout:.1f}s learn {t_learn:.1f}s"
                    + (f" | val {metrics['eval/val_success']:.3f} (" + " ".join(
                        f"L{k[-1]} {v:.2f}" for k, v in sorted(metrics.items()) if k.startswith("eval/val_success_l"))
                       + ")" if "eval/val_success" in metrics else ""))
            done_here += 1
            if (u + 1) % cfg.checkpoint_every == 0 or u + 1 == cfg.updates or stopper.stopped:
                engine.save_checkpoint(str(ckpt_dir), tag=f"update-{u + 1}", client_state={
                    "update": u + 1, "sampler": state.state_dict(), "fingerprint": fingerprint,
                    "torch_rng": torch.get_rng_state().tolist(), "history": history, "evals": evals, "best": best,
                    "early_stopping": stopper.state_dict(),
                    "bc_rng": dist.all_gather(bc_rng.bit_generator.state)})
    finally:
        if worker is not None:
            worker.close()
    completed = len(history) >= cfg.updates or stopper.stopped
    if completed and dist.is_main:
        copy_policy(ckpt_dir / BEST, out_dir)
    dist.barrier()
    return {"history": history, "evals": evals, "best": best, "fingerprint": fingerprint, "completed": completed,
            "early_stopping": stopper.summary(completed_all=len(history) >= cfg.updates)}


def one_forward(cfg: TrainConfig) -> bool:
    """Whether an update is one on-policy optimizer step, so π_old is the training forward's own π_θ.detach()."""
    return cfg.algorithm != "ppo" and cfg.epochs == 1 and cfg.minibatches == 1


def length_chunks(lengths: torch.Tensor, rows: torch.Tensor, k: int) -> list[torch.Tensor]:
    """`rows` sorted by `lengths` (longest first) and split into `k` chunks of near-equal row counts (some empty when
    there are fewer rows than chunks): rows of similar length share a chunk, so each is padded only to its own
    longest row."""
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    return list(torch.tensor_split(order, k))


def _learn(cfg, engine, ref, records, state, pad_id, temperature, u, staleness, demo_examples, bc_rng,
           autocast_context, dist, score_weights: RewardWeights | None = None) -> dict:
    """Advantages and the optimisation steps of one update; returns its metrics.

    **Gradient accumulation.** Each optimizer step (one per minibatch) forwards its rows in `cfg.micro_batches`
    chunks of similar length, each padded to its own longest row, and DeepSpeed accumulates their gradients
    (``gradient_accumulation_steps``) before it clips, reduces over ranks and steps. Every term is weighted by its
    chunk's share of the minibatch's tokens, so the accumulated gradient equals the one-forward gradient of the whole
    minibatch; the learner's activation memory (dominated by the attention scores and the logits) is that of one
    chunk. The no-grad forwards for π_old, V_old and the reference go chunk by chunk too.

    Two savings that change no gradient:
    - **One forward when the update is one on-policy step** (:func:`one_forward`: group baselines, one epoch, one
      minibatch): π_old is then the learner's own π_θ before its only step, so π_old = π_θ.detach() from the training
      forward itself (the ratio is exactly 1, as it would be after a separate no-grad forward) and that forward is
      skipped. PPO needs V_old and π_old before its first step, so it keeps the separate forward.
    - **Only rows that carry signal are forwarded**: rows whose loss mask is empty (zero-variance groups left out of
      the loss) contribute no policy gradient, so they are dropped before the learner's forwards unless the KL term
      is on (behaviour cloning reads demonstrations, not these rows); the entropy bonus is then estimated on the rows
      that are trained on. A rank left
      with no such row (or a chunk left empty) still forwards one row with its loss multiplied by 0, so every rank
      joins every collective step.

    A chunk whose loss is not finite on any rank contributes nothing, and the step it belongs to is applied with a
    learning rate of 0 (the weights stay as they were; counted in ``train/skipped_steps_nonfinite``).
    """
    batch = collate_records(records, pad_id)
    turn_credit: dict[str, float] = {}
    if cfg.turn_credit:  # before episode_scores, which updates the normaliser after using it
        t_rewards, t_mask = turn_rewards(records, score_weights)
        shift, scale = state.normalizer.affine() if state.normalizer is not None else (0.0, 1.0)
        t_returns = A.discounted_returns(t_rewards, cfg.gamma)
    scores = episode_scores(records, state, score_weights)
    groups = group_ids_of(records)
    zero_var = torch.zeros(len(records), dtype=torch.bool)
    device = engine.device
    if cfg.algorithm in ("grpo", "rloo") and cfg.turn_credit:
        t_adv, zero_var = A.turn_advantages((t_returns - shift) / scale * t_mask, t_mask, groups, cfg.algorithm)
        spread = (t_adv.masked_fill(t_mask == 0, -math.inf).amax(1) - t_adv.masked_fill(t_mask == 0, math.inf).amin(1))
        turn_credit = {"turn_credit/turns_per_episode": float(t_mask.sum(1).mean()),
                       "turn_credit/adv_spread_within_episode": float(spread.mean())}
    elif cfg.algorithm in ("grpo", "rloo"):
        ep_adv, zero_var = A.group_advantages(scores, groups, cfg.algorithm)
    loss_mask = batch.mask.clone()
    if cfg.skip_zero_variance_groups and cfg.algorithm != "ppo":
        loss_mask = loss_mask * (~zero_var[batch.episode]).float()[:, None]
    loss_mask = A.loss_weights(loss_mask, batch.episode, len(records), cfg.loss_agg)  # weights: see train.loss_agg
    if cfg.algorithm != "ppo" and ref is None:  # behaviour cloning reads demonstrations, not these rows
        keep = torch.nonzero(loss_mask.sum(1) > 0).flatten()
        if keep.numel() == 0:
            batch, loss_mask = batch.select(torch.tensor([0])), loss_mask[:1] * 0
        else:
            batch, loss_mask = batch.select(keep), loss_mask[keep]
    # demonstrated episodes (train.guide_failed_groups) have no sampling distribution: importance weight 1
    demo_rows = torch.tensor([bool(r.get("demonstrated")) for r in records])[batch.episode]
    lengths = batch.attn.sum(1)
    all_rows = torch.arange(batch.n_rows)
    k = cfg.micro_batches
    single_pass = one_forward(cfg)
    old_logp = old_values = ref_logp = None
    if not single_pass:
        old_logp, old_values = _no_grad_logp(lambda i, a: engine.module(i, a), batch, length_chunks(lengths, all_rows, k),
                                             temperature, device, autocast_context)
    if ref is not None:
        ref_logp, _ = _no_grad_logp(lambda i, a: (ref(input_ids=i, attention_mask=a).logits, None), batch,
                                    length_chunks(lengths, all_rows, k), temperature, device, autocast_context)
    if cfg.algorithm in ("grpo", "rloo") and cfg.turn_credit:
        adv = t_adv[batch.episode[:, None], batch.turn.clamp(min=0)] * batch.mask
        returns = None
    elif cfg.algorithm in ("grpo", "rloo"):
        adv = ep_adv[batch.episode][:, None] * batch.mask
        returns = None
    else:
        if cfg.turn_credit:  # each turn's reward on its last token; the normaliser's shift on the episode's last turn
            last = (t_mask.cumsum(1) == t_mask.sum(1, keepdim=True)) & (t_mask > 0)
            rewards = A.turn_token_rewards((t_rewards - shift * last.float()) / scale, batch.episode, batch.turn,
                                           batch.mask)
            turn_credit = {"turn_credit/turns_per_episode": float(t_mask.sum(1).mean())}
        else:
            # on the episode's last action token only: an episode folded into several rows (segments) is paid once
            rewards = A.token_rewards(scores[batch.episode] * A.last_rows(batch.episode), batch.mask)
        adv, returns = A.compute_gae_over_segments(rewards, old_values * batch.mask, batch.mask, batch.episode,
                                                   cfg.gamma, cfg.lam)
        adv = A.masked_whiten(adv, batch.mask)
    is_w = is_stats = None
    if old_logp is not None:
        sample_logp = torch.where(demo_rows[:, None], old_logp * batch.mask, batch.sample_logp)
        is_w, is_stats = A.truncated_importance_weights(old_logp, sample_logp, loss_mask, cfg.is_clip)

    rng = np.random.default_rng([cfg.seed, u, dist.rank])
    agg: dict[str, list[float]] = {}
    ent_coef = state.entropy.value
    skipped = 0
    for _ in range(cfg.epochs):
        order = torch.from_numpy(rng.permutation(batch.n_rows))
        for rows in torch.tensor_split(order, cfg.minibatches):
            n_pg = float(loss_mask[rows].sum())
            n_act = float(batch.mask[rows].sum())
            step: dict[str, float] = {}
            finite_everywhere = True
            for c, chunk in enumerate(length_chunks(lengths, rows, k)):
                dummy = chunk.numel() == 0  # fewer rows than chunks: forward one row, contribute nothing
                chunk = torch.tensor([0]) if dummy else chunk
                T = int(lengths[chunk].max())
                cut = lambda t: t[chunk][:, :T]  # noqa: E731 - this chunk's rows, trimmed to its longest
                mb = batch.select(chunk)
                ids, attn, mask, m = cut(batch.ids), cut(batch.attn), cut(batch.mask), cut(loss_mask)
                w_pg = float(m.sum()) / max(n_pg, 1.0) if not dummy else 0.0
                w_act = float(mask.sum()) / max(n_act, 1.0) if not dummy else 0.0
                with autocast_context("auto", device):
                    logits, values = engine(ids.to(device), attn.to(device))
                logp = token_logprobs(logits, ids.to(device), temperature).cpu()
                if single_pass:  # π_old = π_θ before this, the only step (see the docstring)
                    old_c = logp.detach() * mask
                    sample_c = torch.where(demo_rows[chunk][:, None], old_c, cut(batch.sample_logp))
                    is_c, is_stats_c = A.truncated_importance_weights(old_c, sample_c, m, cfg.is_clip)
                    is_stats = _merge_stats(is_stats, is_stats_c, w_pg, c == 0)
                else:
                    old_c, is_c = cut(old_logp), cut(is_w)
                pg, pg_m = A.ppo_policy_loss(logp, old_c, cut(adv), m, cfg.clip_eps, is_c)
                ent = A.masked_mean(token_entropy(logits, temperature).cpu(), mask)
                loss = w_pg * pg - w_act * ent_coef * ent
                mets = {**{key: (v, w_pg) for key, v in pg_m.items()}, "policy/entropy": (float(ent.detach()), w_act)}
                if values is not None:
                    vl, vm = A.value_loss(values.cpu(), cut(old_values), cut(returns), mask, cfg.value_clip)
                    loss = loss + w_act * cfg.vf_coef * vl
                    mets.update({key: (v, w_act) for key, v in vm.items()})
                if ref_logp is not None:
                    kl, km = A.kl_penalty(logp, cut(ref_logp), mask)
                    loss = loss + w_act * cfg.kl_coef * kl
                    mets.update({key: (v, w_act) for key, v in km.items()})
                if dummy or n_pg == 0:  # nothing to learn here: keep the collective step, contribute zero
                    loss = loss * 0.0
                if cfg.bc_coef > 0 and demo_examples and c == 0:  # once per optimizer step, with or without RL signal
                    bc = _bc_loss(engine, demo_examples, cfg.bc_batch, bc_rng, pad_id, device, autocast_context)
                    loss = loss + cfg.bc_coef * bc
                    mets["losses/bc"] = (float(bc.detach()), 1.0)
                if not all(dist.all_gather(bool(torch.isfinite(loss.detach())))):
                    finite_everywhere = False  # a NaN/inf loss on any rank: this chunk contributes nothing anywhere
                    loss = sum(p.sum() for p in engine.module.parameters() if p.requires_grad) * 0.0
                    mets = {}
                mets["losses/total"] = (float(loss.detach()), 1.0)
                for key, (v, w) in mets.items():
                    step[key] = step.get(key, 0.0) + v * w
                engine.backward(loss, scale_wrt_gas=False)  # the chunk weights already sum to the minibatch mean
                if c == k - 1:
                    step["diag/params_without_grad"] = params_without_grad(engine.module.policy)
                    step["train/lr"] = float(engine.get_lr()[0])  # the rate this step applies
                    _step_engine(engine, apply=finite_everywhere)
                else:
                    engine.step()  # a no-op inside the accumulation, kept so DeepSpeed counts its micro-steps
            skipped += not finite_everywhere
            gn = engine.get_global_grad_norm()
            step["losses/grad_norm"] = float(gn) if gn is not None else float("nan")
            for key, v in step.items():
                agg.setdefault(key, []).append(v)
    out = {key: float(np.mean(v)) for key, v in agg.items()}
    if cfg.entropy_target is not None and "policy/entropy" in out:
        out["policy/entropy_coef"] = state.entropy.update(out["policy/entropy"])
    else:
        out["policy/entropy_coef"] = ent_coef
    masked = adv[loss_mask > 0]
    out.update({
        "policy/advantage_var": float(masked.var()) if masked.numel() > 1 else 0.0,
        "rollout/zero_variance_group_share": float(zero_var.float().mean()) if cfg.algorithm != "ppo" else 0.0,
        "train/skipped_steps_nonfinite": skipped,
        "train/batch_tokens": int(batch.attn.sum()),
        "train/rows_forwarded": int(batch.n_rows),
        **(is_stats or {}),
        **turn_credit,
    })
    if returns is not None and old_values is not None:
        out["losses/explained_variance"] = A.explained_variance(old_values * batch.mask, returns, batch.mask)
    return out


def _merge_stats(acc: dict | None, new: dict, weight: float, first: bool) -> dict:
    """Token-weighted sum of per-chunk statistics (``offpolicy/*``); max-type entries keep the maximum."""
    if first or acc is None:
        acc = {}
    for key, v in new.items():
        acc[key] = max(acc.get(key, v), v) if key.endswith("_max") else acc.get(key, 0.0) + v * weight
    return acc


def _no_grad_logp(forward, batch: Batch, chunks: list[torch.Tensor], temperature: float, device, autocast_context):
    """Log-probabilities (and values, when `forward` returns them) of every row of `batch` under `forward`, chunk by
    chunk, masked to the action tokens: (rows, T) tensors on the CPU."""
    logp = torch.zeros(batch.ids.shape)
    values = None
    with torch.no_grad():
        for chunk in chunks:
            if chunk.numel() == 0:
                continue
            T = int(batch.attn[chunk].sum(1).max())
            ids, attn = batch.ids[chunk][:, :T].to(device), batch.attn[chunk][:, :T].to(device)
            with autocast_context("auto", device):
                logits, v = forward(ids, attn)
            logp[chunk, :T] = token_logprobs(logits, ids, temperature).float().cpu()
            if v is not None:
                values = torch.zeros(batch.ids.shape) if values is None else values
                values[chunk, :T] = v.float().cpu()
            del logits
    return logp * batch.mask, values


def _step_engine(engine, apply: bool) -> None:
    """The optimizer step that ends an accumulation; ``apply=False`` runs it at a learning rate of 0, so DeepSpeed's
    counters and schedule advance but no weight moves (AdamW's decoupled weight decay is scaled by the rate too).

    What a skipped step still changes: AdamW's moment estimates and step count take in the gradient that was
    accumulated (the finite chunks' part; a non-finite chunk contributes exactly zero, see `_learn`), so the next
    applied step's bias correction and momentum carry it. The moments stay finite; restoring them would need a copy
    of the optimizer state every step, which this rare path does not justify."""
    groups = engine.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    if not apply:
        for g in groups:
            g["lr"] = 0.0
    engine.step()
    if not apply:
        for g, lr in zip(groups, saved):
            if g["lr"] == 0.0:  # no scheduler set the next rate
                g["lr"] = lr


def _bc_loss(engine, examples, n, rng, pad_id, device, autocast_context) -> torch.Tensor:
    """Negative log-likelihood of demonstration action tokens (seed 2.1: a behaviour-cloning anchor)."""
    pick = [examples[i] for i in rng.choice(len(examples), size=min(n, len(examples)), replace=False)]
    T = max(len(e.input_ids) for e in pick)
    ids = torch.full((len(pick), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(pick), T, dtype=torch.long)
    mask = torch.zeros(len(pick), T)
    for i, e in enumerate(pick):
        ids[i, : len(e)] = torch.tensor(e.input_ids)
        attn[i, : len(e)] = 1
        mask[i, : len(e)] = torch.tensor(e.loss_mask, dtype=torch.float32)
    with autocast_context("auto", device):
        logits, _ = engine(ids.to(device), attn.to(device))
    logp = token_logprobs(logits, ids.to(device), 1.0).cpu()
    return -A.masked_mean(logp, mask)
