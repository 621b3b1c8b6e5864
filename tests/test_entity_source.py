"""Adaptation's names for any environment (pipeline.adapt.entity_source, pipeline.policy.names): the shop's drills
and augmentation are byte for byte what they were before the kinds became the shop's hook; an environment with other
kinds, or with no entities.json at all, still gets drills and augmentation, and the metrics say what was applied."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from pipeline.adapt import drills
from pipeline.adapt.entity_source import documents, name_source
from pipeline.envs.capabilities import HasCorpus, NamesEntities, has_capability
from pipeline.envs.contract import ANSWER_SPEC, Environment, Task
from pipeline.envs.registry import environment_class
from pipeline.policy.names import NamePool, augment_names, mine_copyable

# sha256 of the shop's first 500 copy drills, drill vocabulary, first 500 word drills and 20 augmentations (seed 0
# world, default options), computed with the code as it was before the kinds became a hook
SHOP_COPY = "3742d4eb5fa916c73b260660398abd036274dd7fa6ea86f6fe6543e5be5a85c7"
SHOP_WORDS = "ecb002c2651162df64b68d8b273e0c0a8129d02ee98952b867b28653d1f66583"
SHOP_WORD_DRILLS = "825b134f56989c3d47951d9ede4ae73a7ee792687af7bd337cc371a8ef5cc5c1"
SHOP_AUGMENT = "70362494623e12694c91719fac0b4b51dd2edf0c6a67eeed6965e11d40841ce0"


def _sha(x) -> str:
    return hashlib.sha256(json.dumps(x).encode()).hexdigest()


def _shop_world_dir(tmp_path: Path) -> Path:
    from pipeline.envs.contract import BuildRequest

    cls = environment_class("shop")
    out = tmp_path / "data" / "env"
    out.mkdir(parents=True)
    cls.build(out, BuildRequest(0, {"train": 4, "validation": 2, "test": 2}, {1: 1.0}, cls.Options()))
    return out


def test_shop_drills_and_augmentation_are_byte_identical_to_before(tmp_path):
    env_dir = _shop_world_dir(tmp_path)
    shop = environment_class("shop").load(env_dir)
    assert has_capability(shop, NamesEntities) and not has_capability(shop, HasCorpus)
    src = name_source(shop, tmp_path / "data", [], [])
    pool = src.pool
    assert src.source == "entities.json kinds ['products', 'suppliers']"
    copy = drills.copy_drills(pool, 500, np.random.default_rng([0, 1]))
    words = drills.drill_words(pool, extra=list(shop.vocabulary()))
    word = drills.word_drills(pool, words, 500, np.random.default_rng([0, 4]))
    ents = json.loads((env_dir / "entities.json").read_text())
    names = sorted(n for n, s in ents["products"].items() if s == "train")[:3] + \
        sorted(n for n, s in ents["suppliers"].items() if s == "train")[:1]
    q = f'Compare "{names[0]}" and "{names[3]}".'
    steps = [{"action": f'<call>lookup {{"name": "{names[0]}"}}</call>', "observation": f"{names[3]} sells {names[0]}"}]
    rng = np.random.default_rng(7)
    aug = [augment_names(q, steps, names, pool, rng) for _ in range(20)]
    assert (_sha(copy), _sha(words), _sha(word), _sha(aug)) == (SHOP_COPY, SHOP_WORDS, SHOP_WORD_DRILLS, SHOP_AUGMENT)
    # the shop's pre-training mix keeps no documents under the default `auto` (it offers no corpus())
    assert documents(shop, tmp_path / "data", "auto") == []
    assert documents(shop, tmp_path / "data", True)  # its corpus.jsonl, when asked for


class _Kinds(Environment):
    """Entities of kinds the shop does not have; no hooks."""

    name = "kinds"
    levels = (1,)

    @classmethod
    def build(cls, out_dir, request):
        raise NotImplementedError

    @classmethod
    def load(cls, world_dir):
        return cls()

    def tools(self):
        return [ANSWER_SPEC]

    def task_from_dict(self, row):
        return Task.from_dict(row)

    def open_episode(self, task, rng, randomize_values=False):
        raise NotImplementedError


def test_any_kinds_of_entities_json_give_drills_and_augmentation(tmp_path):
    env_dir = tmp_path / "data" / "env"
    env_dir.mkdir(parents=True)
    ents = {"rooms": {"Blue Hall": "train", "Red Annex": "train", "Green Loft": "test"},
            "people": {"Ada Stone": "train", "Bo Lind": "train", "Cy Marsh": "validation"}}
    (env_dir / "entities.json").write_text(json.dumps(ents))
    tasks = [{"task_id": "t1", "question": "Who booked 'Blue Hall'?"}]
    src = name_source(_Kinds(), tmp_path / "data", tasks, [])
    assert src.source == "entities.json kinds ['rooms', 'people']"
    assert src.names(tasks[0]) == ["Blue Hall"]  # no `entities` in the record: the pool's names in its question
    copy = drills.copy_drills(src.pool, 40, np.random.default_rng(0))
    assert len(copy) > 10
    real = {n for kind in ents.values() for n in kind}
    for text in copy:
        assert not any(f"'{n}'" in text for n in real)  # fictitious names only
    word = drills.word_drills(src.pool, drills.drill_words(src.pool, ["capacity"]), 20, np.random.default_rng(1))
    assert len(word) == 20
    q, _, mapping = augment_names(tasks[0]["question"], [], src.names(tasks[0]), src.pool, np.random.default_rng(2))
    assert set(mapping) == {"Blue Hall"} and "Blue Hall" not in q


def test_without_entities_json_names_are_mined_from_the_demonstrations(tmp_path):
    (tmp_path / "data" / "env").mkdir(parents=True)
    rooms = ["Oakridge", "Maplewood", "Riverside", "Stonegate", "Harborview", "Kingsley"]
    tasks = [{"task_id": f"t{i}", "question": f"What is the capacity of '{r}'?"} for i, r in enumerate(rooms)]
    demos = [{"task_id": f"t{i}", "steps": [
        {"action": f'<call>capacity {{"room": "{r}", "unit": "seats"}}</call>', "observation": f"{10 + i}"},
        {"action": f'<call>answer {{"value": "{10 + i}"}}</call>', "observation": ""}]} for i, r in enumerate(rooms)]
    src = name_source(_Kinds(), tmp_path / "data", tasks, demos)
    assert src.source == "strings the demonstrations copy from what they read"
    assert src.names(tasks[2]) == ["Riverside"]  # "seats" is not in the question: not copied, so not mined
    assert drills.copy_drills(src.pool, 20, np.random.default_rng(0))
    assert mine_copyable("no quotes", demos[0]["steps"]) == []


def test_with_nothing_to_copy_the_source_says_why(tmp_path):
    (tmp_path / "data" / "env").mkdir(parents=True)
    src = name_source(_Kinds(), tmp_path / "data", [{"task_id": "t", "question": "2 + 2?"}], [])
    assert not src.pool and src.source.startswith("none, because the world folder has no entities.json")
    assert drills.copy_drills(src.pool, 10, np.random.default_rng(0)) == []


def test_a_character_kind_redraws_the_characters_of_a_training_names_shape():
    """A character kind's fictitious name keeps a training name's shape (length, case, digits, punctuation) with its
    letters and digits drawn from the kind's training names; never a real name, and not a recombination to guess."""
    names = {"Alpha": "train", "Bravo": "train", "T-1042": "train", "Delta": "test"}
    pool = NamePool.from_entities({"codes": names})
    assert pool.shapes == {"codes": ("Alpha", "Bravo", "T-1042")} and not pool.firsts
    assert sorted(pool.chars["codes"]["A"]) == ["A", "B", "T"] and sorted(pool.chars["codes"]["0"]) == list("0124")
    rng = np.random.default_rng(0)
    fakes = [pool.fake("codes", rng, set()) for _ in range(300)]
    assert not set(fakes) & set(names)
    for f in fakes:
        assert any(len(f) == len(s) and all((a.isupper(), a.islower(), a.isdigit(), a if not a.isalnum() else "") ==
                                            (b.isupper(), b.islower(), b.isdigit(), b if not b.isalnum() else "")
                                            for a, b in zip(f, s)) for s in pool.shapes["codes"])
        assert set(f) <= set("AlphaBravoT-1042")
    assert len(set(fakes)) > 250  # far more than the 2 x 2 halves of two five-letter names could give
    ids = [f for f in fakes if len(f) == 6]  # the shape of "T-1042"
    assert ids and all(f[0] in "ABT" and f[1] == "-" and f[2:].isdigit() for f in ids)


def test_on_the_sql_world_the_mined_names_are_its_held_out_values_and_never_its_vocabulary(tmp_path):
    """Mined from the SQL analyst's demonstrations (it writes no entities.json): the cities and categories the
    questions quote into the SQL (held out of training by the world) are names; the table names the describe_table
    calls copy from the questions, and the statuses, segments and channels every split shares, are vocabulary: never
    replaced by fictitious ones, and no fictitious name is built from them."""
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build_demos
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.contract import BuildRequest
    from pipeline.envs.sql import SqlAnalyst, SqlOptions
    from pipeline.envs.sql.world import META_NAME, TABLES

    out = tmp_path / "data" / "env"
    out.mkdir(parents=True)
    result = SqlAnalyst.build(out, BuildRequest(0, {"train": 120, "validation": 200, "test": 8}, {1: 1, 2: 1, 3: 1},
                                                SqlOptions(n_customers=200, n_products=96, n_orders=1500)))
    world = SqlAnalyst.load(out)
    try:
        train = result.tasks["train"]
        demos = build_demos(train, world, BuildEnvConfig(), EnvConfig(name="sql"))
        questions = [t.question for t in result.tasks["validation"]]
        src = name_source(world, tmp_path / "data", [t.to_dict() for t in train], demos, questions)
        before = name_source(world, tmp_path / "data", [t.to_dict() for t in train], demos)  # no questions given
    finally:
        world.close()
    partition = json.loads((out / META_NAME).read_text())["partition"]
    held_out_train = set(partition["city"]["train"]) | set(partition["category"]["train"])
    names = set(src.pool.kind_of)
    assert names and names <= held_out_train
    assert not names & set(TABLES)
    assert src.source.startswith("strings the demonstrations copy from what they read (")
    assert "left as they are" in src.source and "customers" in src.source
    # fictitious names take the shapes and characters of held-out values only, never of vocabulary
    assert set(src.pool.shapes["copyable"]) == names
    assert set("".join(src.pool.chars["copyable"].values())) <= set("".join(names))
    # a task's names to replace are the held-out values its question quotes
    for t in train:
        assert all(f"'{n}'" in t.question for n in src.names(t.to_dict()))
    # the documents alone (the tables' descriptions) already keep the table names out
    assert not set(before.pool.kind_of) & set(TABLES)


def test_the_tokenizer_text_holds_no_real_name_of_a_character_kind_and_every_word_kind_name():
    """The built-in tokenizer learns from text whose character-kind names (mined cities, codes) are replaced by fresh
    fictitious ones at every occurrence, as SFT's augmentation shows them; a word kind's names stay (their words are
    in every fictitious name), and text without names is unchanged."""
    from pipeline.policy.names import without_character_names

    pool = NamePool.from_entities({"cities": {"Verona": "train", "Lille": "train", "Faro": "train"},
                                   "people": {"Ann Lee": "train", "Bo Kim": "train"}})
    texts = ["city = 'Verona' or 'Verona'", "Lillehammer and Lille", "Ann Lee met Bo Kim in Faro.", "no names"]
    out = list(without_character_names(texts, pool, np.random.default_rng(0)))
    assert not any(n in t for t in out for n in ("'Verona'", " Lille", "Faro"))
    a, b = re.findall(r"'([^']+)'", out[0])
    assert a != b and {a, b}.isdisjoint({"Verona", "Lille", "Faro"})  # a fresh fictitious name at each occurrence
    assert set(a + b) <= set("VeronaLilleFaro")
    assert out[1].startswith("Lillehammer and ")  # whole words only
    assert "Ann Lee met Bo Kim in " in out[2] and out[3] == "no names"
    people_only = NamePool.from_entities({"people": {"Ann Lee": "train", "Bo Kim": "train"}})
    assert list(without_character_names(texts, people_only, np.random.default_rng(0))) == texts


def test_the_names_an_answer_copies_from_a_tool_result_are_mined_and_replaced_alike(tmp_path):
    """A top-k answer lists what the query returned: those fields are names the policy must copy from the result, so
    they are mined (a computed figure is not) and augmentation replaces them in the result and in the answer alike.
    Mined names are character kinds: a fictitious two-word name is redrawn letter by letter, not a recombination of
    training words, and the tokenizer's text holds none of the real ones."""
    from pipeline.policy.names import without_character_names

    (tmp_path / "data" / "env").mkdir(parents=True)
    rows = [["Red Saw", "Old Drill"], ["Blue Vise", "Fine Rasp"], ["Long Level", "Wet Sander"], ["Iron Clamp", "Soft Mallet"]]
    tasks = [{"task_id": f"t{i}", "question": f"Which 2 products of 'Shelf {i}' sold best?"} for i in range(len(rows))]
    demos = [{"task_id": f"t{i}", "steps": [
        {"action": '<call>query {"sql": "SELECT name FROM p WHERE shelf = \'Shelf %d\' LIMIT 2"}</call>' % i,
         "observation": "name\n" + "\n".join(r)},
        {"action": '<call>count {"shelf": "Shelf %d"}</call>' % i, "observation": "17"},
        {"action": '<call>answer {"value": "%s"}</call>' % ", ".join(r), "observation": ""}]}
        for i, r in enumerate(rows)]
    src = name_source(_Kinds(), tmp_path / "data", tasks, demos)
    assert src.names(tasks[0]) == ["Shelf 0", "Old Drill", "Red Saw"]  # "17" was read but is no name
    assert not src.pool.firsts and "Red Saw" in src.pool.shapes["copyable"]  # a character kind, even two words
    question, steps, mapping = augment_names(tasks[0]["question"], demos[0]["steps"], src.names(tasks[0]), src.pool,
                                             np.random.default_rng(0))
    fakes = [mapping["Red Saw"], mapping["Old Drill"]]
    assert steps[0]["observation"] == "name\n" + "\n".join(fakes) and ", ".join(fakes) in steps[2]["action"]
    assert not {w for f in fakes for w in f.split()} & {w for r in rows for n in r for w in n.split()}
    text = "\n".join(s["observation"] + s["action"] for d in demos for s in d["steps"])
    cleaned = "".join(without_character_names([text], src.pool, np.random.default_rng(1)))
    assert not any(n in cleaned for r in rows for n in r)


def test_doctests_of_the_names_module():
    import doctest

    from pipeline.policy import names

    result = doctest.testmod(names)
    assert result.failed == 0 and result.attempted > 0
