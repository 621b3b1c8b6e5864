"""Demonstrations as training sequences: the token ids and loss masks that SFT and RL's behaviour-cloning anchor train on.

The text of a demonstration is exactly what the policy reads and writes in an episode: the environment's reset context
(:func:`pipeline.envs.prompt.render_context`), then for every step the action text (written by the policy) and the
observation text (written by the environment). The loss covers only the action tokens (mask 1); prompt and observation
tokens have mask 0. Each piece is tokenized on its own, the way the rollout engine sees it: the prompt is encoded once,
the action is a run of sampled tokens that ends with ``</call>``, the observation is encoded and appended. When the
history outgrows the environment's window the context is folded and is no longer a prefix extension; the
demonstration is then cut into segments, each starting from the folded context the policy would really see
(:func:`demo_segments`).

Entity augmentation (:mod:`pipeline.policy.names`) replaces the entity names of a demonstration by
fictitious ones, so that copying a name from the question or a tool result is the only way to a right call.

Left out: batching and the training loops (:mod:`pipeline.adapt.batching`, :mod:`pipeline.adapt.sft`, the RL
trainer), and continued pre-training's synthetic drills (:mod:`pipeline.adapt.drills`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import read_jsonl
from pipeline.envs.context_actions import note_of
from pipeline.envs.prompt import render_context
from pipeline.policy.names import NamePool, augment_names  # noqa: F401  (re-exported: the demonstrations' augmentation)
from pipeline.policy.tokenizer import encode_action, encode_context, encode_observation


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids, the loss mask (1 = the policy writes this token) and where it came from."""

    input_ids: list[int]
    loss_mask: list[int]
    source: str  # demo_id (SFT) or "corpus" (pre-training)
    level: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)


def prompt_signatures(world, tasks, context_actions=None) -> dict[str, list[str]]:
    """task_id -> the tool list its prompt shows (a mixed run shows each task its own environment's tools), followed
    by the context actions' when `context_actions` (``env.context_actions``) is enabled, as the runner lists them."""
    from pipeline.envs.context_actions import context_specs

    extra = context_specs(context_actions) if context_actions is not None and context_actions.enabled else []
    by_tools: dict[tuple, list[str]] = {}
    out = {}
    for t in tasks:
        specs = list(world.tools_for(t)) + extra
        key = tuple(s.name for s in specs)
        out[t.task_id] = by_tools.setdefault(key, [s.signature() for s in specs])
    return out


def demo_segments(question: str, steps: Sequence[dict], window: int,
                  signatures: Sequence[str]) -> list[tuple[str, list[tuple[str, str]]]]:
    """Cut a demonstration into (prompt, [(action, observation), ...]) segments that replay the episode's contexts.

    Within one segment the context before step k+1 equals the context before step k plus action k and observation k;
    when the environment folds the history (more than `window` steps), or a ``note`` action replaces the earlier
    turns (``env.context_actions``), a new segment starts from the context the policy then sees.

    >>> segs = demo_segments("Q?", [{"action": "<call>answer {}</call>", "observation": "<obs>1</obs>\\n"}], 6, ["answer(value)"])
    >>> len(segs), segs[0][1]
    (1, [('<call>answer {}</call>', '<obs>1</obs>\\n')])
    """
    sigs = list(signatures)
    segments: list[tuple[str, list[tuple[str, str]]]] = []
    history: list[tuple[str, str]] = []
    expected = None
    for step in steps:
        context = render_context(question, sigs, history, window, note_of(history))
        if context != expected:
            segments.append((context, []))
        action, obs = step["action"], step["observation"]
        segments[-1][1].append((action, obs))
        history.append((action, obs))
        expected = context + action + obs
    return segments


def encode_segment(tokenizer, prompt: str, pairs: Sequence[tuple[str, str]], source: str = "", level: int = 0) -> Example:
    """Token ids and loss mask of one segment: mask 1 exactly on the action tokens.

    Laid out as the rollout engine lays out an episode (:func:`pipeline.policy.tokenizer.encode_turns`): the context
    with ``<bos>``, then each action and observation encoded on its own. The segment's last observation is left out:
    nothing after it is in the loss (the engine, too, ends a segment with the sampled action).
    """
    ids = encode_context(tokenizer, prompt)
    mask = [0] * len(ids)
    for k, (action, obs) in enumerate(pairs):
        a = encode_action(tokenizer, action)
        o = encode_observation(tokenizer, obs) if k < len(pairs) - 1 else []
        ids += a + o
        mask += [1] * len(a) + [0] * len(o)
    return Example(ids, mask, source, level)


def demo_examples(tokenizer, demos: Sequence[dict], questions: dict[str, str], window: int,
                  max_len: int | None = None, *, entities: dict[str, Sequence[str]] | None = None,
                  pool: "NamePool | None" = None, augment_prob: float = 0.0,
                  rng: np.random.Generator | None = None, signatures: Mapping[str, Sequence[str]]) -> list[Example]:
    """Every demonstration as training sequences; `questions` maps task_id to the task's question.

    With `augment_prob` > 0, each demonstration has, with that probability (drawn from `rng`), its entity names
    (`entities`: task_id -> the names the task mentions) replaced by fictitious ones from `pool`, once, here
    (:func:`augment_names`): a fixed list, as a behaviour-cloning replay needs.
    A segment longer than `max_len` tokens is cut at the end (its mask with it); whatever is cut is reported by the
    caller through the count of truncated examples.
    """
    if augment_prob > 0 and (pool is None or rng is None or entities is None):
        raise AgentRLError("entity augmentation of demonstrations needs a NamePool (pipeline.adapt.entity_source), the "
                           "tasks' entities and an RNG")
    out = []
    for d in demos:
        try:
            question = questions[d["task_id"]]
        except KeyError:
            raise AgentRLError(f"demonstration {d['demo_id']!r} refers to task {d['task_id']!r}, "
                               "which is not in the training tasks") from None
        steps = d["steps"]
        if augment_prob > 0 and rng.random() < augment_prob:
            question, steps, _ = augment_names(question, steps, entities[d["task_id"]], pool, rng)
        for prompt, pairs in demo_segments(question, steps, window, signatures[d["task_id"]]):
            ex = encode_segment(tokenizer, prompt, pairs, d["demo_id"], int(d["level"]))
            if max_len is not None and len(ex) > max_len:
                ex = Example(ex.input_ids[:max_len], ex.loss_mask[:max_len], ex.source, ex.level)
            out.append(ex)
    return out


def text_examples(tokenizer, texts: Sequence[str], max_len: int) -> list[Example]:
    """Plain texts for continued pre-training: BOS + text + EOS, every token after the first in the loss."""
    out = []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for t in texts:
        ids = encode_context(tokenizer, t) + eos
        ids = ids[:max_len]
        out.append(Example(ids, [1] * len(ids), "corpus"))
    return out


def load_demos(path: Path, task_ids: Sequence[str] | None = None) -> list[dict]:
    """Read and validate the demonstrations (Great Expectations suite ``demonstrations``); a broken file is an
    AgentRLError."""
    from pipeline.core.validation import DataValidationError, validate_records
    from pipeline.envs.demo_suite import register

    register()

    records = read_jsonl(Path(path), "demonstrations", hint="run `agentrl build-env` (DVC stage build_env) first",
                         allow_empty=True)
    try:
        validate_records(records, "demonstrations", str(path), task_ids=task_ids).raise_if_failed()
    except (DataValidationError, TypeError) as exc:
        raise AgentRLError(f"demonstration file {path} breaks the schema:\n{exc}") from None
    return records
