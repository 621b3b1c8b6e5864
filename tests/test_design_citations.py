"""Every citation of the design resolves: ``design.md §N`` anywhere in the repository names a heading of
docs/design.md, and the design is cited only that way.

A citation is ``design.md`` followed by one or more section numbers (``docs/design.md §3.4``,
``docs/design.md §1.3, §3.6``, ``[design.md §5.2.1](design.md)`` in the docs); inside docs/design.md a bare ``§N``
cross-reference must resolve too. A heading of docs/design.md is ``## N title``, ``### N.M title`` or deeper.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SCANNED = ("pipeline", "flows", "bench", "scripts", "docs", "tests", "configs", "projects")
TOP_FILES = ("README.md", "params.yaml", "dvc.yaml", "pyproject.toml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ""}
NUM = r"\d+(?:\.\d+)*"
CITATION = re.compile(rf"design\.md\s*(§{NUM}(?:(?:,\s*|\s+and\s+)§{NUM})*)")
HEADING = re.compile(rf"^#{{2,6}} ({NUM}) \S", re.MULTILINE)
# The old way of citing it, which named a text nobody who clones the repository has.
UNCITABLE = "design " + "document"


def headings(text: str) -> set[str]:
    return set(HEADING.findall(text))


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for folder in SCANNED:
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
    return files


def citations(text: str) -> list[str]:
    """Every section number a ``design.md §…`` citation in `text` names."""
    return [n for m in CITATION.finditer(text) for n in re.findall(NUM, m.group(1))]


def unresolved(files: list[Path], known: set[str]) -> list[str]:
    bad = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        numbers = citations(text)
        if path == DESIGN:
            numbers += re.findall(rf"§({NUM})", text)
        bad += [f"{path.relative_to(ROOT)}: §{n}" for n in numbers if n not in known]
    return bad


def test_design_has_numbered_sections():
    known = headings(DESIGN.read_text(encoding="utf-8"))
    assert {"1", "2", "3", "4", "5", "6", "3.4", "5.2.1"} <= known, sorted(known)


def test_every_citation_resolves():
    known = headings(DESIGN.read_text(encoding="utf-8"))
    files = scanned_files()
    assert sum(len(citations(p.read_text(encoding="utf-8", errors="replace"))) for p in files) > 30
    assert unresolved(files, known) == []


def test_the_design_is_cited_only_through_its_page():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in scanned_files() if p.name != Path(__file__).name
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if UNCITABLE in line.lower()]
    assert hits == [], f"cite docs/design.md §N instead: {hits}"


def test_a_missing_section_is_reported(tmp_path):
    """The checker finds a citation of a section the page lacks, in each way of citing."""
    page = tmp_path / "design.md"
    page.write_text("## 1 One\n\n### 1.2 Two\n", encoding="utf-8")
    known = headings(page.read_text(encoding="utf-8"))
    assert known == {"1", "1.2"}
    cited = citations("as docs/design" + ".md §1.2 and §7 say; docs/design" + ".md §1, §1.4")
    assert cited == ["1.2", "7", "1", "1.4"]
    assert [n for n in cited if n not in known] == ["7", "1.4"]
    assert citations("(docs/design" + ".md\n§1.3, §3.6)") == ["1.3", "3.6"]
    assert citations("[design" + ".md §5.2.1](design.md)") == ["5.2.1"]
