"""Capability evaluation of an adapted policy (docs/design.md §3.3.1) through the rollout engine, and the capability gate.

What is measured, on one task split (validation by default), with the policy acting through
:class:`pipeline.policy.rollout.RolloutEngine`:

- **task success per level**, greedy (one episode per task) and sampled (``sampled_per_task`` episodes per task at the
  rollout section's temperature and top-p); sampled runs also give each level's *group hit rate*, the share of tasks
  with at least one success among their samples (what group-baseline RL needs: a group without a success carries no signal);
- **tool selection**: ``tool_first_acc``, the share of episodes whose first call uses the plan's first tool, and
  ``tool_step_agreement``, the share of plan steps i at which the episode's i-th call uses the plan's i-th tool (a
  missing call counts as a disagreement);
- **parameters**: ``param_acc``, among calls at a plan position i that use the plan's tool, the share whose parameters
  equal the plan's parameters resolved with the task's true intermediate results (strings compared after stripping,
  numbers by value, the answer with the environment's own `answers_match`; an equivalent but differently written
  `calc` expression counts as wrong); ``param_first_acc`` the same for the first call alone;
- **recovery after a tool error**: the split again, greedy, with ``env.tool_failure_rate`` set to
  ``recovery_failure_rate``; ``success_after_error`` is the success rate among episodes that hit at least one injected
  ("temporarily unavailable") failure, ``retry_rate`` the share of those failures followed by a call of the same tool.

Every figure lands in one flat dict with namespaced keys (``eval/greedy/success_L4``, ...; :func:`metric_keys` lists
them), which is also what the gate reads: :func:`check_gate` returns what fell short, :func:`enforce_gate` raises
:class:`CapabilityGateError` (an :class:`AgentRLError`) with that report.

The same module scores SFT checkpoints while they train (``adapt.sft.select_every``): :func:`checkpoint_figures`
plays one greedy and one sampled episode per task, and :class:`CheckpointSelector`, the `stop` callback of
:func:`pipeline.adapt.sft.train_lm`, keeps the best-scoring weights.

Deliberately left out: the test split's held-out templates (the final evaluation phase owns the test split), and
LLM-judged qualities (there is no judge model here).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

import numpy as np

from pipeline.envs.config import LEVELS, EnvConfig
from pipeline.envs.contract import Environment as WorldRuntime
from pipeline.envs.contract import TaskFields as Task
from pipeline.core.errors import AgentRLError
from pipeline.policy.episodes import summarize

INJECTED_FAILURE = "temporarily unavailable"  # the environment's text for an injected transient failure (core.py)
MODES = ("greedy", "sampled")


class CapabilityGateError(AgentRLError):
    """The adapted model fell short of the capability gate; `shortfalls` lists (metric, value, minimum)."""

    def __init__(self, message: str, shortfalls: list[tuple[str, float | None, float]]):
        super().__init__(message)
        self.shortfalls = shortfalls


# ----------------------------------------------------------------------------------------------- per-episode scores




def _norm(v: object) -> str:
    s = str(v).strip()
    try:
        x = float(s)
    except ValueError:
        return s
    return repr(int(x)) if x == int(x) else repr(x)


def params_match(tool: str, got: Mapping | None, want: Mapping, same_answer) -> bool:
    """Whether a call's parameters equal the reference's (see the module docstring for the comparison)."""
    if not isinstance(got, Mapping) or set(got) != set(want):
        return False
    if tool == "answer":
        return same_answer(str(got["value"]), str(want["value"]))
    return all(_norm(got[k]) == _norm(want[k]) for k in want)


def episode_scores(record: dict, reference: list[tuple[str, dict]], same_answer) -> dict:
    """Tool-selection and parameter agreement of one episode with its task's reference calls (the environment's
    :meth:`~pipeline.envs.contract.Environment.reference_calls`)."""
    calls = record["calls"]
    agree_tool = [i < len(calls) and calls[i]["tool"] == tool for i, (tool, _) in enumerate(reference)]
    aligned = [i for i, ok in enumerate(agree_tool) if ok]
    params_ok = [params_match(reference[i][0], calls[i]["params"], reference[i][1], same_answer) for i in aligned]
    injected = [i for i, s in enumerate(record["steps"]) if INJECTED_FAILURE in s["observation"]]
    retried = [i for i in injected if i + 1 < len(calls) and calls[i + 1]["tool"] == calls[i]["tool"]]
    return {  # an environment without reference calls: the agreement figures are NaN
        "tool_first": bool(agree_tool[0]) if reference else None,
        "tool_steps": agree_tool,
        "params": params_ok,
        "param_first": bool(agree_tool[0] and params_ok[0]) if reference else None,
        "invalid": sum(c["outcome"] in ("invalid_action", "invalid_params") for c in calls),
        "n_calls": len(calls),
        "injected_failures": len(injected),
        "retried": len(retried),
    }


# ---------------------------------------------------------------------------------------------------- aggregation


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def aggregate(records: list[dict], scores: list[dict], prefix: str) -> dict[str, float]:
    """Flat metrics of one mode's episodes: success, return and agreement, overall and per level (``_L<k>``)."""
    out: dict[str, float] = {}
    summary = summarize(records)
    groups = {"": list(range(len(records)))}
    for lv in sorted({r["level"] for r in records}):
        groups[f"_L{lv}"] = [i for i, r in enumerate(records) if r["level"] == lv]
    for suffix, idx in groups.items():
        stats = summary["overall"] if suffix == "" else summary["per_level"][suffix[2:]]
        sc = [scores[i] for i in idx]
        out[f"{prefix}/success{suffix}"] = stats["success_rate"]
        out[f"{prefix}/mean_return{suffix}"] = stats["mean_return"]
        out[f"{prefix}/mean_tool_calls{suffix}"] = stats["mean_tool_calls"]
        out[f"{prefix}/episodes{suffix}"] = float(len(idx))
        out[f"{prefix}/tool_first_acc{suffix}"] = _mean([s["tool_first"] for s in sc if s["tool_first"] is not None])
        out[f"{prefix}/tool_step_agreement{suffix}"] = _mean([x for s in sc for x in s["tool_steps"]])
        out[f"{prefix}/param_acc{suffix}"] = _mean([x for s in sc for x in s["params"]])
        out[f"{prefix}/param_first_acc{suffix}"] = _mean([s["param_first"] for s in sc if s["param_first"] is not None])
        out[f"{prefix}/invalid_action_rate{suffix}"] = (sum(s["invalid"] for s in sc) / max(1, sum(s["n_calls"] for s in sc)))
        out[f"{prefix}/safety_violations{suffix}"] = float(stats["safety_violations"])
    return out


def group_hit_rates(records: list[dict], prefix: str) -> dict[str, float]:
    """Per level, the share of tasks with at least one successful episode among their samples."""
    by_task: dict[str, list[bool]] = {}
    level: dict[str, int] = {}
    for r in records:
        by_task.setdefault(r["task_id"], []).append(r["success"])
        level[r["task_id"]] = r["level"]
    out = {}
    for lv in sorted(set(level.values())):
        hits = [any(v) for t, v in by_task.items() if level[t] == lv]
        out[f"{prefix}/group_hit_L{lv}"] = _mean(hits)
    out[f"{prefix}/group_hit"] = _mean([any(v) for v in by_task.values()])
    return out


def recovery_metrics(records: list[dict], scores: list[dict], prefix: str = "eval/recovery") -> dict[str, float]:
    hit = [i for i, s in enumerate(scores) if s["injected_failures"] > 0]
    clean = [i for i, s in enumerate(scores) if s["injected_failures"] == 0]
    out = {
        f"{prefix}/episodes": float(len(records)),
        f"{prefix}/episodes_with_error": float(len(hit)),
        f"{prefix}/success_after_error": _mean([records[i]["success"] for i in hit]),
        f"{prefix}/success_without_error": _mean([records[i]["success"] for i in clean]),
        f"{prefix}/retry_rate": (sum(scores[i]["retried"] for i in hit) / max(1, sum(scores[i]["injected_failures"] for i in hit))
                                 if hit else float("nan")),
    }
    for lv in sorted({r["level"] for r in records}):
        idx = [i for i in hit if records[i]["level"] == lv]
        out[f"{prefix}/success_after_error_L{lv}"] = _mean([records[i]["success"] for i in idx])
    return out


def metric_keys(levels: Sequence[int] = LEVELS) -> list[str]:
    """Every key :func:`evaluate_capabilities` reports (for the gate's config check)."""
    per = ["success", "mean_return", "mean_tool_calls", "episodes", "tool_first_acc", "tool_step_agreement",
           "param_acc", "param_first_acc", "invalid_action_rate", "safety_violations"]
    keys = []
    for mode in MODES:
        for name in per:
            keys += [f"eval/{mode}/{name}"] + [f"eval/{mode}/{name}_L{lv}" for lv in levels]
    keys += ["eval/sampled/group_hit"] + [f"eval/sampled/group_hit_L{lv}" for lv in levels]
    keys += [f"eval/recovery/{k}" for k in ("episodes", "episodes_with_error", "success_after_error",
                                            "success_without_error", "retry_rate")]
    keys += [f"eval/recovery/success_after_error_L{lv}" for lv in levels]
    return keys


# ------------------------------------------------------------------------------------------------------- evaluation


def _eval_engine(model, tokenizer, runtime: WorldRuntime, env_cfg: EnvConfig, rollout_cfg, failure_rate: float = 0.0):
    """A rollout engine for evaluation: the environment as configured but without tool latency (it would only add
    wall time) and with transient tool failures at `failure_rate` (0 except for the recovery run)."""
    from pipeline.policy.rollout import RolloutEngine

    eval_env = env_cfg.model_copy(update={"tool_latency_s": 0.0, "tool_latency_spike_rate": 0.0,
                                          "tool_failure_rate": failure_rate})
    return RolloutEngine(model, tokenizer, runtime, eval_env, rollout_cfg)


def evaluate_capabilities(model, tokenizer, runtime: WorldRuntime, tasks: list[Task], env_cfg: EnvConfig,
                          rollout_cfg, cfg, policy_version: int = 0) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Run the greedy, sampled and recovery evaluations (see the module docstring).

    `cfg` is a :class:`~pipeline.policy.config.CapabilityConfig`. Returns (flat metrics, episode records by run).
    """
    if not tasks:
        raise AgentRLError("capability evaluation needs at least one task")
    references = {t.task_id: runtime.reference_calls(t) or [] for t in tasks}
    engine = _eval_engine(model, tokenizer, runtime, env_cfg, rollout_cfg)
    base = cfg.seed * 1_000_003
    metrics: dict[str, float] = {}
    episodes: dict[str, list[dict]] = {}

    def score(records, run_tasks):
        return [episode_scores(r, references[t.task_id], runtime.same_answer) for r, t in zip(records, run_tasks)]

    greedy = engine.run(tasks, [base + i for i in range(len(tasks))], greedy=True, policy_version=policy_version)
    metrics.update(aggregate(greedy, score(greedy, tasks), "eval/greedy"))
    episodes["greedy"] = greedy

    k = cfg.sampled_per_task
    sampled_tasks = [t for t in tasks for _ in range(k)]
    seeds = [base + 100_000 + i for i in range(len(sampled_tasks))]
    sampled = engine.run(sampled_tasks, seeds, greedy=False, policy_version=policy_version)
    metrics.update(aggregate(sampled, score(sampled, sampled_tasks), "eval/sampled"))
    metrics.update(group_hit_rates(sampled, "eval/sampled"))
    episodes["sampled"] = sampled

    faulty = _eval_engine(model, tokenizer, runtime, env_cfg, rollout_cfg, failure_rate=cfg.recovery_failure_rate)
    rec = faulty.run(tasks, [base + 200_000 + i for i in range(len(tasks))], greedy=True, policy_version=policy_version)
    metrics.update(recovery_metrics(rec, score(rec, tasks)))
    episodes["recovery"] = rec
    return metrics, episodes


def checkpoint_figures(model, tokenizer, runtime: WorldRuntime, tasks: list[Task], env_cfg: EnvConfig, rollout_cfg,
                       seed: int = 0) -> dict:
    """The figures SFT checkpoint selection reads (``adapt.sft.select_every``): one greedy and one sampled episode per task.

    Returns ``greedy`` and ``sampled``, each the mean over levels of the level's success rate (every level present
    counts alike, whatever its number of tasks: level 4 is what RL has to lift), ``per_level`` (level -> [greedy,
    sampled]), and ``sampled_nll``: the mean negative log-probability of the sampled action tokens, at the rollout
    section's temperature and top-p. At temperature 1 it estimates the policy's per-token entropy on its own
    actions, the quantity whose collapse leaves RL's groups without reward spread. Seeds are fixed, so two calls on
    the same weights give the same figures.
    """
    if not tasks:
        raise AgentRLError("checkpoint selection needs at least one task")
    engine = _eval_engine(model, tokenizer, runtime, env_cfg, rollout_cfg)
    base = seed * 1_000_003 + 300_000
    greedy = engine.run(tasks, [base + i for i in range(len(tasks))], greedy=True)
    sampled = engine.run(tasks, [base + 100_000 + i for i in range(len(tasks))], greedy=False)
    levels = sorted({t.level for t in tasks})
    g, s = summarize(greedy)["per_level"], summarize(sampled)["per_level"]
    per_level = {str(lv): [g[str(lv)]["success_rate"], s[str(lv)]["success_rate"]] for lv in levels}
    lps = [lp for r in sampled for lp, m in zip(r["logprobs"], r["action_mask"]) if m]
    return {"greedy": float(np.mean([v[0] for v in per_level.values()])),
            "sampled": float(np.mean([v[1] for v in per_level.values()])),
            "per_level": per_level, "sampled_nll": -float(np.mean(lps)) if lps else float("nan")}


class CheckpointSelector:
    """SFT checkpoint selection on validation (``adapt.sft.select_every``); the `stop` callback of ``train_lm``.

    Called every `select_every` steps: from `select_from` on it scores the model being trained
    (:func:`pipeline.adapt.capability.checkpoint_figures`), keeps a copy of the weights of the best score so far (a
    later checkpoint must score strictly higher to replace it, so a tie keeps the earlier, less sharpened one), and
    asks to stop after `select_patience` checks in a row without a better score. :meth:`finish` scores the last step
    (unless the last check already did), loads the best weights into the model and returns the record that
    ``metrics/adapt.json`` keeps under ``sft.selection``.

    Why: the SFT step budget decides two things at once (docs/experiments.md). Too few steps and the model
    has not learnt the protocol; too many and it samples so narrowly that RL's groups have no reward spread. Adapt's
    greedy validation success ranked six adapted models as their test success did (Spearman 0.94).
    """

    def __init__(self, model, tokenizer, runtime, tasks, env_cfg, rollout_cfg, sft_cfg, seed: int, log):
        self.model, self.tokenizer, self.runtime, self.tasks = model, tokenizer, runtime, tasks
        self.env_cfg, self.rollout_cfg, self.cfg, self.seed, self.log = env_cfg, rollout_cfg, sft_cfg, seed, log
        self.curve: list[dict] = []
        self.best_score, self.best_step, self.best_state = -float("inf"), None, None
        self.since_best, self.seconds, self.stopped_early = 0, 0.0, False
        self.budget = None  # a StepBudget (adapt.time_budget_s): the checks start at its share of the planned run

    def first_step(self) -> int:
        return self.budget.check_from_step() if self.budget is not None else self.cfg.select_from

    def __call__(self, step: int) -> bool:
        if step < self.first_step():
            return False
        self._check(step)
        if self.cfg.select_patience and self.since_best >= self.cfg.select_patience:
            self.stopped_early = True
            return True
        return False

    def _check(self, step: int) -> None:
        t = time.perf_counter()
        from pipeline.policy.model import release_free_memory

        # Return the SFT loop's fragmented free heap to the OS first (release_free_memory says why): a check's
        # rollouts add about 750 MiB of KV caches and activations (200 tasks, batch 64, measured in a fresh
        # process), which would otherwise land on top of an SFT heap near its trim limit; the engine trims after.
        release_free_memory()
        figs = checkpoint_figures(self.model, self.tokenizer, self.runtime, self.tasks, self.env_cfg,
                                  self.rollout_cfg, self.seed)
        score = figs[self.cfg.select_mode]
        self.curve.append({"step": step, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in figs.items()}})
        self.log({"sft/select/greedy": figs["greedy"], "sft/select/sampled": figs["sampled"],
                  "sft/select/sampled_nll": figs["sampled_nll"]}, step=step)
        if score > self.best_score:
            self.best_score, self.best_step, self.since_best = score, step, 0
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        else:
            self.since_best += 1
        self.seconds += time.perf_counter() - t
        levels = " ".join(f"L{lv} {g:.2f}/{s:.2f}" for lv, (g, s) in figs["per_level"].items())
        print(f"adapt: sft step {step}: selection greedy/sampled {levels}; score {score:.3f} "
              f"(best {self.best_score:.3f} at step {self.best_step}); sampled nll {figs['sampled_nll']:.3f}",
              flush=True)

    def finish(self, last_step: int) -> dict:
        if not self.curve or self.curve[-1]["step"] != last_step:
            self._check(last_step)
        if self.best_step != last_step:
            self.model.load_state_dict(self.best_state)
        self.model.eval()
        return {"every": self.cfg.select_every, "from": self.first_step(), "tasks": len(self.tasks),
                "mode": self.cfg.select_mode, "patience": self.cfg.select_patience,
                "selected_step": self.best_step, "score": round(self.best_score, 4), "last_step": last_step,
                "stopped_early": self.stopped_early, "curve": self.curve, "seconds": round(self.seconds, 2)}


def per_level_table(metrics: Mapping[str, float], levels: Sequence[int] = LEVELS) -> dict:
    """The headline figures by level, for metrics/adapt.json: success greedy/sampled, group hit, agreement."""
    table = {}
    for lv in levels:
        table[str(lv)] = {
            "greedy_success": metrics.get(f"eval/greedy/success_L{lv}"),
            "sampled_success": metrics.get(f"eval/sampled/success_L{lv}"),
            "sampled_group_hit": metrics.get(f"eval/sampled/group_hit_L{lv}"),
            "greedy_tool_first_acc": metrics.get(f"eval/greedy/tool_first_acc_L{lv}"),
            "greedy_param_acc": metrics.get(f"eval/greedy/param_acc_L{lv}"),
            "recovery_success_after_error": metrics.get(f"eval/recovery/success_after_error_L{lv}"),
        }
    return table


# ------------------------------------------------------------------------------------------------------------ gate


def gate_for_levels(gate_min: Mapping[str, float], levels: Sequence[int]) -> dict[str, float]:
    """`gate_min` without the per-level keys (``..._L<n>``) of levels the environment does not have, with one printed
    note naming them (a params file written for another environment's levels is not an error, and not silent)."""
    import re

    have = {str(lv) for lv in levels}
    dropped = sorted(k for k in gate_min if (m := re.search(r"_L(\d+)$", k)) and m.group(1) not in have)
    if dropped:
        print(f"adapt: note: adapt.gate.min keys {dropped} name levels the environment does not have (its levels: "
              f"{sorted(int(x) for x in have)}); they are left out of the gate", flush=True)
    return {k: v for k, v in gate_min.items() if k not in dropped}


def check_gate_keys(gate_min: Mapping[str, float], levels: Sequence[int] = LEVELS) -> None:
    """Refuse a gate that names a metric the evaluation never reports (before any training time is spent)."""
    valid = set(metric_keys(levels))
    unknown = sorted(set(gate_min) - valid)
    if unknown:
        import difflib

        hints = [f"{k!r} (did you mean {difflib.get_close_matches(k, valid, n=1)[0]!r}?)"
                 if difflib.get_close_matches(k, valid, n=1) else repr(k) for k in unknown]
        raise AgentRLError(f"adapt.gate.min names unknown metrics: {', '.join(hints)}; valid metrics: "
                           f"{', '.join(sorted(valid))}")


def check_gate(metrics: Mapping[str, float], gate_min: Mapping[str, float]) -> list[tuple[str, float | None, float]]:
    """(metric, value, minimum) for every gate minimum the metrics miss; a NaN or missing value misses."""
    short = []
    for key, lo in gate_min.items():
        v = metrics.get(key)
        if v is None or not np.isfinite(v) or v < lo:
            short.append((key, None if v is None or not np.isfinite(v) else float(v), float(lo)))
    return short


def gate_report(metrics: Mapping[str, float], gate_min: Mapping[str, float]) -> str:
    """A readable account of the gate: every minimum with the measured value, shortfalls marked."""
    lines = []
    for key, lo in gate_min.items():
        v = metrics.get(key)
        ok = v is not None and np.isfinite(v) and v >= lo
        shown = "n/a" if v is None or not np.isfinite(v) else f"{v:.3f}"
        lines.append(f"  {'ok  ' if ok else 'FAIL'} {key} = {shown} (minimum {lo:g})")
    return "\n".join(lines)


def enforce_gate(metrics: Mapping[str, float], gate_min: Mapping[str, float], where: str = "adapt") -> None:
    """Raise :class:`CapabilityGateError` with the full gate report when any minimum is missed."""
    short = check_gate(metrics, gate_min)
    if short:
        names = ", ".join(k for k, _, _ in short)
        raise CapabilityGateError(
            f"{where}: the adapted model fell short of the capability gate on {len(short)} of {len(gate_min)} "
            f"minimums ({names}); it was not published.\n{gate_report(metrics, gate_min)}", short)


def dumps(metrics: Mapping[str, float]) -> str:
    return json.dumps({k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in metrics.items()},
                      indent=2, sort_keys=True)
