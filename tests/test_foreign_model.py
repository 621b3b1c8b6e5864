"""A foreign Hugging Face model as the policy: a tiny random Qwen2 with its own byte-level BPE tokenizer and a
tool-calling chat template (scripts/make_tiny_hf_model.py), built into a temporary folder.

Known answers for the template's rendering and the token deltas, the start-up check refusing templates that
rewrite earlier turns, the refusals of folders that lack what the pipeline needs, the built-in tokenizer's ids
unchanged, and (slow) the foreign model through every phase of a tiny project: build-env, adapt (LoRA), train,
evaluate, check-drift, deploy (int8) and serve (one request over loopback).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.core.errors import AgentRLError
from pipeline.policy.chat import ChatFormat, bound_tools, chat_format, context_messages
from pipeline.policy.config import ModelConfig, RolloutConfig
from pipeline.policy.model import build_policy, load_base_tokenizer, load_policy, save_policy
from pipeline.policy.tokenizer import (encode_action, encode_context, encode_continuation, encode_observation,
                                       encode_turns, marker_ids, train_tokenizer)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [  # OpenAI function shape, as an environment declares its tools
    {"type": "function", "function": {"name": "lookup", "description": "read one field of an entity",
                                      "parameters": {"type": "object", "properties": {
                                          "name": {"type": "string"}, "field": {"type": "string"}},
                                          "required": ["name", "field"]}}},
    {"type": "function", "function": {"name": "answer", "description": "give the final answer",
                                      "parameters": {"type": "object", "properties": {"value": {"type": "string"}},
                                                     "required": ["value"]}}},
]
SYSTEM = "You are an agent that can use tools. Available tools: lookup(name, field) answer(value)."
CONTEXT = SYSTEM + "\nTask: What is the price of 'Cedar Kettle'?\n"
A1, O1 = '<call>lookup {"name": "Cedar Kettle", "field": "price"}</call>', "<obs>19.5</obs>\n"
A2, O2 = '<call>answer {"value": "19.5"}</call>', "<obs>done</obs>\n"


def make_tiny_hf_model():
    spec = importlib.util.spec_from_file_location("make_tiny_hf_model", ROOT / "scripts" / "make_tiny_hf_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_hf_model()(tmp_path_factory.mktemp("tiny_qwen2") / "model",
                                texts=[json.dumps(t) for t in TOOLS] + [CONTEXT, A1, O1, A2, O2])


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_base_tokenizer(ModelConfig(base=str(tiny_dir), dtype="fp32"), tools=TOOLS)


def with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    return dst


# ------------------------------------------------------------------------------------------- the model folder itself
def test_the_folder_loads_with_auto_classes_offline_as_a_small_qwen2(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    raw = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000
    assert raw.chat_template and raw.eos_token == "<|im_end|>" and raw.bos_token is None
    assert model.get_input_embeddings().num_embeddings > len(raw)  # padded like released Qwen models: resize runs
    assert len(raw.encode("<call>", add_special_tokens=False)) > 1  # the markers are the pipeline's to add


def test_the_builder_is_deterministic(tiny_dir, tmp_path):
    again = make_tiny_hf_model()(tmp_path / "again", texts=[json.dumps(t) for t in TOOLS] + [CONTEXT, A1, O1, A2, O2])
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


# --------------------------------------------------------------------------------------------- template known answers
def test_the_context_is_read_as_a_conversation():
    msgs, pairs = context_messages(CONTEXT + A1 + O1, with_tools=True)
    assert msgs == [{"role": "system", "content": "You are an agent that can use tools."},
                    {"role": "user", "content": "Task: What is the price of 'Cedar Kettle'?"}]
    assert pairs == [(A1, O1)]
    assert context_messages(CONTEXT, with_tools=False)[0][0]["content"] == SYSTEM
    assert context_messages("Item 0: 'Acme'.\n{\"name\": \"Acme\"}", with_tools=True) is None  # a drill: plain text


def test_the_prompt_renders_tools_into_the_system_turn_and_ends_with_the_generation_prompt(tok):
    text = tok.decode(encode_context(tok, CONTEXT))
    tool_lines = "\n".join(json.dumps(t) for t in TOOLS)
    assert text == ("<|im_start|>system\nYou are an agent that can use tools.\n\n# Tools\n\nYou may call one or more "
                    "functions to assist with the user query.\n\nYou are provided with function signatures within "
                    f"<tools></tools> XML tags:\n<tools>\n{tool_lines}\n</tools><|im_end|>\n"
                    "<|im_start|>user\nTask: What is the price of 'Cedar Kettle'?<|im_end|>\n<|im_start|>assistant\n")


def test_actions_and_tool_results_are_the_templates_token_deltas(tok):
    assert tok.decode(encode_action(tok, A1)) == A1
    assert encode_action(tok, A1)[-1] == marker_ids(tok)["</call>"]
    assert tok.decode(encode_observation(tok, O1)) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n<obs>19.5</obs>"
                                                       "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    whole = encode_context(tok, CONTEXT + A1 + O1 + A2 + O2)
    built = (encode_context(tok, CONTEXT) + encode_action(tok, A1) + encode_observation(tok, O1)
             + encode_action(tok, A2) + encode_observation(tok, O2))
    assert whole == built
    messages = [{"role": "system", "content": "You are an agent that can use tools."},
                {"role": "user", "content": "Task: What is the price of 'Cedar Kettle'?"},
                {"role": "assistant", "content": A1}, {"role": "tool", "content": O1[:-1]},
                {"role": "assistant", "content": A2}, {"role": "tool", "content": O2[:-1]}]
    rendered = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert whole == tok.encode(rendered, add_special_tokens=False)  # what an inference server would feed
    ids, mask = encode_turns(tok, CONTEXT, [(A1, O1)])
    assert ids == encode_context(tok, CONTEXT + A1 + O1) and sum(mask) == len(encode_action(tok, A1))


def test_marker_ids_use_the_foreign_tokenizers_own_pad_and_eos(tok):
    ids = marker_ids(tok)
    assert ids["<bos>"] is None and ids["<eos>"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert ids["<pad>"] == tok.pad_token_id
    assert all(len(tok.encode(m, add_special_tokens=False)) == 1 for m in ("<call>", "</call>", "<obs>", "</obs>"))


# -------------------------------------------------------------------------------------------------- start-up check
COUNTING = ("{{- '<|im_start|>system\\n' + messages[0].content + ' (' + (messages | length | string) + ' messages)"
            "<|im_end|>\\n' }}{%- for m in messages[1:] %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
            "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
STRIPPING = ("{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'assistant' %}"
             "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
             "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 != ns.last %}"
             "{{- '<|im_start|>assistant\\n<|im_end|>\\n' }}{%- else %}"
             "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("template, what", [(COUNTING, "assistant turn 1 changes earlier tokens"), (STRIPPING, "assistant turn 2")],
                         ids=["message-count-in-system-turn", "strips-earlier-assistant-content"])
def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_tokenizer(tiny_dir, tmp_path, template, what):
    bad = with_template(tiny_dir, tmp_path / "bad", template)
    with pytest.raises(AgentRLError, match="not append-only") as err:
        load_base_tokenizer(ModelConfig(base=str(bad)), tools=TOOLS)
    assert str(bad) in str(err.value) and what in str(err.value) and "first difference at token" in str(err.value)


TOOLLESS = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_does_not_render_the_tools_is_refused(tiny_dir, tmp_path):
    """Append-only but blind to `tools`: the prompt would list no tools at all (tools that silently never fire)."""
    bad = with_template(tiny_dir, tmp_path / "toolless", TOOLLESS)
    with pytest.raises(AgentRLError, match="does not render the tools") as err:
        load_base_tokenizer(ModelConfig(base=str(bad)), tools=TOOLS)
    assert str(bad) in str(err.value)


def test_a_saved_policy_keeps_its_tools_and_is_checked_again_on_load(tiny_dir, tok, tmp_path):
    model = build_policy(ModelConfig(base=str(tiny_dir), dtype="fp32"), tok)
    save_policy(model, tok, tmp_path / "policy", {"phase": "test"})
    assert json.loads((tmp_path / "policy" / "policy.json").read_text())["chat_tools"] == json.dumps(TOOLS)  # key order
    _, tok2, _ = load_policy(tmp_path / "policy")
    assert bound_tools(tok2) == TOOLS and encode_context(tok2, CONTEXT + A1 + O1) == encode_context(tok, CONTEXT + A1 + O1)
    (tmp_path / "policy" / "chat_template.jinja").write_text(COUNTING)
    with pytest.raises(AgentRLError, match="not append-only") as err:
        load_policy(tmp_path / "policy")
    assert str(tmp_path / "policy") in str(err.value)


# ---------------------------------------------------------------------------------------------- refused folders
def test_folders_lacking_what_the_pipeline_needs_are_refused_with_the_folder_and_the_problem(tiny_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy2(tiny_dir / name, bare / name)
    with pytest.raises(AgentRLError, match=f"{bare}.*has no tokenizer"):
        load_base_tokenizer(ModelConfig(base=str(bare)))

    broken = with_template(tiny_dir, tmp_path / "broken", "{% for m in messages %}{{ m.content }")
    with pytest.raises(AgentRLError, match=f"{broken}.*(chat template|cannot load its tokenizer)"):
        load_base_tokenizer(ModelConfig(base=str(broken)))

    no_eos = tmp_path / "no_eos"
    shutil.copytree(tiny_dir, no_eos)
    cfg = json.loads((no_eos / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None  # (left out, Qwen2's tokenizer class would fall back to <|endoftext|>)
    (no_eos / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AgentRLError, match=f"{no_eos}.*no eos token"):
        load_base_tokenizer(ModelConfig(base=str(no_eos)))

    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    tok = load_base_tokenizer(ModelConfig(base=str(no_weights)))
    with pytest.raises(AgentRLError, match=f"{no_weights}.*cannot load it locally"):
        build_policy(ModelConfig(base=str(no_weights)), tok)


def test_a_raw_foreign_tokenizer_without_the_markers_does_not_fit_a_policy(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    with pytest.raises(AgentRLError, match="'<call>' as a single token"):
        marker_ids(raw)
    shutil.copytree(tiny_dir, tmp_path / "raw")  # a plain HF folder: the embedding has more rows than the tokenizer
    with pytest.raises(AgentRLError, match="tokens but the model's embedding has"):
        load_policy(tmp_path / "raw")


# --------------------------------------------------------------------------------------------- the built-in default
def test_the_builtin_tokenizer_keeps_its_ids_and_has_no_chat_format():
    texts = [CONTEXT + A1 + O1, "Task: How many units are in stock?\n" + A2 + O2] * 3
    tok = train_tokenizer(texts, vocab_size=300)
    assert chat_format(tok) is None and marker_ids(tok) == {t: i for i, t in enumerate(
        ("<pad>", "<bos>", "<eos>", "<call>", "</call>", "<obs>", "</obs>"))}
    for text in (CONTEXT, A1, O1):
        assert encode_action(tok, text) == encode_observation(tok, text) == encode_continuation(tok, text) \
            == tok.encode(text, add_special_tokens=False)
    assert encode_context(tok, CONTEXT) == [1] + tok.encode(CONTEXT, add_special_tokens=False)


# ----------------------------------------------------------------------------------------- the engine on the model
def test_the_rollout_engine_completes_actions_with_the_foreign_model(tiny_dir, tok):
    from pipeline.policy.rollout import RolloutEngine

    model = build_policy(ModelConfig(base=str(tiny_dir), dtype="fp32"), tok)
    engine = RolloutEngine(model, tok, cfg=RolloutConfig(max_new_tokens=8, batch_size=2, num_threads=1))
    out = engine.complete([CONTEXT, CONTEXT + A1 + O1], seeds=[0, 1])
    for rec, ctx in zip(out, (CONTEXT, CONTEXT + A1 + O1)):
        prompt = encode_context(tok, ctx)
        assert rec["token_ids"][:len(prompt)] == prompt and 1 <= sum(rec["action_mask"]) <= 8
        assert rec["text"] == tok.decode(rec["token_ids"][len(prompt):], skip_special_tokens=False)
    assert ChatFormat(tok, TOOLS).context_ids(CONTEXT) == encode_context(tok, CONTEXT)


def test_decoding_under_the_schemas_works_over_the_foreign_tokenizer(tiny_dir, tok):
    """`rollout.constrain: schema` over the foreign tokenizer (byte-level BPE, its own special tokens, the protocol's
    markers added): the grammar accepts the protocol's actions and refuses what breaks a schema, an action must open
    with ``<call>``, and the untrained model sampling under the masks, token by token, writes whole calls that pass."""
    from pipeline.envs.contract import ToolSpec
    from pipeline.policy.constrain import CallConstraint, violations

    specs = [ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in TOOLS]
    model = build_policy(ModelConfig(base=str(tiny_dir), dtype="fp32"), tok).eval()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids = marker_ids(tok)
    constraint = CallConstraint(tok, vocab, ids["<call>"], ids["</call>"])
    good = [encode_action(tok, A1), encode_action(tok, A2)]
    bad = [encode_action(tok, '<call>lookup {"field": "price", "name": "Cedar Kettle"}</call>'),  # not the order
           encode_action(tok, '<call>answer {"value": 19.5}</call>'),  # a number where the schema says string
           encode_action(tok, '<call>search {"value": "x"}</call>')]  # no such tool
    assert violations(constraint, specs, good) == [] and violations(constraint, specs, bad) == [0, 1, 2]

    first = constraint.mask_(torch.zeros(1, vocab), [("start", specs, True)])  # the first token of an action
    assert torch.isfinite(first[0]).nonzero().flatten().tolist() == [ids["<call>"]]
    constraint.end("start")

    # sampling: tools whose values are bounded (an enum, a one-digit integer), so that every call must close soon
    closed = [ToolSpec("lookup", "d", {"type": "object", "properties": {"field": {"type": "string",
                                                                                   "enum": ["price", "stock"]}},
                                       "required": ["field"], "additionalProperties": False}),
              ToolSpec("count", "d", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}},
                                      "required": ["n"], "additionalProperties": False})]
    gen = torch.Generator().manual_seed(0)
    for seed in range(3):
        written = encode_context(tok, CONTEXT)
        prompt_len, starts = len(written), True
        with torch.no_grad():
            while len(written) - prompt_len < 40:
                logits = model(torch.tensor([written])).logits[:, -1].float()
                constraint.mask_(logits, [(seed, closed, starts)])
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                constraint.consume(seed, token)
                written.append(token)
                starts = False
                if token == ids["</call>"]:
                    break
        action = written[prompt_len:]
        assert action[-1] == ids["</call>"], tok.decode(action)  # the schema's call closed within 40 tokens
        assert violations(constraint, closed, [action]) == [], tok.decode(action)
    assert constraint.stats["dropped"] == 0 and constraint.stats["actions"] == 4


# ------------------------------------------------------------------------------------------------ every phase (slow)
@pytest.mark.services
@pytest.mark.slow
def test_the_foreign_model_goes_through_every_phase(tmp_path):
    """build-env, adapt (LoRA), train, evaluate, check-drift, deploy (int8) and serve with model.base the tiny Qwen2
    folder."""
    import httpx
    import yaml

    from test_flow import BIN, agentrl, clean_env, make_project
    from deploy_support import free_port, wait_http

    root = make_project(tmp_path / "project")
    built = agentrl(root, "build-env")
    assert built.returncode == 0, built.stderr[-3000:]
    questions = [json.loads(line)["question"] for line in (root / "data/tasks/train.jsonl").read_text().splitlines()]
    steps = [s["action"] + s["observation"] for line in (root / "data/demos/train.jsonl").read_text().splitlines()
             for s in json.loads(line)["steps"]]
    base = make_tiny_hf_model()(tmp_path / "tiny_qwen2", texts=[json.dumps(t) for t in TOOLS] + questions + steps)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["model"]["base"] = str(base)
    params["adapt"]["pretrain"]["steps"] = 0
    params["adapt"]["sft"]["max_len"] = 2048  # the template's tool list makes prompts long with a tiny vocabulary
    params["deploy"]["precisions"] = ["fp32", "int8"]
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    for phase in ("adapt", "train", "evaluate", "check-drift", "deploy"):
        proc = agentrl(root, phase)
        assert proc.returncode == 0, f"{phase} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    adapt_metrics = json.loads((root / "metrics/adapt.json").read_text())
    assert "lora" in json.dumps(adapt_metrics).lower()
    for name in ("adapted", "policy"):
        model, tok, meta = load_policy(root / "models" / name)
        assert type(model).__name__ == "Qwen2ForCausalLM" and chat_format(tok) is not None, name
        assert json.loads(meta["chat_tools"]), name
    assert "int8" in (root / "metrics/deploy.json").read_text()

    port = free_port()
    proc = subprocess.Popen([str(BIN / "agentrl"), "serve", "--port", str(port)], cwd=root, env=clean_env(root),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=180, proc=proc)
        r = httpx.post(f"http://127.0.0.1:{port}/solve", json={"question": "What is the price of 'Cedar Kettle'?"},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["n_calls"] == len(r.json()["trajectory"]) >= 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sys.executable  # the phases ran with this interpreter's agentrl
