"""The adapt stage: SFT data and masks, adapters, the training loop, capability evaluation and gate, the phase's
refusals of bad input. Tiny world, tiny model: seconds each."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.envs.config import EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.envs.runner import AgentEnv
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.tasks import Task
from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import read_jsonl
from pipeline.adapt import adapters
from pipeline.adapt import capability
from pipeline.adapt import batching, drills, sft
from pipeline.policy.config import ModelConfig, RolloutConfig
from pipeline.adapt.config import AdaptConfig, AdapterConfig, CapabilityConfig, GateConfig, PretrainConfig, SFTConfig
from pipeline.policy.demos import NamePool, augment_names, demo_examples, demo_segments, encode_segment, load_demos
from pipeline.policy.model import build_policy, load_policy, save_policy
from pipeline.policy.tokenizer import corpus_texts, encode_context, train_tokenizer

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_positions=512, vocab_size=400, dtype="fp32")


# ------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A tiny build_env output (world, splits, demos, metrics) made by the real phase."""
    from pipeline.build_env.main import build

    root = tmp_path_factory.mktemp("adapt")
    cfg = BuildEnvConfig(options={"n_products": 40, "n_suppliers": 12}, tasks_per_split={"train": 80, "validation": 16, "test": 8},
                         demos={"level_coverage": {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.5}, "wrong_order_prob": 0.3,
                                "redundant_call_prob": 0.3})
    build(cfg, EnvConfig(), root / "data", root / "metrics" / "build_env.json")
    return root / "data"


@pytest.fixture(scope="module")
def world(data_dir):
    w = ShopWorld.load(data_dir / "env")
    yield w
    w.close()


@pytest.fixture(scope="module")
def signatures(world) -> list[str]:
    """The tool signatures the prompt lists, as the phases take them from the environment."""
    return [s.signature() for s in world.tools()]


@pytest.fixture(scope="module")
def tokenizer(data_dir, signatures):
    return train_tokenizer(corpus_texts(data_dir, signatures), TINY.vocab_size)


@pytest.fixture(scope="module")
def demos(data_dir):
    return [json.loads(l) for l in (data_dir / "demos" / "train.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tasks(data_dir):
    return {s: [Task.from_dict(json.loads(l)) for l in (data_dir / "tasks" / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "validation")}


def tiny_adapt_config(**over) -> AdaptConfig:
    base = dict(threads=None,
                # pre-training in this process (a child process costs seconds of start-up per run): the good run
                # and test_pretraining_in_a_child_process_gives_the_same_weights take the default's child process
                pretrain=PretrainConfig(steps=3, batch_size=8, warmup_steps=1, max_len=64, copy_drills=50,
                                        subprocess=False),
                adapter=AdapterConfig(kind="lora", lora_r=4, lora_alpha=8),
                sft=SFTConfig(steps=4, batch_size=8, warmup_steps=1, log_every=2, compile=False,
                              select_every=0),
                eval=CapabilityConfig(max_tasks=6, sampled_per_task=2),
                gate=GateConfig(enabled=False))
    base.update(over)
    return AdaptConfig(**base)


def run_phase(data_dir: Path, out: Path, cfg: AdaptConfig | None = None, model_cfg: ModelConfig = TINY,
              data: Path | None = None, rollout_cfg: RolloutConfig | None = None) -> dict:
    from pipeline.adapt.main import adapt

    return adapt(cfg or tiny_adapt_config(), model_cfg, rollout_cfg or RolloutConfig(batch_size=8, max_new_tokens=24),
                 EnvConfig(),
                 data or data_dir, out / "models" / "adapted", out / "metrics" / "adapt.json",
                 data_dir.parent / "metrics" / "build_env.json")


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ data and masks


def test_loss_mask_covers_exactly_the_action_tokens(tokenizer, demos, tasks, signatures):
    questions = {t.task_id: t.question for t in tasks["train"]}
    for demo in demos[:40]:
        (prompt, pairs), = demo_segments(questions[demo["task_id"]], demo["steps"], window=6, signatures=signatures)
        ex = encode_segment(tokenizer, prompt, pairs)
        ids, mask = np.array(ex.input_ids), np.array(ex.loss_mask)
        assert set(mask.tolist()) <= {0, 1} and len(ids) == len(mask)
        assert tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == "".join(a for a, _ in pairs)
        masked_out = tokenizer.decode(ids[mask == 0].tolist()[1:], skip_special_tokens=False)  # without <bos>
        assert masked_out == prompt + "".join(o for _, o in pairs[:-1])
        # the prompt is exactly the context the environment shows at reset, tokenized as the rollout engine does
        first = int(np.argmax(mask))
        assert ex.input_ids[:first] == encode_context(tokenizer, prompt)


def test_sft_text_replays_the_environment_contexts(data_dir, demos, tasks, signatures):
    """Replaying a demonstration's actions in the environment shows, before every step, exactly the SFT text so far."""
    by_id = {t.task_id: t for t in tasks["train"]}
    runtime = ShopWorld.load(data_dir / "env")
    try:
        env = AgentEnv(world=runtime, tasks=tasks["train"], config=EnvConfig())
        for demo in [d for d in demos if d["n_calls"] >= 3][:10]:
            (prompt, pairs), = demo_segments(by_id[demo["task_id"]].question, demo["steps"], window=6,
                                             signatures=signatures)
            obs, _ = env.reset(seed=0, options={"task": by_id[demo["task_id"]]})
            text = prompt
            for action, observation in pairs:
                assert obs["context"] == text
                obs, *_ = env.step(action)
                text += action + observation
        env.close()
    finally:
        runtime.close()


def test_folded_history_starts_a_new_segment_from_the_folded_context(signatures):
    steps = [{"action": f'<call>lookup {{"name": "P{i}", "field": "price"}}</call>', "observation": f"<obs>{i}</obs>\n"}
             for i in range(5)]
    segs = demo_segments("Q?", steps, window=2, signatures=signatures)
    assert all(" ".join(signatures) in p for p, _ in segs)  # every segment's prompt lists the environment's tools
    assert [len(p) for _, p in segs] == [3, 1, 1]  # folding starts once the history exceeds the window
    assert segs[1][0].count("State: earlier calls and results") == 1
    assert sum(len(p) for _, p in segs) == 5


def test_entity_augmentation_renames_consistently_and_never_uses_a_real_name(data_dir, demos, tasks, tokenizer, signatures):
    entities = json.loads((data_dir / "env" / "entities.json").read_text())
    pool = NamePool.from_entities(entities)
    real = set(entities["products"]) | set(entities["suppliers"])
    by_id = {t.task_id: t for t in tasks["train"]}
    rng = np.random.default_rng(0)
    for demo in demos[:30]:
        task = by_id[demo["task_id"]]
        question, steps, mapping = augment_names(task.question, demo["steps"], task.entities, pool, rng)
        assert set(mapping) == set(task.entities) and not set(mapping.values()) & real
        text = question + "".join(s["action"] + s["observation"] for s in steps)
        assert not any(e in text for e in task.entities)  # every occurrence replaced
        for fake, name in {v: k for k, v in mapping.items()}.items():  # ... by the same name everywhere
            text = text.replace(fake, name)
        assert text == task.question + "".join(s["action"] + s["observation"] for s in demo["steps"])
    # the sampler's augmented examples keep the mask exact: it decodes to the (renamed) actions
    sampler = batching.DemoSampler(tokenizer, demos[:10], {t.task_id: t.to_dict() for t in tasks["train"]}, 6, 1024, 1.0, pool,
                                   signatures={t.task_id: signatures for t in tasks["train"]})
    for i in range(10):
        (ex,) = sampler(i, rng)
        acts = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m], skip_special_tokens=False)
        assert acts.count("<call>") == len(demos[i]["steps"])
        assert not any(e in acts for e in by_id[demos[i]["task_id"]].entities)


def test_copy_drills_end_in_a_json_copy_of_a_quoted_fictitious_name(data_dir):
    entities = json.loads((data_dir / "env" / "entities.json").read_text())
    real = set(entities["products"]) | set(entities["suppliers"])
    texts = drills.copy_drills(NamePool.from_entities(entities), 50, np.random.default_rng(0))
    assert len(texts) >= 45
    for text in texts:
        body, record = text.rsplit("\n", 1)
        values = [v for k, v in json.loads(record).items() if k != "item"]
        assert values and all((f"'{v}'" in body or f'"{v}"' in body) and v not in real for v in values)


def test_word_drills_copy_an_unquoted_word_and_the_quoted_name_of_their_sentence(data_dir):
    entities = json.loads((data_dir / "env" / "entities.json").read_text())
    pool = NamePool.from_entities(entities)
    words = drills.drill_words(pool, extra=["price", "stock"])
    assert "price" in words and len(words) > 20 and all(w == w.lower() for w in words)
    texts = drills.word_drills(pool, words, 60, np.random.default_rng(0))
    assert len(texts) >= 55
    seen_words = set()
    for text in texts:
        body, record = text.rsplit("\n", 1)
        fields = json.loads(record)
        assert f"'{fields['name']}'" in body and fields["name"] not in set(entities["products"]) | set(entities["suppliers"])
        assert re.search(rf"(^|\s){re.escape(fields['field'])}(\s|[.?,:])", body.replace(f"'{fields['name']}'", ""))
        seen_words.add(fields["field"])
    assert len(seen_words) > 20  # a vocabulary to copy from, not a handful of classes to memorise


def test_masked_loss_ignores_masked_positions():
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[5, batching.IGNORE, 3, batching.IGNORE]])
    loss, n = sft.masked_lm_loss(logits, labels)
    expected = torch.nn.functional.cross_entropy(logits[0, 1:2], torch.tensor([3]))
    assert n == 1 and torch.allclose(loss, expected)
    # changing a logit row whose next label is ignored changes nothing
    logits2 = logits.clone()
    logits2[0, 0] += 5.0
    assert torch.allclose(sft.masked_lm_loss(logits2, labels)[0], loss)


def test_unreadable_demo_files_are_refused_naming_the_file_and_line(tmp_path, demos):
    with pytest.raises(AgentRLError, match=r"demonstrations not found; run `agentrl build-env`"):
        load_demos(tmp_path / "missing.jsonl")
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(demos[0]) + "\n{not json\n")
    with pytest.raises(AgentRLError, match=rf"{re.escape(str(path))}:2: not valid JSON"):
        load_demos(path)


def test_demo_file_that_breaks_the_schema_is_refused(tmp_path, demos):
    bad = [dict(d) for d in demos[:5]]
    bad[2]["steps"] = [{"action": "<call>answer {}</call>"}]  # no observation
    del bad[3]["level"]
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in bad))
    with pytest.raises(AgentRLError, match="breaks the schema"):
        load_demos(path)


# ------------------------------------------------------------------------------------------------------- adapters


def _batch(tokenizer, demos, tasks, signatures, n=8):
    questions = {t.task_id: t.question for t in tasks["train"]}
    ex = demo_examples(tokenizer, demos[:n], questions, 6, signatures={t.task_id: signatures for t in tasks["train"]})
    return batching.collate(ex, tokenizer.pad_token_id)


def test_a_step_in_length_chunks_equals_one_forward_of_the_batch(tokenizer, demos, tasks, signatures):
    batch = _batch(tokenizer, demos, tasks, signatures)
    lengths = batch["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # chunks are trimmed to their own longest row
    grads, losses = [], []
    for micro_batches in (1, 3):
        model = build_policy(TINY, tokenizer)  # TINY's seed: the same weights both times
        res = sft.train_lm(model, iter([batch]), steps=1, lr=1e-3, micro_batches=micro_batches)
        losses.append(res.losses[0])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-7, rtol=1e-4), n


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_step_with_the_shared_prefix_computed_once_equals_the_step_without(micro_batches, tokenizer, demos, tasks,
                                                                            signatures):
    """adapt.sft.shared_prefix: every demonstration starts with the same system line and tool list; running it once
    per chunk gives the same loss and gradients as running it once per row (float rounding aside)."""
    batch = _batch(tokenizer, demos, tasks, signatures)
    P = sft.shared_prefix_len(batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert P >= sft.MIN_SHARED_PREFIX
    runs = []
    for shared in (False, True):
        model = build_policy(TINY, tokenizer)  # TINY's seed: the same weights both times
        res = sft.train_lm(model, iter([batch]), steps=1, lr=1e-3, micro_batches=micro_batches, shared_prefix=shared)
        runs.append((res, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (off, g_off), (on, g_on) = runs
    assert off.shared_tokens == 0 and on.shared_tokens >= P * (len(batch["input_ids"]) - micro_batches)
    assert on.tokens == off.tokens and on.loss_tokens == off.loss_tokens
    assert on.losses[0] == pytest.approx(off.losses[0], rel=1e-5)
    assert g_off.keys() == g_on.keys() and g_off
    for n in g_off:
        assert torch.allclose(g_on[n], g_off[n], atol=1e-6, rtol=1e-4), n


@pytest.mark.parametrize("shared", [False, True])
def test_bf16_training_runs_attention_in_fp32_and_leaves_the_model_on_sdpa(shared, tokenizer, demos, tasks,
                                                                          signatures):
    """Under bf16 autocast on the CPU the training forward's attention kernel, and so its backward, gets fp32 queries,
    keys and values (pipeline.adapt.fp32_attention: the CPU's bf16 flash-attention backward is ~3x slower than the
    fp32 one), while the projections stay bf16; outside training forwards the model is plain ``sdpa`` again (the
    rollout engine accepts only sdpa and eager)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Kernels(TorchDispatchMode):  # below autocast: sees the dtypes the kernels actually run in
        def __init__(self):
            super().__init__()
            self.attn, self.mm = set(), set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "scaled_dot_product" in name:
                self.attn.add((name.split(".")[1], *(a.dtype for a in args[:4] if isinstance(a, torch.Tensor))))
            elif name.startswith("aten.mm"):
                self.mm.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    batch = _batch(tokenizer, demos, tasks, signatures)
    model = build_policy(TINY, tokenizer)
    kernels = Kernels()
    with kernels:
        sft.train_lm(model, iter([batch]), steps=1, lr=1e-3, shared_prefix=shared,
                     autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert any("backward" in a[0] for a in kernels.attn) and any("backward" not in a[0] for a in kernels.attn)
    assert {dt for a in kernels.attn for dt in a[1:]} == {torch.float32}, kernels.attn
    assert torch.bfloat16 in kernels.mm
    assert model.config._attn_implementation == "sdpa"


def test_no_prefix_is_shared_when_a_loss_token_lies_inside_it():
    ids = torch.tensor([[1, 5, 6, 7, 9, 9], [1, 5, 6, 7, 9, 8]])
    att = torch.ones_like(ids)
    labels = torch.full_like(ids, batching.IGNORE)
    assert sft.shared_prefix_len(ids, att, labels) == 5
    labels[:, 2] = ids[:, 2]
    assert sft.shared_prefix_len(ids, att, labels) == 0
    assert sft.shared_prefix_len(ids[:1], att[:1], labels[:1]) == 0  # a single row shares nothing

@pytest.mark.slow
def test_compiled_sft_steps_equal_eager_steps(tokenizer, demos, tasks, signatures):
    """torch.compile (adapt.sft.compile) trains the module itself and gives the same steps as eager PyTorch (fp32, up
    to the fused kernels' rounding), over batches of two different lengths (the second runs the dynamic graph)."""
    batch = _batch(tokenizer, demos, tasks, signatures)
    short = {k: v[:, :int(batch["attention_mask"].sum(1).min())] for k, v in batch.items()}
    runs = []
    for compile in (False, True):
        model = build_policy(TINY, tokenizer)  # TINY's seed: the same weights both times
        res = sft.train_lm(model, iter([batch, short, batch]), steps=3, lr=1e-3, compile=compile)
        runs.append((res.losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (eager_losses, eager_w), (comp_losses, comp_w) = runs
    assert comp_losses == pytest.approx(eager_losses, rel=1e-4)
    moved = 0
    for n, w in eager_w.items():
        assert torch.allclose(comp_w[n], w, atol=1e-5, rtol=1e-4), n
        moved += not torch.equal(w, build_policy(TINY, tokenizer).state_dict()[n])
    assert moved == len(eager_w)  # every weight trained, in both


def test_compiled_sft_runs_under_deterministic_algorithms_and_restores_the_setting(tokenizer, demos, tasks,
                                                                                  monkeypatch, signatures):
    """Inductor's CPU kernels are not reproducible run to run by default (measured: two processes, the same weights
    and batches, different losses from the first steps; with deterministic algorithms, bit-identical), so the compiled
    loop runs under ``torch.use_deterministic_algorithms(True)`` and puts the previous setting back afterwards; the
    eager loop is left alone."""
    seen = []

    def fake_compile(model, **kwargs):  # the compiled forward, observed: is determinism on while it runs?
        def forward(**inputs):
            seen.append(torch.are_deterministic_algorithms_enabled())
            return model(**inputs)
        return forward

    monkeypatch.setattr(sft.torch, "compile", fake_compile)
    batch = _batch(tokenizer, demos, tasks, signatures)
    assert not torch.are_deterministic_algorithms_enabled()
    sft.train_lm(build_policy(TINY, tokenizer), iter([batch, batch]), steps=2, lr=1e-3, compile=True)
    assert seen == [True, True] and not torch.are_deterministic_algorithms_enabled()
    seen.clear()
    hooked = build_policy(TINY, tokenizer)
    hooked.register_forward_pre_hook(lambda m, a: seen.append(torch.are_deterministic_algorithms_enabled()))
    sft.train_lm(hooked, iter([batch]), steps=1, lr=1e-3, compile=False)
    assert seen == [False]


@pytest.mark.parametrize("kind", ["lora", "bottleneck", "none"])
def test_a_few_adaptation_steps_change_every_trainable_parameter_and_lower_the_loss(kind, tokenizer, demos, tasks, signatures):
    model = build_policy(TINY, tokenizer)
    cfg = AdapterConfig(kind=kind, lora_r=4, lora_alpha=8, bottleneck_dim=8)
    wrapped = adapters.apply_adapter(model, cfg)
    trainable = {n: p.detach().clone() for n, p in wrapped.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in wrapped.named_parameters() if not p.requires_grad}
    assert trainable
    if kind != "none":
        assert frozen and adapters.trainable_summary(wrapped)["trainable_fraction"] < 0.5
    batch = _batch(tokenizer, demos, tasks, signatures)
    before = sft.masked_lm_loss(wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                batch["labels"])[0].item()
    res = sft.train_lm(wrapped, iter([batch] * 12), steps=12, lr=1e-2)
    after = sft.masked_lm_loss(wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                               batch["labels"])[0].item()
    assert after < before - 0.1, (before, after, res.losses)
    params = dict(wrapped.named_parameters())
    unchanged = [n for n, p in trainable.items() if torch.equal(params[n].detach(), p)]
    assert not unchanged, f"trainable parameters that did not change: {unchanged}"
    moved = [n for n, p in frozen.items() if not torch.equal(params[n].detach(), p)]
    assert not moved, f"frozen parameters that changed: {moved}"


def test_training_stops_when_the_stop_check_says_so(tokenizer, demos, tasks, signatures):
    """Pre-training ends at the first check that reaches `adapt.pretrain.copy_target` (the check sees the model)."""
    model = build_policy(TINY, tokenizer)
    batch = _batch(tokenizer, demos, tasks, signatures, n=4)
    checks = []

    def stop(step):
        checks.append((step, model.training))
        return step >= 4

    res = sft.train_lm(model, iter([batch] * 10), steps=10, lr=1e-3, stop=stop, stop_every=2)
    assert [s for s, _ in checks] == [2, 4] and res.steps == len(res.losses) == 4
    never = sft.train_lm(model, iter([batch] * 5), steps=5, lr=1e-3, stop=lambda s: False, stop_every=2)
    assert never.steps == 5


def test_copy_accuracy_counts_only_whole_copies(tokenizer):
    """A model that gets the first token of a copy right but not the rest scores 0 (exact copy), unlike one that
    predicts every token."""

    class Oracle(torch.nn.Module):
        def __init__(self, wrong_after_first: bool):
            super().__init__()
            self.wrong = wrong_after_first
            self.training = False

        def forward(self, input_ids):
            ids = input_ids[0]
            logits = torch.zeros(1, len(ids), len(tokenizer))
            for t in range(len(ids) - 1):  # predict the true next token (teacher forcing makes this an oracle)
                logits[0, t, ids[t + 1]] = 1.0
            if self.wrong:
                logits[0, -2, :] = 0.0
                logits[0, -2, (ids[-1] + 1) % len(tokenizer)] = 1.0
            return type("Out", (), {"logits": logits})()

    texts = ['Item 0: \'Polar Kettle\'.\n{"item": 0, "name": "Polar Kettle"}']
    assert drills.copy_accuracy(Oracle(False), tokenizer, texts) == 1.0
    assert drills.copy_accuracy(Oracle(True), tokenizer, texts) == 0.0


@pytest.mark.parametrize("kind", ["lora", "bottleneck"])
def test_adapted_model_saves_and_loads_with_load_policy_to_the_same_outputs(kind, tmp_path, tokenizer, demos, tasks, signatures):
    model = build_policy(TINY, tokenizer)
    wrapped = adapters.apply_adapter(model, AdapterConfig(kind=kind, lora_r=4, lora_alpha=8, bottleneck_dim=8))
    batch = _batch(tokenizer, demos, tasks, signatures, n=4)
    sft.train_lm(wrapped, iter([batch] * 3), steps=3, lr=1e-2)
    with torch.no_grad():
        want = wrapped(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    final = adapters.finalize(wrapped)
    assert not any("lora" in n for n, _ in final.named_parameters())  # LoRA merged away
    save_policy(final, tokenizer, tmp_path / "adapted", {"phase": "test"})
    loaded, tok2, meta = load_policy(tmp_path / "adapted")
    assert meta["phase"] == "test" and len(tok2) == len(tokenizer)
    assert type(loaded).__name__ == ("LlamaForCausalLM" if kind == "lora" else "LlamaBottleneckForCausalLM")
    with torch.no_grad():
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_bottleneck_starts_as_the_identity_and_refuses_a_too_wide_bottleneck(tokenizer):
    model = build_policy(TINY, tokenizer)
    ids = torch.tensor([encode_context(tokenizer, "What is the price of 'X'?")])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = adapters.to_bottleneck(model, 4)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(AgentRLError, match="bottleneck_dim"):
        adapters.to_bottleneck(model, TINY.d_model)


def test_auto_adapter_is_full_fine_tuning_for_the_builtin_base_and_lora_otherwise():
    assert adapters.resolve_kind("auto", "builtin") == "none"
    assert adapters.resolve_kind("auto", "models/some-pretrained-llm") == "lora"
    assert adapters.resolve_kind("bottleneck", "builtin") == "bottleneck"
    with pytest.raises(AgentRLError, match="resolve 'auto'"):
        adapters.apply_adapter(torch.nn.Linear(2, 2), AdapterConfig(kind="auto"))


def test_lora_starts_from_the_same_adapter_whatever_the_process_drew_before(tokenizer):
    """LoRA's initial A matrices come from a seeded generator, not from torch's global state (which earlier work in
    the same process, such as an earlier adaptation, has moved)."""
    adapters_seen = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        wrapped = adapters.apply_adapter(build_policy(TINY, tokenizer), AdapterConfig(kind="lora", lora_r=4))
        adapters_seen.append({k: v.clone() for k, v in wrapped.state_dict().items() if "lora_A" in k})
    assert adapters_seen[0] and adapters_seen[0].keys() == adapters_seen[1].keys()
    assert all(torch.equal(adapters_seen[0][k], adapters_seen[1][k]) for k in adapters_seen[0])


def test_lora_on_missing_modules_and_unknown_train_also_are_refused(tokenizer):
    with pytest.raises(AgentRLError, match="lora_target_modules"):
        adapters.apply_adapter(build_policy(TINY, tokenizer), AdapterConfig(kind="lora", lora_target_modules=["c_attn"]))
    with pytest.raises(AgentRLError, match="train_also"):
        adapters.apply_adapter(build_policy(TINY, tokenizer), AdapterConfig(kind="lora", train_also=["no_such_module"]))


# --------------------------------------------------------------------------------------------- capability and gate


def test_capability_gate_fails_with_a_report_on_a_bad_model(data_dir, tokenizer, tasks):
    model = build_policy(TINY, tokenizer)  # untrained: writes gibberish
    runtime = ShopWorld.load(data_dir / "env")
    try:
        metrics, episodes = capability.evaluate_capabilities(
            model, tokenizer, runtime, tasks["validation"][:6], EnvConfig(), RolloutConfig(batch_size=8, max_new_tokens=16),
            CapabilityConfig(sampled_per_task=2))
    finally:
        runtime.close()
    assert metrics["eval/greedy/success"] == 0.0 and metrics["eval/sampled/episodes"] == 12
    assert set(metrics) <= set(capability.metric_keys())
    gate = GateConfig().min
    with pytest.raises(capability.CapabilityGateError) as err:
        capability.enforce_gate(metrics, gate)
    text = str(err.value)
    assert "fell short" in text and all(k in text for k in gate) and "FAIL" in text
    assert {k for k, _, _ in err.value.shortfalls} == set(gate)


def test_episode_scores_follow_the_plan(data_dir, tasks):
    """The expert agrees with its plan everywhere; a wrong first call is caught by tool and parameter accuracy."""
    from pipeline.envs.shop.expert import ExpertPolicy
    from pipeline.policy.episodes import run_episode

    runtime = ShopWorld.load(data_dir / "env")
    try:
        env = AgentEnv(world=runtime, tasks=tasks["validation"], config=EnvConfig())
        for task in tasks["validation"][:8]:
            rec = run_episode(env, ExpertPolicy(), task, seed=0)
            reference = runtime.reference_calls(task)
            assert [tool for tool, _ in reference] == [step["tool"] for step in task.plan]
            s = capability.episode_scores(rec, reference, runtime.same_answer)
            assert s["tool_first"] and all(s["tool_steps"]) and all(s["params"]) and s["param_first"]
            bad = dict(rec, calls=[dict(rec["calls"][0], params={"name": "nothing", "field": "price"})] + rec["calls"][1:])
            s2 = capability.episode_scores(bad, reference, runtime.same_answer)
            assert s2["tool_first"] and not s2["param_first"]
        env.close()
    finally:
        runtime.close()


def test_gate_with_an_unknown_metric_is_refused_before_training():
    with pytest.raises(AgentRLError, match="did you mean 'eval/greedy/success_L4'"):
        capability.check_gate_keys({"eval/greedy/sucess_L4": 0.5})


# ------------------------------------------------------------------------------------------------------ the phase


@pytest.mark.slow
def test_phase_publishes_a_loadable_model_and_metrics(good_run):
    model, tok, meta = load_policy(good_run / "models" / "adapted")
    assert meta["phase"] == "adapt" and meta["adapter"] == "lora" and meta["data_version"]
    written = json.loads((good_run / "metrics" / "adapt.json").read_text())
    assert written["per_level"].keys() == {"1", "2", "3", "4"}
    assert written["baselines"]["expert"]["success"] == 1.0
    assert written["sft"]["loss_curve"] and written["pretrain"]["steps"] == 3
    assert written["pretrain"]["drills"] > 0 and 0 <= written["pretrain"]["copy_accuracy"] <= 1
    assert "eval/recovery/success_after_error" in written["capability"]
    assert written["gate"] == {"enabled": False, "passed": None, "min": GateConfig().min, "shortfalls": []}
    peaks = written["peak_rss_mib"]  # high-water marks after each part: positive and never falling
    assert set(peaks) == {"pretrain", "sft", "evaluate"} and 0 < peaks["pretrain"] <= peaks["sft"] <= peaks["evaluate"]


@pytest.mark.slow
def test_phase_reports_learnability_of_its_greedy_episodes(good_run):
    from pipeline.policy.learnability_render import flat_metrics, render

    written = json.loads((good_run / "metrics" / "adapt.json").read_text())
    learn, cap = written["learnability"], written["capability"]
    n = cap["eval/greedy/episodes"]
    assert learn["episodes"] == n and learn["success"] == cap["eval/greedy/success"]
    assert learn["actions"]["n"] == round(cap["eval/greedy/mean_tool_calls"] * n)  # every greedy action, once
    assert learn["copy"]["source"] == {"reference_calls": n}  # the shop has reference calls for every task
    assert learn["limits"] == {"max_new_tokens": 24, "max_action_chars": EnvConfig().max_action_chars}
    assert sum(t["calls"] for t in learn["tools"].values()) + learn["actions"]["unknown_tool"] <= learn["actions"]["n"]
    assert sum(g["episodes"] for g in learn["level_figures"].values()) == n
    assert sum(g["demos"] for g in learn["family_figures"].values()) == written["sft"]["demos"]
    assert flat_metrics(learn)["learnability/episodes"] == n and render(learn).count("\n") > 5


@pytest.fixture(scope="module")
def good_run(data_dir, tmp_path_factory) -> Path:
    """One good run of the phase (models/adapted and metrics/adapt.json), made once per module."""
    out = tmp_path_factory.mktemp("good")
    # SFT compiled, as on the default (the other tiny runs stay eager: compiling costs more than their few steps)
    run_phase(data_dir, out, tiny_adapt_config(
        pretrain=PretrainConfig(steps=3, batch_size=8, warmup_steps=1, max_len=64, copy_drills=50, subprocess=True),
        sft=SFTConfig(steps=4, batch_size=8, warmup_steps=1, log_every=2, compile=True, select_every=0)))
    return out


@pytest.mark.slow
def test_pretraining_in_a_child_process_gives_the_same_weights(data_dir, tmp_path):
    """adapt.pretrain.subprocess hands back the weights and the batch generator's state: SFT goes on from the same
    point, so the published weights are bit-identical to pre-training in the phase's own process."""
    figures = {}
    for child in (False, True):
        cfg = tiny_adapt_config(pretrain=PretrainConfig(steps=6, batch_size=8, warmup_steps=1, max_len=64,
                                                        copy_drills=50, check_every=3, subprocess=child))
        figures[child] = run_phase(data_dir, tmp_path / str(child), cfg)
    weights = {child: load_policy(tmp_path / str(child) / "models" / "adapted")[0].state_dict() for child in figures}
    assert weights[True].keys() == weights[False].keys()
    assert all(torch.equal(weights[True][k], weights[False][k]) for k in weights[True])
    timing = {"seconds", "tokens_per_s"}
    for part in ("pretrain", "sft"):
        assert ({k: v for k, v in figures[True][part].items() if k not in timing}
                == {k: v for k, v in figures[False][part].items() if k not in timing}), part
    assert figures[True]["capability"] == figures[False]["capability"]
    assert figures[True]["pretrain"]["copy_curve"] and figures[True]["pretrain"]["steps"] == 6


@pytest.mark.slow
def test_the_phase_run_twice_publishes_byte_identical_models(data_dir, tmp_path):
    """Two runs of the phase on the same inputs, at different times and into different folders, publish the same
    bytes: DVC gives a reproduced models/adapted the same hash (nothing run-specific is saved with the weights)."""
    for run in ("one", "two"):
        run_phase(data_dir, tmp_path / run)
    assert tree_digest(tmp_path / "one" / "models" / "adapted") == tree_digest(tmp_path / "two" / "models" / "adapted")


@pytest.fixture
def published(good_run, tmp_path):
    """A copy of the good run's outputs in this test's folder; returns their digests."""
    for name in ("models", "metrics"):
        shutil.copytree(good_run / name, tmp_path / name)
    return tree_digest(tmp_path / "models"), (tmp_path / "metrics" / "adapt.json").read_bytes()


def _untouched(tmp_path, published):
    assert tree_digest(tmp_path / "models") == published[0]
    assert (tmp_path / "metrics" / "adapt.json").read_bytes() == published[1]
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["adapted"]  # no temporary folders left


@pytest.mark.slow
def test_a_model_path_that_does_not_exist_is_refused(data_dir, tmp_path, published):
    with pytest.raises(AgentRLError, match="no-such-model"):
        run_phase(data_dir, tmp_path, model_cfg=TINY.model_copy(update={"base": str(tmp_path / "no-such-model")}))
    _untouched(tmp_path, published)


@pytest.mark.slow
def test_a_tokenizer_that_does_not_match_the_model_is_refused(data_dir, tmp_path, published, tokenizer, signatures):
    base = tmp_path / "base"
    shutil.copytree(tmp_path / "models" / "adapted", base)
    other = train_tokenizer(corpus_texts(data_dir, signatures), 330)  # a different vocabulary size
    assert len(other) != len(tokenizer)
    other.save_pretrained(base)
    with pytest.raises(AgentRLError, match="tokenizer has .* tokens but the model's embedding has"):
        run_phase(data_dir, tmp_path, model_cfg=TINY.model_copy(update={"base": str(base)}))
    _untouched(tmp_path, published)


@pytest.mark.slow
def test_compiled_sft_without_a_cxx_compiler_is_refused_before_training(data_dir, tmp_path, published, monkeypatch):
    """adapt.sft.compile needs a C++ compiler (Inductor's CPU kernels): without one the phase stops at once, naming
    the key and the way out, and the published model stays as it was."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cfg = tiny_adapt_config(sft=SFTConfig(steps=4, batch_size=8, warmup_steps=1, log_every=2, compile=True,
                                          select_every=0))
    with pytest.raises(AgentRLError, match=r"adapt\.sft\.compile is true, but no C\+\+ compiler .*compile: false"):
        run_phase(data_dir, tmp_path, cfg)
    _untouched(tmp_path, published)


@pytest.mark.slow
def test_a_demo_file_that_breaks_the_schema_is_refused_by_the_phase(data_dir, tmp_path, published):
    bad = tmp_path / "bad-data"
    shutil.copytree(data_dir, bad)
    lines = (bad / "demos" / "train.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["flaw"] = "sloppy"
    rec["n_calls"] = -1
    (bad / "demos" / "train.jsonl").write_text("\n".join([json.dumps(rec)] + lines[1:]) + "\n")
    with pytest.raises(AgentRLError, match="breaks the schema"):
        run_phase(data_dir, tmp_path, data=bad)
    _untouched(tmp_path, published)


@pytest.mark.slow
def test_a_model_below_the_gate_is_not_published(data_dir, tmp_path, published, capsys):
    cfg = tiny_adapt_config(gate=GateConfig(enabled=True, min={"eval/greedy/success_L1": 0.99}))
    with pytest.raises(capability.CapabilityGateError, match="eval/greedy/success_L1"):
        run_phase(data_dir, tmp_path, cfg=cfg)
    _untouched(tmp_path, published)
    assert "adapt: learnability on the validation split (greedy)" in capsys.readouterr().out  # why, before it stops


@pytest.mark.slow
def test_starting_from_a_saved_policy_continues_from_its_weights(data_dir, tmp_path, published):
    """model.base may name a policy folder (e.g. a previous adapted model): loaded with its own tokenizer."""
    base = tmp_path / "base"
    shutil.copytree(tmp_path / "models" / "adapted", base)
    metrics = run_phase(data_dir, tmp_path / "second", cfg=tiny_adapt_config(pretrain=PretrainConfig(steps=0)),
                        model_cfg=TINY.model_copy(update={"base": str(base)}))
    assert metrics["base"]["source"] == f"policy:{base}" and metrics["pretrain"] is None


# ------------------------------------------------------------------------------------------ checkpoint selection


@pytest.mark.slow
def test_checkpoint_selection_publishes_the_best_scored_weights_and_stops_on_patience(data_dir, tmp_path, monkeypatch):
    """Scores are scripted (1st check best): the published weights are those the model had at that check, every
    later check is recorded, and patience 2 ends SFT two checks after the best."""
    import pipeline.adapt.main as phase

    scores = iter([0.5, 0.4, 0.5, 0.9])  # steps 2, 4, 6 (stop), the 4th must never be asked for
    snapshots = {}

    def scripted(model, tokenizer, runtime, tasks, env_cfg, rollout_cfg, seed=0):
        assert len(tasks) == 5 and all(t.split == "validation" for t in tasks)
        s = next(scores)
        snapshots[len(snapshots)] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"greedy": s, "sampled": 0.0, "per_level": {"1": [s, 0.0]}, "sampled_nll": 1.0}

    monkeypatch.setattr(capability, "checkpoint_figures", scripted)
    cfg = tiny_adapt_config(adapter=AdapterConfig(kind="none"),
                            sft=SFTConfig(steps=10, batch_size=8, warmup_steps=1, log_every=2, compile=False,
                                          select_every=2, select_from=2, select_tasks=5, select_patience=2))
    metrics = run_phase(data_dir, tmp_path, cfg)
    sel = metrics["sft"]["selection"]
    assert [c["step"] for c in sel["curve"]] == [2, 4, 6] and sel["stopped_early"] and sel["last_step"] == 6
    assert sel["selected_step"] == 2 and sel["score"] == 0.5  # the tie at step 6 keeps the earlier checkpoint
    assert metrics["sft"]["steps"] == 6 and metrics["seconds"]["select"] >= 0
    model, _, meta = load_policy(tmp_path / "models" / "adapted")
    assert meta["step"] == metrics["pretrain"]["steps"] + 2
    published = model.state_dict()
    assert all(torch.equal(published[k].float(), v.float()) for k, v in snapshots[0].items())
    assert not all(torch.equal(published[k].float(), v.float()) for k, v in snapshots[2].items())


@pytest.mark.slow
def test_checkpoint_selection_scores_reproduce_on_the_published_model(data_dir, tmp_path):
    """Real figures (no script): the selected score is what the published model scores again on the same tasks."""
    cfg = tiny_adapt_config(adapter=AdapterConfig(kind="none"),
                            sft=SFTConfig(steps=6, batch_size=8, warmup_steps=1, log_every=2, compile=False,
                                          select_every=3, select_from=3, select_tasks=8, select_mode="sampled"))
    metrics = run_phase(data_dir, tmp_path, cfg)
    sel = metrics["sft"]["selection"]
    assert [c["step"] for c in sel["curve"]] == [3, 6] and not sel["stopped_early"]
    for c in sel["curve"]:
        assert 0 <= c["greedy"] <= 1 and 0 <= c["sampled"] <= 1 and c["sampled_nll"] > 0
    assert sel["score"] == max(c["sampled"] for c in sel["curve"])
    model, tok, _ = load_policy(tmp_path / "models" / "adapted")
    validation = [Task.from_dict(json.loads(l)) for l in
                  (data_dir / "tasks" / "validation.jsonl").read_text().splitlines()][:8]
    runtime = ShopWorld.load(data_dir / "env")
    try:
        again = capability.checkpoint_figures(model, tok, runtime, validation, EnvConfig(),
                                              RolloutConfig(batch_size=8, max_new_tokens=24))
    finally:
        runtime.close()
    chosen = next(c for c in sel["curve"] if c["step"] == sel["selected_step"])
    assert round(again["sampled"], 4) == chosen["sampled"] and round(again["greedy"], 4) == chosen["greedy"]


def test_selection_that_would_score_nothing_before_the_last_step_is_refused():
    with pytest.raises(ValueError, match="select_from=2000 is after the last step"):
        SFTConfig(steps=1000, select_every=100, select_from=2000)
    assert SFTConfig(steps=1000, select_every=0, select_from=2000).select_every == 0  # off: not checked


@pytest.mark.slow
def test_checkpoint_selection_with_lora_scores_the_unmerged_model_and_publishes_a_merged_one(data_dir, tmp_path):
    """The checks play the peft-wrapped model being trained (with LoRA dropout, off by default); the published model
    is the merged selected one."""
    cfg = tiny_adapt_config(adapter=AdapterConfig(kind="lora", lora_r=4, lora_alpha=8, lora_dropout=0.1),
                            sft=SFTConfig(steps=4, batch_size=8, warmup_steps=1, log_every=2, compile=False,
                                          select_every=2, select_from=2, select_tasks=4))
    metrics = run_phase(data_dir, tmp_path, cfg)
    sel = metrics["sft"]["selection"]
    assert metrics["adapter"]["kind"] == "lora" and [c["step"] for c in sel["curve"]] == [2, 4]
    assert sel["selected_step"] in (2, 4) and all(c["sampled_nll"] > 0 for c in sel["curve"])
    model, _, meta = load_policy(tmp_path / "models" / "adapted")
    assert meta["adapter"] == "lora" and not any("lora" in n for n, _ in model.named_parameters())


def test_every_option_that_is_off_by_default_runs_in_a_real_adapt(data_dir, tmp_path, tasks, capsys):
    """One tiny run with every adapt, model and rollout option that is off by default turned on (each elsewhere only in
    unit tests, if at all): torch threads, the document corpus and the training questions in pre-training, the
    bottleneck adapter with base parameters trained next to it, weight decay, micro-batches, grouped-query
    attention, bf16 rollouts on their own thread count with top-p sampling, decoding under the tools' schemas (whose
    grammar first checks every demonstrated action), a time budget that leaves every step in."""
    before = torch.get_num_threads()
    corpus = (data_dir / "env" / "corpus.jsonl").read_text().splitlines()
    cfg = tiny_adapt_config(
        threads=1, time_budget_s=3600.0,
        pretrain=PretrainConfig(steps=3, batch_size=8, warmup_steps=1, max_len=64, copy_drills=50, word_drills=20,
                                subprocess=False, include_documents=True, include_questions=True),
        adapter=AdapterConfig(kind="bottleneck", bottleneck_dim=8, train_also=["norm"]),
        sft=SFTConfig(steps=4, batch_size=8, warmup_steps=1, log_every=2, compile=False, select_every=0,
                      micro_batches=2, weight_decay=0.1))
    try:
        metrics = run_phase(data_dir, tmp_path, cfg, model_cfg=TINY.model_copy(update={"n_kv_heads": 1}),
                            rollout_cfg=RolloutConfig(batch_size=8, max_new_tokens=24, dtype="bf16", num_threads=1,
                                                      top_p=0.9, constrain="schema"))
        assert torch.get_num_threads() == 1  # adapt.threads
    finally:
        torch.set_num_threads(before)
    assert metrics["pretrain"]["domain_texts"] == len([l for l in corpus if l.strip()]) + len(tasks["train"])
    assert metrics["pretrain"]["drills"] > 50 and metrics["sft"]["steps"] == 4
    # SFT planned once, at the end of its probe steps; pre-training keeps its schedule (its steps are a maximum)
    for part, steps, plans in (("pretrain", 3, []), ("sft", 4, [[4, 4]])):
        b = metrics[part]["budget"]
        assert b["planned_steps"] == b["configured_steps"] == steps and b["plans"] == plans, part
        assert not b["out_of_time"] and 0 < b["used_s"] < b["seconds"]
    assert metrics["pretrain"]["budget"]["seconds"] == 1200.0  # its share: a third of adapt's budget
    assert metrics["adapter"]["kind"] == "bottleneck" and metrics["eval"]["top_p"] == 0.9
    n_actions = sum(len(d["steps"]) for d in read_jsonl(data_dir / "demos" / "train.jsonl", "demos"))
    assert f"rollout.constrain: schema accepts all {n_actions} demonstrated actions" in capsys.readouterr().out
    model, _, meta = adapters.load_adapted(tmp_path / "models" / "adapted")
    assert meta["adapter"] == "bottleneck" and model.config.num_key_value_heads == 1
    # SFT trained the adapters and, next to them, the final norm (train_also), not the rest of the base
    adapter_size = sum(p.numel() for n, p in model.named_parameters() if ".mlp.adapter." in n)
    assert adapter_size > 0
    assert metrics["adapter"]["trainable"] == adapter_size + model.model.norm.weight.numel()
