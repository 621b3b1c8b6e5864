"""Phase `reward_model`: train the learned verifier on the pipeline's own trajectories and report how well it agrees
with the rules on held-out tasks.

Reads the `reward_model`, `env` and `rollout` sections. Steps:

1. **Demonstrations** (``data/demos/train.jsonl``): each is replayed action by action through the pipeline's runner
   (:class:`pipeline.policy.episode_drivers.EnvEpisode`), so it gets the same record as a rollout: the observations,
   the call log and the rule verifier's report, in any environment.
2. **Rollouts** of ``reward_model.policy`` (the adapted policy) on ``rollout_tasks`` random training tasks,
   ``rollouts_per_task`` sampled episodes each (:class:`pipeline.policy.rollout.RolloutEngine`): the policy's own
   mistakes, which the demonstrations (mostly successful) lack.
3. **Labels** from the rules (:func:`pipeline.reward_model.features.rule_labels`): success, and soundness (verifier
   passed, no failed call, no redundant call).
4. **People's labels** (``reward_model.feedback``, a traffic snapshot or a folder of capture segments:
   :mod:`pipeline.core.traffic`):
   each captured request that got feedback joins with the person's success label; it trains the success head only
   (its soundness is unknown, so that label is masked out of the loss). Held out by a hash of its request id like
   the tasks; ``feedback`` in the metrics reports the success head against people's labels on the held-out ones
   (``agreement``: accuracy at 0.5; AUC, Brier, ECE) and how often the rule verifier agreed with people where the
   request carried ground truth. The other reports stay on rule-labelled episodes.
5. **Fit** the two logistic heads on the tasks outside the held-out share (a hash of the task id), and report on the
   held-out tasks: AUC, accuracy, Brier score and expected calibration error per head, overall and for rollouts and
   demonstrations apart, in ``metrics/reward_model.json``; the model goes to ``models/reward_model``; MLflow run
   ``reward_model`` gets the params, the flat metrics and both as artefacts.
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import numpy as np

from pipeline.core.atomic import write_json
from pipeline.core.config import load_section
from pipeline.core.errors import AgentRLError
from pipeline.envs.config import EnvConfig
from pipeline.reward_model.config import RewardModelConfig
from pipeline.reward_model.features import featurize, rule_labels
from pipeline.reward_model import model as M

OUT_DIR = Path("models/reward_model")
METRICS_PATH = Path("metrics/reward_model.json")


def replay_demos(demos: list[dict], tasks_by_id: dict, runtime, env_cfg: EnvConfig) -> list[dict]:
    """Each demonstration replayed through the runner (episode seed = its index): a record like a rollout's. A
    demonstration whose task is unknown or that does not end within its actions is skipped."""
    from pipeline.policy.episode_drivers import EnvEpisode

    out = []
    for i, demo in enumerate(demos):
        task = tasks_by_id.get(demo["task_id"])
        if task is None:
            continue
        ep, done = EnvEpisode(runtime, env_cfg, task, seed=i), False
        for step in demo["steps"]:
            done = ep.step(step["action"])[0]
            if done:
                break
        if not done:
            ep.env.close()
            continue
        out.append({**ep.record(), "source": "demo"})
    return out


def holdout(task_id: str, fraction: float, seed: int) -> bool:
    """Whether a task is held out: CRC-32 of ``seed:task_id`` in the lowest `fraction` of its range."""
    return zlib.crc32(f"{seed}:{task_id}".encode()) < fraction * 2 ** 32


def fit_on(records: list[dict], people: list[dict], cfg: RewardModelConfig):
    """Fit on the rule-labelled `records` and the `people`-labelled feedback episodes outside the held-out share;
    returns (model, losses, predictions, labels, held-out mask, fitted indices) over records + people in order."""
    X = [featurize(r["steps"], cfg.hash_dim) for r in records + people]
    Y = np.array([rule_labels(r) for r in records] + [(r["label"], 0) for r in people], dtype=np.int64)
    known = np.ones_like(Y)
    known[len(records):, M.HEADS.index("sound")] = 0  # a person's label says nothing about the process
    held = np.array([holdout(r["task_id"], cfg.holdout_fraction, cfg.seed) for r in records + people], dtype=bool)
    fit_idx = np.flatnonzero(~held)
    model, losses = M.fit([X[i] for i in fit_idx], Y[fit_idx], cfg.hash_dim, epochs=cfg.epochs, lr=cfg.lr,
                          l2=cfg.l2, seed=cfg.seed, known=known[fit_idx] if people else None)
    return model, losses, model.predict(X), Y, held, fit_idx


def feedback_episodes(cfg: RewardModelConfig) -> list[dict]:
    """The captured episodes people labelled (:func:`pipeline.core.traffic.labelled_episodes`) in
    ``reward_model.feedback``; none when it is null or not a folder."""
    from pipeline.core.traffic import labelled_episodes

    if cfg.feedback is None or not Path(cfg.feedback).is_dir():
        return []
    return labelled_episodes(cfg.feedback, cfg.feedback_success_rating)


def feedback_report(people: list[dict], p_success: np.ndarray, held: np.ndarray, cfg: RewardModelConfig) -> dict:
    """How the model's success head agrees with people's labels on the held-out feedback (``heldout``: the
    success head's metrics against them; ``agreement`` is its accuracy at 0.5), and how often the rule verifier
    agreed with them where the request carried ground truth (``rule_agreement``)."""
    labels = np.array([r["label"] for r in people], dtype=np.int64)
    judged = [(r["rule_success"], r["label"]) for r in people if r["rule_success"] is not None]
    heldout = M.head_metrics(p_success[held], labels[held], cfg.calibration_bins) if people else {"n": 0}
    return {"episodes": len(people), "fit": int((~held).sum()), "heldout_n": int(held.sum()),
            "success_label_rate": float(labels.mean()) if people else None,
            "heldout": heldout, "agreement": heldout.get("accuracy"),
            "rule_agreement": float(np.mean([int(bool(a)) == b for a, b in judged])) if judged else None,
            "rule_judged": len(judged)}


def train_reward_model(cfg: RewardModelConfig, env_cfg: EnvConfig, rollout_cfg, *, data_dir: Path = Path("data"),
                       out_dir: Path = OUT_DIR, metrics_path: Path = METRICS_PATH, tracker=None) -> dict:
    """Run the phase (see the module docstring); returns what it wrote to `metrics_path`."""
    from pipeline.core.tracking import NullTracker, flatten
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.demos import load_demos
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine

    t0 = time.perf_counter()
    data_dir, out_dir, metrics_path = Path(data_dir), Path(out_dir), Path(metrics_path)
    if metrics_path.resolve() in {(out_dir / f).resolve() for f in (M.WEIGHTS_FILE, M.META_FILE)}:
        raise AgentRLError(f"reward_model: the metrics file {metrics_path} would overwrite the model's own file; "
                           f"write it outside {out_dir}")
    metrics_path.unlink(missing_ok=True)
    if not Path(cfg.policy).is_dir():
        raise AgentRLError(f"reward_model: the policy folder {cfg.policy} does not exist; run the `adapt` stage first "
                           f"(reward_model.policy)")
    try:
        runtime = open_environment(env_cfg.name, data_dir / "env")
        tasks = load_task_file(data_dir / "tasks" / "train.jsonl", runtime, validate=False)
    except (FileNotFoundError, ValueError) as exc:
        raise AgentRLError(f"reward_model: {exc}; run the `build_env` stage first") from None
    demos = load_demos(data_dir / "demos" / "train.jsonl")[:cfg.max_demos]
    tracker = tracker or NullTracker()
    with tracker.run("reward_model", params={"reward_model": cfg.model_dump(), "env": env_cfg.model_dump(),
                                             "rollout": rollout_cfg.model_dump()}) as run:
        records = replay_demos(demos, {t.task_id: t for t in tasks}, runtime, env_cfg)
        t_demos = time.perf_counter() - t0
        rng = np.random.default_rng([cfg.seed, 17])
        chosen = [tasks[i] for i in rng.choice(len(tasks), size=min(cfg.rollout_tasks, len(tasks)), replace=False)]
        ep_tasks = [t for t in chosen for _ in range(cfg.rollouts_per_task)]
        t1 = time.perf_counter()
        if ep_tasks:
            policy, tok, _ = load_policy(cfg.policy)
            engine = RolloutEngine(policy, tok, runtime, env_cfg,
                                   rollout_cfg.model_copy(update={"temperature": cfg.rollout_temperature}))
            seeds = [cfg.seed * 1_000_003 + 500_000 + i for i in range(len(ep_tasks))]
            records += [{**r, "source": "rollout"} for r in engine.run(ep_tasks, seeds, greedy=False)]
        t_rollouts = time.perf_counter() - t1
        runtime.close()
        if not records:
            raise AgentRLError("reward_model: no trajectories to train on (no usable demonstrations, rollout_tasks 0)")
        t2 = time.perf_counter()
        people = feedback_episodes(cfg)
        n_rule = len(records)
        model, losses, P_all, Y, held_all, fit_idx = fit_on(records, people, cfg)
        t_fit = time.perf_counter() - t2
        P, Y, held = P_all[:n_rule], Y[:n_rule], held_all[:n_rule]  # the rule-label reports, as before
        source = np.array([r["source"] for r in records])

        def report(mask: np.ndarray) -> dict:
            return {h: M.head_metrics(P[mask, k], Y[mask, k], cfg.calibration_bins) for k, h in enumerate(M.HEADS)}

        result = {
            "env": env_cfg.name, "policy": cfg.policy,
            "episodes": {"demos": int((source == "demo").sum()), "rollouts": int((source == "rollout").sum()),
                         "feedback": len(people), "fit": int(len(fit_idx)), "heldout": int(held_all.sum())},
            "label_rates": {src: {h: float(Y[source == src, k].mean()) if (source == src).any() else None
                                  for k, h in enumerate(M.HEADS)} for src in ("demo", "rollout")},
            "heldout": report(held), "heldout_rollouts": report(held & (source == "rollout")),
            "heldout_demos": report(held & (source == "demo")), "fit": report(~held),
            "feedback": feedback_report(people, P_all[n_rule:, 0], held_all[n_rule:], cfg),
            "final_loss": losses[-1],
            "seconds": {"demos": round(t_demos, 2), "rollouts": round(t_rollouts, 2), "fit": round(t_fit, 2),
                        "total": round(time.perf_counter() - t0, 2)},
        }
        M.save(model, out_dir, {"env": env_cfg.name, "config": cfg.model_dump(), "heldout": result["heldout"]})
        write_json(metrics_path, result)
        flat = {f"reward_model/{k}": v for k, v in flatten({k: result[k] for k in
                ("episodes", "heldout", "heldout_rollouts", "fit", "feedback", "seconds")}, sep="/").items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        run.log_metrics({**flat, "reward_model/final_loss": result["final_loss"]})
        run.log_artifact(metrics_path)
        run.log_artifact(out_dir, "reward_model")
    return result


def write_unused(reason: str, out_dir: Path = OUT_DIR, metrics_path: Path = METRICS_PATH) -> dict:
    """The stage's outputs when no run reads the verifier: a marker in `out_dir` and the same record as metrics. Their
    bytes depend on nothing else, so the `train` stage, which lists `out_dir` among its deps, stays up to date."""
    out_dir, metrics_path = Path(out_dir), Path(metrics_path)
    result = {"trained": False, "reason": reason}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / M.UNUSED_FILE, result)
    write_json(metrics_path, result)
    return result


def main(params_path: str = "params.yaml") -> dict:
    """The stage: train the verifier, or (``reward_model.when: used`` while ``train.learned_reward.coef`` is 0) only
    write the marker of :func:`write_unused`."""
    from pipeline.core.config import parse_section, read_params
    from pipeline.core.tracking import Tracker
    from pipeline.policy.config import RolloutConfig
    from pipeline.reward_model.config import LearnedRewardConfig

    cfg = load_section(RewardModelConfig, "reward_model", params_path)
    learned = parse_section(LearnedRewardConfig, (read_params(params_path).get("train") or {}).get("learned_reward"),
                            f"{params_path}:train.learned_reward")
    if cfg.when == "used" and learned.coef == 0:
        # a phase run all the same, so the flow's lineage finds every stage (tagged: nothing trained)
        with Tracker().run("reward_model", params={"reward_model": cfg.model_dump(),
                                                   "learned_reward": learned.model_dump()}) as run:
            result = write_unused("train.learned_reward.coef is 0: no training run reads a learned verifier "
                                  "(reward_model.when: always trains one anyway)")
            run.set_tags({"reward_model.trained": "false"})
            run.log_artifact(METRICS_PATH)
        print(f"reward_model: not trained ({result['reason']})")
        return result
    env_cfg = load_section(EnvConfig, "env", params_path)
    rollout_cfg = load_section(RolloutConfig, "rollout", params_path)
    result = train_reward_model(cfg, env_cfg, rollout_cfg, tracker=Tracker())
    h = result["heldout"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"reward_model: {result['episodes']['demos']} demonstrations + {result['episodes']['rollouts']} rollouts; "
          f"held-out AUC success {fmt(h['success'].get('auc'))}, sound {fmt(h['sound'].get('auc'))}; ECE success "
          f"{fmt(h['success'].get('ece'))}, sound {fmt(h['sound'].get('ece'))}; {result['seconds']['total']:.1f}s")
    fb = result["feedback"]
    if fb["episodes"]:
        print(f"reward_model: {fb['episodes']} episodes with people's feedback; agreement with them on "
              f"{fb['heldout_n']} held out: {fmt(fb['agreement'])}")
    return result
