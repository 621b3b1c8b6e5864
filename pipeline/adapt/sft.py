"""Supervised adaptation of the policy: demonstrations to token ids and loss masks, and one small training loop.

The SFT text of a demonstration is exactly what the policy reads and writes in an episode: the environment's reset
context (:func:`pipeline.env.prompt.render_context`), then for every step the action text (written by the policy) and
the observation text (written by the environment). The loss covers only the action tokens (mask 1); prompt and
observation tokens have mask 0 (shared/STYLE.md: masks are first-class). Each piece is tokenized on its own, the way the
rollout engine sees it: the prompt is encoded once, the action is a run of sampled tokens that ends with ``</call>``,
the observation is encoded and appended. When the history outgrows the environment's window the context is folded
and is no longer a prefix extension; the demonstration is then cut into segments, each starting from the folded context
the policy would really see (:func:`demo_segments`).

Continued pre-training (seed 3.3.2.1) uses the same loop with every token in the loss, on the environment's document
corpus and the training questions (:func:`pretraining_texts`).

Deliberately left out: sequence packing across documents (padding is kept small by length-bucketed batches instead, so
attention never crosses an episode boundary), gradient accumulation, and distributed training (RL owns DeepSpeed).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.env.prompt import render_context
from pipeline.env.tools import default_tools, signature
from pipeline.core.errors import AgentRLError
from pipeline.policy.model import HeapTrimmer
from pipeline.policy.tokenizer import encode_context, encode_continuation

IGNORE = -100  # label of tokens outside the loss (torch's cross_entropy default ignore_index)
TRIM_HEADROOM_MIB = 1024  # train_lm trims the C heap once its resident size grew this much since the last trim


# ------------------------------------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class Example:
    """One training sequence: token ids, the loss mask (1 = the policy writes this token) and where it came from."""

    input_ids: list[int]
    loss_mask: list[int]
    source: str  # demo_id (SFT) or "corpus" (pre-training)
    level: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)


def tool_signatures() -> list[str]:
    """The tool list of the prompt, as the environment renders it."""
    return [signature(t) for t in default_tools()]


def demo_segments(question: str, steps: Sequence[dict], window: int,
                  signatures: Sequence[str] | None = None) -> list[tuple[str, list[tuple[str, str]]]]:
    """Cut a demonstration into (prompt, [(action, observation), ...]) segments that replay the episode's contexts.

    Within one segment the context before step k+1 equals the context before step k plus action k and observation k;
    when the environment folds the history (more than `window` steps) a new segment starts from the folded context.

    >>> segs = demo_segments("Q?", [{"action": "<call>answer {}</call>", "observation": "<obs>1</obs>\\n"}], 6, ["answer(value)"])
    >>> len(segs), segs[0][1]
    (1, [('<call>answer {}</call>', '<obs>1</obs>\\n')])
    """
    sigs = list(signatures) if signatures is not None else tool_signatures()
    segments: list[tuple[str, list[tuple[str, str]]]] = []
    history: list[tuple[str, str]] = []
    expected = None
    for step in steps:
        context = render_context(question, sigs, history, window)
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
        a = encode_continuation(tokenizer, action)
        o = encode_continuation(tokenizer, obs) if k < len(pairs) - 1 else []
        ids += a + o
        mask += [1] * len(a) + [0] * len(o)
    return Example(ids, mask, source, level)


def demo_examples(tokenizer, demos: Sequence[dict], questions: dict[str, str], window: int,
                  max_len: int | None = None, *, entities: dict[str, Sequence[str]] | None = None,
                  pool: "NamePool | None" = None, augment_prob: float = 0.0,
                  rng: np.random.Generator | None = None) -> list[Example]:
    """Every demonstration as training sequences; `questions` maps task_id to the task's question.

    With `augment_prob` > 0, each demonstration has, with that probability (drawn from `rng`), its entity names
    (`entities`: task_id -> the names the task mentions) replaced by fictitious ones from `pool`, once, here
    (:func:`augment_names`): a fixed list, as a behaviour-cloning replay needs.
    A segment longer than `max_len` tokens is cut at the end (its mask with it); whatever is cut is reported by the
    caller through the count of truncated examples.
    """
    if augment_prob > 0 and (pool is None or rng is None or entities is None):
        raise AgentRLError("entity augmentation of demonstrations needs a NamePool (data/env/entities.json), the "
                           "tasks' entities and an RNG")
    sigs = tool_signatures()
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
        for prompt, pairs in demo_segments(question, steps, window, sigs):
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


# --------------------------------------------------------------------------------------------- entity augmentation


@dataclass(frozen=True)
class NamePool:
    """Words to build fictitious entity names from, and every real name (which a fictitious one must never be).

    Product names are "Adjective Noun", supplier names "Word Kind" (pipeline.env.world); a fictitious name pairs a first
    word with a last word of the same kind, both taken from *training* entities, such that no real entity of any split
    has that name: held-out names never enter training text, and a fictitious name has no price to memorise.
    """

    firsts: dict[str, tuple[str, ...]]
    lasts: dict[str, tuple[str, ...]]
    kind_of: dict[str, str]  # real name -> "products" | "suppliers"

    @classmethod
    def from_entities(cls, entities: dict) -> "NamePool":
        firsts, lasts, kind_of = {}, {}, {}
        for kind in ("products", "suppliers"):
            split_of = entities.get(kind, {})
            train = [n for n, sp in split_of.items() if sp == "train" and len(n.split()) >= 2]
            firsts[kind] = tuple(sorted({n.split()[0] for n in train}))
            lasts[kind] = tuple(sorted({n.split()[-1] for n in train}))
            kind_of.update({n: kind for n in split_of})
        return cls(firsts, lasts, kind_of)

    def fake(self, kind: str, rng: np.random.Generator, avoid: set[str]) -> str | None:
        a, b = self.firsts.get(kind, ()), self.lasts.get(kind, ())
        for _ in range(64):
            if not a or not b:
                return None
            name = f"{a[int(rng.integers(len(a)))]} {b[int(rng.integers(len(b)))]}"
            if name not in self.kind_of and name not in avoid:
                return name
        return None


def augment_names(question: str, steps: Sequence[dict], entities: Sequence[str], pool: NamePool,
                  rng: np.random.Generator) -> tuple[str, list[dict], dict[str, str]]:
    """(question, steps, {real name: fictitious name}): the demonstration with every entity the task names replaced by a fictitious name of the same kind, everywhere
    it occurs (question, actions, observations), consistently within the demonstration.

    Why: the training tasks name only a few hundred products, so a small model lowers its SFT loss fastest by
    memorising them, and then writes a *training* name for a held-out product (measured: greedy validation success of
    5% on level 1 at a training loss of 0.19). With fictitious names in part of the demonstrations, the only way to the
    name in a call is to copy it from the question or from a tool result, which is the skill the validation split asks for.
    """
    mapping: dict[str, str] = {}
    for e in entities:
        kind = pool.kind_of.get(e)
        new = pool.fake(kind, rng, set(mapping.values())) if kind else None
        if new:
            mapping[e] = new
    if not mapping:
        return question, [dict(s) for s in steps], mapping
    pattern = re.compile("|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)))
    sub = lambda text: pattern.sub(lambda m: mapping[m.group(0)], text)  # noqa: E731
    return (sub(question), [{**s, "action": sub(s["action"]), "observation": sub(s["observation"])} for s in steps],
            mapping)


def copy_drills(pool: NamePool, n: int, rng: np.random.Generator) -> list[str]:
    """`n` short synthetic texts that each end in a JSON field copied from a quoted name earlier in the text.

    Two forms, half each: a numbered list of 1-3 quoted names followed by ``{"item": k, "name": "<name k>"}``, and a
    sentence quoting two names followed by ``{"first": ..., "second": ...}``. Names are fictitious (:class:`NamePool`)
    and quoted with single quotes, unlike the JSON: the circuit has to find a name by what precedes it in the text,
    not by an exact repeat of the token before it (a plain induction head), and then serves either quoting style.

    Why (measured on the default model and data, 1 thread): the policy must write a name it read in the question or in
    a search result as a JSON string. Plain SFT learns that copy only after a phase change at about 1,000 steps on
    level-1 data (until then the loss on a held-out name's first token stays at log(40) ≈ 3.8, whatever the question
    says, and greedy validation success is 0-5% on every level after 600-1,200 steps). On the default, after the 400
    pre-training steps on these drills the first token of a held-out drill name was right 67% of the time
    (``pretrain.copy_accuracy``), and after 1,000 SFT steps greedy validation success was 0.30 / 0.68 / 0.76 on levels
    1-3 (a full fine-tune without drills, 700 steps: 0.24 / 0.19 / 0.20).
    """
    texts = []
    for _ in range(n):
        kind = "products" if rng.random() < 0.75 else "suppliers"
        q = "'"
        if rng.random() < 0.5:
            names: list[str] = []
            for _ in range(int(rng.integers(1, 4))):
                name = pool.fake(kind, rng, set(names))
                if name:
                    names.append(name)
            if not names:
                continue
            k = int(rng.integers(len(names)))
            listing = " ".join(f"Item {i}: {q}{name}{q}." for i, name in enumerate(names))
            texts.append(f"{listing}\n{json.dumps({'item': k, 'name': names[k]})}")
        else:
            a, b = pool.fake(kind, rng, set()), pool.fake("products", rng, set())
            if a and b and a != b:
                texts.append(f"{q}{a}{q} comes with {q}{b}{q}.\n{json.dumps({'first': a, 'second': b})}")
    return texts


WORD_FRAMES = (
    "Please report the {w} of {q}{name}{q}.",
    "Which {w} does {q}{name}{q} have?",
    "About {q}{name}{q}: tell me its {w}.",
    "I want to know the {w} for {q}{name}{q} today.",
    "Check {q}{name}{q} and write down the {w} you see.",
    "The {w} is what matters for {q}{name}{q}.",
)


def word_drills(pool: NamePool, words: Sequence[str], n: int, rng: np.random.Generator) -> list[str]:
    """`n` short synthetic texts in which a sentence names a quoted (fictitious) name and an *unquoted* word, and a
    JSON record then copies both: ``{"name": "<the name>", "field": "<the word>"}``.

    The word is drawn from `words` (every word of the world's entity names, field and unit words, lower-cased: a
    vocabulary of a few hundred, so the only way to the right word is to copy it), and it sits at a different place in
    each of the :data:`WORD_FRAMES`, none of them a task template.

    Why (measured on the default adapted model, validation level 1): at ``"field": "`` of a lookup call the policy
    gave price / supplier / category the same probabilities, about 0.26 / 0.30 / 0.43, whatever the question asked
    (``stock``, 0.99, was the one field it read), so greedy level-1 success stayed at 0.38. The name drills
    (:func:`copy_drills`) build a circuit that copies *quoted* text; a question's field word is not quoted, and 1,000
    SFT steps on about 800 level-1 demonstrations did not form the second circuit.
    """
    texts = []
    for _ in range(n):
        kind = "products" if rng.random() < 0.75 else "suppliers"
        name = pool.fake(kind, rng, set())
        if not name:
            continue
        w = words[int(rng.integers(len(words)))]
        frame = WORD_FRAMES[int(rng.integers(len(WORD_FRAMES)))]
        texts.append(frame.format(w=w, q="'", name=name) + "\n" + json.dumps({"name": name, "field": w}))
    return texts


def drill_words(pool: NamePool, extra: Sequence[str] = ()) -> list[str]:
    """The vocabulary of :func:`word_drills`: the lower-cased words of the training entity names plus `extra`."""
    words = {w.lower() for part in (pool.firsts, pool.lasts) for names in part.values() for w in names}
    return sorted(words | set(extra))


def _number(rng: np.random.Generator) -> str:
    """A number as tool results write them: an integer (1-5 digits) or a decimal with one or two places."""
    if rng.random() < 0.7:
        return str(int(rng.integers(1, 10 ** int(rng.integers(1, 6)))))
    return str(round(float(rng.uniform(0.01, 1000)), int(rng.integers(1, 3))))


def number_drills(n: int, rng: np.random.Generator) -> list[str]:
    """`n` short synthetic texts that end in a JSON field copying numbers from tool observations earlier in the text.

    Three forms, a third each, with 1-3 observations ``<obs>N</obs>`` (the protocol's markers, as in an episode):
    ``{"value": "<the last one>"}`` (an answer after a calculation), ``{"expr": "<a>*<b>"}`` / ``+`` / ``-`` with two
    observations in their order or a small constant (a calculation on lookups), and ``{"item": k, "value": ...}``
    (the k-th observation).

    Why they exist, and why they are off by default (``adapt.pretrain.number_drills: 0``): with the old 400-step
    pre-training, seed 1 learned to copy names but not numbers from observations into the next call (``595*5`` after
    ``<obs>576</obs>``; greedy validation success 0.00-0.05 on every level). Next to the name drills, 10,000 of these
    then kept the name-copy circuit from forming (seeds 1 and 2 ended at 0 on every level), while running pre-training
    until names are copied exactly (``adapt.pretrain.copy_target``) made seed 1 learn both. Numbers are digits one
    per token (:mod:`pipeline.policy.tokenizer`), so the skill is a copy of a run of digit tokens.
    """
    texts = []
    for _ in range(n):
        nums = [_number(rng) for _ in range(int(rng.integers(1, 4)))]
        obs = "".join(f"<obs>{x}</obs>\n" for x in nums)
        form = rng.random()
        if form < 1 / 3:
            record = {"value": nums[-1]}
        elif form < 2 / 3:
            op = "*+-"[int(rng.integers(3))]
            a, b = (nums[-2], nums[-1]) if len(nums) > 1 else (nums[-1], str(int(rng.integers(2, 10))))
            record = {"expr": f"{a}{op}{b}"}
        else:
            k = int(rng.integers(len(nums)))
            record = {"item": k, "value": nums[k]}
        texts.append(obs + json.dumps(record))
    return texts


@torch.no_grad()
def copy_accuracy(model, tokenizer, texts: Sequence[str], autocast: Callable | None = None) -> float:
    """Share of drills (:func:`copy_drills`, :func:`number_drills`) whose last JSON string value the model copies
    exactly: every token of the value (a whole name, a whole number) is the greedy prediction after the true text
    before it (teacher-forced). The first token has to be found; the later ones must follow it rather than what the
    training names make likely (a held-out "Acme Trading" written as the training supplier "Acme Depot")."""
    hits, n = 0, 0
    was = model.training
    model.eval()
    for text in texts:
        head, sep, value = text.rpartition('": "')
        if not sep:
            continue
        prefix = encode_context(tokenizer, head + sep)
        target = encode_continuation(tokenizer, value.split('"')[0])
        ids = torch.tensor([prefix + target])
        with autocast() if autocast is not None else _null():
            logits = model(input_ids=ids).logits[0]
        pred = logits[len(prefix) - 1:len(prefix) - 1 + len(target)].argmax(-1)
        hits += bool((pred == torch.tensor(target)).all())
        n += 1
    model.train(was)
    return hits / max(n, 1)


class DemoSampler:
    """Demonstrations as training items for :func:`item_batches`: item i is demonstration i, tokenized when drawn,
    with its entity names replaced by fictitious ones (:func:`augment_names`) with probability `augment_prob`."""

    def __init__(self, tokenizer, demos: Sequence[dict], tasks: dict[str, dict], window: int, max_len: int,
                 augment_prob: float = 0.0, pool: NamePool | None = None):
        missing = [d["demo_id"] for d in demos if d["task_id"] not in tasks]
        if missing:
            raise AgentRLError(f"demonstrations {missing[:5]} refer to tasks that are not in the training tasks")
        if augment_prob > 0 and pool is None:
            raise AgentRLError("entity augmentation needs a NamePool (data/env/entities.json)")
        self.tokenizer, self.demos, self.tasks = tokenizer, list(demos), tasks
        self.window, self.max_len, self.augment_prob, self.pool = window, max_len, augment_prob, pool
        self.truncated = 0  # segments of the plain demonstrations cut at max_len
        self.plain = [self._encode(d, self.tasks[d["task_id"]]["question"], d["steps"], count=True) for d in self.demos]
        self.lengths = [sum(len(e) for e in exs) for exs in self.plain]

    def _encode(self, demo: dict, question: str, steps: Sequence[dict], count: bool = False) -> list[Example]:
        out = []
        for prompt, pairs in demo_segments(question, steps, self.window):
            ex = encode_segment(self.tokenizer, prompt, pairs, demo["demo_id"], int(demo["level"]))
            if len(ex) > self.max_len:
                ex = Example(ex.input_ids[: self.max_len], ex.loss_mask[: self.max_len], ex.source, ex.level)
                self.truncated += count
            out.append(ex)
        return out

    def __call__(self, i: int, rng: np.random.Generator) -> list[Example]:
        if self.augment_prob <= 0 or rng.random() >= self.augment_prob:
            return self.plain[i]
        demo = self.demos[i]
        task = self.tasks[demo["task_id"]]
        question, steps, _ = augment_names(task["question"], demo["steps"], task["entities"], self.pool, rng)
        return self._encode(demo, question, steps)


# ---------------------------------------------------------------------------------------------------------- input


def read_jsonl(path: Path, what: str) -> list[dict]:
    if not path.is_file():
        raise AgentRLError(f"{what} not found at {path}; run `agentrl build-env` (DVC stage build_env) first")
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise AgentRLError(f"{path}: line {i} is not valid JSON ({exc.msg})") from None
    return records


def load_demos(path: Path, task_ids: Sequence[str] | None = None) -> list[dict]:
    """Read and validate the demonstrations (Great Expectations suite ``demos``); a broken file is an AgentRLError."""
    from pipeline.core.validation import DataValidationError, validate_records

    records = read_jsonl(Path(path), "demonstrations")
    try:
        validate_records(records, "demos", str(path), task_ids=task_ids).raise_if_failed()
    except (DataValidationError, TypeError) as exc:
        raise AgentRLError(f"demonstration file {path} breaks the schema:\n{exc}") from None
    return records


def pretraining_texts(data_dir: Path, tasks: Sequence[dict] | None = None, documents: bool = True) -> list[str]:
    """The domain text for continued pre-training: the world's documents, plus the training questions when given.

    Only text the environment shows a policy is used (documents are what `search` returns); no action or answer text,
    so pre-training teaches the domain's language and names, not the demonstrations.
    """
    texts = []
    if documents:
        texts += [d["text"] for d in read_jsonl(Path(data_dir) / "env" / "corpus.jsonl", "document corpus")]
    if tasks:
        texts += [t["question"] for t in tasks]
    return texts


# -------------------------------------------------------------------------------------------------------- batching


def batches(examples: Sequence[Example], batch_size: int, rng: np.random.Generator, pad_id: int,
            bucket: int = 32) -> Iterator[dict]:
    """Endless length-bucketed batches of a fixed list of examples (see :func:`item_batches`)."""
    return item_batches([len(e) for e in examples], lambda i, _rng: [examples[i]], batch_size, rng, pad_id, bucket)


def item_batches(lengths: Sequence[int], make: Callable[[int, np.random.Generator], list[Example]], batch_size: int,
                 rng: np.random.Generator, pad_id: int, bucket: int = 32) -> Iterator[dict]:
    """Endless length-bucketed batches of items: shuffle, sort windows of `bucket` batches by length, shuffle batches.

    Item i (a demonstration, a text) becomes examples through ``make(i, rng)`` when it is drawn, so augmentation is
    fresh at every epoch; `lengths` only guides the bucketing. Yields ``input_ids`` (B, T), ``attention_mask`` (B, T)
    and ``labels`` (B, T) with :data:`IGNORE` where the loss mask is 0 and on padding (right padding); B is
    `batch_size` items (more when an item gives several segments).
    """
    n = len(lengths)
    if n == 0:
        raise AgentRLError("no training examples")
    while True:
        order = rng.permutation(n)
        chunk = batch_size * bucket
        groups = []
        for s in range(0, n, chunk):
            part = sorted(order[s:s + chunk], key=lambda i: lengths[i])
            groups += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
        for g in rng.permutation(len(groups)):
            yield collate([ex for i in groups[g] for ex in make(int(i), rng)], pad_id)


def collate(items: Sequence[Example], pad_id: int) -> dict:
    T = max(len(x) for x in items)
    ids = torch.full((len(items), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(items), T), dtype=torch.long)
    labels = torch.full((len(items), T), IGNORE, dtype=torch.long)
    for i, x in enumerate(items):
        L = len(x)
        ids[i, :L] = torch.tensor(x.input_ids)
        att[i, :L] = 1
        lab = torch.tensor(x.input_ids)
        lab[torch.tensor(x.loss_mask) == 0] = IGNORE
        labels[i, :L] = lab
    return {"input_ids": ids, "attention_mask": att, "labels": labels}


# -------------------------------------------------------------------------------------------------------- training


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over positions whose label is not :data:`IGNORE`.

    logits: (B, T, V); labels: (B, T), the token at t is predicted from positions < t. Returns (loss, n_tokens).
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    n = int((shift_labels != IGNORE).sum())
    loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss / max(n, 1), n


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warm-up to `peak`, then cosine decay to `final_frac · peak` at `total` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@dataclass
class TrainResult:
    losses: list[float]  # mean loss of every step
    tokens: int  # tokens processed (padding excluded)
    loss_tokens: int  # tokens inside the loss
    seconds: float
    steps: int

    def summary(self, tail: int = 20) -> dict:
        first = float(np.mean(self.losses[: min(tail, len(self.losses))])) if self.losses else float("nan")
        last = float(np.mean(self.losses[-tail:])) if self.losses else float("nan")
        return {"loss_first": first, "loss_final": last, "steps": self.steps, "tokens": self.tokens,
                "loss_tokens": self.loss_tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0}


def check_compile_available() -> None:
    """Raise a clear error when ``torch.compile`` cannot build CPU kernels here: Inductor needs a C++ compiler (``CXX``,
    or ``c++``/``g++``/``clang++`` on ``PATH``), and without one it fails only inside the first training step."""
    import os
    import shutil

    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        raise AgentRLError("adapt.sft.compile is true, but no C++ compiler was found (CXX, c++, g++ or clang++), which "
                           "torch.compile needs on the CPU: install one (e.g. `apt install g++`) or set "
                           "adapt.sft.compile: false in params.yaml")


def train_lm(model: torch.nn.Module, data: Iterator[dict], steps: int, lr: float, *, warmup: int = 0,
             weight_decay: float = 0.0, grad_clip: float = 1.0, autocast: Callable | None = None,
             log: Callable[[int, dict], None] | None = None, log_every: int = 10,
             stop: Callable[[int], bool] | None = None, stop_every: int = 100, micro_batches: int = 1,
             compile: bool = False) -> TrainResult:
    """AdamW on the trainable parameters for `steps` batches of `data`; the loss is :func:`masked_lm_loss`.

    `micro_batches` > 1 forwards each batch in that many chunks of rows (each trimmed to its own longest row) and
    accumulates their gradients, each chunk's loss weighted by its share of the batch's loss tokens: the same step as
    one forward of the batch, with the activation memory of one chunk.

    `autocast` returns a context manager for the forward pass (bf16 autocast on a CPU that supports it);
    `log(step, metrics)` receives ``loss``, ``lr``, ``grad_norm`` and ``tokens_per_s`` every `log_every` steps;
    `stop(step)`, called every `stop_every` steps, ends training early when it returns True (the lr schedule still
    spans `steps`). The result's `steps` counts the steps taken.

    `compile` runs the training forward (and so its backward) through ``torch.compile`` (Inductor: fused elementwise
    kernels around the matmuls; dynamic shapes after the first new sequence length). The first steps pay for the
    compilation (about 30 s on 2 cores for the default model, on a cold cache); the module itself is trained, so the weights,
    ``stop`` checks and everything after see the same parameters.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise AgentRLError("the model has no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    model.train()
    if compile:
        check_compile_available()
    forward = torch.compile(model, dynamic=True) if compile else model
    with _deterministic(compile):
        return _train_loop(model, forward, opt, params, data, steps, lr, warmup, grad_clip, autocast, log, log_every,
                           stop, stop_every, micro_batches)


@contextlib.contextmanager
def _deterministic(on: bool):
    """``torch.use_deterministic_algorithms(True)`` for the duration (the previous setting is restored afterwards).

    Why, for the compiled loop: Inductor's CPU kernels are not run-to-run reproducible by default. Measured (session 11,
    the same adapted weights, the same 40 SFT batches, two processes each): eager gave bit-identical losses twice;
    compiled gave different losses from the first steps (0.1202 against 0.1224 at step 40), with the FX graph cache
    on and with it off, so a cold cache does not help; compiled under deterministic algorithms gave bit-identical
    losses. Session 10's two default runs, whose SFT diverged on the same data, were this. Eager runs are left as
    they are (their kernels are deterministic on the CPU already)."""
    if not on:
        yield
        return
    before, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


def _train_loop(model, forward, opt, params, data, steps, lr, warmup, grad_clip, autocast, log, log_every, stop,
                stop_every, micro_batches) -> TrainResult:
    losses, tokens, loss_tokens = [], 0, 0
    t0 = tw = time.perf_counter()
    window_tokens = 0
    trimmer = HeapTrimmer(TRIM_HEADROOM_MIB)
    for step in range(steps):
        batch = next(data)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        opt.zero_grad(set_to_none=True)
        n = int((batch["labels"][:, 1:] != IGNORE).sum())
        loss = torch.zeros(())
        order = torch.arange(batch["input_ids"].shape[0])
        if micro_batches > 1:  # one chunk keeps the batch's own row order: its step is bit-identical to before chunks
            order = torch.argsort(batch["attention_mask"].sum(1), descending=True, stable=True)
        for rows in torch.tensor_split(order, micro_batches):
            if rows.numel() == 0:
                continue
            T = int(batch["attention_mask"][rows].sum(1).max())
            with autocast() if autocast is not None else _null():
                logits = forward(input_ids=batch["input_ids"][rows, :T],
                                 attention_mask=batch["attention_mask"][rows, :T]).logits
            part, n_part = masked_lm_loss(logits, batch["labels"][rows, :T])
            part = part * (n_part / max(n, 1))
            part.backward()
            loss = loss + part.detach()
        gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(loss.item())
        trimmer.maybe()  # the heap's free pages back to the OS once it has grown (why: release_free_memory)
        ntok = int(batch["attention_mask"].sum())
        tokens += ntok
        window_tokens += ntok
        loss_tokens += n
        if log is not None and ((step + 1) % log_every == 0 or step == steps - 1):
            now = time.perf_counter()
            log(step + 1, {"loss": float(np.mean(losses[-log_every:])), "lr": opt.param_groups[0]["lr"],
                           "grad_norm": float(gnorm), "tokens_per_s": window_tokens / max(now - tw, 1e-9)})
            tw, window_tokens = now, 0
        if stop is not None and (step + 1) % stop_every == 0 and step + 1 < steps:
            t_stop = time.perf_counter()
            done = stop(step + 1)
            model.train()
            t0 += time.perf_counter() - t_stop  # the check is not training time
            tw += time.perf_counter() - t_stop
            if done:
                break
    model.eval()
    return TrainResult(losses, tokens, loss_tokens, time.perf_counter() - t0, len(losses))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
