"""Continued pre-training of the adapt phase: full parameters, every token in the loss, before SFT.

The text (:func:`pretraining_texts` and :mod:`pipeline.adapt.drills`): copy drills (short texts that end in a JSON copy
of a quoted fictitious name: the skill held-out entities need, which SFT alone forms only after a slow phase change)
and word drills, with the world's documents (``include_documents``, :func:`pipeline.adapt.entity_source.documents`:
continued pre-training on the domain corpus, docs/design.md §3.3.2) and the training questions (``include_questions``); never
demonstrations. Training stops early once the exact-copy accuracy on held-out name drills reaches
``adapt.pretrain.copy_target``, or when its share of ``adapt.time_budget_s`` is spent. By default it runs in a child
process (``adapt.pretrain.subprocess``), so that the heap the loop leaves behind is returned when the child exits; the
weights are the same either way.

Left out: the loop itself (:func:`pipeline.adapt.sft.train_lm`) and everything about SFT.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch

from pipeline.adapt import drills
from pipeline.adapt.batching import batches
from pipeline.adapt.budget import PRETRAIN_SHARE, StepBudget, probe_steps
from pipeline.adapt.config import AdaptConfig
from pipeline.adapt.sft import train_lm
from pipeline.core.isolation import run_in_child
from pipeline.policy.config import ModelConfig
from pipeline.policy.demos import text_examples
from pipeline.policy.model import autocast_context


def pretraining_texts(documents: Sequence[str] = (), tasks: Sequence[dict] | None = None) -> list[str]:
    """The domain text for continued pre-training: the world's documents (chosen by
    :func:`pipeline.adapt.entity_source.documents` under ``include_documents``), plus the training questions when
    given.

    Only text the environment shows a policy is used; no action or answer text, so pre-training teaches the domain's
    language and names, not the demonstrations.
    """
    texts = [t for t in documents if isinstance(t, str)]
    if tasks:
        texts += [t["question"] for t in tasks]
    return texts


def continued_pretraining(model, tokenizer, cfg: AdaptConfig, model_cfg: ModelConfig, documents: Sequence[str], pool,
                          vocabulary: list[str], questions: list[str] | None, rng: np.random.Generator, log) -> dict:
    """:func:`pretrain` in a child process (``adapt.pretrain.subprocess``, :func:`pretrain_in_child`) or in this one;
    either way `model`, `rng` and torch's generator end in the same state. Returns the summary."""
    if cfg.pretrain.subprocess:
        out = run_in_child("adapt: continued pre-training (adapt.pretrain.subprocess: false runs it in this "
                           "process)", pretrain_in_child, model, tokenizer, cfg, model_cfg,
                           list(documents), pool, vocabulary, questions, rng, torch.get_num_threads(),
                           torch.get_rng_state())
        model.load_state_dict(torch.load(io.BytesIO(out["state"]), weights_only=True))
        for p in model.parameters():
            p.requires_grad_(True)
        rng.bit_generator.state = out["rng"]
        torch.set_rng_state(out["torch_rng"])
        for metrics, step in out["logged"]:
            log(metrics, step=step)
        return out["summary"]
    return pretrain(model, tokenizer, cfg, model_cfg, documents, pool, vocabulary, questions, rng, log)


def pretrain(model, tokenizer, cfg: AdaptConfig, model_cfg: ModelConfig, documents: Sequence[str], pool,
             vocabulary: list[str], questions: list[str] | None, rng: np.random.Generator, log) -> dict:
    """Continued pre-training of `model` in place (see the module docstring); returns its summary for
    ``metrics/adapt.json``. `rng` draws the batches (SFT goes on drawing from it); `log(metrics, step=...)` records
    the progress and the copy-accuracy checks."""
    autocast = lambda: autocast_context(model_cfg)  # noqa: E731
    texts = pretraining_texts(documents, [{"question": q} for q in questions] if questions is not None else None)
    n_domain = len(texts)
    texts += drills.copy_drills(pool, cfg.pretrain.copy_drills, np.random.default_rng([cfg.seed, 1]))
    words = drills.drill_words(pool, extra=list(vocabulary))
    texts += drills.word_drills(pool, words, cfg.pretrain.word_drills, np.random.default_rng([cfg.seed, 4]))
    if not texts:  # no documents, and no names to drill (pipeline.adapt.entity_source): nothing to pre-train on
        print("adapt: continued pre-training skipped: no documents (adapt.pretrain.include_documents, the "
              "environment's corpus()) and no names to drill (entities.json, copyable strings)", flush=True)
        return {"skipped": "no pre-training text", "steps": 0, "texts": 0, "domain_texts": 0, "drills": 0}
    pre_ex = text_examples(tokenizer, texts, cfg.pretrain.max_len)
    for p in model.parameters():
        p.requires_grad_(True)
    probe = drills.copy_drills(pool, 200, np.random.default_rng([cfg.seed, 9]))
    copy_curve: list[list[float]] = []

    def copied_enough(step: int) -> bool:
        acc = drills.copy_accuracy(model, tokenizer, probe[:100], autocast)
        copy_curve.append([step, acc])
        log({"pretrain/copy_accuracy_check": acc}, step=step)
        print(f"adapt: pretrain step {step}: exact-copy accuracy {acc:.2f} (target {cfg.pretrain.copy_target})",
              flush=True)
        return acc >= cfg.pretrain.copy_target

    check = cfg.pretrain.copy_target is not None and bool(probe)
    budget = None
    if cfg.time_budget_s is not None:  # pre-training takes at most its share of adapt's budget
        # its schedule is a maximum (it stops at its copy target): kept, and cut only when the time is up (budget.py)
        budget = StepBudget(cfg.time_budget_s * PRETRAIN_SHARE, cfg.pretrain.steps,
                            probe_steps(cfg.pretrain.warmup_steps), name="pretrain", shorten=False)
    res = train_lm(model, batches(pre_ex, cfg.pretrain.batch_size, rng, tokenizer.pad_token_id),
                   cfg.pretrain.steps, cfg.pretrain.lr, warmup=cfg.pretrain.warmup_steps,
                   autocast=autocast, log=lambda s, m: progress("pretrain", s, cfg.pretrain.steps, m,
                                                                cfg.sft.log_every, log),
                   log_every=cfg.sft.log_every,
                   # without entity names there is nothing to probe copying on: the steps run in full
                   stop=copied_enough if check else None,
                   stop_every=cfg.pretrain.check_every, budget=budget)
    word_probe = drills.word_drills(pool, words, 200, np.random.default_rng([cfg.seed, 12]))
    summary = {**res.summary(), "texts": len(texts), "domain_texts": n_domain,
               "drills": len(texts) - n_domain, "word_drills": cfg.pretrain.word_drills,
               "copy_accuracy": drills.copy_accuracy(model, tokenizer, probe, autocast),
               "word_copy_accuracy": drills.copy_accuracy(model, tokenizer, word_probe, autocast),
               "copy_target": cfg.pretrain.copy_target, "copy_curve": copy_curve,
               **({"budget": budget.summary()} if budget is not None else {})}
    log({"pretrain/copy_accuracy": summary["copy_accuracy"],
         "pretrain/word_copy_accuracy": summary["word_copy_accuracy"]})
    return summary


def pretrain_in_child(model, tokenizer, cfg: AdaptConfig, model_cfg: ModelConfig, documents: Sequence[str], pool,
                      vocabulary: list[str], questions: list[str] | None, rng: np.random.Generator, threads: int,
                      torch_rng: torch.Tensor) -> dict:
    """:func:`pretrain` as run by :func:`pipeline.core.isolation.run_in_child`: returns what the parent needs to go on as
    if it had trained in place: the weights (``torch.save`` bytes), the summary, the states of `rng` and of torch's
    generator after training, and the logged metrics (MLflow's run lives in the parent, which logs them).

    `threads` and `torch_rng` are the parent's torch thread count and generator state, set here first: a spawned
    interpreter starts with one thread per core (a matmul split over another number of threads sums in another order,
    so the weights would differ in their last bits) and with torch's default seed."""
    torch.set_num_threads(threads)
    torch.set_rng_state(torch_rng)
    logged: list[tuple[dict, int | None]] = []
    summary = pretrain(model, tokenizer, cfg, model_cfg, documents, pool, vocabulary, questions, rng,
                       lambda metrics, step=None: logged.append((metrics, step)))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return {"state": buf.getvalue(), "summary": summary, "rng": rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(), "logged": logged}


def progress(name: str, step: int, steps: int, m: dict, every: int, log) -> None:
    """Log a training step's metrics to MLflow, and print a progress line every 10 logs (the stage's progress display)."""
    log({f"{name}/{k}": v for k, v in m.items()}, step=step)
    if step % (10 * every) == 0 or step == steps:
        print(f"adapt: {name} step {step}/{steps} loss {m['loss']:.3f}", flush=True)
