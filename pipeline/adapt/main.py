"""Phase 2, `adapt`: base-model adaptation. Build or load the base, continue pre-training on the environment's text,
fine-tune on the demonstrations with an adapter, evaluate capabilities, apply the gate, publish atomically.

Steps (each a library call; this module only does I/O and wiring):

1. read and validate the inputs: the training tasks and the evaluation split (suite ``tasks``), the demonstrations
   (suite ``demos``); a file that breaks its schema stops the phase before any training;
2. the base: ``model.base: builtin`` trains the byte-level BPE tokenizer on the training text
   (:func:`pipeline.policy.tokenizer.corpus_texts`) and builds the small Llama; a directory written by
   :func:`~pipeline.policy.model.save_policy` is loaded with its tokenizer (a tokenizer that does not fit the model is
   refused); any other local model directory or cached hub id is loaded with its own tokenizer plus the protocol markers;
3. continued pre-training (``adapt.pretrain``, full parameters, every token in the loss) on copy drills (short texts
   that end in a JSON copy of a quoted fictitious name: the skill held-out entities need, which SFT alone forms only
   after a slow phase change; :mod:`pipeline.adapt.drills`), optionally with the world's documents and the
   training questions; no demonstrations; by default in a child process (``adapt.pretrain.subprocess``,
   :mod:`pipeline.adapt.pretrain`), so that the heap the loop leaves behind is returned when the child exits;
4. SFT (``adapt.sft``) with the adapter (``adapt.adapter``: LoRA merged afterwards, bottleneck kept, full fine-tuning;
   ``auto`` is full fine-tuning for the built-in from-scratch base and LoRA for a pre-trained one), loss on action
   tokens only, entity names replaced by fictitious ones in a share of the demonstrations; the loss curve goes to
   MLflow; with ``adapt.sft.select_every`` the checkpoint that scores best on validation tasks is kept
   (:class:`pipeline.adapt.capability.CheckpointSelector`);
5. capability evaluation (:mod:`pipeline.adapt.capability`) on the validation split: success per level greedy and
   sampled, tool selection, parameters, recovery after injected tool errors; and the learnability report of the
   greedy episodes (:mod:`pipeline.policy.learnability`: ``learnability`` in the metrics, printed last);
6. the gate (``adapt.gate``): a model below it raises :class:`~pipeline.adapt.capability.CapabilityGateError` and is
   not published;
7. only then is the model saved to ``models/adapted`` (``save_policy`` writes a temporary sibling and swaps it in) and
   ``metrics/adapt.json`` written (temporary file, then rename).

Any failure before step 7 (bad input, a model that does not load, the gate) leaves an existing ``models/adapted`` and
``metrics/adapt.json`` exactly as they were.

Deliberately left out: hyper-parameter search (DVC experiments do that: ``dvc exp run -S adapt.sft.lr=...``), and
DeepSpeed (SFT of the default model takes minutes on two cores; the RL phase owns distributed training).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.core.config import load_section
from pipeline.envs.config import EnvConfig
from pipeline.core.errors import AgentRLError
from pipeline.core.isolation import tree_peak_mib
from pipeline.policy.config import ModelConfig, RolloutConfig
from pipeline.adapt.config import AdaptConfig
from pipeline.adapt import recipe as recipes
from pipeline.core.recipe import describe as describe_recipe, mlflow_params as recipe_params

PHASE = "adapt"
EXAMPLES_PER_LEVEL = 2  # greedy transcripts per level stored as an MLflow artefact
LEARN_TITLE = "adapt: learnability on the {split} split (greedy)"


# ----------------------------------------------------------------------------------------------------------- inputs


def load_inputs(data_dir: Path, split: str, world) -> dict:
    """Training tasks, evaluation tasks and demonstrations, each validated against its schema."""
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.demos import load_demos

    train_path = data_dir / "tasks" / "train.jsonl"
    eval_path = data_dir / "tasks" / f"{split}.jsonl"
    for p in (train_path, eval_path):
        if not p.is_file():
            raise AgentRLError(f"{p} not found; run `agentrl build-env` (DVC stage build_env) first")
    train = load_task_file(train_path, world)
    evaluation = load_task_file(eval_path, world)
    demos = load_demos(data_dir / "demos" / "train.jsonl", task_ids=[t.task_id for t in train])
    return {"train": train, "eval": evaluation, "demos": demos}


def base_policy(model_cfg: ModelConfig, data_dir: Path, world, names=None):
    """(model, tokenizer, description) of the base to adapt; see step 2 of the module docstring. A built-in
    tokenizer learns from the training text with the real names of `names`' character kinds (a NamePool) replaced by
    fictitious ones (:func:`pipeline.policy.names.without_character_names`)."""
    from pipeline.policy.model import build_policy, check_pair, load_base_tokenizer, load_policy
    from pipeline.policy.model import POLICY_JSON
    from pipeline.policy.names import without_character_names
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer

    import pipeline.adapt.adapters  # noqa: F401  (registers the bottleneck model class for a bottleneck base)

    if model_cfg.base == "builtin":
        from pipeline.envs.capabilities import HasCorpus, has_capability

        documents = world.corpus() if has_capability(world, HasCorpus) else ()
        texts = corpus_texts(data_dir, [s.signature() for s in world.tools()], documents)
        if names is not None:
            texts = without_character_names(texts, names, np.random.default_rng([model_cfg.seed, 7]))
        tokenizer = train_tokenizer(texts, model_cfg.vocab_size)
        model = build_policy(model_cfg, tokenizer)
        source = "builtin"
    elif (Path(model_cfg.base) / POLICY_JSON).is_file():
        model, tokenizer, _ = load_policy(model_cfg.base)
        source = f"policy:{model_cfg.base}"
    else:
        tokenizer = load_base_tokenizer(model_cfg, tools=world.tools())  # what a chat template renders
        model = build_policy(model_cfg, tokenizer)
        source = f"hf:{model_cfg.base}"
    check_pair(model, tokenizer, f"model.base={model_cfg.base!r}")
    return model, tokenizer, source


def check_base_exists(model_cfg: ModelConfig) -> None:
    """Refuse a base that is neither 'builtin', nor an existing path, nor shaped like a hub id ('org/name'), early."""
    base = model_cfg.base
    looks_like_path = base.startswith((".", "/", "~")) or base.count("/") != 1
    if base != "builtin" and looks_like_path and not Path(base).expanduser().exists():
        raise AgentRLError(f"model.base={base!r}: no such directory (give 'builtin', a local model directory, or a "
                           f"hub id already in the local cache)")


def baselines(metrics_path: Path, split: str) -> dict | None:
    """Expert and random success on the evaluation split, from build_env's metrics (None when absent)."""
    if not metrics_path.is_file():
        return None
    try:
        data = json.loads(metrics_path.read_text())
    except json.JSONDecodeError:
        return None
    out = {}
    for policy in ("expert", "random"):
        b = data.get("baselines", {}).get(f"{split}/{policy}")
        if b:
            out[policy] = {"success": b["success_rate"], "mean_return": b["mean_return"],
                           "per_level_success": b["per_level_success"]}
    return out or None


def data_version(metrics_path: Path) -> dict:
    if not metrics_path.is_file():
        return {}
    try:
        return json.loads(metrics_path.read_text()).get("checksums", {})
    except json.JSONDecodeError:
        return {}


# ------------------------------------------------------------------------------------------------------------ phase


def adapt(cfg: AdaptConfig, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, env_cfg: EnvConfig, data_dir: Path,
          out_dir: Path, metrics_path: Path, build_metrics: Path, run=None) -> dict:
    """Run the phase (see the module docstring); returns the metrics written to `metrics_path`."""
    from pipeline.envs.registry import open_environment
    from pipeline.adapt import capability
    from pipeline.adapt.entity_source import name_source
    from pipeline.policy.learnability_render import render
    from pipeline.policy.model import n_parameters, resolve_dtype

    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    peak_mib: dict[str, float] = {}  # the process tree's high-water resident size after each part (tree_peak_mib)
    cfg, levels = checked_config(cfg, model_cfg, env_cfg)
    world = open_environment(env_cfg.name, data_dir / "env")
    inputs = load_inputs(data_dir, cfg.eval.split, world)
    eval_tasks = inputs["eval"][: cfg.eval.max_tasks] if cfg.eval.max_tasks else inputs["eval"]
    gate = recipes.gate_recipe(cfg.gate, inputs["demos"], [t.level for t in inputs["train"]],
                               baselines(build_metrics, cfg.eval.split), len(world.tools()), cfg.eval.split)
    gate_min = gate["value"]

    # the fictitious names of the drills and of entity augmentation (the built-in tokenizer learns without them)
    names = name_source(world, data_dir, [t.to_dict() for t in inputs["train"]], inputs["demos"],
                        [t.question for t in inputs["eval"]])
    print(f"adapt: fictitious names for drills and augmentation: {names.source}", flush=True)
    t = time.perf_counter()
    model, tokenizer, source = base_policy(model_cfg, data_dir, world, names.pool)
    seconds["base"] = time.perf_counter() - t
    rollout_cfg, recipe = recipes.token_recipe(rollout_cfg, tokenizer, inputs["demos"])  # before the first rollout
    if rollout_cfg.constrain == "schema":
        check_constrained_demos(model, tokenizer, world, env_cfg, inputs)
    recipe[recipes.GATE_KEY] = gate
    n_base = n_parameters(model)
    rng = np.random.default_rng([cfg.seed, 2])
    log = run.log_metrics if run is not None else (lambda *a, **k: None)

    pre_summary = None
    if cfg.pretrain.steps > 0:
        t = time.perf_counter()
        pre_summary = _pretrain(model, tokenizer, cfg, model_cfg, world, data_dir, inputs, names, rng, log)
        seconds["pretrain"] = time.perf_counter() - t
        peak_mib["pretrain"] = round(tree_peak_mib(), 1)

    t = time.perf_counter()
    sft_budget_s = cfg.time_budget_s - (t - t0) if cfg.time_budget_s is not None else None  # what pre-training left
    model, sft = _sft(model, tokenizer, cfg, model_cfg, env_cfg, rollout_cfg, world, inputs, names, rng, log, levels,
                      sft_budget_s)
    seconds["sft"] = time.perf_counter() - t
    if sft.selector is not None:
        seconds["select"] = sft.selector.seconds
    peak_mib["sft"] = round(tree_peak_mib(), 1)

    t = time.perf_counter()
    cap, episodes, learn = _evaluate(model, tokenizer, world, eval_tasks, inputs, env_cfg, rollout_cfg, cfg)
    seconds["evaluate"] = time.perf_counter() - t
    peak_mib["evaluate"] = round(tree_peak_mib(), 1)
    shortfalls = capability.check_gate(cap, gate_min) if cfg.gate.enabled else []
    seconds["total"] = time.perf_counter() - t0
    metrics = {
        "base": {"source": source, "n_parameters": n_base, "vocab_size": len(tokenizer),
                 "bf16": resolve_dtype(model_cfg.dtype) == torch.bfloat16, "dtype": model_cfg.dtype},
        "adapter": {"kind": sft.kind, "configured_kind": cfg.adapter.kind, **sft.counts},
        "recipe": recipe,
        "pretrain": pre_summary,
        "sft": sft.summary,
        **_capability_metrics(cap, levels, learn, cfg, rollout_cfg, len(eval_tasks), build_metrics),
        "gate": {"enabled": cfg.gate.enabled, "passed": (not shortfalls) if cfg.gate.enabled else None,
                 "min": dict(gate_min),
                 "shortfalls": [{"metric": k, "value": v, "min": lo} for k, v, lo in shortfalls]},
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "peak_rss_mib": peak_mib,
    }
    if run is not None:
        _log_run(run, metrics, cap, episodes)
    if shortfalls:  # the gate stops the phase here: say why the policy does not learn first
        print(render(learn, LEARN_TITLE.format(split=cfg.eval.split)), flush=True)
    if cfg.gate.enabled:
        capability.enforce_gate(cap, gate_min, PHASE)
    _publish(model, tokenizer, metrics, cfg, model_cfg, out_dir, metrics_path, build_metrics, run)
    return metrics


def check_constrained_demos(model, tokenizer, world, env_cfg: EnvConfig, inputs: dict) -> None:
    """Under `rollout.constrain: schema`, every demonstrated action must be one the grammar accepts
    (:func:`pipeline.policy.constrain.check_demonstrations`): before any training, not after it."""
    from pipeline.envs.context_actions import context_specs
    from pipeline.envs.runner import toolset
    from pipeline.policy.constrain import check_demonstrations

    extra = tuple(context_specs(env_cfg.context_actions)) if env_cfg.context_actions.enabled else ()
    tasks = {t.task_id: t for t in inputs["train"]}
    n = check_demonstrations(tokenizer, int(model.get_output_embeddings().weight.shape[0]), inputs["demos"],
                             lambda task_id: toolset(world, tasks[task_id], extra).specs)
    print(f"adapt: rollout.constrain: schema accepts all {n} demonstrated actions", flush=True)


def checked_config(cfg: AdaptConfig, model_cfg: ModelConfig, env_cfg: EnvConfig) -> tuple[AdaptConfig, tuple]:
    """The phase's config with a fixed gate made per level, and the environment's levels (not a fixed 1-4); refuses
    what would fail minutes into the phase (gate keys, torch.compile, a missing base). Also sets the thread count."""
    from pipeline.envs.registry import environment_class
    from pipeline.adapt import capability, sft
    from pipeline.policy.model import dtype_notice

    levels = tuple(sorted(environment_class(env_cfg.name).levels))
    if cfg.gate.min != "auto":  # an `auto` gate is derived from the data (recipe.gate_recipe)
        cfg = cfg.model_copy(update={"gate": cfg.gate.model_copy(update={"min": capability.gate_for_levels(
            cfg.gate.min, levels)})})
        capability.check_gate_keys(cfg.gate.min if cfg.gate.enabled else {}, levels)
    if cfg.sft.compile:
        sft.check_compile_available()  # before pre-training, not minutes into the phase
    check_base_exists(model_cfg)
    if (notice := dtype_notice(model_cfg.dtype)) is not None:
        print(f"adapt: {notice}", flush=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return cfg, levels


def _pretrain(model, tokenizer, cfg: AdaptConfig, model_cfg: ModelConfig, world, data_dir: Path, inputs: dict, names,
              rng, log) -> dict:
    """Continued pre-training: full parameters, every token (in a child process unless adapt.pretrain.subprocess is
    off); returns its summary."""
    from pipeline.adapt import pretrain
    from pipeline.adapt.entity_source import documents

    questions = [t.question for t in inputs["train"]] if cfg.pretrain.include_questions else None
    return pretrain.continued_pretraining(model, tokenizer, cfg, model_cfg,
                                          documents(world, data_dir, cfg.pretrain.include_documents), names.pool,
                                          world.vocabulary(), questions, rng, log)


@dataclass
class SFTResult:
    """What `_sft` hands back besides the finished model."""

    kind: str  # the adapter kind, `auto` resolved
    counts: dict  # trainable and total parameters (adapters.trainable_summary)
    summary: dict  # metrics["sft"]
    selector: object | None  # the CheckpointSelector when adapt.sft.select_every is on


def _sft(model, tokenizer, cfg: AdaptConfig, model_cfg: ModelConfig, env_cfg: EnvConfig, rollout_cfg: RolloutConfig,
         world, inputs: dict, names, rng, log, levels: tuple, budget_s: float | None = None):
    """SFT with the adapter on the demonstrations; returns the finished (merged) model and an :class:`SFTResult`.
    `budget_s`: the wall-clock seconds SFT and its selection checks may take (None: the configured steps)."""
    from pipeline.adapt import adapters, batching, capability, pretrain, sft
    from pipeline.adapt.budget import StepBudget, probe_steps
    from pipeline.policy.demos import prompt_signatures
    from pipeline.policy.model import autocast_context

    sampler = batching.DemoSampler(tokenizer, inputs["demos"], {t.task_id: t.to_dict() for t in inputs["train"]},
                                   env_cfg.history_window, cfg.sft.max_len, cfg.sft.entity_augmentation, names.pool,
                                   signatures=prompt_signatures(world, inputs["train"], env_cfg.context_actions),
                                   names=names.names)
    examples = [e for exs in sampler.plain for e in exs]
    kind = adapters.resolve_kind(cfg.adapter.kind, model_cfg.base)
    trainable_model = adapters.apply_adapter(model, cfg.adapter.model_copy(update={"kind": kind}))
    counts = adapters.trainable_summary(trainable_model)
    curve: list[list[float]] = []

    def sft_log(step: int, m: dict) -> None:
        curve.append([step, round(m["loss"], 5)])
        pretrain.progress("sft", step, budget.total if budget is not None else cfg.sft.steps, m, cfg.sft.log_every,
                          log)  # the planned steps under a time budget

    selector, budget = None, None
    if cfg.sft.select_every:
        selector = capability.CheckpointSelector(trainable_model, tokenizer, world,
                                                 inputs["eval"][: cfg.sft.select_tasks], env_cfg, rollout_cfg, cfg.sft,
                                                 cfg.eval.seed, log)
    if budget_s is not None:
        budget = StepBudget(max(0.0, budget_s), cfg.sft.steps, probe_steps(cfg.sft.warmup_steps),
                            check_every=cfg.sft.select_every, check_from=cfg.sft.select_from, name="sft")
        if selector is not None:
            selector.budget = budget
    res = sft.train_lm(trainable_model, batching.item_batches(sampler.lengths, sampler, cfg.sft.batch_size, rng,
                                                              tokenizer.pad_token_id),
                       cfg.sft.steps, cfg.sft.lr, warmup=cfg.sft.warmup_steps, weight_decay=cfg.sft.weight_decay,
                       grad_clip=cfg.sft.grad_clip, autocast=lambda: autocast_context(model_cfg), log=sft_log,
                       log_every=cfg.sft.log_every, micro_batches=cfg.sft.micro_batches, compile=cfg.sft.compile,
                       shared_prefix=cfg.sft.shared_prefix, stop=selector, stop_every=cfg.sft.select_every or 100,
                       budget=budget)
    selection = selector.finish(res.steps) if selector is not None else None
    summary = {**res.summary(), "examples": len(examples), "truncated_examples": sampler.truncated,
               "demos": len(inputs["demos"]), "loss_curve": curve,
               "examples_per_level": {str(lv): sum(e.level == lv for e in examples) for lv in levels},
               "loss_tokens_per_epoch": sum(sum(e.loss_mask) for e in examples),
               "epochs": res.steps * cfg.sft.batch_size / max(1, len(inputs["demos"])),
               "entity_augmentation": cfg.sft.entity_augmentation if names.pool else 0.0,
               "entity_augmentation_applied": sampler.applied(), "entity_augmentation_source": names.source,
               "selection": selection, **({"budget": budget.summary()} if budget is not None else {})}
    return adapters.finalize(trainable_model), SFTResult(kind, counts, summary, selector)


def _evaluate(model, tokenizer, world, eval_tasks: list, inputs: dict, env_cfg: EnvConfig, rollout_cfg: RolloutConfig,
              cfg: AdaptConfig) -> tuple[dict, dict, dict]:
    """Capability evaluation on the evaluation split and the learnability report of its greedy episodes; closes the
    world. Returns (capabilities, episodes, learnability)."""
    from pipeline.adapt import capability
    from pipeline.policy import learnability
    from pipeline.policy.model import release_free_memory

    # The SFT loop leaves its C heap fragmented, up to `sft.TRIM_HEADROOM_MIB` above its live size, and the
    # evaluation's rollouts (about 900 MiB in a fresh process) land on top of it; return the free pages first
    # (release_free_memory says why the heap grows; nothing numerical changes).
    release_free_memory()
    try:
        cap, episodes = capability.evaluate_capabilities(model, tokenizer, world, eval_tasks, env_cfg, rollout_cfg,
                                                         cfg.eval)
        # why the greedy episodes fail, per tool, limit, copied string, family and level (docs/environments.md)
        learn = learnability.report_for(world, episodes["greedy"], eval_tasks, inputs["demos"], inputs["train"],
                                        env_cfg, rollout_cfg)
    finally:
        world.close()
    return cap, episodes, learn


def _capability_metrics(cap: dict, levels: tuple, learn: dict, cfg: AdaptConfig, rollout_cfg: RolloutConfig,
                        n_tasks: int, build_metrics: Path) -> dict:
    """The evaluation's part of metrics/adapt.json: capabilities (NaN as null), per level, learnability, the
    baselines build-env measured, and what was evaluated how."""
    from pipeline.adapt import capability

    return {
        "capability": {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in sorted(cap.items())},
        "per_level": capability.per_level_table(cap, levels),
        "learnability": learn,
        "baselines": baselines(build_metrics, cfg.eval.split),
        "eval": {"split": cfg.eval.split, "tasks": n_tasks, "sampled_per_task": cfg.eval.sampled_per_task,
                 "temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p,
                 "recovery_failure_rate": cfg.eval.recovery_failure_rate},
    }


def _publish(model, tokenizer, metrics: dict, cfg: AdaptConfig, model_cfg: ModelConfig, out_dir: Path,
             metrics_path: Path, build_metrics: Path, run) -> None:
    """Publish: the model (atomic swap), then the metrics (temp file + rename)."""
    from pipeline.core.atomic import write_json
    from pipeline.policy.model import save_policy

    pre_summary, selection = metrics["pretrain"], metrics["sft"]["selection"]
    meta = {"phase": PHASE, "data_version": data_version(build_metrics), "model_config": model_cfg.model_dump(),
            "adapt_config": cfg.model_dump(), "base": metrics["base"]["source"], "adapter": metrics["adapter"]["kind"],
            "step": (pre_summary["steps"] if pre_summary else 0) + (selection["selected_step"] if selection
                                                                     else metrics["sft"]["steps"]),
            "capability": {k: metrics["per_level"][k] for k in metrics["per_level"]},
            "recipe": {k: v for k, v in metrics["recipe"].items() if k == recipes.TOKEN_KEY}}  # what later `auto` reads
    save_policy(model, tokenizer, out_dir, meta)
    write_json(metrics_path, metrics)
    if run is not None:
        run.log_artifact(str(metrics_path))


def _log_run(run, metrics: dict, cap: dict, episodes: dict) -> None:
    from pipeline.policy.learnability_render import flat_metrics

    flat = {k: v for k, v in cap.items() if np.isfinite(v)}
    for part in ("pretrain", "sft"):
        if metrics[part]:
            flat.update({f"{part}/{k}": v for k, v in metrics[part].items() if isinstance(v, (int, float))})
    flat.update({f"model/{k}": v for k, v in metrics["adapter"].items() if isinstance(v, (int, float))})
    flat.update({f"sys/{k}_seconds": v for k, v in metrics["seconds"].items()})
    if metrics["gate"]["passed"] is not None:
        flat["eval/gate_passed"] = float(metrics["gate"]["passed"])
    run.log_metrics(flat)
    run.log_params(recipe_params(metrics["recipe"]))
    run.log_dict({k: v for k, v in metrics.items() if k != "capability"}, "adapt_summary.json")
    run.log_metrics(flat_metrics(metrics["learnability"]))
    run.log_dict(metrics["learnability"], "learnability.json")
    samples = []
    for lv in (int(k) for k in metrics["per_level"]):
        eps = [e for e in episodes["greedy"] if e["level"] == lv][:EXAMPLES_PER_LEVEL]
        samples += [{"task_id": e["task_id"], "level": lv, "success": e["success"],
                     "steps": e["steps"], "ground_truth": e["ground_truth"]} for e in eps]
    run.log_dict(samples, "greedy_transcripts.json")


def main(params_path: str = "params.yaml", data_dir: str = "data", out_dir: str = "models/adapted",
         metrics_path: str = "metrics/adapt.json", build_metrics: str = "metrics/build_env.json") -> dict:
    """Entry point of `agentrl adapt` and of the DVC stage `adapt`."""
    from pipeline.core.tracking import Tracker

    env_cfg = load_section(EnvConfig, "env", params_path)
    model_cfg = load_section(ModelConfig, "model", params_path)
    rollout_cfg = load_section(RolloutConfig, "rollout", params_path, resolve=False)  # its tokens are derived here
    cfg = load_section(AdaptConfig, "adapt", params_path)
    params = {"env": env_cfg.model_dump(), "model": model_cfg.model_dump(), "rollout": rollout_cfg.model_dump(),
              "adapt": cfg.model_dump()}
    with Tracker().run(PHASE, params=params) as run:
        metrics = adapt(cfg, model_cfg, rollout_cfg, env_cfg, Path(data_dir), Path(out_dir), Path(metrics_path),
                        Path(build_metrics), run)
    pl = metrics["per_level"]
    gate = {True: "passed", False: "failed", None: "off"}[metrics["gate"]["passed"]]
    levels = " ".join(f"L{lv} {pl[str(lv)]['greedy_success']:.2f}/{pl[str(lv)]['sampled_success']:.2f}" for lv in pl
                      if pl[str(lv)]["greedy_success"] is not None)
    print(f"adapt: {metrics['adapter']['kind']} on {metrics['base']['source']} "
          f"({metrics['base']['n_parameters'] / 1e6:.2f}M parameters, {metrics['adapter']['trainable_fraction']:.1%} "
          f"trained); {metrics['eval']['split']} success greedy/sampled: {levels}; gate {gate}; "
          f"{metrics['seconds']['total']:.0f}s -> {out_dir}")
    print(f"adapt: recipe: {describe_recipe(metrics['recipe'])}")
    from pipeline.policy.learnability_render import render

    print(render(metrics["learnability"], LEARN_TITLE.format(split=metrics["eval"]["split"])), flush=True)
    return metrics
