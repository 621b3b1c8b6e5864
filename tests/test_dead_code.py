"""No dead functions: every function or method defined in ``pipeline/`` and ``flows/`` is referenced somewhere.

The check is an AST walk. A function counts as *referenced* when its name occurs anywhere in ``pipeline/``,
``flows/``, ``tests/``, ``bench/`` or ``scripts/`` as a name (``f(...)``), an attribute (``obj.f``), an imported
name, or a word inside a string constant (``"module:f"``, ``getattr(obj, "f")``), or in ``pyproject.toml``,
``dvc.yaml``, ``params.yaml`` or ``prefect.yaml`` (entry points and ``module:Class`` references). A name is all it
takes, so the check is conservative: it misses a dead ``reset`` beside a live one, and never reports a live function.

What is called by a framework and never by name is exempt:

- special methods (``__init__``, ``__call__``, ...);
- functions registered by their decorator (:data:`REGISTERING_DECORATORS`: pydantic validators, FastAPI routes);
- the hooks listed in :data:`CALLBACKS`, each with the framework that calls it.

Hooks of the environment contract and of the training extensions are called by name by the pipeline, so they
need no entry. A new dead function fails :func:`test_no_dead_functions` with its file, line and name: delete it,
or, if a framework calls it, add it to :data:`CALLBACKS` saying which.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFINED_IN = ("pipeline", "flows")
USED_IN = ("pipeline", "flows", "tests", "bench", "scripts")
CONFIG_FILES = ("pyproject.toml", "dvc.yaml", "params.yaml", "prefect.yaml")
# Decorators that hand the function to a framework, which calls it (the last dotted part of the decorator's name).
REGISTERING_DECORATORS = ("field_validator", "model_validator", "get", "post", "put", "delete", "on_event")
# (class, method) -> who calls it.
CALLBACKS = {
    ("AgentPolicyModel", "load_context"): "MLflow's PythonModel, when the packaged model is loaded",
    ("SlotLayer", "get_mask_sizes"): "transformers' Cache layer interface, from the attention mask code",
    ("SlotLayer", "get_max_length"): "transformers' Cache layer interface",
}
WORD = re.compile(r"[A-Za-z_]\w*")


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> tuple[str, ast.AST | None]:
    """The text of `path` and its syntax tree (None for a file that is not Python): each file is parsed once."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return text, ast.parse(text)
    except SyntaxError:
        return text, None


def defined_functions(root: Path, folders=DEFINED_IN) -> list[tuple[str, int, str | None, str, list[str]]]:
    """(path, line, enclosing class or None, name, decorator names) of every function under `folders`."""
    out = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()

            def visit(node: ast.AST, cls: str | None) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        decorators = [ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1]
                                      for d in child.decorator_list]
                        out.append((rel, child.lineno, cls, child.name, decorators))
                        visit(child, None)
                    else:
                        visit(child, child.name if isinstance(child, ast.ClassDef) else cls)

            visit(_parse(path)[1], None)
    return out


def used_names(root: Path, folders=USED_IN, config_files=CONFIG_FILES) -> set[str]:
    """Every name, attribute, imported name and word of a string constant under `folders` (Python files and the
    extension-less scripts), plus every word of `config_files`."""
    used: set[str] = set()
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or not (path.suffix == ".py" or (folder == "scripts" and not path.suffix)):
                continue
            text, tree = _parse(path)
            if tree is None:  # a shell script: every word counts
                used.update(WORD.findall(text))
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Name):
                    used.add(node.id)
                elif isinstance(node, ast.Attribute):
                    used.add(node.attr)
                elif isinstance(node, ast.alias):
                    used.add(node.name.split(".")[-1])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    used.update(WORD.findall(node.value))
    for name in config_files:
        if (root / name).is_file():
            used.update(WORD.findall((root / name).read_text(encoding="utf-8")))
    return used


def dead_functions(root: Path) -> list[str]:
    """"path:line: name" of every function under DEFINED_IN that nothing references (see the module docstring)."""
    used = used_names(root)
    dead = []
    for path, line, cls, name, decorators in defined_functions(root):
        if name in used or (name.startswith("__") and name.endswith("__")) or (cls, name) in CALLBACKS:
            continue
        if any(d in REGISTERING_DECORATORS for d in decorators):
            continue
        dead.append(f"{path}:{line}: {cls + '.' if cls else ''}{name}")
    return dead


def test_no_dead_functions():
    dead = dead_functions(ROOT)
    assert not dead, "functions nothing references (delete them, or list a framework callback in CALLBACKS):\n" + \
        "\n".join(dead)


def test_callbacks_still_exist():
    """An allow-list entry whose method is gone would hide nothing but stay forever: each must still be defined."""
    defined = {(cls, name) for _, _, cls, name, _ in defined_functions(ROOT)}
    assert set(CALLBACKS) <= defined, sorted(set(CALLBACKS) - defined)


def test_a_dead_function_is_found(tmp_path):
    """The check fails on a tree with a dead function and passes once something calls it."""
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pipeline" / "mod.py").write_text(
        "from pydantic import BaseModel, field_validator\n\n"
        "def live():\n    return 1\n\n"
        "def unused_helper():\n    return live()\n\n"
        "class C(BaseModel):\n    x: int = 0\n\n"
        "    @field_validator('x')\n    @classmethod\n    def _check(cls, v):\n        return v\n\n"
        "    def __repr__(self):\n        return 'C'\n", encoding="utf-8")
    assert dead_functions(tmp_path) == ["pipeline/mod.py:6: unused_helper"]
    (tmp_path / "tests" / "test_mod.py").write_text("from pipeline.mod import unused_helper\n", encoding="utf-8")
    assert dead_functions(tmp_path) == []
