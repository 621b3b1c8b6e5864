"""Phase `deploy`: quantise the trained policy, check parity on the test split, register it in the MLflow model
registry as `challenger`, and run the promotion gate. Also the entry points of `agentrl promote`, `agentrl rollback`
and `agentrl serve`.

Inputs: ``models/policy`` (train), ``metrics/train.json`` (provenance, logged with the version),
``metrics/adapt.json`` (capability gate), ``metrics/drift.json`` (drift and consistency verdicts), and
``metrics/evaluate.json`` when the evaluate stage has written it (its per-task test results are what the paired test
compares; without it the fp32 policy's greedy episodes on the test split, task i with seed ``deploy.seed + i``, are
used, and the champion is evaluated on the same tasks with the same seeds when its stored results do not cover them).
A missing required input is an :class:`AgentRLError` before anything is registered.

Steps: (1) every variant in ``deploy.precisions`` plays the test tasks greedily: success, return, safety violations,
latency per action (one episode at a time), throughput (batched) and state size, each also as a ratio to fp32;
(2) parity: a variant fails when its success drops more than ``parity_tolerance`` below fp32; (3) the pyfunc (HF
weights + packaged world + serving settings) and the gate inputs are logged in a ``deploy`` MLflow run; (4) that
logged pyfunc is served by `agentrl serve` and checked against the training path (:mod:`pipeline.deploy.served_check`,
a gate input); (5) with ``deploy.promote`` the gate judges from reads alone (with
``deploy.gate.require_live`` and a champion in place, a new version fails the check ``live``: it has met no live
traffic yet, so it stays challenger until `agentrl serve` has judged it in shadow or canary and `agentrl promote`
reads that evidence); (6) the version is created with every tag
in one request and the aliases move last (``challenger``, and ``champion`` on a pass). Writes ``metrics/deploy.json`` (variants, parity, version, ``served_consistency``, the gate's
decision and reasons).

Idempotent: when the policy's weights (``weights.sha256``) are those of the version ``champion`` or ``challenger``
points to, nothing is measured, registered or moved; the log says so and ``metrics/deploy.json`` records
``"unchanged": <that version>``, ``"unchanged_alias"`` and that version's figures from the run that registered it
(see :mod:`pipeline.deploy.registry` for why, and for the order of the registry writes when the tracking server fails
part-way).

Deliberately left out: serving itself (``agentrl serve`` is a long-running process, not a stage) and any retraining
decision (the retraining flow reads the gate's outcome).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.config import load_section
from pipeline.deploy.config import DeployConfig
from pipeline.envs.config import EnvConfig
from pipeline.core.errors import AgentRLError

if TYPE_CHECKING:
    from pipeline.deploy.registry import ChampionEvaluator

REQUIRED_METRICS = {"train": "train.json", "adapt": "adapt.json", "drift": "drift.json"}
EVALUATE_METRICS = "evaluate.json"
RECORD_ARTIFACT = "deploy_record.json"  # the registering deploy run's copy of metrics/deploy.json


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise AgentRLError(f"deploy: {path} not found ({what}); run the stage that writes it first")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AgentRLError(f"deploy: {path}: not valid JSON ({exc.msg})") from None


def load_inputs(cfg: DeployConfig, metrics_dir: Path, world) -> dict:
    """Every file the phase reads, checked before any work: a missing or unreadable one is an AgentRLError."""
    from pipeline.envs.taskfile import load_task_file

    if not Path(cfg.policy).is_dir():
        raise AgentRLError(f"deploy: policy {cfg.policy} not found; run the train stage first (`agentrl train`)")
    inputs = {k: _read_json(metrics_dir / f, f"the {k} stage's metrics") for k, f in REQUIRED_METRICS.items()}
    evaluate = metrics_dir / EVALUATE_METRICS
    inputs["evaluate"] = _read_json(evaluate, "evaluate") if evaluate.is_file() else None
    tasks = load_task_file(cfg.test_tasks, world)
    inputs["tasks"] = tasks[: cfg.max_test_tasks] if cfg.max_test_tasks else tasks
    return inputs


def summarize_variant(records: list[dict], timing: dict, size: int) -> dict:
    from pipeline.policy.episodes import summarize

    o = summarize(records)["overall"]
    return {"success": o["success_rate"], "mean_return": o["mean_return"], "safety_violations": o["safety_violations"],
            "mean_tool_calls": o["mean_tool_calls"], "size_bytes": size, **timing}


def measure_variants(model, tokenizer, tasks, runtime, env_cfg: EnvConfig, rollout_cfg, cfg: DeployConfig) -> dict:
    """Every configured precision on `tasks`: summaries with ratios to fp32, parity, and the fp32 episode records."""
    from pipeline.deploy.quantize import make_variant, measure_variant, state_size_bytes

    roll = rollout_cfg.model_copy(update={"dtype": "fp32"})  # a variant computes in its own dtype
    order = ["fp32"] + [p for p in cfg.precisions if p != "fp32"]
    variants, fp32_records = {}, None
    for prec in order:
        variant = make_variant(model, prec, cfg.quantization)
        m = measure_variant(variant, tokenizer, runtime, tasks, env_cfg, roll, cfg.seed, cfg.latency_repeats,
                            cfg.latency_tasks)
        variants[prec] = summarize_variant(m["records"], m["timing"], state_size_bytes(variant))
        if prec == "fp32":
            fp32_records = m["records"]
        del variant
    ref = variants["fp32"]
    for v in variants.values():
        v["size_ratio"] = v["size_bytes"] / ref["size_bytes"]
        lat, ref_lat = v.get("latency_per_action_ms"), ref.get("latency_per_action_ms")
        v["latency_ratio"] = lat / ref_lat if lat is not None and ref_lat else None
        v["throughput_ratio"] = v["actions_per_s"] / ref["actions_per_s"] if ref["actions_per_s"] else None
    parity = {p: {"success": v["success"], "fp32_success": ref["success"], "drop": ref["success"] - v["success"],
                  "tolerance": cfg.parity_tolerance,
                  "passed": ref["success"] - v["success"] <= cfg.parity_tolerance + 1e-12}
              for p, v in variants.items()}
    return {"variants": variants, "parity": parity, "fp32_records": fp32_records}


def deploy(cfg: DeployConfig, env_cfg: EnvConfig, rollout_cfg, metrics_dir: str | Path = "metrics",
           out_path: str | Path = "metrics/deploy.json", tracker=None, registry=None) -> dict:
    """The phase on explicit configs and paths (tests call this); returns what it writes to `out_path`."""
    from pipeline.deploy.registry import ModelRegistry, weights_digest
    from pipeline.envs.registry import open_environment
    from pipeline.policy.model import load_policy
    from pipeline.core.tracking import Tracker, store_failure

    t0 = time.perf_counter()
    metrics_dir, out_path = Path(metrics_dir), Path(out_path)
    runtime = open_environment(env_cfg.name, cfg.world_dir)
    try:
        inputs = load_inputs(cfg, metrics_dir, runtime)
        model, tokenizer, meta = load_policy(cfg.policy)
        digest = weights_digest(cfg.policy)
        tracker = tracker or Tracker()
        registry = registry or ModelRegistry(cfg.model_name, tracker.tracking_uri)
        state: dict = {"published": None}
        try:
            same = registry.unchanged(digest)
            if same is not None:  # and a deploy killed between its alias moves is finished here
                finished = registry.finish_publish(same[1])
                if finished:
                    print(f"deploy: {cfg.model_name} v{same[1]}: {finished} (an earlier deploy stopped before)")
                out = {**unchanged_record(cfg, registry, digest, meta, *same, time.perf_counter() - t0),
                       "finished": finished}
            else:
                out = _register(cfg, env_cfg, rollout_cfg, metrics_dir, tracker, registry, runtime, inputs, model,
                                tokenizer, meta, digest, t0, state)
        except Exception as exc:
            why = None if isinstance(exc, AgentRLError) else store_failure(exc)  # the registry's errors say it all
            if why is None:
                raise
            done = (f"version {state['published']} of {cfg.model_name!r} is registered with its tags and aliases; "
                    f"recording it in its deploy run failed" if state["published"] else
                    "nothing was registered and no alias moved")
            raise AgentRLError(f"deploy: {why}; {done}") from exc
    finally:
        runtime.close()
    decision = out.pop("decision")
    from pipeline.core.atomic import write_json

    write_json(out_path, out)
    out["decision"] = decision
    return out


def unchanged_record(cfg: DeployConfig, registry, digest: str, meta: dict, alias: str, version: str,
                     seconds: float) -> dict:
    """What deploy writes when the policy's weights are those of the version `alias` points to: nothing registered,
    no alias moved, nothing measured. The figures are that version's own, as the deploy run that registered it
    recorded them (``recorded_by`` names the run), so a stage rerun that changed nothing keeps the measured record
    in ``metrics/deploy.json``; a version registered without that record (a deploy stopped before it wrote it) gets
    empty figures and ``recorded_by`` None."""
    bare = {"tasks": 0, "test_results_source": None, "variants": {}, "parity": {}, "gate": None}
    recorded, run_id = registered_record(registry, version)
    return {
        "model_name": cfg.model_name, "version": version, "unchanged": version, "unchanged_alias": alias,
        "model_uri": registry.model_uri(version), "policy": cfg.policy,
        "policy_meta": {k: meta.get(k) for k in ("phase", "step")}, "weights_sha256": digest, "same_weights_as": [],
        "serve_precision": cfg.serve_precision,
        **{k: recorded.get(k, v) for k, v in bare.items()},
        **({"served_consistency": recorded["served_consistency"]} if "served_consistency" in recorded else {}),
        "recorded_by": run_id if recorded else None,
        "champion": registry.alias_version("champion"), "seconds": round(seconds, 1), "decision": None,
    }


def registered_record(registry, version: str) -> tuple[dict, str | None]:
    """({figures}, run id) of the deploy run that registered `version`: its ``deploy_record.json``, {} when it logged
    none (a deploy stopped before it wrote it). A store that does not answer is raised, not taken for "none"."""
    run_id = registry.client.get_model_version(registry.name, str(version)).run_id
    if not run_id or RECORD_ARTIFACT not in {a.path for a in registry.client.list_artifacts(run_id)}:
        return {}, run_id
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(registry.client.download_artifacts(run_id, RECORD_ARTIFACT, tmp)).read_text()
    try:
        return json.loads(text), run_id
    except json.JSONDecodeError as exc:
        raise AgentRLError(f"version {version} of {registry.name!r}: {RECORD_ARTIFACT} of run {run_id} is not valid "
                           f"JSON ({exc.msg}); nothing was registered and no alias moved") from None


def _register(cfg, env_cfg, rollout_cfg, metrics_dir: Path, tracker, registry, runtime, inputs: dict, model,
              tokenizer, meta: dict, digest: str, t0: float, state: dict) -> dict:
    """Measure, judge, register and publish a policy whose weights no alias holds yet (see the registry's order);
    ``state["published"]`` is set to the version once its aliases are set."""
    import dataclasses

    from pipeline.deploy.gate import GateInputs, check_live, extract_task_results, task_result
    from pipeline.deploy.pyfunc import save_pyfunc, serving_settings
    from pipeline.deploy.registry import WEIGHTS_TAG, ChampionMoved, decision_tags, judge, promote
    from pipeline.deploy.served_check import served_consistency

    measured = measure_variants(model, tokenizer, inputs["tasks"], runtime, env_cfg, rollout_cfg, cfg)
    if inputs["evaluate"] is not None:
        results = extract_task_results(inputs["evaluate"], str(metrics_dir / EVALUATE_METRICS))
        source = str(metrics_dir / EVALUATE_METRICS)
    else:
        results = [task_result(r) for r in measured["fp32_records"]]
        source = f"fp32 greedy episodes on {cfg.test_tasks} (seed {cfg.seed} + i)"
    quant = {"serve_precision": cfg.serve_precision, "parity": measured["parity"],
             "variants": measured["variants"], "quantization": cfg.quantization.model_dump()}
    gate_inputs = GateInputs(adapt=inputs["adapt"], drift=inputs["drift"], quantization=quant,
                             test_results=results)
    settings = serving_settings(env_cfg, rollout_cfg, cfg.serve_precision, cfg.quantization, cfg.seed)
    params = {"deploy": cfg.model_dump(), "env": env_cfg.model_dump(), "rollout": rollout_cfg.model_dump()}
    with tracker.run("deploy", params=params) as run, tempfile.TemporaryDirectory() as tmp:
        run.log_metrics(flat_metrics(measured["variants"], measured["parity"]))
        run.log_dict(inputs["train"], "provenance/train.json")
        save_pyfunc(Path(tmp) / "model", cfg.policy, cfg.world_dir, settings)
        logged = registry.log_candidate(run.run_id, Path(tmp) / "model", gate_inputs)
        served = served_consistency(cfg, env_cfg, rollout_cfg, registry.tracking_uri, logged, run, inputs["tasks"],
                                    model, tokenizer, runtime)  # pipeline.deploy.served_check; a gate input
        gate_inputs = dataclasses.replace(gate_inputs, served_consistency=served)
        decision, evaluator, tags = None, None, {WEIGHTS_TAG: digest}
        if cfg.promote:  # decided from reads alone, before the version exists: its tags go in with it
            evaluator = champion_evaluator(registry, inputs["tasks"], runtime, env_cfg, rollout_cfg, cfg.seed)
            decision = judge(registry, cfg.gate, "new", gate_inputs, evaluate_champion=evaluator)
            if cfg.gate.require_live and decision.champion is not None:  # no live evidence yet: it stays challenger
                decision.checks.append(check_live({}))
            tags.update(decision_tags(decision))
        same = registry.versions_with_weights(digest)
        version = registry.create_version(run.run_id, tags=tags)
        if decision is not None:
            decision = dataclasses.replace(decision, version=version)
        try:
            registry.publish(version, decision)  # the champion moves only if it is still the one judged against
        except ChampionMoved as moved:  # another pipeline promoted since: judge once more against its champion
            print(f"deploy: {cfg.model_name}: {moved.judge_again_line()}")
            if not cfg.gate.require_live:  # with it the version waits for its live check either way
                decision = promote(registry, cfg.gate, version=version, evaluate_champion=evaluator, attempts=1)
        if decision is not None:
            run.log_dict(decision.to_dict(), "gate_decision.json")
            run.log_metrics({"gate/passed": decision.passed})
            run.set_tags({"deploy.decision": "promoted" if decision.passed else "rejected"})
        run.set_tags({"deploy.model_name": cfg.model_name, "deploy.version": version})
        out = {
            "model_name": cfg.model_name, "version": version, "model_uri": registry.model_uri(version),
            "policy": cfg.policy, "policy_meta": {k: meta.get(k) for k in ("phase", "step")},
            "weights_sha256": digest, "same_weights_as": same,
            "tasks": len(inputs["tasks"]), "test_results_source": source, "serve_precision": cfg.serve_precision,
            "variants": measured["variants"], "parity": measured["parity"], "served_consistency": served,
            "gate": decision.to_dict() if decision else None,
            "champion": registry.alias_version("champion"), "seconds": round(time.perf_counter() - t0, 1),
            "unchanged": None, "finished": None,
        }
        run.log_dict(out, RECORD_ARTIFACT)  # what a later deploy of the same weights reports (`unchanged_record`)
    return {**out, "decision": decision}


def champion_evaluator(registry, tasks: list, runtime, env_cfg, rollout_cfg,
                       seed: int) -> ChampionEvaluator:
    """An evaluator for :func:`pipeline.deploy.registry.promote`: downloads the champion's policy folder and plays,
    greedily, the challenger's tasks (found by task_id in `tasks`) with the challenger's seeds (``seed + position in
    tasks`` where none is recorded). Tasks the challenger has that `tasks` lacks are left out (the pairing then shows
    how many remain)."""

    def evaluate(version: str, challenger_results: list[dict]) -> list[dict]:
        from pipeline.deploy.registry import MODEL_DIR
        from pipeline.deploy.gate import task_result
        from pipeline.deploy.quantize import make_variant
        from pipeline.policy.model import load_policy
        from pipeline.policy.rollout import RolloutEngine

        index = {t.task_id: (i, t) for i, t in enumerate(tasks)}
        chosen = [(index[r["task_id"]][1], r["seed"] if r.get("seed") is not None else seed + index[r["task_id"]][0])
                  for r in challenger_results if r["task_id"] in index]
        if not chosen:
            return []
        mv = registry.client.get_model_version(registry.name, version)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                local = Path(registry.client.download_artifacts(mv.run_id, f"{MODEL_DIR}/artifacts/policy", tmp))
            except Exception as exc:  # noqa: BLE001 - any failure means the champion cannot be re-evaluated
                raise AgentRLError(f"champion v{version}: cannot download its policy ({exc})") from None
            model, tokenizer, _ = load_policy(local)
        model = make_variant(model, "fp32")
        engine = RolloutEngine(model, tokenizer, runtime, env_cfg, rollout_cfg.model_copy(update={"dtype": "fp32"}))
        records = engine.run([t for t, _ in chosen], [s for _, s in chosen], greedy=True)
        return [task_result(r) for r in records]

    return evaluate


def flat_metrics(variants: dict, parity: dict) -> dict:
    flat = {}
    for prec, v in variants.items():
        for k in ("success", "mean_return", "safety_violations", "size_bytes", "size_ratio", "latency_per_action_ms",
                  "latency_ratio", "actions_per_s", "episodes_per_s"):
            if v.get(k) is not None:
                flat[f"deploy/{prec}/{k}"] = v[k]
        flat[f"deploy/{prec}/parity_passed"] = parity[prec]["passed"]
    return flat


def report(out: dict) -> str:
    if out.get("unchanged"):
        return (f"deploy: {out['model_name']} unchanged: the policy's weights are those of v{out['unchanged']} (alias "
                f"{out['unchanged_alias']}; sha256 {out['weights_sha256'][:12]}), so nothing was registered and no "
                f"alias moved" + (f"; `agentrl promote --version {out['unchanged']}` judges it again"
                                  if out["unchanged_alias"] != "champion" else "")
                + (f"\n  champion: v{out['champion']}" if out["champion"] else "\n  champion: none"))
    lines = [f"deploy: {out['model_name']} v{out['version']} registered as challenger ({out['tasks']} test tasks; "
             f"test results from {out['test_results_source']})"]
    if out.get("same_weights_as"):
        lines.append(f"  weights identical to v{', v'.join(out['same_weights_as'])} (sha256 {out['weights_sha256'][:12]}): "
                     f"this run reproduced an earlier policy bit for bit")
    for prec, v in out["variants"].items():
        lat = (f"latency/action {v['latency_per_action_ms']:.1f} ms (x{v['latency_ratio']:.2f}), "
               if v.get("latency_ratio") is not None else "")
        lines.append(f"  {prec:>4}: success {v['success']:.3f}, size {v['size_bytes'] / 1e6:.2f} MB "
                     f"(x{v['size_ratio']:.2f}), {lat}{v['actions_per_s']:.0f} actions/s batched; parity "
                     f"{'pass' if out['parity'][prec]['passed'] else 'FAIL'}")
    if out.get("served_consistency") is not None:
        from pipeline.deploy.served_check import describe

        lines.append(describe(out["served_consistency"]))
    if out["decision"] is not None:
        lines.append(out["decision"].describe())
    lines.append(f"  champion: v{out['champion']}" if out["champion"] else "  champion: none")
    return "\n".join(lines)


def main(params_path: str = "params.yaml") -> dict:
    """Entry point of `agentrl deploy` and of the DVC stage `deploy`."""
    from pipeline.policy.config import RolloutConfig

    cfg = load_section(DeployConfig, "deploy", params_path)
    env_cfg = load_section(EnvConfig, "env", params_path)
    rollout_cfg = load_section(RolloutConfig, "rollout", params_path)
    out = deploy(cfg, env_cfg, rollout_cfg)
    print(report(out))
    return out


# ------------------------------------------------------------------------------------------ promote, rollback, serve
def promote_main(params_path: str = "params.yaml", version: int | None = None, alias: str | None = None,
                 dry_run: bool = False, require_live: bool = False) -> bool:
    """`agentrl promote`: the gate on a version (default: the challenger); returns whether it passed. With
    `require_live` (or ``deploy.gate.require_live``) the version's live check must have passed."""
    from pipeline.deploy.registry import ModelRegistry, promote
    from pipeline.envs.registry import open_environment
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.config import RolloutConfig
    from pipeline.core.tracking import Tracker, store_errors

    cfg = load_section(DeployConfig, "deploy", params_path)
    env_cfg = load_section(EnvConfig, "env", params_path)
    rollout_cfg = load_section(RolloutConfig, "rollout", params_path)
    tracker = Tracker()
    registry = ModelRegistry(cfg.model_name, tracker.tracking_uri)
    runtime, evaluator = None, None
    if Path(cfg.test_tasks).is_file() and Path(cfg.world_dir).is_dir():  # lets the champion be re-evaluated
        runtime = open_environment(env_cfg.name, cfg.world_dir)
        tasks = load_task_file(cfg.test_tasks, runtime)
        evaluator = champion_evaluator(registry, tasks, runtime, env_cfg, rollout_cfg, cfg.seed)
    try:
        with store_errors("promote", "the gate's tags of the version may be partly written (gate.decision judging "
                                     "until the last; `agentrl registry check` lists them); the champion alias moves "
                                     "only after all of them"):
            decision = promote(registry, cfg.gate, version=version, alias=alias, dry_run=dry_run,
                               evaluate_champion=evaluator, notify=lambda line: print(f"promote: {line}"),
                               require_live=require_live or cfg.gate.require_live)
    finally:
        if runtime is not None:
            runtime.close()
    print(("dry run (nothing written): " if dry_run else "") + decision.describe())
    if not dry_run:
        with tracker.run("promote", params={"deploy.gate": cfg.gate.model_dump()}) as run:
            run.log_dict(decision.to_dict(), "gate_decision.json")
            run.log_metrics({"gate/passed": decision.passed})
            run.set_tags({"deploy.model_name": cfg.model_name, "deploy.version": decision.version,
                          "deploy.decision": "promoted" if decision.passed else "rejected"})
        champion = registry.alias_version("champion")
        print(f"champion: v{champion}" if champion else "champion: none")
    return decision.passed


def rollback_main(params_path: str = "params.yaml") -> tuple[str, str]:
    from pipeline.core.tracking import store_errors
    from pipeline.deploy.registry import ModelRegistry, rollback

    cfg = load_section(DeployConfig, "deploy", params_path)
    registry = ModelRegistry(cfg.model_name)
    with store_errors("rollback", "the history is shortened before the champion alias moves, so running rollback "
                                  "again finishes it"):
        current, previous = rollback(registry)
    print(f"rollback: champion of {cfg.model_name} moved from v{current} back to v{previous}")
    return current, previous


def serve_main(params_path: str = "params.yaml", model_uri: str | None = None, host: str | None = None,
               port: int | None = None) -> None:
    from pipeline.deploy.serve import serve
    from pipeline.deploy.serve_validation import serving_key

    cfg = load_section(DeployConfig, "deploy", params_path)
    if model_uri is not None and not model_uri.strip():  # an unset shell variable, not a request for the champion
        raise AgentRLError("--model-uri is empty: give a model URI, or leave the option out to serve the champion")
    if port is not None and not 0 <= port <= 65535:
        raise AgentRLError(f"serve: --port {port} is not a TCP port (0-65535; 0: any free port)")
    serving_key(host or cfg.serve.host, cfg.serve)  # a non-loopback bind without an API key fails first
    if cfg.serve.capture.enabled:  # before the model loads: a refused start costs nothing
        from pipeline.deploy.capture import check_folder

        check_folder(cfg.serve.capture)
    uri = model_uri or f"models:/{cfg.model_name}@champion"
    serve_cfg = cfg.serve
    if serve_cfg.challenger.mode != "off" and serve_cfg.challenger.uri is None:
        challenger = serve_cfg.challenger.model_copy(update={"uri": f"models:/{cfg.model_name}@challenger"})
        serve_cfg = serve_cfg.model_copy(update={"challenger": challenger})
    for u in (uri, serve_cfg.challenger.uri if serve_cfg.challenger.mode != "off" else ""):
        if u.startswith("models:/"):
            from pipeline.core.tracking import require_tracking

            require_tracking(f"serving {u} (a registry model)")
    serve(uri, serve_cfg, host, port, alarm=cfg.snapshot)
