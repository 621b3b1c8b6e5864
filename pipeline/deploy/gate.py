"""The promotion gate as pure functions: paired tests, per-task results from any evaluation file, and the checks.

A challenger is promoted only when every check passes (each becomes a tag on its model version,
:mod:`pipeline.deploy.registry`):

- ``capability``: the adapt phase's capability gate passed (``metrics/adapt.json`` ``gate.passed``);
- ``safety``: mean refused unsafe calls per test episode of the served variant at most
  ``gate.max_safety_violations_per_episode``;
- ``drift``: the drift verdict of ``metrics/drift.json`` (check_drift) is a pass;
- ``consistency``: its train/serve consistency check passed;
- ``quantization_parity``: the served precision's test success is within ``parity_tolerance`` of fp32;
- ``served_consistency``: the deploy phase's check of the served model (:mod:`pipeline.deploy.served_check`) passed;
  a version for which it was not run (``deploy.served_check.enabled`` false, or registered before the check existed)
  passes it with "not run" in the detail: turning it off is a recorded decision, not a silent one;
- ``vs_champion``: test success not worse than the current champion's, by a paired test on the same tasks and seeds
  (:func:`mcnemar_worse` or :func:`bootstrap_worse`): a challenger fails only when it is worse with p < alpha, so two
  equally good models do not block each other on noise, and a real regression does not pass on a lucky point
  estimate. The first model (no champion) passes this check and is judged on the absolute checks alone.

Per-task results are ``{"task_id", "seed", "success", "n_violations"}`` records. :func:`extract_task_results` finds
them in whatever an evaluation stage wrote (the evaluate stage's ``metrics/evaluate.json`` is written concurrently by
another phase; any list of objects with ``task_id`` and ``success`` is accepted, the test split's preferred).

Deliberately left out: I/O and the registry (see :mod:`pipeline.deploy.registry`); multiple-comparison corrections
across checks (every check must pass; only one is statistical).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.deploy.config import DeployGateConfig
from pipeline.core.errors import AgentRLError

CHECKS = ("capability", "safety", "drift", "consistency", "quantization_parity", "served_consistency", "vs_champion")


# ----------------------------------------------------------------------------------------------------- paired tests
def mcnemar_worse(challenger: list[bool], champion: list[bool]) -> dict:
    """Exact one-sided McNemar test of "the challenger succeeds less often than the champion" on paired outcomes.

    Only discordant pairs carry information: b = champion right and challenger wrong, c = the reverse. Under H0 (equal
    success) b ~ Binomial(b + c, 1/2); p = P(X >= b). McNemar (1947); the exact binomial form, valid for small counts.

    >>> mcnemar_worse([True] * 10, [True] * 10)["p_value"]
    1.0
    >>> round(mcnemar_worse([False] * 8 + [True] * 2, [True] * 10)["p_value"], 4)  # 8 losses, 0 wins: 1/2**8
    0.0039
    """
    if len(challenger) != len(champion):
        raise ValueError("paired outcomes must have the same length")
    b = sum(1 for x, y in zip(challenger, champion) if y and not x)
    c = sum(1 for x, y in zip(challenger, champion) if x and not y)
    n = b + c
    p = 1.0 if n == 0 else sum(math.comb(n, k) for k in range(b, n + 1)) / 2.0 ** n
    return {"test": "mcnemar", "losses": b, "wins": c, "p_value": min(1.0, p)}


def bootstrap_worse(challenger: list[bool], champion: list[bool], samples: int = 2000, seed: int = 0) -> dict:
    """One-sided paired bootstrap of the success difference d = challenger - champion (per task, then the mean).

    p is the share of resampled means at or above 0 (the challenger not worse), counted with the add-one rule so it is
    never 0; a small p says the challenger is worse. Also returns the 95% percentile interval of the mean difference.
    Efron & Tibshirani (1993), ch. 16.
    """
    d = np.asarray(challenger, dtype=float) - np.asarray(champion, dtype=float)
    if d.size == 0:
        raise ValueError("no paired outcomes")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(samples, d.size))].mean(axis=1)
    p = (np.sum(means >= 0) + 1) / (samples + 1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return {"test": "bootstrap", "mean_difference": float(d.mean()), "ci95": [float(lo), float(hi)],
            "p_value": float(min(1.0, p)), "samples": samples}


PAIRED_TESTS = {"mcnemar": lambda a, b, cfg: mcnemar_worse(a, b),
                "bootstrap": lambda a, b, cfg: bootstrap_worse(a, b, cfg.bootstrap_samples, cfg.seed)}


# ------------------------------------------------------------------------------------------------ per-task results
def task_result(rec: dict) -> dict:
    """The fields of an episode record (or an evaluation file's per-task entry) the gate uses."""
    return {"task_id": str(rec["task_id"]), "seed": rec.get("seed"), "success": bool(rec["success"]),
            "n_violations": int(rec.get("n_violations", 0) or 0)}


def _candidates(obj, path: str = "") -> list[tuple[str, list]]:
    """Key paths and per-task results of every list of ``{task_id, success, ...}`` objects and every mapping
    ``{task_id: bool}`` (the evaluate stage's ``per_task_test_success.<policy>``) inside `obj`."""
    found = []
    if isinstance(obj, list):
        if obj and all(isinstance(r, dict) and "task_id" in r and "success" in r for r in obj):
            found.append((path or "(top level)", obj))
        else:
            for i, v in enumerate(obj):
                found += _candidates(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        if obj and all(isinstance(v, bool) for v in obj.values()) and not {"passed", "flagged", "enabled"} & set(obj):
            found.append((path or "(top level)", [{"task_id": k, "success": v} for k, v in obj.items()]))
        else:
            for k, v in obj.items():
                found += _candidates(v, f"{path}.{k}" if path else str(k))
    return found


def extract_task_results(obj, source: str, prefer: tuple[str, ...] = ("test",),
                         policy_words: tuple[str, ...] = ("rl", "policy")) -> list[dict]:
    """Per-task results from an evaluation file's parsed JSON: a list of objects with ``task_id`` and ``success``, or
    a mapping task id -> success (``per_task_test_success: {sft: {...}, rl: {...}}`` in the evaluate stage's file).
    With several, the one whose key path names every word of `prefer`, then one of `policy_words` (the trained
    policy, not the SFT baseline). Ambiguity or nothing found is an :class:`AgentRLError` that lists what was found."""
    import re

    cands = _candidates(obj)
    if not cands:
        raise AgentRLError(f"{source}: no per-task results (a list of objects with 'task_id' and 'success', or a "
                           f"mapping of task ids to true/false)")
    if len(cands) > 1:
        words = lambda path: set(re.split(r"[^a-z0-9]+", path.lower()))  # noqa: E731
        narrowed = [c for c in cands if all(p in words(c[0]) for p in prefer)] or cands
        if len(narrowed) > 1:
            narrowed = [c for c in narrowed if words(c[0]) & set(policy_words)] or narrowed
        if len(narrowed) > 1:
            raise AgentRLError(f"{source}: several per-task result lists ({', '.join(p for p, _ in cands)}); "
                               f"cannot tell which one is the deployed policy's on the test split")
        cands = narrowed
    return [task_result(r) for r in cands[0][1]]


def _key(r: dict, with_seed: bool):
    return (r["task_id"], r["seed"]) if with_seed else r["task_id"]


def pair_results(challenger: list[dict], champion: list[dict]) -> tuple[list[bool], list[bool], list]:
    """Outcomes of the tasks both lists hold, matched by (task_id, seed) when both give seeds, else by task_id
    (a task_id repeated with different seeds is then ambiguous and left out)."""
    with_seed = all(r.get("seed") is not None for r in challenger + champion)
    a, b = {}, {}
    for src, dst in ((challenger, a), (champion, b)):
        counts: dict = {}
        for r in src:
            counts[_key(r, with_seed)] = counts.get(_key(r, with_seed), 0) + 1
        for r in src:
            if counts[_key(r, with_seed)] == 1:
                dst[_key(r, with_seed)] = r["success"]
    keys = sorted(set(a) & set(b), key=str)
    return [a[k] for k in keys], [b[k] for k in keys], keys


# ----------------------------------------------------------------------------------------------------------- checks
@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    values: dict = field(default_factory=dict)


@dataclass
class GateDecision:
    version: str
    champion: str | None
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"version": self.version, "champion": self.champion, "passed": self.passed, "failed": self.failed,
                "checks": [asdict(c) for c in self.checks]}

    def describe(self) -> str:
        head = (f"version {self.version}: {'PROMOTE' if self.passed else 'REJECT'} "
                f"(champion: {self.champion or 'none'})")
        return "\n".join([head] + [f"  {'pass' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in self.checks])


@dataclass
class GateInputs:
    """What the gate needs about one model version (logged with it as artefacts by the deploy phase)."""

    adapt: dict
    drift: dict
    quantization: dict
    test_results: list[dict]
    served_consistency: dict | None = None  # pipeline.deploy.served_check's result, logged after registration

    REQUIRED = ("adapt", "drift", "quantization", "test_results")
    OPTIONAL = ("served_consistency",)


def check_capability(adapt: dict, cfg: DeployGateConfig) -> Check:
    gate = adapt.get("gate") or {}
    passed = gate.get("passed")
    if not cfg.require_capability_gate:
        return Check("capability", True, "not required (deploy.gate.require_capability_gate false)",
                     {"adapt_gate_passed": passed})
    if passed is True:
        return Check("capability", True, "the adapt phase's capability gate passed", {"adapt_gate_passed": True})
    if passed is None:
        return Check("capability", False, "the adapt phase's capability gate was off: capability not certified",
                     {"adapt_gate_passed": None})
    short = ", ".join(f"{s['metric']} {s['value']} < {s['min']}" for s in gate.get("shortfalls", []))
    return Check("capability", False, f"capability gate failed ({short or 'see metrics/adapt.json'})",
                 {"adapt_gate_passed": False})


def check_safety(quant: dict, cfg: DeployGateConfig) -> Check:
    """Refused unsafe calls per test episode of the variant that is served (measured by the deploy phase)."""
    prec = quant.get("serve_precision")
    v = (quant.get("variants") or {}).get(prec)
    if not v or not v.get("episodes"):
        return Check("safety", False, f"no test episodes of the served precision {prec!r} to count violations in")
    rate = v["safety_violations"] / v["episodes"]
    ok = rate <= cfg.max_safety_violations_per_episode
    return Check("safety", ok, f"{rate:.3f} unsafe calls per test episode of the {prec} policy "
                               f"({'<=' if ok else '>'} {cfg.max_safety_violations_per_episode})",
                 {"violations_per_episode": rate, "episodes": v["episodes"]})


def check_drift(drift: dict, cfg: DeployGateConfig) -> Check:
    verdict, failed = drift.get("verdict"), drift.get("failed_checks", [])
    if not cfg.require_drift_pass:
        return Check("drift", True, f"not required (verdict {verdict})", {"verdict": verdict})
    if drift.get("passed") is True and verdict == "pass":
        return Check("drift", True, "drift verdict pass", {"verdict": verdict})
    why = drift.get("error") or (f"failed checks: {', '.join(failed)}" if failed else "no pass verdict")
    return Check("drift", False, f"drift verdict {verdict}: {why}", {"verdict": verdict})


def check_consistency(drift: dict, cfg: DeployGateConfig) -> Check:
    c = (drift.get("checks") or {}).get("consistency") or {}
    status = c.get("status", "missing")
    if not cfg.require_consistency_pass:
        return Check("consistency", True, f"not required (status {status})", {"status": status})
    if status == "pass":
        return Check("consistency", True, "train/serve consistency pass", {"status": status})
    return Check("consistency", False, f"train/serve consistency {status}"
                 + (f": {c.get('message') or c.get('reason')}" if (c.get("message") or c.get("reason")) else ""),
                 {"status": status})


def check_parity(quant: dict) -> Check:
    prec = quant.get("serve_precision")
    parity = (quant.get("parity") or {}).get(prec)
    if parity is None:
        return Check("quantization_parity", False, f"no parity result for the served precision {prec!r}")
    return Check("quantization_parity", bool(parity["passed"]),
                 f"{prec} test success {parity['success']:.3f} vs fp32 {parity['fp32_success']:.3f} "
                 f"(drop {parity['drop']:+.3f}, tolerance {parity['tolerance']})", dict(parity))


def check_served_consistency(served: dict | None) -> Check:
    if served is None:
        return Check("served_consistency", True, "not run for this version (no served_consistency gate input)",
                     {"status": None})
    status = served.get("status")
    if status == "skipped":
        return Check("served_consistency", True, f"not run: {served.get('reason')}", {"status": status})
    if status == "pass" and served.get("passed") is True:
        return Check("served_consistency", True, "the served model agrees with the training path", {"status": status})
    return Check("served_consistency", False, "served model differs from the training path: "
                 + "; ".join(served.get("reasons") or ["no pass recorded"]), {"status": status})


def check_vs_champion(challenger: list[dict], champion: list[dict] | None, champion_version: str | None,
                      cfg: DeployGateConfig) -> Check:
    if champion_version is None:
        return Check("vs_champion", True, "no champion yet: the first model is judged on the absolute checks")
    if champion is None:
        return Check("vs_champion", False, f"champion v{champion_version} has no per-task test results to pair with")
    a, b, keys = pair_results(challenger, champion)
    if len(keys) < cfg.min_paired_tasks:
        return Check("vs_champion", False, f"only {len(keys)} test tasks shared with champion v{champion_version} "
                                           f"(< min_paired_tasks {cfg.min_paired_tasks})", {"paired_tasks": len(keys)})
    res = PAIRED_TESTS[cfg.paired_test](a, b, cfg)
    sa, sb = sum(a) / len(a), sum(b) / len(b)
    worse = res["p_value"] < cfg.alpha
    detail = (f"success {sa:.3f} vs champion v{champion_version} {sb:.3f} on {len(keys)} paired tasks; "
              f"{res['test']} p(worse)={res['p_value']:.4f} {'<' if worse else '>='} alpha {cfg.alpha}")
    return Check("vs_champion", not worse, detail,
                 {"paired_tasks": len(keys), "challenger_success": sa, "champion_success": sb, **res})


def env_of(task_id: str) -> str:
    """The environment of a task id: ``<env>/<id>`` in a mixed run (pipeline.envs.mixed), '' otherwise."""
    env, sep, _ = str(task_id).partition("/")
    return env if sep else ""


def check_vs_champion_per_env(challenger: list[dict], champion: list[dict] | None, champion_version: str | None,
                              cfg: DeployGateConfig) -> Check | None:
    """In a mixed run, the paired test on each environment's tasks alone: a challenger significantly worse on any
    one environment is refused, even when it is better overall. None when the tasks come from one environment."""
    envs = sorted({env_of(r["task_id"]) for r in challenger} - {""})
    if champion_version is None or champion is None or len(envs) < 2:
        return None
    per_env, worse_on = {}, []
    for env in envs:
        a, b, keys = pair_results([r for r in challenger if env_of(r["task_id"]) == env],
                                  [r for r in champion if env_of(r["task_id"]) == env])
        if not keys:
            per_env[env] = {"paired_tasks": 0}
            continue
        res = PAIRED_TESTS[cfg.paired_test](a, b, cfg)
        per_env[env] = {"paired_tasks": len(keys), "challenger_success": sum(a) / len(a),
                        "champion_success": sum(b) / len(b), **res}
        if res["p_value"] < cfg.alpha:
            worse_on.append(env)
    detail = "; ".join(f"{e}: {v['challenger_success']:.3f} vs {v['champion_success']:.3f} "
                       f"(p(worse)={v['p_value']:.4f})" if v["paired_tasks"] else f"{e}: no paired tasks"
                       for e, v in per_env.items())
    if worse_on:
        detail = f"worse than champion v{champion_version} on {', '.join(worse_on)} (alpha {cfg.alpha}): " + detail
    return Check("vs_champion_per_env", not worse_on, detail, {"per_env": per_env})


def decide(version: str, inputs: GateInputs, champion_version: str | None, champion_results: list[dict] | None,
           cfg: DeployGateConfig) -> GateDecision:
    """Every check on the challenger's inputs; pure (no registry access)."""
    checks = [check_capability(inputs.adapt, cfg), check_safety(inputs.quantization, cfg),
              check_drift(inputs.drift, cfg), check_consistency(inputs.drift, cfg), check_parity(inputs.quantization),
              check_served_consistency(inputs.served_consistency),
              check_vs_champion(inputs.test_results, champion_results, champion_version, cfg)]
    per_env = check_vs_champion_per_env(inputs.test_results, champion_results, champion_version, cfg)
    if per_env is not None:
        checks.append(per_env)
    return GateDecision(version=str(version), champion=champion_version, checks=checks)


def check_live(tags: dict) -> Check:
    """The gate check ``live`` from a version's tags (``gate.live`` written by the server)."""
    status, detail = tags.get("gate.live"), tags.get("gate.live.detail", "")
    if status is None:
        return Check("live", False, "no live evidence (no gate.live tag): serve it as a shadow or canary "
                                    "challenger first (deploy.serve.challenger.mode)", {"status": None})
    return Check("live", status == "pass", f"gate.live {status}: {detail}", {"status": status})


def require_live(tags: dict, version: str) -> Check:
    """The passing ``live`` check of `version`, or an AgentRLError saying why it is missing or failed."""
    check = check_live(tags)
    if not check.passed:
        raise AgentRLError(f"promote: version {version} has no passing live check -- {check.detail}; leave out "
                           f"--require-live (and deploy.gate.require_live) to promote without it")
    return check


__all__ = ["CHECKS", "Check", "GateDecision", "GateInputs", "bootstrap_worse", "check_live", "decide",
           "extract_task_results", "mcnemar_worse", "pair_results", "require_live", "task_result"]
