"""Fictitious names: the pool they are drawn from, and the augmentation that puts them into demonstrations.

- :class:`NamePool`: for every *kind* of name an environment offers, the parts to build fictitious names from (taken
  from training names only) and every real name (which a fictitious one must never be), with each kind's weight in
  the drills;
- :func:`augment_names`: a demonstration with the names its task mentions replaced by fictitious ones of the same
  kind, consistently;
- :func:`mine_copyable`: the strings a demonstration's calls copy verbatim from its question or an earlier
  observation (the names of an environment that writes no ``entities.json``).

A kind whose training names mostly have two words or more is a *word* kind: a fictitious name is the first word of
one training name and the last word of another ("Adjective Noun" + "Word Kind" gives "Adjective Kind"). Any other
kind is a *character* kind: the first half of one training name joined to the second half of another. Where the
names come from (``entities.json``, an environment's hooks, the demonstrations) is decided in
:mod:`pipeline.adapt.entity_source`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

_CALL = re.compile(r"<call>\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\{.*\})\s*</call>", re.S)


@dataclass(frozen=True)
class NamePool:
    """Parts of fictitious names per kind, every real name, and the kinds' weights in the drills (in order)."""

    firsts: dict[str, tuple[str, ...]]
    lasts: dict[str, tuple[str, ...]]
    kind_of: dict[str, str]  # real name -> its kind
    weights: tuple[tuple[str, float], ...] = ()  # (kind, weight) in drawing order; the first kind is the primary one
    joiners: dict[str, str] = field(default_factory=dict)  # kind -> " " (word kind) or "" (character kind)

    @classmethod
    def from_entities(cls, entities: Mapping[str, Mapping[str, str]],
                      kinds: Mapping[str, float] | None = None) -> "NamePool":
        """The pool of `entities` ({kind: {name: split}}, as in ``entities.json``) restricted to `kinds` ({kind:
        drill weight}, in order; default: every kind of `entities`, in its order, weight 1 each). A kind without
        training names to build from is left out of the weights."""
        kinds = dict(kinds) if kinds is not None else {k: 1.0 for k in entities}
        firsts, lasts, kind_of, joiners, weights = {}, {}, {}, {}, []
        for kind, weight in kinds.items():
            split_of = entities.get(kind, {}) or {}
            train = [n for n, sp in split_of.items() if sp == "train" and isinstance(n, str)]
            multi = [n for n in train if len(n.split()) >= 2]
            if multi and 2 * len(multi) >= len(train):
                firsts[kind] = tuple(sorted({n.split()[0] for n in multi}))
                lasts[kind] = tuple(sorted({n.split()[-1] for n in multi}))
                joiners[kind] = " "
            else:
                single = [n for n in train if len(n) >= 4]
                firsts[kind] = tuple(sorted({n[: len(n) // 2] for n in single}))
                lasts[kind] = tuple(sorted({n[len(n) // 2:] for n in single}))
                joiners[kind] = ""
            kind_of.update({n: kind for n in split_of})
            if firsts[kind] and lasts[kind] and weight > 0:
                weights.append((kind, float(weight)))
        return cls(firsts, lasts, kind_of, tuple(weights), joiners)

    def __bool__(self) -> bool:
        return bool(self.weights)

    @property
    def primary(self) -> str | None:
        return self.weights[0][0] if self.weights else None

    def draw_kind(self, rng: np.random.Generator) -> str | None:
        """A kind by weight, with one draw of `rng` (None, and no draw, when the pool has no kind)."""
        if not self.weights:
            return None
        r, acc, total = rng.random(), 0.0, sum(w for _, w in self.weights)
        for kind, w in self.weights:
            acc += w / total
            if r < acc:
                return kind
        return self.weights[-1][0]

    def fake(self, kind: str, rng: np.random.Generator, avoid: set[str]) -> str | None:
        a, b = self.firsts.get(kind, ()), self.lasts.get(kind, ())
        join = self.joiners.get(kind, " ")
        for _ in range(64):
            if not a or not b:
                return None
            name = f"{a[int(rng.integers(len(a)))]}{join}{b[int(rng.integers(len(b)))]}"
            if name not in self.kind_of and name not in avoid:
                return name
        return None

    def words(self) -> set[str]:
        """The lower-cased words of the training names (word kinds: their first and last words; character kinds:
        the whole names)."""
        out = set()
        for kind in self.firsts:
            if self.joiners.get(kind, " "):
                out |= {w.lower() for part in (self.firsts, self.lasts) for w in part[kind]}
            else:
                out |= {n.lower() for n, k in self.kind_of.items() if k == kind and len(n.split()) == 1}
        return out


def augment_names(question: str, steps: Sequence[dict], entities: Sequence[str], pool: NamePool,
                  rng: np.random.Generator) -> tuple[str, list[dict], dict[str, str]]:
    """(question, steps, {real name: fictitious name}): the demonstration with every entity the task names replaced
    by a fictitious name of the same kind, everywhere it occurs (question, actions, observations), consistently within
    the demonstration.

    Why: the training tasks name only a few hundred entities, so a small model lowers its SFT loss fastest by
    memorising them, and then writes a *training* name for a held-out entity (measured on the default world: greedy
    validation success of 5% on level 1 at a training loss of 0.19). With fictitious names in part of the
    demonstrations, the only way to the name in a call is to copy it from the question or from a tool result, which
    is the skill the validation split asks for.
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


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


_QUOTED = re.compile(r"'([^'\n]+)'|\"([^\"\n]+)\"")  # a span between single or double quotes, on one line


def mine_copyable(question: str, steps: Sequence[dict], min_len: int = 3) -> list[str]:
    """The strings a demonstration's calls copy from its question or from an observation before the call, in order of
    first use; at least `min_len` characters with a letter, and never the answer's value (what the episode computes
    is not copied). A string is copied when it is a whole parameter value (at any depth) that occurs verbatim in
    what was read, or a quoted span of what was read (between ``'`` or ``"``) that occurs inside a parameter value:
    a value written into a larger one, such as a city into a query.

    >>> mine_copyable('Where is "Blue Hill"?', [{"action": '<call>find {"place": "Blue Hill"}</call>',
    ...                                         "observation": "north of Redwater"},
    ...                                        {"action": '<call>answer {"value": "north"}</call>', "observation": ""}])
    ['Blue Hill']
    >>> code = "count(visits, city='Lyon')"
    >>> mine_copyable("How many visits from 'Lyon' were 'late'?",
    ...               [{"action": "<call>run " + json.dumps({"code": code}) + "</call>", "observation": "7"}])
    ['Lyon']
    """
    seen, out = question, []
    for s in steps:
        m = _CALL.search(str(s.get("action", "")))
        if m and m.group(1) != "answer":
            try:
                params = json.loads(m.group(2))
            except ValueError:
                params = {}
            quoted = [a or b for a, b in _QUOTED.findall(seen)]
            for v in _strings(params):
                found = [v] if v in seen else []
                found += [q for q in quoted if q != v and q in v]
                out += [c for c in found if len(c) >= min_len and any(ch.isalpha() for ch in c) and c not in out]
        seen += "\n" + str(s.get("observation", ""))
    return out
