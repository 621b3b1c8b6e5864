"""The policy's tokenizer and model: protocol markers, digits, quoted names, hostile text; build, save, load, errors."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.envs.runner import AgentEnv
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.expert import ExpertPolicy
from pipeline.envs.prompt import render_header
from pipeline.envs.protocol import CALL_CLOSE, CALL_OPEN, OBS_CLOSE, OBS_OPEN, format_action
from pipeline.envs.shop.tasks import generate_tasks
from pipeline.core.errors import AgentRLError
from pipeline.policy.episodes import run_episode
from pipeline.policy.config import ModelConfig
from pipeline.policy.model import (autocast_context, build_policy, dtype_notice, load_policy, n_parameters,
                                   save_policy, supports_bf16)
from pipeline.policy.tokenizer import (SPECIAL_TOKENS, corpus_texts, encode_context, encode_continuation, encode_turns,
                                       marker_ids, train_tokenizer)

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_positions=512, seed=0)


def training_texts(runtime: ShopWorld, n_tasks: int = 60) -> list[str]:
    tasks = generate_tasks(runtime.world, "train", n_tasks, {1: 1, 2: 1, 3: 1, 4: 1}, 0, runtime.solve)
    texts = [f"{d['title']}\n{d['text']}" for d in runtime.world.corpus]
    texts += [render_header(t.question, signatures(runtime)) for t in tasks]
    env = AgentEnv(world=runtime, tasks=tasks)
    for i, t in enumerate(tasks):
        texts += [s["action"] + s["observation"] for s in run_episode(env, ExpertPolicy(), t, i)["steps"]]
    return texts


def signatures(world) -> list[str]:
    return [s.signature() for s in world.tools()]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def runtime():
    rt = ShopWorld.default()
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def tokenizer(runtime):
    return train_tokenizer(training_texts(runtime), vocab_size=600)


# ---------------------------------------------------------------------------------------------------------- tokenizer
def test_special_tokens_are_single_ids_and_the_tokenizer_pads_left(tokenizer):
    ids = marker_ids(tokenizer)
    assert [ids[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    text = f'{CALL_OPEN}lookup {{"name": "x"}}{CALL_CLOSE}{OBS_OPEN}12{OBS_CLOSE}\n'
    toks = tokenizer.convert_ids_to_tokens(encode_continuation(tokenizer, text))
    for marker in (CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE):
        assert toks.count(marker) == 1
    assert tokenizer.pad_token == "<pad>" and tokenizer.padding_side == "left"
    assert encode_context(tokenizer, "hi")[0] == ids["<bos>"]
    assert ids["<bos>"] not in encode_continuation(tokenizer, "hi")


def test_digits_are_split_one_per_token(tokenizer):
    toks = tokenizer.convert_ids_to_tokens(encode_continuation(tokenizer, "<obs>90417.25</obs>"))
    assert [t for t in toks if any(c.isdigit() for c in t)] == list("9041725")


def test_quoted_names_tokenize_alike_in_questions_calls_and_results(runtime, tokenizer):
    for product in runtime.world.products[:40]:
        name = product["name"]
        name_ids = encode_continuation(tokenizer, name)
        question = encode_continuation(tokenizer, f"What is the price of '{name}'?")
        call = encode_continuation(tokenizer, format_action("lookup", {"name": name, "field": "price"}))
        for seq in (question, call):
            assert any(seq[i:i + len(name_ids)] == name_ids for i in range(len(seq))), name
    # frequent words were merged: a seen product name is two words of at most two tokens each and the space
    assert len(encode_continuation(tokenizer, runtime.world.products[0]["name"])) <= 5


def test_a_word_has_the_same_ids_after_a_space_and_after_a_quote(runtime, tokenizer):
    """What lets the policy copy a field word or a supplier's name from the question into a call (tokenizer docstring):
    `stock` in "the stock of" and in ``"field": "stock"``, a name in ``of "..."`` and in a search query."""
    for word in ("stock", "category", "supplier", "price"):
        question = encode_continuation(tokenizer, f"What is the {word} of 'X'?")
        call = encode_continuation(tokenizer, format_action("lookup", {"name": "X", "field": word}))
        word_ids = encode_continuation(tokenizer, word)
        for seq in (question, call):
            assert any(seq[i:i + len(word_ids)] == word_ids for i in range(len(seq))), word
    for supplier in runtime.world.suppliers[:20]:
        name_ids = encode_continuation(tokenizer, supplier["name"])
        query = encode_continuation(tokenizer, format_action("search", {"query": f"flagship product of {supplier['name']}"}))
        assert any(query[i:i + len(name_ids)] == name_ids for i in range(len(query))), supplier["name"]


def test_context_encodes_as_the_concatenation_of_its_turns(runtime, tokenizer):
    """What keeps the KV cache valid across turns: encode(before + action + obs) == encode(before) + ... ."""
    tasks = generate_tasks(runtime.world, "validation", 12, {1: 1, 2: 1, 3: 1, 4: 1}, 0, runtime.solve)
    env = AgentEnv(world=runtime, tasks=tasks)
    for i, t in enumerate(tasks):
        rec = run_episode(env, ExpertPolicy(), t, i)
        prompt = render_header(t.question, signatures(runtime))
        pairs = [(s["action"], s["observation"]) for s in rec["steps"]]
        ids, mask = encode_turns(tokenizer, prompt, pairs)
        assert ids == encode_context(tokenizer, prompt + "".join(a + o for a, o in pairs))
        assert tokenizer.decode([x for x, m in zip(ids, mask) if m]) == "".join(a for a, _ in pairs)


HOSTILE = ["", "\x00\x01\x7f", "naïve café ÆØÅ", "😀🧪\u200b\u202e", "\ud800 lone surrogate", "<call><call></obs>",
           "\t\n\r" * 5, "١٢٣ ٤", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢" * 20]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_text_encodes_and_round_trips(tokenizer, text):
    ids = encode_continuation(tokenizer, text)
    assert all(0 <= i < len(tokenizer) for i in ids)
    expected = text.encode("utf-8", "replace").decode("utf-8")
    assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80))
def test_any_text_encodes(tokenizer, text):
    ids = encode_context(tokenizer, text)
    assert ids[0] == marker_ids(tokenizer)["<bos>"] and max(ids) < len(tokenizer)


def test_corpus_texts_reads_only_training_data(tmp_path):
    for sub, name, rec in (("env", "corpus.jsonl", {"doc_id": "d", "title": "Doc", "text": "Alpha doc"}),
                           ("tasks", "train.jsonl", {"question": "TRAINQ 'Blue Lamp'?"}),
                           ("tasks", "validation.jsonl", {"question": "VALQ"}),
                           ("tasks", "test.jsonl", {"question": "TESTQ"}),
                           ("demos", "train.jsonl",
                            {"steps": [{"action": "<call>x</call>", "observation": "<obs>1</obs>\n"}]})):
        (tmp_path / sub).mkdir(exist_ok=True)
        (tmp_path / sub / name).write_text(json.dumps(rec) + "\n")
    text = "\n".join(corpus_texts(tmp_path, ["lookup(name, field)", "answer(value)"]))
    assert "TRAINQ" in text and "Alpha doc" in text and "<call>x</call><obs>1</obs>" in text
    assert "VALQ" not in text and "TESTQ" not in text
    assert "lookup(name, field)" in text  # each training question's header lists the tools
    (tmp_path / "demos" / "train.jsonl").unlink()
    with pytest.raises(AgentRLError, match="demos/train.jsonl"):
        list(corpus_texts(tmp_path, ["answer(value)"]))


def test_too_small_vocabulary_is_refused():
    with pytest.raises(AgentRLError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


# -------------------------------------------------------------------------------------------------------------- model
def test_builtin_default_size_and_seeded_init(tokenizer):
    model = build_policy(ModelConfig(), tokenizer)
    assert 2.5e6 < n_parameters(model) < 4.5e6  # the prototype's size: ~3M with a ~1k vocabulary
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tokenizer)
    state = torch.get_rng_state()
    a, b = build_policy(TINY, tokenizer), build_policy(TINY, tokenizer)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = build_policy(TINY.model_copy(update={"seed": 1}), tokenizer)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_config_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, n_heads=4)


def test_save_load_round_trip_gives_identical_logits_and_metadata(tokenizer, tmp_path):
    model = build_policy(TINY, tokenizer)
    path = save_policy(model, tokenizer, tmp_path / "policy", {"step": 7, "data_version": {"x": "abc"}})
    loaded, tok2, meta = load_policy(path)
    ids = torch.tensor([encode_context(tokenizer, "What is the price of 'Blue Lamp'? <call>lookup")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert tok2.encode("x <call>1</call>") == tokenizer.encode("x <call>1</call>") and tok2.padding_side == "left"
    assert meta["step"] == 7 and meta["data_version"] == {"x": "abc"}
    assert {"n_parameters", "hf_config", "vocab_size"} <= set(meta)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def _files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_saving_the_same_model_twice_gives_byte_identical_folders(tokenizer, tmp_path, monkeypatch):
    """What DVC hashes must not depend on when, where or from which checkout a policy was saved: a second save a
    year later, from a directory outside any git repository, and saves of one policy loaded from two different
    folders all write the same bytes; policy.json keeps its keys sorted and holds nothing run-specific."""
    import shutil
    import time

    from pipeline.policy.model import RUN_SPECIFIC

    model = build_policy(TINY, tokenizer)
    meta = {"phase": "train", "step": 3, "data_version": {"data/x": "abc"}}
    first = save_policy(model, tokenizer, tmp_path / "first", meta)
    real_gmtime = time.gmtime
    monkeypatch.setattr(time, "gmtime", lambda *a: real_gmtime(a[0] if a else time.time() + 365 * 86400))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not inside a git repository: no commit to read
    second = save_policy(model, tokenizer, tmp_path / "second", dict(meta))
    assert _files(first) == _files(second)
    saved = (first / "policy.json").read_text()
    assert saved == json.dumps(json.loads(saved), indent=2, sort_keys=True) + "\n"
    assert not RUN_SPECIFIC & set(json.loads(saved)) and "_name_or_path" not in json.loads(saved)["hf_config"]

    # the same policy loaded from two folders (a workspace and a DVC checkout elsewhere) saves alike
    resaved = []
    for where in ("a", "b"):
        shutil.copytree(first, tmp_path / where / "policy")
        loaded, tok, _ = load_policy(tmp_path / where / "policy")
        resaved.append(_files(save_policy(loaded, tok, tmp_path / where / "out", dict(meta))))
    assert resaved[0] == resaved[1]

    # the meta of a policy saved before (train passes on its parent's) loses its run-specific keys on the way
    third = save_policy(model, tokenizer, tmp_path / "third", {**meta, "saved_at": "2026-01-01T00:00:00Z",
                                                               "git_commit": "0" * 40})
    assert _files(third) == _files(first)


def test_a_bf16_model_is_stored_in_fp32_and_left_as_it_was(tokenizer, tmp_path):
    """What a bf16 engine trains (DeepSpeed on a GPU) is saved in fp32, exactly, so the artefact does not depend on
    where training ran; the live model keeps its dtype."""
    from safetensors import safe_open

    model = build_policy(TINY, tokenizer).to(torch.bfloat16)
    path = save_policy(model, tokenizer, tmp_path / "policy")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert stored and {t.dtype for t in stored.values()} == {torch.float32}
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    live = model.state_dict()
    for k, t in stored.items():
        assert torch.equal(t, live[k].float())
    assert next(model.parameters()).dtype == torch.bfloat16
    loaded, _, _ = load_policy(path)
    assert next(loaded.parameters()).dtype == torch.float32
    for k, t in loaded.state_dict().items():
        assert torch.equal(t, live[k].float()), k


def test_missing_path_and_non_model_folders_are_clear_errors(tmp_path):
    with pytest.raises(AgentRLError, match="does not exist"):
        load_policy(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AgentRLError, match="not a model directory"):
        load_policy(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(AgentRLError, match="not a directory"):
        load_policy(tmp_path / "file")


def test_corrupt_weights_are_a_clear_error(tokenizer, tmp_path):
    path = save_policy(build_policy(TINY, tokenizer), tokenizer, tmp_path / "policy")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AgentRLError, match="cannot load the model"):
        load_policy(path)


def test_tokenizer_that_does_not_fit_the_model_is_refused(runtime, tokenizer, tmp_path):
    model = build_policy(TINY, tokenizer)
    other = train_tokenizer(training_texts(runtime, 10), vocab_size=330)
    assert len(other) != len(tokenizer)
    with pytest.raises(AgentRLError, match="embedding"):
        save_policy(model, other, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    path = save_policy(model, tokenizer, tmp_path / "good")
    other.save_pretrained(path)  # someone swaps the tokenizer files
    with pytest.raises(AgentRLError, match="tokenizer has .* tokens but the model's embedding has"):
        load_policy(path)


class _FailingModel:
    """A model whose save writes part of its files and then fails (disk full, killed process...)."""

    def __init__(self, real):
        self.real, self.config = real, real.config

    def get_input_embeddings(self):
        return self.real.get_input_embeddings()

    def parameters(self):
        return self.real.parameters()

    def save_pretrained(self, path, **kw):
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")


def test_failed_save_leaves_the_previous_model_in_place(tokenizer, tmp_path):
    model = build_policy(TINY, tokenizer)
    path = save_policy(model, tokenizer, tmp_path / "policy", {"step": 1})
    with pytest.raises(OSError, match="disk full"):
        save_policy(_FailingModel(build_policy(TINY.model_copy(update={"seed": 5}), tokenizer)), tokenizer, path,
                    {"step": 2})
    loaded, _, meta = load_policy(path)
    assert meta["step"] == 1 and torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_local_directory_as_base_loads_its_weights(tokenizer, tmp_path):
    model = build_policy(TINY, tokenizer)
    path = save_policy(model, tokenizer, tmp_path / "base")
    again = build_policy(TINY.model_copy(update={"base": str(path)}), tokenizer)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    with pytest.raises(AgentRLError, match="cannot load it locally"):
        build_policy(TINY.model_copy(update={"base": str(tmp_path / "missing-model")}), tokenizer)


def test_autocast_context_follows_the_dtype():
    assert isinstance(supports_bf16(), bool)
    with autocast_context("fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast_context("bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with autocast_context(ModelConfig(dtype="auto")):
        assert torch.is_autocast_enabled("cpu") == supports_bf16()


def test_dtype_notice_names_the_fp32_fallback_of_auto(monkeypatch):
    import pipeline.policy.model as model_mod

    monkeypatch.setattr(model_mod, "supports_bf16", lambda device="cpu": False)
    notice = dtype_notice("auto")
    assert notice is not None and "fp32" in notice and "AVX512-BF16" in notice
    assert dtype_notice("fp32") is None and dtype_notice("bf16") is None  # chosen, not fallen back to
    monkeypatch.setattr(model_mod, "supports_bf16", lambda device="cpu": True)
    assert dtype_notice("auto") is None


LINUX_PROC = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs Linux /proc")


def _fragment_heap() -> tuple[list, list]:
    """About 400 MiB of tensors in glibc's heap, each followed by a small survivor, as variable-length batches leave
    it (see release_free_memory). Freeing a 16 MiB block first raises the mmap threshold, so the tensors use the heap."""
    big = torch.ones(16 * 2**20 // 4)
    del big
    keep, scratch = [], []
    for i in range(300):
        scratch.append(torch.ones(200_000 + 997 * i))
        keep.append(torch.ones(2048))
    return keep, scratch


@LINUX_PROC
def test_release_free_memory_hands_a_fragmented_heap_back_to_the_os():
    from pipeline.policy.model import release_free_memory, resident_mib

    keep, scratch = _fragment_heap()
    del scratch
    before = resident_mib()
    assert release_free_memory() is True  # glibc on this Linux
    after = resident_mib()
    assert after < before - 200, f"RSS {before:.0f} -> {after:.0f} MiB"  # about 400 MiB were freed
    assert sum(float(k.sum()) for k in keep) == 300 * 2048  # live tensors untouched


@LINUX_PROC
def test_heap_trimmer_trims_only_after_the_resident_size_grew_by_its_headroom():
    from pipeline.policy.model import HeapTrimmer

    lazy, eager = HeapTrimmer(headroom_mib=10**6), HeapTrimmer(headroom_mib=100)
    keep, scratch = _fragment_heap()
    assert lazy.maybe() is False and lazy.trims == 0  # grew, but not by its headroom
    del scratch
    assert eager.maybe() is True and eager.trims == 1
    assert eager.maybe() is False  # the limit moved to the trimmed size plus the headroom
    assert len(keep) == 300
