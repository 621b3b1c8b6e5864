"""Population training of the `train` phase (docs/design.md §2.1 and §3.2): several policies trained side by side from
the same adapted policy, the best on validation kept, and how differently the members behave.

**What it does.** With ``train.population.size`` = N > 1 the stage trains N members one after the other (on this
machine they would only compete for the same cores side by side), each a complete run of the ordinary loop with its
own config (:func:`member_configs`): ``vary: seed`` gives member i the seed ``train.seed + i`` (task plan, rollouts,
behaviour-cloning draws), ``vary: entropy`` gives it ``entropy_coefs[i]`` as its entropy bonus λ (same seed). Member 0
of ``vary: seed`` is the single run's config. Each member has its own checkpoint folder (the run key hashes the
member's config), so a killed population resumes member by member; each member's best policy stays in
``<its checkpoint folder>/policy``. The member whose best validation value (``train.early_stopping_metric``) is highest
becomes ``models/policy`` (the first one on a tie), and its learning curve is ``train_curve.csv``.

**Reported** in ``metrics/train.json`` under ``population``: every member's seed, entropy coefficient, best update,
best validation success and metric value and its evaluation history; the selected member; and the pairwise behaviour
diversity 1 − cos_sim(φ(τ_i), φ(τ_j)) between members. φ(τ) (:func:`trajectory_features`) counts an episode's tool
calls per tool and its tool bigrams (from a start marker; an unparsable action counts as ``<invalid>``), the features
that show a different strategy rather than different parameter values; each member plays the same validation tasks
(the first ``train.eval_tasks``, greedy, the validation seeds) with its kept policy, and the diversity of two members
is the mean over tasks of 1 − cos_sim of their two episodes' φ (:func:`member_diversity`). MLflow gets each member's
update metrics under ``member<i>/`` and the summary under ``population/``.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations
from pathlib import Path
from typing import Callable

from pipeline.train.extensions.base import Extension


def member_configs(cfg) -> list:
    """The TrainConfig of every member of `cfg`'s population (validated, so a member whose entropy coefficient
    contradicts the section fails with the reason)."""
    from pipeline.train.config import TrainConfig

    pop, base = cfg.population, cfg.model_dump()
    out = []
    for i in range(pop.size):
        update = {"seed": cfg.seed + i} if pop.vary == "seed" else {"entropy_coef": pop.entropy_coefs[i]}
        out.append(TrainConfig.model_validate({**base, **update}))
    return out


# ------------------------------------------------------------------------------------------------------ diversity
def trajectory_features(tools: list[str | None]) -> Counter:
    """φ(τ) of an episode from its actions' tools in order (None: an action the protocol rejected): counts of
    ``tool:<name>`` and of ``bigram:<prev>><name>`` from a ``<start>`` marker."""
    phi: Counter = Counter()
    prev = "<start>"
    for tool in tools:
        name = tool or "<invalid>"
        phi[f"tool:{name}"] += 1
        phi[f"bigram:{prev}>{name}"] += 1
        prev = name
    return phi


def cosine(a: Counter, b: Counter) -> float:
    """Cosine similarity of two sparse count vectors; two empty vectors are identical (1), one empty one is not (0)."""
    na2, nb2 = sum(v * v for v in a.values()), sum(v * v for v in b.values())
    if na2 == 0 or nb2 == 0:
        return 1.0 if na2 == nb2 else 0.0
    return min(1.0, sum(v * b.get(k, 0) for k, v in a.items()) / math.sqrt(na2 * nb2))


def member_diversity(phis_a: dict[str, Counter], phis_b: dict[str, Counter]) -> float:
    """Mean over the episodes both members played (same keys: task and seed) of 1 − cos_sim(φ_a, φ_b)."""
    keys = sorted(set(phis_a) & set(phis_b))
    if not keys:
        raise ValueError("member_diversity needs episodes of the same tasks from both members")
    return sum(1.0 - cosine(phis_a[k], phis_b[k]) for k in keys) / len(keys)


def pairwise_diversity(phis: list[dict[str, Counter]]) -> dict[str, float]:
    """``"i-j"`` -> :func:`member_diversity` of members i < j."""
    return {f"{i}-{j}": member_diversity(phis[i], phis[j]) for i, j in combinations(range(len(phis)), 2)}


def member_features(policy_dir: Path, tasks: list, runtime, env_cfg, rollout_cfg, dist, seed: int) -> dict:
    """φ of each greedy episode of the policy in `policy_dir` on `tasks` (seeds ``seed + i``, split over ranks as
    the validation is), keyed ``"<i>:<task_id>"``; every rank gets all of them."""
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine

    model, tok, _ = load_policy(policy_dir)
    idx = list(range(len(tasks)))[dist.rank::dist.world_size]
    records = RolloutEngine(model, tok, runtime, env_cfg, rollout_cfg).run(
        [tasks[i] for i in idx], [seed + i for i in idx], greedy=True) if idx else []
    mine = {f"{i}:{r['task_id']}": dict(trajectory_features([a.get("tool") for a in r["actions"]]))
            for i, r in zip(idx, records)}
    out: dict[str, Counter] = {}
    for part in dist.all_gather(mine):
        out.update({k: Counter(v) for k, v in part.items()})
    return out


# -------------------------------------------------------------------------------------------------------- training
class MemberRun:
    """A tracking run seen by one member: its metrics and tags go to the stage's run under ``member<i>/``."""

    def __init__(self, run, index: int):
        self.run, self.prefix = run, f"member{index}/"

    def log_metrics(self, metrics, step=None) -> None:
        self.run.log_metrics({self.prefix + k: v for k, v in metrics.items()}, step=step)

    def set_tags(self, tags) -> None:
        self.run.set_tags({self.prefix + k: v for k, v in tags.items()})

    def __getattr__(self, name):
        return getattr(self.run, name)


def best_value(result: dict, metric: str) -> float:
    best = result["best"]
    return float(best.get(metric, best["success"]))


def train_population(cfg, train_one: Callable, ckpt_dir_of: Callable, out_dir: Path, run, dist,
                     features_of: Callable, log: Callable = print) -> dict:
    """Train every member with ``train_one(member_cfg, out_dir, ckpt_dir, run)`` (the loop's :func:`train` with the
    stage's other arguments bound), keep the best one in `out_dir`, and return its result with
    ``extension_summary: {"population": ...}`` added (see the module docstring). ``ckpt_dir_of(member_cfg)`` is a member's checkpoint folder and
    ``features_of(policy_dir)`` the φ of its greedy validation episodes (:func:`member_features`). A member that does
    not complete (stopped by a hook) ends the call with its own result, ``completed`` False."""
    from pipeline.policy.model import copy_policy

    metric = cfg.early_stopping_metric
    results, dirs = [], []
    for i, mcfg in enumerate(member_configs(cfg)):
        ckpt = ckpt_dir_of(mcfg)
        if dist.is_main:
            log(f"population: member {i + 1}/{cfg.population.size} (seed {mcfg.seed}, entropy_coef "
                f"{mcfg.entropy_coef}) in {ckpt}")
        res = train_one(mcfg, ckpt / "policy", ckpt, MemberRun(run, i))
        if not res["completed"]:
            return res
        results.append(res)
        dirs.append(ckpt / "policy")
    values = [best_value(r, metric) for r in results]
    chosen = max(range(len(values)), key=lambda i: (values[i], -i))
    if dist.is_main:
        copy_policy(dirs[chosen], out_dir)
    dist.barrier()
    phis = [features_of(d) for d in dirs]
    diversity = pairwise_diversity(phis)
    members = [{"member": i, "seed": m.seed, "entropy_coef": m.entropy_coef, "best_update": r["best"]["update"],
                "best_val_success": r["best"]["success"], f"best_val_{metric}": values[i], "evals": r["evals"],
                "updates_run": len(r["history"]), "early_stopping": r["early_stopping"]}
               for i, (m, r) in enumerate(zip(member_configs(cfg), results))]
    summary = {"size": cfg.population.size, "vary": cfg.population.vary, "metric": metric, "selected": chosen,
               "members": members, "diversity": diversity,
               "mean_diversity": sum(diversity.values()) / len(diversity) if diversity else 0.0}
    if dist.is_main:
        run.log_metrics({"population/selected": chosen, "population/mean_diversity": summary["mean_diversity"],
                         **{f"population/member{i}_best_val": v for i, v in enumerate(values)},
                         **{f"population/diversity_{k}": v for k, v in diversity.items()}})
        log(f"population: best member {chosen} ({metric} {values[chosen]:.3f}; members "
            + ", ".join(f"{v:.3f}" for v in values) + f"); mean diversity {summary['mean_diversity']:.3f}")
    return {**results[chosen], "extension_summary": {"population": summary}}


class Population(Extension):
    """On when ``train.population.size`` > 1. It is no hook of the loop (each member is a plain run, with the
    member's own extensions): it trains the stage (:meth:`~pipeline.train.extensions.base.Extension.train_stage`)."""

    name = "population"

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return None

    @classmethod
    def train_stage(cls, cfg, stage) -> dict | None:
        if cfg.population.size <= 1:
            return None
        from pipeline.train.validation import VAL_SEED

        return train_population(cfg, stage.train_one, stage.ckpt_dir_of, stage.out_dir, stage.run, stage.dist,
                                lambda d: member_features(d, stage.val_tasks[:cfg.eval_tasks], stage.runtime,
                                                          stage.env_cfg, stage.rollout_cfg, stage.dist, VAL_SEED))
