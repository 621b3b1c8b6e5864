"""No world's words outside the worlds: the library and the flows speak of environments, entities and tools, never of
one environment's products, suppliers or SQL tables (beside tests/test_layering.py, which checks the imports).

A file of ``pipeline/`` or ``flows/`` outside the built-in environments' folders (:data:`WORLDS`) fails when it
contains, as a whole word and in any case, a word of :data:`WORDS` (code, comments and docstrings alike), or an SQL
statement of a world (``select ... from``) outside a module that keeps its own data in SQLite (:data:`STORAGE`:
``sqlite`` as a storage engine is fine). The registry may name the built-in environments (``shop``, ``sql``,
``calendar``): those are names, not a world's words.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLDS = ("pipeline/envs/shop/", "pipeline/envs/sql/", "pipeline/envs/calendar/")
WORDS = ("product", "products", "supplier", "suppliers", "price", "prices", "stock", "weight_kg", "flagship",
         "catalog", "catalogue", "analyst", "customer", "customers", "orders")
STORAGE = ("pipeline/envs/memory.py",)  # the long-term memory's own SQLite store
_WORD = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(WORDS) + r")(?![A-Za-z0-9_])", re.I)
_SELECT = re.compile(r"\bselect\s+[\w*(),\s]+\s+from\b", re.I)


def world_words(root: Path) -> list[str]:
    """Every occurrence of a world's word under `root`'s pipeline/ and flows/ outside :data:`WORLDS`, as
    "path:line: word"."""
    found = []
    for folder in ("pipeline", "flows"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(WORLDS):
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                found += [f"{rel}:{i}: {m.group(0)}" for m in _WORD.finditer(line)]
                if rel not in STORAGE:
                    found += [f"{rel}:{i}: {m.group(0)}" for m in _SELECT.finditer(line)]
    return found


def test_no_worlds_words_outside_the_worlds():
    found = world_words(ROOT)
    assert not found, "a world's words outside its folder (use a neutral example or a hook):\n" + "\n".join(found)


def test_the_checker_finds_each_kind_of_word(tmp_path):
    (tmp_path / "pipeline" / "envs" / "shop").mkdir(parents=True)
    (tmp_path / "flows").mkdir()
    (tmp_path / "pipeline" / "envs" / "shop" / "x.py").write_text("price = 1  # the shop's own words are fine\n")
    (tmp_path / "pipeline" / "a.py").write_text('"""Each Product has a PRICE."""\nstock_level = 1  # not a word\n')
    (tmp_path / "flows" / "b.py").write_text('q = "SELECT name FROM things"\nengine = "sqlite"\n')
    assert world_words(tmp_path) == ["pipeline/a.py:1: Product", "pipeline/a.py:1: PRICE",
                                     "flows/b.py:1: SELECT name FROM"]
