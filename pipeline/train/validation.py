"""Evaluate-and-keep: every `train.eval_every` updates the policy is evaluated greedily on the validation split; the
best one by `train.early_stopping_metric` is saved in the checkpoint folder (:data:`pipeline.train.checkpoint.BEST`)
and early stopping (:mod:`pipeline.train.early_stopping`) watches the same metric.

With `train.merge_alpha` below 1 the policy that is validated and kept is the weight-space ensemble
θ_start + α(θ − θ_start) of the RL weights with the adapted ones (WiSE-FT, Wortsman et al. 2022,
:class:`WeightEnsemble`); RL itself goes on training θ. The final SFT-against-RL test comparison is the worker's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.envs.contract import TaskFields as Task
from pipeline.policy.episodes import summarize
from pipeline.train import core_algos as A
from pipeline.train.config import TrainConfig
from pipeline.train.early_stopping import EarlyStopping, metric_value

VAL_SEED = 10_000  # validation episodes' seeds are VAL_SEED + i, the same at every evaluation


def evaluate_greedy(rollout, tasks: list[Task], dist, seed: int, records_out: list | None = None) -> dict:
    """Greedy evaluation split over ranks; returns `summarize` of all records (every rank gets the same), with
    ``per_level_template_seen`` (each level's figures on its seen-wording tasks) where the split also holds tasks in
    a held-out wording (:func:`pipeline.train.worker.seen_wording_headroom` reads it). With `records_out`, every
    rank's records, with their ``steps`` and ``actions`` but without token streams, are appended to it (what the
    learnability report reads)."""
    mine = tasks[dist.rank::dist.world_size]
    seeds = [seed + i for i in range(len(tasks))][dist.rank::dist.world_size]
    records = rollout.run(mine, seeds, greedy=True) if mine else []
    drop = ("token_ids", "logprobs", "action_mask") + (("steps", "actions") if records_out is None else ())
    light = [{k: v for k, v in r.items() if k not in drop} for r in records]
    gathered = [r for part in dist.all_gather(light) for r in part]
    if records_out is not None:
        records_out.extend(gathered)
    out = summarize(gathered)
    if "template_seen" in out:  # a split with held-out wordings (test): each level's seen-wording figures too
        out["per_level_template_seen"] = summarize([r for r in gathered if r["template_seen"]])["per_level"]
    return out


class WeightEnsemble:
    """θ_start + α(θ − θ_start) in a frozen copy of the policy, with a rollout engine of its own."""

    def __init__(self, start_weights: dict[str, torch.Tensor], policy: torch.nn.Module, new_engine, alpha: float):
        self.start, self.alpha = start_weights, alpha
        self.model = copy.deepcopy(policy).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.rollout = new_engine(self.model)

    def refresh(self, policy: torch.nn.Module) -> None:
        self.model.load_state_dict(A.interpolate_weights(self.start, policy.state_dict(), self.alpha))


@dataclass
class Validation:
    """The evaluations of a run so far, the best policy's record and the early stopper (all checkpointed)."""

    cfg: TrainConfig
    val_tasks: list[Task]
    evaluate: Callable  # (rollout, tasks, dist, seed) -> summary, as evaluate_greedy
    stopper: EarlyStopping
    evals: list = field(default_factory=list)
    best: dict = field(default_factory=lambda: {"success": -1.0, "update": None})

    def due(self, update: int) -> bool:
        """Whether the policy after `update` updates (1-based) is evaluated."""
        return update % self.cfg.eval_every == 0 or update == self.cfg.updates

    def run(self, update: int, kept: torch.nn.Module, scored, dist, save_best: Callable[[torch.nn.Module, dict], None],
            log, tracker_run) -> dict:
        """Evaluate `scored` (the rollout engine of the policy `kept`) after `update` updates; record the evaluation,
        step early stopping, keep `kept` through `save_best(kept, meta)` (rank 0) when it is the best so far.
        Returns the metrics to log."""
        cfg = self.cfg
        summary = self.evaluate(scored, self.val_tasks[:cfg.eval_tasks], dist, seed=VAL_SEED)
        val = summary["overall"]["success_rate"]
        entry = {"update": update, "val_success": val, **{f"val_success_l{lv}": s["success_rate"]
                                                          for lv, s in summary["per_level"].items()}}
        decision = self.stopper.update(metric_value(cfg.early_stopping_metric, summary), update)
        entry[f"val_{cfg.early_stopping_metric}"] = decision.value
        self.evals.append(entry)
        metrics = {f"eval/{k}": v for k, v in entry.items() if k != "update"}
        metrics.update({"early_stopping/best_value": decision.best_value,
                        "early_stopping/evals_since_best": decision.evals_since_best,
                        "early_stopping/stopped": decision.stop})
        if dist.is_main and decision.stop:
            log(f"early stopping: {decision.reason}")
            tracker_run.set_tags({"early_stopping.stopped": True, "early_stopping.reason": decision.reason})
        if decision.improved:
            self.best = {"success": val, "update": update, cfg.early_stopping_metric: decision.value}
            if dist.is_main:
                save_best(kept, {"step": update, "rl_update": update, "val_success": val})
        dist.barrier()
        return metrics
