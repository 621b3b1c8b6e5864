"""Every relative link of the README and docs/ resolves: the file exists, and an anchor (``page.md#section``) names a
heading of that page, as GitHub renders it (lower case; punctuation other than ``-`` and ``_`` dropped; each space a
``-``). Links to web pages are not followed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: ``### `train.lr` (why)`` -> ``trainlr-why``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(h) for h in HEADING.findall(text)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8")))


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    bad = []
    for page in pages:
        for target in links(page):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no such heading)")
    return bad


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert sum(len(links(p)) for p in pages) > 50
    assert broken_links(pages) == []


def test_a_broken_link_is_found(tmp_path):
    assert slug("`train.guide_failed_groups`") == "trainguide_failed_groups"
    (tmp_path / "a.md").write_text("# Top\n\n## The committed run (run 18)\n\n[ok](#the-committed-run-run-18) "
                                   "[ok](b.md) [gone](c.md) [bad](b.md#nothing) [web](https://example.org/x.md)\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links([tmp_path / "a.md"], tmp_path) == ["a.md: c.md (no such file)", "a.md: b.md#nothing (no such heading)"]


def test_front_pages_stay_short():
    """The README is a front page and experiments.md the figures behind today's defaults, not lab notebooks: the
    README at most 350 lines, experiments.md at most 500, with its dated "Record" as the last section."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 350
    experiments = (ROOT / "docs" / "experiments.md").read_text(encoding="utf-8")
    assert len(experiments.splitlines()) <= 500
    sections = re.findall(r"^## (.+)$", FENCE.sub("", experiments), flags=re.MULTILINE)
    assert sections[-1] == "Record", sections


CODE_PATH = re.compile(r"`((?:pipeline|flows|bench|scripts|tests)/[\w/.-]+\.(?:py|yaml|md|sh))")


def missing_code_paths(pages: list[Path], root: Path = ROOT) -> list[str]:
    """Repository files that a page names in code spans (``pipeline/train/loop.py``) and that do not exist."""
    return [f"{page.relative_to(root)}: {path}" for page in pages
            for path in CODE_PATH.findall(page.read_text(encoding="utf-8")) if not (root / path).exists()]


def test_every_code_path_the_docs_name_exists(tmp_path):
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert sum(len(CODE_PATH.findall(p.read_text(encoding="utf-8"))) for p in pages) > 50
    assert missing_code_paths(pages) == []
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "here.py").write_text("")
    (tmp_path / "a.md").write_text("`pipeline/here.py` and `pipeline/gone.py`, (`pipeline/x/`)\n")
    assert missing_code_paths([tmp_path / "a.md"], tmp_path) == ["a.md: pipeline/gone.py"]
