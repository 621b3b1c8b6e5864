"""Features the drift checks compare: of tasks, of the world's entities, of episodes, and of the policy's hidden states.

Every feature is declared once in :data:`TASK_FEATURES` or :data:`TRAJECTORY_FEATURES` (name, kind, unit, meaning);
the extractors return one ``pandas.Series`` per declared feature, so a feature the data cannot provide (demonstrations
have no reward components, expert episodes no token ids) is an all-missing series and the check skips it, saying so.

Units matter for the tests' validity (a two-sample test assumes independent draws):

- ``task``: one value per task record;
- ``entity``: one value per *distinct* entity the sample names, read from the environment's entity table
  (:meth:`Environment.entity_table`, capability DriftSource); its numeric columns are the features
  (``entity_<column>``, :func:`task_feature_specs`), and an environment without a table has none. Tasks naming the
  same entity are not independent draws of its values, so per-task entity values would make a small pool of entities
  look like a large sample (the default world's held-out splits name ~60 entities across 400 tasks) and the KS test
  fire on nothing;
- ``episode``: one value per episode record.

Extraction is one pass over the records into flat lists, then pandas/numpy: 100k episodes take about a second (see
``bench/drift.py``). The hidden-state features (:func:`hidden_state_features`) are the mean of a causal LM's last
hidden state over an observation's prompt tokens; they work with any Hugging Face causal LM and its tokenizer.

Deliberately left out: features of the text content beyond lengths (n-grams, embeddings other than the policy's own);
the hidden-state test covers what the policy actually represents.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

Kind = Literal["categorical", "continuous"]
Unit = Literal["task", "entity", "episode"]


@dataclass(frozen=True)
class Feature:
    name: str
    kind: Kind
    unit: Unit
    description: str


def _registry(*features: Feature) -> dict[str, Feature]:
    return {f.name: f for f in features}


TASK_FEATURES: dict[str, Feature] = _registry(
    Feature("family", "categorical", "task", "task family (the mix of families)"),
    Feature("level", "categorical", "task", "difficulty level (the level mix)"),
    Feature("template", "categorical", "task", "question template id, e.g. 'lookup/2' (unseen templates show here)"),
    Feature("question_chars", "continuous", "task", "question length in characters"),
    Feature("answer_value", "continuous", "task", "ground-truth answer read as a number (text answers are missing)"),
)  # and one ``entity_<column>`` feature per numeric column of the environment's entity table (task_feature_specs)

TRAJECTORY_FEATURES: dict[str, Feature] = _registry(
    Feature("tool_sequence", "categorical", "episode", "the episode's tools in order, e.g. 'lookup,calc,answer' "
            "(the tool-call distribution, one unit per episode; '?' for an unparsable action)"),
    Feature("success", "categorical", "episode", "whether the answer was correct"),
    Feature("n_calls", "continuous", "episode", "actions taken"),
    Feature("n_failed", "continuous", "episode", "failed actions (invalid, schema errors, tool errors, refusals)"),
    Feature("return", "continuous", "episode", "episode return R (the reward distribution)"),
    Feature("correctness", "continuous", "episode", "reward component: correctness"),
    Feature("efficiency", "continuous", "episode", "reward component: efficiency"),
    Feature("safety", "continuous", "episode", "reward component: safety"),
    Feature("user_experience", "continuous", "episode", "reward component: user experience"),
    Feature("action_chars", "continuous", "episode", "characters the policy wrote (all actions)"),
    Feature("observation_chars", "continuous", "episode", "characters of tool output the policy read"),
    Feature("n_tokens", "continuous", "episode", "tokens of the episode (rollout records only)"),
    Feature("n_action_tokens", "continuous", "episode", "tokens the policy sampled (action_mask == 1; rollouts only)"),
)

OUTCOME_FEATURES: tuple[str, ...] = ("success", "return", "correctness")
"""Trajectory features that need the verifier's answer key (how well the policy did, not what it did)."""
assert set(OUTCOME_FEATURES) <= set(TRAJECTORY_FEATURES)

ALL_FEATURES: dict[str, Feature] = {**TASK_FEATURES, **TRAJECTORY_FEATURES}
assert len(ALL_FEATURES) == len(TASK_FEATURES) + len(TRAJECTORY_FEATURES), "feature names must be unique"

_CALL_HEAD = re.compile(r"\s*<call>\s*([A-Za-z_]\w*)")
NAN = math.nan


# ------------------------------------------------------------------------------------------------------------ tasks
def entity_fields(world) -> tuple[str, ...]:
    """The numeric columns of `world`'s entity table, in the table's order (() without a world or a table)."""
    table = world.entity_table() if world is not None else None
    if table is None:
        return ()
    return tuple(str(c) for c in table.columns if pd.api.types.is_numeric_dtype(table[c])
                 and not pd.api.types.is_bool_dtype(table[c]))


def task_feature_specs(world=None) -> dict[str, Feature]:
    """:data:`TASK_FEATURES` and one ``entity_<column>`` feature per numeric column of `world`'s entity table."""
    return {**TASK_FEATURES, **{f"entity_{c}": Feature(f"entity_{c}", "continuous", "entity",
                                                       f"{c} of each distinct entity named, from the environment's "
                                                       f"entity table") for c in entity_fields(world)}}


def task_features(records: Sequence[dict], world=None, fields: Sequence[str] | None = None) -> dict[str, pd.Series]:
    """One series per feature of :func:`task_feature_specs`; the entity features (`fields`, default: `world`'s
    numeric entity columns) need `world` (an environment with an entity table). Entities a task names that the world
    lacks are left out (see :func:`unknown_entities`)."""
    df = pd.DataFrame.from_records([{"entities": [], "template_id": "", **r} for r in records],
                                   columns=["family", "level", "template_id", "question", "answer", "entities"])
    out = {
        "family": df["family"].astype(str),
        "level": df["level"].astype(str),
        "template": df["template_id"].astype(str),
        "question_chars": df["question"].astype(str).str.len().astype(float),
        "answer_value": pd.to_numeric(df["answer"].astype(str), errors="coerce").astype(float),
    }
    fields = entity_fields(world) if fields is None else tuple(fields)
    values = entity_values(df["entities"], world, fields)
    for f in fields:
        out[f"entity_{f}"] = values[f] if values is not None else pd.Series([], dtype=float)
    return out


def entity_values(entities: pd.Series, world, fields: Sequence[str]) -> pd.DataFrame | None:
    """Numeric attributes of each distinct entity named in `entities` (a series of name lists), from `world`'s
    entity table (columns it lacks are all-missing)."""
    table = world.entity_table() if world is not None else None
    if table is None:
        return None
    names = pd.Index(entities.explode().dropna().astype(str).unique())
    table = table.reindex(columns=list(fields))
    return table.loc[names.intersection(table.index, sort=False)].astype(float)


def unknown_entities(records: Sequence[dict], world) -> list[str]:
    """Entity names of `records` that `world` does not know (sorted); [] when it lists no entity names."""
    known = world.entity_names() if world is not None else None
    if known is None:
        return []
    return sorted({e for r in records for e in (r.get("entities") or []) if isinstance(e, str) and e not in known})


# ----------------------------------------------------------------------------------------------------- trajectories
def _tool_of(action: object) -> str:
    m = _CALL_HEAD.match(action) if isinstance(action, str) else None
    return m.group(1) if m else "?"


def trajectory_features(records: Sequence[dict]) -> dict[str, pd.Series]:
    """One series per :data:`TRAJECTORY_FEATURES` entry, from episode records of any of the pipeline's producers:
    :func:`pipeline.policy.episodes.run_episode`, the rollout engine (adds token fields) or the demonstrations (no calls
    or reward components: tools are read from the action text, missing fields stay missing)."""
    seq, success, n_calls, n_failed, ret = [], [], [], [], []
    comp: dict[str, list] = {c: [] for c in ("correctness", "efficiency", "safety", "user_experience")}
    a_chars, o_chars, n_tok, n_act = [], [], [], []
    for r in records:
        steps = r.get("steps") or []
        calls = r.get("calls")
        if calls is not None:
            tools = [(c.get("tool") or "?") if isinstance(c, dict) else "?" for c in calls]
        else:
            tools = [_tool_of(s.get("action")) for s in steps]
        seq.append(",".join(tools))
        s = r.get("success")
        success.append(str(bool(s)) if s is not None else None)
        n_calls.append(r.get("n_calls", len(steps)))
        nf = r.get("n_failed")
        if nf is None and calls is not None:
            nf = sum(1 for c in calls if isinstance(c, dict) and c.get("outcome") not in ("ok", "answer"))
        n_failed.append(NAN if nf is None else nf)
        ret.append(r.get("return", NAN))
        components = r.get("components") or {}
        for c, values in comp.items():
            values.append(components.get(c, NAN))
        a_chars.append(sum(len(x.get("action") or "") for x in steps))
        o_chars.append(sum(len(x.get("observation") or "") for x in steps))
        tok, mask = r.get("token_ids"), r.get("action_mask")
        n_tok.append(len(tok) if isinstance(tok, list) else NAN)
        n_act.append(mask.count(1) if isinstance(mask, list) else NAN)

    def num(values: list) -> pd.Series:
        return pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").astype(float)

    return {
        "tool_sequence": pd.Series(seq, dtype=object),
        "success": pd.Series(success, dtype=object),
        "n_calls": num(n_calls),
        "n_failed": num(n_failed),
        "return": num(ret),
        **{c: num(v) for c, v in comp.items()},
        "action_chars": num(a_chars),
        "observation_chars": num(o_chars),
        "n_tokens": num(n_tok),
        "n_action_tokens": num(n_act),
    }


# ------------------------------------------------------------------------------------------------- observations
def tool_signatures(world) -> list[str]:
    """The tool list of the prompt, as the runner renders it for `world`'s tools."""
    return [s.signature() for s in world.tools()]


def episode_contexts(question: str, steps: Sequence[dict], window: int, signatures: Sequence[str],
                     render: Callable | None = None) -> list[str]:
    """The context the policy saw before each step of an episode (the environment's `context` observation),
    replayed with the one prompt function (or `render`, same signature as render_context)."""
    from pipeline.envs.prompt import render_context

    render = render or render_context
    sigs = list(signatures)
    history: list[tuple[str, str]] = []
    out = []
    for s in steps:
        out.append(render(question, sigs, history, window))
        history.append((s["action"], s["observation"]))
    return out


def observation_contexts(tasks: Sequence[dict], trajectories: Sequence[dict] | None, window: int,
                         signatures: Sequence[str], one_per_episode: np.random.Generator | None = None) -> list[str]:
    """Observations for the hidden-state test: every step's context of `trajectories` (questions looked up by
    task_id in `tasks`; episodes of unknown tasks are left out), or, without trajectories, each task's first
    observation (the reset context).

    `one_per_episode`: a generator that picks one step of each episode (its context only). The steps of one episode
    share its question and history, so they are not independent draws; a two-sample test that counts them as such
    (the MMD permutation test) fires more often than its level. One step per episode keeps the draws independent."""
    from pipeline.envs.prompt import render_context

    sigs = list(signatures)
    if not trajectories:
        return [render_context(t["question"], sigs, [], window) for t in tasks]
    questions = {t["task_id"]: t["question"] for t in tasks}
    out: list[str] = []
    for r in trajectories:
        q = questions.get(r.get("task_id"))
        steps = r.get("steps") or []
        if q is None or not steps:
            continue
        if one_per_episode is None:
            out += episode_contexts(q, steps, window, sigs)
        else:
            k = int(one_per_episode.integers(len(steps)))
            out.append(episode_contexts(q, steps[: k + 1], window, sigs)[k])
    return out


# ------------------------------------------------------------------------------------------------ hidden states
def default_encode(tokenizer, text: str) -> list[int]:
    """The training path's tokenization: pipeline.policy.tokenizer.encode_context (``<bos>`` + text), which is a
    plain ``tokenizer.encode(text, add_special_tokens=True)`` for any Hugging Face tokenizer."""
    from pipeline.policy.tokenizer import encode_context

    return encode_context(tokenizer, text)


def clip_ids(ids: list[int], max_tokens: int) -> list[int]:
    """Keep the first token (``<bos>``) and the last ``max_tokens - 1`` (what the rollout engine keeps)."""
    return ids if len(ids) <= max_tokens else ids[:1] + ids[len(ids) - max_tokens + 1:]


MIN_SHARED_PREFIX = 16  # tokens; a shorter common prefix is not worth a separate forward pass


def shared_prefix_length(ids: Sequence[Sequence[int]]) -> int:
    """Length of the token prefix every sequence shares, leaving each at least one token of its own.

    >>> shared_prefix_length([[1, 5, 6, 7], [1, 5, 6, 9, 9], [1, 5, 6]])
    2
    """
    if not ids:
        return 0
    common = os.path.commonprefix([list(x) for x in ids])  # elementwise on lists too
    return max(0, min(len(common), min(len(x) for x in ids) - 1))


def _accepts_cache(backbone) -> bool:
    try:
        return "cache" in inspect.signature(backbone.forward).parameters
    except (TypeError, ValueError):
        return False


def hidden_states_from_ids(model, ids: Sequence[Sequence[int]], batch_size: int = 32, dtype: str = "fp32",
                           share_prefix: bool = True) -> np.ndarray:
    """Mean over each sequence's tokens of the model's last hidden state (after the final norm): (n, hidden) float32.

    Batches are right-padded and sorted by length; under causal attention a real token never sees the padding after
    it, so the result equals running each sequence alone (up to float summation order). Every observation starts
    with the same system prompt, so with `share_prefix` the tokens all sequences share (at least
    :data:`MIN_SHARED_PREFIX`) are run once: their hidden states, which under causal attention do not depend on what
    follows, enter every mean, and each batch runs only its suffixes on a copy of the prefix's key/value cache (about
    half the tokens of an episode's observations, three quarters of reset observations; tested equal to the plain
    path). This needs a backbone whose forward takes a transformers ``cache`` (every decoder model of the pinned
    transformers 5.x); others take the plain path. `dtype` is the compute dtype ('fp32', 'bf16' autocast, or 'auto':
    bf16 where the device computes it fast, as pipeline.policy.model.resolve_dtype decides); weights are not cast.
    The model's train/eval mode is restored."""
    import torch

    from pipeline.policy.model import resolve_dtype

    n = len(ids)
    if n == 0:
        raise ValueError("no sequences to embed")
    if any(len(x) == 0 for x in ids):
        raise ValueError("cannot embed an empty token sequence")
    backbone = getattr(model, "base_model", model)
    device = next(model.parameters()).device
    bf16 = resolve_dtype(dtype, device) == torch.bfloat16
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    p = shared_prefix_length(ids) if share_prefix and backbone is not model and _accepts_cache(backbone) else 0
    p = p if p >= MIN_SHARED_PREFIX else 0
    order = np.argsort([len(x) for x in ids], kind="stable")
    out: np.ndarray | None = None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), autocast:
            prefix_cache, prefix_sum = None, 0.0
            if p:
                pre = backbone(input_ids=torch.as_tensor([list(ids[0][:p])], device=device), use_cache=True)
                prefix_cache, prefix_sum = pre.cache, pre.last_hidden_state[0].float().sum(0)
            for start in range(0, n, batch_size):
                rows = order[start:start + batch_size]
                width = max(len(ids[i]) for i in rows) - p
                batch = torch.zeros((len(rows), width), dtype=torch.long)
                mask = torch.zeros((len(rows), p + width), dtype=torch.long)
                mask[:, :p] = 1
                for j, i in enumerate(rows):
                    batch[j, :len(ids[i]) - p] = torch.as_tensor(ids[i][p:], dtype=torch.long)
                    mask[j, p:len(ids[i])] = 1
                batch, mask = batch.to(device), mask.to(device)
                if p:
                    cache = copy.deepcopy(prefix_cache)
                    cache.batch_repeat_interleave(len(rows))
                    positions = (p + torch.arange(width, device=device)).expand(len(rows), width)
                    h = backbone(input_ids=batch, attention_mask=mask, position_ids=positions, cache=cache,
                                 use_cache=True).last_hidden_state
                elif backbone is not model:
                    h = backbone(input_ids=batch, attention_mask=mask).last_hidden_state
                else:
                    h = model(input_ids=batch, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
                own = mask[:, p:].unsqueeze(-1).float()
                pooled = (prefix_sum + (h.float() * own).sum(1)) / (p + own.sum(1))
                if out is None:
                    out = np.empty((n, pooled.shape[1]), dtype=np.float32)
                out[rows] = pooled.cpu().numpy()
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]


def hidden_state_features(model, tokenizer, contexts: Sequence[str], batch_size: int = 32, max_tokens: int = 512,
                          encode: Callable[[object, str], list[int]] | None = None, dtype: str = "fp32",
                          share_prefix: bool = True) -> np.ndarray:
    """Mean-pooled last hidden state of `model` over the prompt tokens of each context: (len(contexts), hidden).

    Works with any Hugging Face causal LM and its tokenizer; `encode(tokenizer, text)` defaults to
    :func:`default_encode`; `dtype` and `share_prefix` as in :func:`hidden_states_from_ids`."""
    encode = encode or default_encode
    ids = [clip_ids(encode(tokenizer, c), max_tokens) for c in contexts]
    return hidden_states_from_ids(model, ids, batch_size, dtype, share_prefix)
