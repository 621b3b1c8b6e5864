"""Training batches for the adapt loops: length-bucketed, right-padded, labels masked outside the loss.

- :class:`DemoSampler`: the demonstrations as training items, tokenized when drawn, with entity augmentation
  (:func:`pipeline.policy.demos.augment_names`) fresh at every draw;
- :func:`item_batches` / :func:`batches`: endless length-bucketed batches of items (padding stays small without
  packing sequences, so attention never crosses an episode boundary);
- :func:`collate`: ``input_ids``, ``attention_mask`` and ``labels`` with :data:`IGNORE` outside the loss mask.

Left out: the loss and the optimizer (:mod:`pipeline.adapt.sft`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from pipeline.core.errors import AgentRLError
from pipeline.policy.demos import Example, demo_segments, encode_segment
from pipeline.policy.names import NamePool, augment_names

IGNORE = -100  # label of tokens outside the loss (torch's cross_entropy default ignore_index)


class DemoSampler:
    """Demonstrations as training items for :func:`item_batches`: item i is demonstration i, tokenized when drawn,
    with its entity names replaced by fictitious ones (:func:`augment_names`) with probability `augment_prob`.

    `names(task record)` gives a task's names to replace (default: its record's ``entities``; adaptation passes
    :meth:`pipeline.adapt.entity_source.NameSource.names`). `drawn` and `augmented` count the draws and those whose
    names were really replaced (the share adaptation reports)."""

    def __init__(self, tokenizer, demos: Sequence[dict], tasks: dict[str, dict], window: int, max_len: int,
                 augment_prob: float = 0.0, pool: NamePool | None = None, *,
                 signatures: Mapping[str, Sequence[str]], names: Callable[[dict], Sequence[str]] | None = None):
        missing = [d["demo_id"] for d in demos if d["task_id"] not in tasks]
        if missing:
            raise AgentRLError(f"demonstrations {missing[:5]} refer to tasks that are not in the training tasks")
        if augment_prob > 0 and pool is None:
            raise AgentRLError("entity augmentation needs a NamePool (pipeline.adapt.entity_source)")
        self.tokenizer, self.demos, self.tasks = tokenizer, list(demos), tasks
        self.window, self.max_len, self.augment_prob, self.pool = window, max_len, augment_prob, pool
        self.signatures = signatures  # task_id -> its tool list, as the prompt shows it (prompt_signatures)
        self.names = names or (lambda task: task.get("entities", []))
        self.drawn = self.augmented = 0
        self.truncated = 0  # segments of the plain demonstrations cut at max_len
        self.plain = [self._encode(d, self.tasks[d["task_id"]]["question"], d["steps"], count=True) for d in self.demos]
        self.lengths = [sum(len(e) for e in exs) for exs in self.plain]

    def _encode(self, demo: dict, question: str, steps: Sequence[dict], count: bool = False) -> list[Example]:
        out = []
        for prompt, pairs in demo_segments(question, steps, self.window, self.signatures[demo["task_id"]]):
            ex = encode_segment(self.tokenizer, prompt, pairs, demo["demo_id"], int(demo["level"]))
            if len(ex) > self.max_len:
                ex = Example(ex.input_ids[: self.max_len], ex.loss_mask[: self.max_len], ex.source, ex.level)
                self.truncated += count
            out.append(ex)
        return out

    def __call__(self, i: int, rng: np.random.Generator) -> list[Example]:
        self.drawn += 1
        if self.augment_prob <= 0 or rng.random() >= self.augment_prob:
            return self.plain[i]
        demo = self.demos[i]
        task = self.tasks[demo["task_id"]]
        question, steps, mapping = augment_names(task["question"], demo["steps"], self.names(task), self.pool, rng)
        self.augmented += bool(mapping)
        return self._encode(demo, question, steps)

    def applied(self) -> float:
        """The share of drawn demonstrations whose names were replaced (0 before any draw)."""
        return round(self.augmented / self.drawn, 4) if self.drawn else 0.0



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
