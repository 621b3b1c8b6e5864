"""Synthetic drills for continued pre-training, and the probe that measures what they teach.

- :func:`copy_drills`: short texts that end in a JSON field copied from a quoted fictitious name earlier in the text
  (the circuit that copies a held-out entity's name into a call);
- :func:`word_drills`: a quoted name and an *unquoted* word, both copied into a JSON record (the field a question asks
  for);
- :func:`copy_accuracy`: the share of drills whose value the model copies exactly, teacher-forced.

Names are fictitious (:class:`pipeline.policy.names.NamePool`): a drill never names a real entity. The kind of each
name is drawn by the pool's weights (:meth:`NamePool.draw_kind`, one draw per drill); the second name of a two-name
drill is of the pool's first kind. Left out: the
training loop (:mod:`pipeline.adapt.sft`) and which texts pre-training mixes (:mod:`pipeline.adapt.pretrain`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pipeline.policy.names import NamePool
from pipeline.policy.tokenizer import encode_context, encode_continuation


def copy_drills(pool: NamePool, n: int, rng: np.random.Generator) -> list[str]:
    """`n` short synthetic texts that each end in a JSON field copied from a quoted name earlier in the text.

    Two forms, half each: a numbered list of 1-3 quoted names followed by ``{"item": k, "name": "<name k>"}``, and a
    sentence quoting two names followed by ``{"first": ..., "second": ...}``. Names are fictitious (:class:`NamePool`)
    and quoted with single quotes, unlike the JSON: the circuit has to find a name by what precedes it in the text,
    not by an exact repeat of the token before it (a plain induction head), and then serves either quoting style.

    Why: the policy must write a name it read in the question or in a search result as a JSON string, and plain SFT
    learns that copy only after a phase change at about 1,000 steps; pre-training on these drills forms it first.
    """
    texts = []
    if not pool:  # no kind to draw names of: no drill
        return texts
    for _ in range(n):
        kind = pool.draw_kind(rng)
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
            a, b = pool.fake(kind, rng, set()), pool.fake(pool.primary, rng, set())
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

    Why: the name drills (:func:`copy_drills`) build a circuit that copies *quoted* text; a question's field word is
    not quoted, and without these drills the policy wrote the same field whatever the question asked.
    """
    texts = []
    if not pool or not words:
        return texts
    for _ in range(n):
        kind = pool.draw_kind(rng)
        name = pool.fake(kind, rng, set())
        if not name:
            continue
        w = words[int(rng.integers(len(words)))]
        frame = WORD_FRAMES[int(rng.integers(len(WORD_FRAMES)))]
        texts.append(frame.format(w=w, q="'", name=name) + "\n" + json.dumps({"name": name, "field": w}))
    return texts


def drill_words(pool: NamePool, extra: Sequence[str] = ()) -> list[str]:
    """The vocabulary of :func:`word_drills`: the lower-cased words of the training entity names plus `extra`."""
    return sorted(pool.words() | set(extra))


@torch.no_grad()
def copy_accuracy(model, tokenizer, texts: Sequence[str], autocast: Callable | None = None) -> float:
    """Share of drills (:func:`copy_drills`, :func:`word_drills`) whose last JSON string value the model copies
    exactly: every token of the value (a whole name, a word) is the greedy prediction after the true text
    before it (teacher-forced). The first token has to be found; the later ones must follow it rather than what the
    training names make likely (a held-out "Acme Trading" written as the training name "Acme Depot")."""
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
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = model(input_ids=ids).logits[0]
        pred = logits[len(prefix) - 1:len(prefix) - 1 + len(target)].argmax(-1)
        hits += bool((pred == torch.tensor(target)).all())
        n += 1
    model.train(was)
    return hits / max(n, 1)
