"""The library's layering, read from the import statements of every module under pipeline/.

Rules (each import anywhere in a file counts, inside functions too, relative imports resolved):

- the library imports no orchestrator and nothing of the flows: no ``prefect``, no ``flows``;
- MLflow is imported only by the tracking, registry and model-packaging modules (:data:`MLFLOW_MODULES`);
- the packages form layers: ``core`` imports no other pipeline package, ``envs`` only ``core``, ``policy`` only
  ``core`` and ``envs``; a phase package imports those three and never another phase. One exception is listed by
  name (:data:`CONFIG_READS`): ``check_drift`` reads the ``build_env`` section through ``pipeline.build_env.config``,
  because its fresh reference samples must be drawn with the settings the build drew the training tasks with; and
  ``train`` reads the learned verifier through ``pipeline.reward_model.config`` and ``pipeline.reward_model.reward``
  (``train.learned_reward``: the model scores episodes as a reward component);
- the built-in environments are private to themselves (:data:`PRIVATE_ENVS`): no module outside
  ``pipeline/envs/shop/`` imports ``pipeline.envs.shop``, and none outside ``pipeline/envs/sql/`` imports
  ``pipeline.envs.sql``; the registry names them by string (``module:Class``), so phases reach them only through
  the contract.

The checker is a plain function over a folder, so a test can also run it on a temporary tree that breaks each rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = ("prefect", "flows")
MLFLOW_MODULES = frozenset({"core/tracking.py", "deploy/registry.py", "deploy/pyfunc.py", "deploy/pyfunc_entry.py"})
SHARED = ("core", "envs", "policy")
PHASES = ("build_env", "adapt", "reward_model", "train", "evaluate", "check_drift", "deploy")
ALLOWED = {"core": set(), "envs": {"core"}, "policy": {"core", "envs"}, **{p: set(SHARED) for p in PHASES}}
# A phase that must read another phase's params section the way that phase does: (reader, "phase.config").
CONFIG_READS = frozenset({
    ("check_drift", "build_env.config"),  # a fresh reference sample uses the build's settings
    ("train", "reward_model.config"), ("train", "reward_model.reward"),  # the learned verifier as a reward component
})
# Environments only their own package may import (the registry names them by string): dotted package -> its folder.
PRIVATE_ENVS = {"pipeline.envs.shop": "envs/shop/", "pipeline.envs.sql": "envs/sql/",
                "pipeline.envs.calendar": "envs/calendar/"}


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in `source`, the module being `module` (relative imports resolved).

    ``from a import b`` yields ``a.b`` as well as ``a``, so that ``from pipeline import train`` names the package.
    """
    package = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*"]
    return out


def layering_violations(pipeline_dir: Path) -> list[str]:
    """Every import under `pipeline_dir` that breaks a rule of the module docstring, as "path:line: what"."""
    problems = {}  # (file, line, rule) -> message: `from a import b` reports once, naming a.b
    for path in sorted(pipeline_dir.rglob("*.py")):
        rel = path.relative_to(pipeline_dir)
        parts = list(rel.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(["pipeline", *(parts[:-1] if is_package else parts)])
        own = rel.parts[0] if len(rel.parts) > 1 else None  # None: pipeline/__init__.py itself
        where = f"pipeline/{rel.as_posix()}"
        for line, name in imported_modules(path.read_text(encoding="utf-8"), module, is_package):
            top = name.split(".")[0]
            private = next((pkg for pkg in PRIVATE_ENVS if name == pkg or name.startswith(pkg + ".")), None)
            if private and not rel.as_posix().startswith(PRIVATE_ENVS[private]):
                key, what = private, f"imports {name} (only {PRIVATE_ENVS[private]} imports {private})"
                problems.setdefault((where, line, key), f"{where}:{line}: {what}")
            if top in FORBIDDEN:
                key, what = top, f"imports {name} (the library imports no {top})"
            elif top == "mlflow" and rel.as_posix() not in MLFLOW_MODULES:
                key, what = top, f"imports {name} (MLflow only in {sorted(MLFLOW_MODULES)})"
            elif top == "pipeline" and own is not None and name.count("."):
                target = name.split(".")[1]
                if target not in ALLOWED or target == own or target in ALLOWED.get(own, set()):
                    continue
                if (own, ".".join(name.split(".")[1:3])) in CONFIG_READS:
                    continue
                key, what = target, f"pipeline.{own} imports pipeline.{target} ({name})"
            else:
                continue
            problems.setdefault((where, line, key), f"{where}:{line}: {what}")
    return sorted(problems.values())


def test_the_library_keeps_its_layers():
    problems = layering_violations(ROOT / "pipeline")
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_every_package_has_a_layer():
    packages = {p.name for p in (ROOT / "pipeline").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert packages == set(ALLOWED), f"packages without a layer rule: {sorted(packages - set(ALLOWED))}"


def test_the_mlflow_modules_exist():
    missing = [m for m in MLFLOW_MODULES if not (ROOT / "pipeline" / m).is_file()]
    assert not missing, f"the MLflow allow-list names modules that are gone: {missing}"


BAD_IMPORTS = {
    "core/a.py": ("def f():\n    import prefect\n", "imports prefect"),
    "core/b.py": ("from flows.cli import main\n", "imports flows.cli"),
    "envs/c.py": ("import flows.summary as s\n", "imports flows.summary"),
    "envs/d.py": ("import mlflow\n", "imports mlflow (MLflow only"),
    "core/e.py": ("from pipeline.envs import taskfile\n", "pipeline.core imports pipeline.envs"),
    "envs/f.py": ("from pipeline.policy.model import load_policy\n", "pipeline.envs imports pipeline.policy"),
    "policy/g.py": ("from pipeline import train\n", "pipeline.policy imports pipeline.train"),
    "train/h.py": ("def f():\n    from pipeline.adapt.sft import x\n", "pipeline.train imports pipeline.adapt"),
    "deploy/i.py": ("from ..evaluate import report\n", "pipeline.deploy imports pipeline.evaluate"),
    "check_drift/j.py": ("from . import suites\nfrom ..envs import taskfile\nimport mlflow.pyfunc\n",
                         "imports mlflow.pyfunc"),
    # the built-in environments are reached through the registry only
    "policy/k.py": ("from pipeline.envs.shop.tasks import Task\n", "imports pipeline.envs.shop.tasks (only envs/shop/"),
    "train/l.py": ("def f():\n    import pipeline.envs.sql\n", "imports pipeline.envs.sql (only envs/sql/"),
    "envs/m.py": ("from .shop import ShopWorld\n", "imports pipeline.envs.shop (only envs/shop/"),
    "envs/sql/n.py": ("from ..shop.world import World\n", "imports pipeline.envs.shop.world (only envs/shop/"),
    "envs/shop/o.py": ("from pipeline.envs.sql import tools\n", "imports pipeline.envs.sql (only envs/sql/"),
}


@pytest.mark.parametrize("rel", sorted(BAD_IMPORTS))
def test_the_checker_reports_an_added_import(tmp_path, rel):
    source, expected = BAD_IMPORTS[rel]
    for name in ("core", "envs", "envs/shop", "envs/sql", "policy", "train", "deploy", "check_drift", "evaluate",
                 "adapt"):
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(source)
    problems = layering_violations(tmp_path)
    assert len(problems) == 1 and expected in problems[0] and problems[0].startswith(f"pipeline/{rel}:"), problems


def test_the_checker_accepts_allowed_imports(tmp_path):
    files = {
        "core/a.py": "import json\nfrom pipeline.core.errors import AgentRLError\nfrom . import errors\n",
        "core/tracking.py": "def f():\n    import mlflow\n",
        "envs/b.py": "from pipeline.core.jsonl import read_jsonl\nfrom .contract import Task\n",
        "envs/registry.py": "BUILTIN = {'shop': 'pipeline.envs.shop:ShopWorld'}\nfrom pipeline.envs.contract import Environment\n",
        "envs/shop/world.py": "from pipeline.envs.shop.tools import Lookup\nfrom .tasks import Task\nfrom ..contract import ToolSpec\n",
        "envs/sql/env.py": "from pipeline.envs.sql.tools import TOOL_NAMES\nfrom . import tools\n",
        "policy/c.py": "from pipeline.envs.contract import Task\nfrom pipeline.core import config\n",
        "train/d.py": "from pipeline.policy import model\nfrom pipeline.train.config import TrainConfig\n",
        "__init__.py": "import os\n",
    }
    for rel, source in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    assert layering_violations(tmp_path) == []


def import_circles(root: Path, packages=("pipeline", "flows")) -> list[list[str]]:
    """Every circle of modules under `packages` that import each other, counting imports inside functions too (a
    loop of them is a tangle whichever import runs first); a package's ``__init__`` counts as its own module."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = (path, name.endswith(".__init__"))
    # a module's own packages are left out: Python imports them before the module anyway, so `from pkg import x`
    # inside pkg ties nothing new
    graph = {m: sorted({d for _, d in imported_modules(path.read_text(), m, is_pkg)
                        if d in files and d != m and not m.startswith(d + ".")})
             for m, (path, is_pkg) in files.items()}
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                circles.append(path[path.index(d):] + [m, d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return circles


def test_no_import_circle_anywhere():
    circles = import_circles(Path(__file__).resolve().parents[1])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle(tmp_path):
    for name, body in {"a.py": "from pipeline import b\n", "b.py": "def f():\n    from pipeline import a\n"}.items():
        (tmp_path / "pipeline").mkdir(exist_ok=True)
        (tmp_path / "pipeline" / name).write_text(body)
    (tmp_path / "pipeline" / "__init__.py").write_text("")
    assert import_circles(tmp_path, ("pipeline",)) == [["pipeline.a", "pipeline.b", "pipeline.a"]]
