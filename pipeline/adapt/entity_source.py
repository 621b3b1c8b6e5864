"""Where adaptation's names and documents come from, for any environment.

The drills of continued pre-training and the name augmentation of SFT need names the agent must copy exactly; the
documents of pre-training are the world's text. Both are taken from what the environment offers, in this order:

1. ``entities.json`` in the world folder (``{kind: {name: split}}``): every kind in it, in the file's order with
   equal drill weights, or the kinds and weights of the environment's ``entity_kinds()`` hook (capability
   :class:`~pipeline.envs.capabilities.NamesEntities`; the default world's: its two kinds, 0.75 and 0.25);
2. otherwise the environment's ``copyable_strings(task)`` (capability :class:`~pipeline.envs.capabilities.HasCorpus`)
   of every training task;
3. otherwise the strings the demonstrations' calls copy verbatim from their question or an earlier observation
   (:func:`pipeline.policy.names.mine_copyable`, over ``data/demos/train.jsonl``), less the world's *vocabulary*
   (:func:`vocabulary`): a mined string that the world's documents or the evaluation split's questions also contain
   is shared by every split (a table's name, a room, a status), not a name held out of training, and stays as it is;
4. otherwise nothing, and the metrics say so (``"none, because ..."``).

Why the vocabulary is left out: augmentation replaces a name in every drawn demonstration, and the fictitious names
are built from the pool's own parts. Mined from the demonstrations of a world whose tools take database tables, the
pool was its four table names (a call ``describe_table {"table": "visits"}`` copies the word from "How many visits
..."), so SFT never showed a real table name and taught a dozen fakes built from their halves instead ("visiters"):
65 % of the adapted model's ``describe_table`` calls failed and greedy validation success was 3 %. A string the
held-out tasks use too gains nothing from a fictitious stand-in. The evaluation questions are a sample: a shared value
that none of them happens to use (a status in 40 questions) stays a name; at the default 400 validation tasks every
status, segment and channel of the built-in SQL world is found.

A task's names to replace (augmentation) are its record's ``entities`` list where it has one, else the pool's names
that occur in its question (case 1) or the strings of case 2 or 3 for that task.

Documents (``adapt.pretrain.include_documents``): ``auto`` (the default) takes the environment's ``corpus()`` where it
offers :class:`~pipeline.envs.capabilities.HasCorpus` and nothing otherwise, so a world that only writes
``corpus.jsonl`` for its search tool (the shop) keeps a pre-training mix of drills alone; ``true`` takes ``corpus()``
or, without the capability, the texts of ``corpus.jsonl``; ``false`` takes none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import read_jsonl
from pipeline.envs.capabilities import HasCorpus, NamesEntities, has_capability
from pipeline.policy.names import NamePool, mine_copyable, whole_words_in

COPYABLE = "copyable"  # the one kind of names gathered from copyable strings


@dataclass
class NameSource:
    """The pool of fictitious-name parts, each training task's names to replace, and where they came from."""

    pool: NamePool
    names_of: dict[str, list[str]] = field(default_factory=dict)  # task_id -> names the task mentions
    source: str = ""

    def names(self, task: Mapping) -> list[str]:
        """The names of `task` (a task record) that augmentation replaces."""
        own = task.get("entities")
        if isinstance(own, list):
            return own
        return self.names_of.get(task["task_id"], [])


def _read_entities(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AgentRLError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise AgentRLError(f"{path}: expected {{kind: {{name: split}}}}, got {type(data).__name__}")
    return data


def vocabulary(strings: Sequence[str], texts: Sequence[str]) -> set[str]:
    """The `strings` that occur in `texts` as whole words (not inside a longer word), exactly.

    >>> sorted(vocabulary(["visits", "Lyon", "visit"], ["visits: visit_id INTEGER", "How many visits in 'Oslo'?"]))
    ['visits']
    """
    joined = "\n".join(texts)
    return {s for s in strings if whole_words_in(s, joined)}


def name_source(world, data_dir: Path, tasks: Sequence[dict], demos: Sequence[dict],
                shared_questions: Sequence[str] = ()) -> NameSource:
    """The names adaptation uses (see the module docstring); `tasks` are the training task records (``to_dict``),
    `shared_questions` the questions of the split adapt evaluates on, which tell mined names from vocabulary."""
    path = Path(data_dir) / "env" / "entities.json"
    reasons = []
    if path.is_file():
        kinds = world.entity_kinds() if has_capability(world, NamesEntities) else None
        pool = NamePool.from_entities(_read_entities(path), kinds)
        if pool:
            by_len = sorted(pool.kind_of, key=len, reverse=True)
            names_of = {t["task_id"]: [n for n in by_len if n in t["question"]] for t in tasks
                        if not isinstance(t.get("entities"), list)}
            return NameSource(pool, names_of, f"entities.json kinds {[k for k, _ in pool.weights]}")
        reasons.append("entities.json has no kind with training names to build fictitious ones from")
    else:
        reasons.append("the world folder has no entities.json")
    if has_capability(world, HasCorpus):
        by_task = {t.task_id: list(world.copyable_strings(t)) for t in
                   (world.task_from_dict(r) for r in tasks)}
        origin = "the environment's copyable_strings"
    else:
        question = {t["task_id"]: t["question"] for t in tasks}
        by_task: dict[str, list[str]] = {}
        for d in demos:
            if d["task_id"] in question:
                got = by_task.setdefault(d["task_id"], [])
                got += [s for s in mine_copyable(question[d["task_id"]], d["steps"]) if s not in got]
        origin = "strings the demonstrations copy from what they read"
        shared = vocabulary(sorted({s for ss in by_task.values() for s in ss}),
                            documents(world, data_dir, True) + list(shared_questions))
        if shared:
            by_task = {k: [s for s in ss if s not in shared] for k, ss in by_task.items()}
            origin += (f" ({len(shared)} left as they are: the world's documents or the evaluation questions use "
                       f"them too: {', '.join(sorted(shared)[:4])}{', ...' if len(shared) > 4 else ''})")
    strings = {s: "train" for ss in by_task.values() for s in ss}
    pool = NamePool.from_entities({COPYABLE: strings}, characters=True)
    if pool:
        return NameSource(pool, by_task, origin)
    reasons.append(f"no {origin} to build fictitious names from")
    return NameSource(pool, {}, "none, because " + "; ".join(reasons))


def documents(world, data_dir: Path, setting: bool | str) -> list[str]:
    """The world's documents for pre-training under ``adapt.pretrain.include_documents`` (see the module docstring)."""
    if setting is False:
        return []
    if has_capability(world, HasCorpus):
        return [t for t in world.corpus() if isinstance(t, str)]
    if setting == "auto":
        return []
    path = Path(data_dir) / "env" / "corpus.jsonl"
    if not path.is_file():
        return []
    return [d["text"] for d in read_jsonl(path, "document corpus", allow_empty=True) if isinstance(d.get("text"), str)]
