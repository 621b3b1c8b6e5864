"""The code's shape: no function in `pipeline/` or `flows/` longer than :data:`MAX_FUNCTION_LINES` lines.

A function's length runs from its `def` line to its last line (decorators left out, docstring, comments and nested
functions counted in), as :func:`long_functions` reads it from the syntax tree. A longer function does more than one
job: split it into functions that each do one and read top to bottom.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
PACKAGES = ("pipeline", "flows")

# Functions allowed over the limit for now, as "path:qualified name". Each is being split in its own change; when that
# change lands, its entry here fails test_every_allowed_function_is_still_long_so_its_entry_is_still_needed and is
# removed. Add nothing to this list.
ALLOWED: set[str] = set()


def function_lengths(source: str, path: str) -> dict[str, int]:
    """{"path:qualified name": lines} of every function and method in `source`, nested ones included (their name
    under their parent's: ``outer.inner``)."""
    lengths: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{path}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return lengths


@functools.cache
def all_function_lengths() -> dict[str, int]:
    lengths: dict[str, int] = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            lengths.update(function_lengths(file.read_text(encoding="utf-8"), file.relative_to(ROOT).as_posix()))
    return lengths


def long_functions(lengths: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}


def test_no_function_in_pipeline_or_flows_is_longer_than_the_limit():
    too_long = {name: n for name, n in long_functions(all_function_lengths()).items() if name not in ALLOWED}
    assert not too_long, "\n".join(f"{name}: {n} lines (at most {MAX_FUNCTION_LINES}: split it)"
                                   for name, n in sorted(too_long.items(), key=lambda item: -item[1]))


def test_every_allowed_function_is_still_long_so_its_entry_is_still_needed():
    lengths = all_function_lengths()
    stale = sorted(name for name in ALLOWED if lengths.get(name, 0) <= MAX_FUNCTION_LINES)
    assert not stale, f"remove from ALLOWED (gone, renamed or now short enough): {stale}"


def test_the_count_includes_nested_functions_methods_and_docstrings():
    lines = "".join(f"x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 3))
    source = (
        "import functools\n\n"
        "@functools.cache\n"
        "def short():\n"
        '    """One line of docstring."""\n'
        + textwrap.indent(lines, " " * 4)
        + "    return 0\n\n"
        "class Engine:\n"
        "    async def step(self):\n"
        "        def inner():\n"
        + textwrap.indent(lines, " " * 12)
        + "            return 1\n"
        "        return inner\n"
    )
    lengths = function_lengths(source, "m.py")
    assert lengths["m.py:short"] == MAX_FUNCTION_LINES  # the decorator is not counted; the docstring is
    assert lengths["m.py:Engine.step.inner"] == MAX_FUNCTION_LINES - 1
    assert lengths["m.py:Engine.step"] == MAX_FUNCTION_LINES + 1  # its nested function counts in it
    assert long_functions(lengths) == {"m.py:Engine.step": MAX_FUNCTION_LINES + 1}
