"""Fictitious names: the pool they are drawn from, and the augmentation that puts them into demonstrations.

- :class:`NamePool`: for every *kind* of name an environment offers, the parts to build fictitious names from (taken
  from training names only) and every real name (which a fictitious one must never be), with each kind's weight in
  the drills;
- :func:`augment_names`: a demonstration with the names its task mentions replaced by fictitious ones of the same
  kind, consistently;
- :func:`mine_copyable`: the strings a demonstration's calls copy verbatim from its question or an earlier
  observation (the names of an environment that writes no ``entities.json``).

A kind whose training names mostly have two words or more is a *word* kind: a fictitious name is the first word of
one training name and the last word of another ("Adjective Noun" + "Word Kind" gives "Adjective Kind"): a held-out
name of such a world is a new pair of known words. Any other kind is a *character* kind (cities, codes, ids): a
fictitious name keeps the shape of one training name (its length, case, digits, spaces and punctuation) with every
letter and digit drawn afresh from the characters of the kind's training names ("Bologna" may give "Rnaeolg",
"T-1042" gives "T-7310"). A held-out name of such a world is a new character string, and a model can write it only by
copying. Fictitious names built from the halves of training names ("Bol" + "ille") were tried first: on the built-in
SQL world the adapted model learned the halves and wrote invented names such as "Mallle" for a held-out city it
should have copied. Where the names come from (``entities.json``, an environment's hooks, the demonstrations) is
decided in :mod:`pipeline.adapt.entity_source`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

_CALL = re.compile(r"<call>\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\{.*\})\s*</call>", re.S)


def _class(ch: str) -> str:
    """The class a character of a character-kind name is redrawn within: "a" (lower case), "A" (upper case), "0"
    (digit), or "" (kept as it is)."""
    if ch.isdigit():
        return "0"
    if ch.isalpha():
        return "A" if ch.isupper() else "a"
    return ""


@dataclass(frozen=True)
class NamePool:
    """Parts of fictitious names per kind, every real name, and the kinds' weights in the drills (in order).

    A word kind has ``firsts`` and ``lasts`` (the first and last words of its training names); a character kind has
    ``shapes`` (its training names) and ``chars`` (per character class, every character of its training names, with
    repeats, so that a redrawn character follows their frequencies)."""

    firsts: dict[str, tuple[str, ...]]
    lasts: dict[str, tuple[str, ...]]
    kind_of: dict[str, str]  # real name -> its kind
    weights: tuple[tuple[str, float], ...] = ()  # (kind, weight) in drawing order; the first kind is the primary one
    shapes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # character kind -> its training names
    chars: dict[str, dict[str, str]] = field(default_factory=dict)  # character kind -> {class: its characters}

    @classmethod
    def from_entities(cls, entities: Mapping[str, Mapping[str, str]],
                      kinds: Mapping[str, float] | None = None, characters: bool = False) -> "NamePool":
        """The pool of `entities` ({kind: {name: split}}, as in ``entities.json``) restricted to `kinds` ({kind:
        drill weight}, in order; default: every kind of `entities`, in its order, weight 1 each). A kind without
        training names to build from is left out of the weights. With `characters`, every kind is a character kind
        (names mined from demonstrations: nothing says how a held-out one is formed)."""
        kinds = dict(kinds) if kinds is not None else {k: 1.0 for k in entities}
        firsts, lasts, kind_of, shapes, chars, weights = {}, {}, {}, {}, {}, []
        for kind, weight in kinds.items():
            split_of = entities.get(kind, {}) or {}
            train = [n for n, sp in split_of.items() if sp == "train" and isinstance(n, str)]
            multi = [n for n in train if len(n.split()) >= 2]
            if multi and 2 * len(multi) >= len(train) and not characters:
                firsts[kind] = tuple(sorted({n.split()[0] for n in multi}))
                lasts[kind] = tuple(sorted({n.split()[-1] for n in multi}))
                usable = firsts[kind] and lasts[kind]
            else:
                shapes[kind] = tuple(sorted({n for n in train if sum(_class(c) != "" for c in n) >= 3}))
                chars[kind] = {k: "".join(c for n in shapes[kind] for c in n if _class(c) == k) for k in "aA0"}
                usable = shapes[kind]
            kind_of.update({n: kind for n in split_of})
            if usable and weight > 0:
                weights.append((kind, float(weight)))
        return cls(firsts, lasts, kind_of, tuple(weights), shapes, chars)

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
        """A fictitious name of `kind` (see the module docstring) that is no real name and not in `avoid`; None when
        the kind has nothing to build from or 64 draws found none."""
        for _ in range(64):
            name = self._draw(kind, rng)
            if name is None:
                return None
            if name not in self.kind_of and name not in avoid:
                return name
        return None

    def _draw(self, kind: str, rng: np.random.Generator) -> str | None:
        if kind in self.shapes:
            shapes, chars = self.shapes[kind], self.chars[kind]
            if not shapes:
                return None
            shape = shapes[int(rng.integers(len(shapes)))]
            return "".join(chars[k][int(rng.integers(len(chars[k])))] if (k := _class(c)) else c for c in shape)
        a, b = self.firsts.get(kind, ()), self.lasts.get(kind, ())
        if not a or not b:
            return None
        return f"{a[int(rng.integers(len(a)))]} {b[int(rng.integers(len(b)))]}"

    def words(self) -> set[str]:
        """The lower-cased words of the training names (word kinds: their first and last words; character kinds:
        the whole names)."""
        out = set()
        for kind in self.firsts:
            out |= {w.lower() for part in (self.firsts, self.lasts) for w in part[kind]}
        for kind in self.shapes:
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


def whole_words_in(part: str, text: str) -> bool:
    """Whether `part` occurs in `text` as whole words (not inside a longer word)."""
    return re.search(rf"(?<!\w){re.escape(part)}(?!\w)", text) is not None


def without_character_names(texts: Iterable[str], pool: NamePool, rng: np.random.Generator) -> Iterator[str]:
    """`texts` with every occurrence of a character kind's real name (as whole words) replaced by a fresh fictitious
    one: the text a tokenizer is trained on when the policy is to copy such names.

    Why: entity augmentation replaces them in every demonstration SFT draws, so a tokenizer trained on the raw
    demonstrations learns a token for each frequent training name ("Verona") that no training step ever shows. On the
    built-in SQL world the adapted model then copied the held-out cities (pieces of known tokens) and failed on every
    training city, the names of the tasks RL trains on and of most real traffic: it wrote 'Cri' for 'Verona'. Without
    those tokens a training name is pieces like a held-out one. Word kinds are left alone: their fictitious names are
    made of the training names' words, which SFT shows.
    """
    names = sorted((n for n, k in pool.kind_of.items() if k in pool.shapes), key=len, reverse=True)
    if not names:
        yield from texts
        return
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(re.escape(n) for n in names) + r")(?!\w)")
    stand_in = lambda m: pool.fake(pool.kind_of[m.group(0)], rng, set()) or m.group(0)  # noqa: E731
    for text in texts:
        yield pattern.sub(stand_in, text)


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


_FIELD = re.compile(r"\n|\t|\s*[|,;]\s*")  # what separates the fields of a tool's result: lines, tabs, | , ;
# a span between single or double quotes, on one line; a quote inside a word (an apostrophe: "Where's") opens none
_QUOTED = re.compile(r"(?<!\w)'([^'\n]+)'(?!\w)|(?<!\w)\"([^\"\n]+)\"(?!\w)")


def mine_copyable(question: str, steps: Sequence[dict], min_len: int = 3) -> list[str]:
    """The strings a demonstration's calls copy from its question or from an observation before the call, in order of
    first use; at least `min_len` characters with a letter. A string is copied when it is a whole parameter value (at
    any depth) that occurs verbatim in what was read, or a quoted span of what was read (between ``'`` or ``"``) that
    occurs inside a parameter value: a value written into a larger one, such as a city into a query. The answer's
    value copies the fields of the tools' results it contains as whole words (a field: a result's line, or a part
    of it between ``|``, ``,``, ``;`` or tabs), such as the names a query listed; what the episode computes (a sum,
    a count) has no letter and is never a name.

    >>> mine_copyable('Where is "Blue Hill"?', [{"action": '<call>find {"place": "Blue Hill"}</call>',
    ...                                         "observation": "north of Redwater"},
    ...                                        {"action": '<call>answer {"value": "north"}</call>', "observation": ""}])
    ['Blue Hill']
    >>> code = "count(visits, city='Lyon')"
    >>> mine_copyable("How many of the day's visits from 'Lyon' were 'late'?",
    ...               [{"action": "<call>run " + json.dumps({"code": code}) + "</call>", "observation": "7"}])
    ['Lyon']

    >>> code = "top(2, category='tools')"
    >>> mine_copyable("Which 2 'tools' sold best?", [
    ...     {"action": "<call>run " + json.dumps({"code": code}) + "</call>", "observation": "name|Red Saw|Old Drill"},
    ...     {"action": '<call>answer {"value": "Red Saw, Old Drill"}</call>', "observation": ""}])
    ['tools', 'Old Drill', 'Red Saw']

    A quoted span counts only as whole words of the value: 'Lyon' is not copied into "Lyonnais".

    >>> mine_copyable("Dishes from 'Lyon'?", [{"action": '<call>find {"q": "Lyonnais"}</call>', "observation": ""}])
    []
    """
    seen, results, out = question, "", []
    for s in steps:
        m = _CALL.search(str(s.get("action", "")))
        if m:
            try:
                params = json.loads(m.group(2))
            except ValueError:
                params = {}
            quoted = [a or b for a, b in _QUOTED.findall(seen)]
            fields = {f.strip() for f in _FIELD.split(results)} - {""}
            for v in _strings(params):
                if m.group(1) == "answer":
                    found = [f for f in sorted(fields) if whole_words_in(f, v)]
                else:
                    found = [v] if v in seen else []
                    found += [q for q in quoted if q != v and whole_words_in(q, v)]
                out += [c for c in found if len(c) >= min_len and any(ch.isalpha() for ch in c) and c not in out]
        seen += "\n" + str(s.get("observation", ""))
        # the observation keeps its <obs>...</obs>, so a listed result's first and last rows are no field of their
        # own and are not mined: they stay real names in the augmented demonstrations. Mining them too (the wrapper
        # stripped) took a built-in world's adapted model from 0.26 to 0.00 on its list answers, which then showed
        # SFT no real name at all (docs/env-sql.md, "What limits it")
        results += "\n" + str(s.get("observation", ""))
    return out

