"""Finding environments: by built-in name, by entry point, or by ``module:Class``; and opening their data.

``env.name`` in params.yaml is one of:

- a built-in name: ``shop`` (the default), ``sql`` (the read-only SQL environment) or ``calendar`` (the
  booking calendar);
- the name of an entry point in the group ``agentrl.environments`` of an installed package, for example in its
  ``pyproject.toml``: ``[project.entry-points."agentrl.environments"] support = "my_pkg.env:SupportDesk"``;
- ``module:Class`` for a class importable from the current Python path;
- a mapping ``{name: weight, ...}`` of two or more of these: a mixed run (:mod:`pipeline.envs.mixed`).

A name that resolves to nothing, or to something that is not an :class:`~pipeline.envs.contract.Environment`
subclass with every required method, raises :class:`EnvironmentError_` naming the name and what is wrong.
``agentrl envs`` lists what is installed (:func:`list_environments`).
"""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import entry_points
from pathlib import Path

from pipeline.core.errors import AgentRLError
from pipeline.envs.contract import Environment

GROUP = "agentrl.environments"
BUILTIN = {"shop": "pipeline.envs.shop:ShopWorld", "sql": "pipeline.envs.sql:SqlAnalyst",
           "calendar": "pipeline.envs.calendar:CalendarWorld"}
REQUIRED = ("build", "load", "tools", "task_from_dict", "open_episode")


class EnvironmentError_(AgentRLError, ValueError):
    """An environment that cannot be found or does not keep the contract."""


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def _import(target: str, name: str) -> type:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise EnvironmentError_(f"environment {name!r}: {target!r} is not of the form module:Class")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an environment's own import error is reported, not raised through
        raise EnvironmentError_(f"environment {name!r}: cannot import {module_name} "
                                f"({type(exc).__name__}: {str(exc)[:200]})") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise EnvironmentError_(f"environment {name!r}: {module_name} has no attribute {attr!r}")
    return obj


def contract_problems(cls: object) -> list[str]:
    """What keeps `cls` from being an environment class: empty when it keeps the contract's shape."""
    if not inspect.isclass(cls) or not issubclass(cls, Environment):
        return [f"{getattr(cls, '__name__', cls)!r} is not a subclass of pipeline.envs.contract.Environment"]
    problems = []
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        problems.append(f"methods not implemented: {', '.join(abstract)}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        problems.append(f"class attribute `name` must be an identifier string, got {name!r}")
    levels = getattr(cls, "levels", ())
    if not levels or not all(isinstance(lv, int) and lv >= 1 for lv in levels):
        problems.append(f"class attribute `levels` must be a non-empty tuple of integers >= 1, got {levels!r}")
    return problems


def environment_class(name) -> type[Environment]:
    """The environment class `name` refers to (built-in name, entry point, module:Class, or a {name: weight} mix),
    checked."""
    if isinstance(name, dict):
        from pipeline.envs.mixed import mixed_class

        try:
            return mixed_class(name, environment_class)
        except ValueError as exc:
            raise EnvironmentError_(f"env.name: {exc}") from None
    if not isinstance(name, str) or not name.strip():
        raise EnvironmentError_(f"env.name must be a non-empty string, got {name!r}")
    target = BUILTIN.get(name) or _entry_points().get(name) or (name if ":" in name else None)
    if target is None:
        known = sorted({*BUILTIN, *_entry_points()})
        raise EnvironmentError_(f"unknown environment {name!r}: not a built-in, not an installed entry point of "
                                f"{GROUP!r}, not module:Class; installed: {', '.join(known)}")
    cls = _import(target, name)
    problems = contract_problems(cls)
    if problems:
        raise EnvironmentError_(f"environment {name!r} ({target}) breaks the contract: " + "; ".join(problems))
    return cls


def open_environment(name, world_dir: str | Path) -> Environment:
    """Load environment `name`'s world from `world_dir` (written by its build), as every phase does."""
    cls = environment_class(name)
    try:
        return cls.load(Path(world_dir))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise EnvironmentError_(f"environment {name!r}: cannot load its world from {world_dir} ({exc})") from None


def list_environments() -> list[dict]:
    """Every environment one can name: built-ins and installed entry points, with where each comes from and
    whether it loads and keeps the contract's shape."""
    rows = []
    for source, table in (("built-in", BUILTIN), ("entry point", _entry_points())):
        for name, target in table.items():
            try:
                cls = environment_class(name)
                rows.append({"name": name, "source": source, "target": target, "ok": True,
                             "description": cls.description})
            except EnvironmentError_ as exc:
                rows.append({"name": name, "source": source, "target": target, "ok": False,
                             "description": str(exc)})
    return rows
