"""A memo of passed validations: the same data under the same suite is not validated twice.

Importing Great Expectations costs about 2 s and a process's first validation another 1-1.5 s, so every phase that
re-reads a dataset an earlier phase already validated (tasks, demonstrations, episodes) would pay 3-4 s to learn
again what is already known. :func:`pipeline.core.validation.validate` therefore looks its question up here first.

The key is a SHA-256 of everything the answer depends on:
- the suite's name and id column, and the sources of the packages that define its builder and derive functions
  and of this library (every ``.py`` file under them: an edited suite, or an edited constant it reads, is a new
  suite);
- the suite's parameters (JSON, with sets sorted, so the key does not depend on the process's hash seed);
- the installed Great Expectations version;
- the frame as validated: its column names, dtypes and values, each column pickled, so that the integer ``1`` and
  the string ``"1"`` (which GX types apart) never share a key.

Only passes are kept (a failure is always computed again, so its report is fresh and names its rows); an entry is
the pass's results as JSON, written atomically, so concurrent processes may share one memo folder. A hit returns
the same results GX gave, so metrics and reports are identical with the memo on or off.

The folder is ``$AGENTRL_VALIDATION_MEMO`` (``off`` turns the memo off), else
``$XDG_CACHE_HOME/agentrl/validation`` (``~/.cache/agentrl/validation``). Entries are small (a passed suite's
results); the folder is not pruned: delete it at will, nothing else reads it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pandas as pd

ENV = "AGENTRL_VALIDATION_MEMO"
FORMAT = "1"  # bump when the entry or key layout changes

_package_hashes: dict[str, str] = {}


def folder() -> Path | None:
    """The memo's folder, or None when ``$AGENTRL_VALIDATION_MEMO`` is ``off``."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "false", "no"):
        return None
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentrl" / "validation"


def key(spec: Any, params: dict, df: pd.DataFrame) -> str:
    """The memo key of validating `df` against suite `spec` with `params` (see the module docstring)."""
    h = hashlib.sha256()
    sources = [_package_hash(m) for m in ("pipeline", getattr(spec.build, "__module__", None),
                                          getattr(spec.derive, "__module__", None))]
    for part in (FORMAT, spec.name, spec.id_column, _gx_version(), *sources, _code_hash(spec.build),
                 _code_hash(spec.derive), json.dumps(params, sort_keys=True, default=_plain)):
        h.update(str(part).encode())
        h.update(b"\0")
    h.update(pickle.dumps([str(c) for c in df.columns], protocol=5))
    for col in df.columns:
        s = df[col]
        h.update(str(s.dtype).encode())
        values = s.to_numpy()
        if values.dtype == object or not values.flags.c_contiguous:
            h.update(pickle.dumps(values.tolist(), protocol=5))
        else:
            h.update(values.tobytes())
    return h.hexdigest()


def load(memo_key: str | None) -> list[dict] | None:
    """The results of a pass stored under `memo_key`, or None (no memo, no entry, or an unreadable one)."""
    base = folder()
    if memo_key is None or base is None:
        return None
    try:
        entry = json.loads((base / memo_key[:2] / f"{memo_key}.json").read_text())
    except (OSError, ValueError):
        return None
    return entry.get("results") if isinstance(entry, dict) and entry.get("format") == FORMAT else None


def store(memo_key: str | None, results: list[dict]) -> None:
    """Keep a pass's results under `memo_key` (atomically; a memo that cannot be written is skipped, never fatal)."""
    base = folder()
    if memo_key is None or base is None:
        return
    try:
        text = json.dumps({"format": FORMAT, "results": results})
    except (TypeError, ValueError):
        return
    if json.loads(text)["results"] != results:  # only what reads back equal (no tuples, no NaN): a hit is exact
        return
    path = base / memo_key[:2] / f"{memo_key}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return f"{type(value).__name__}:{value!r}"


@functools.cache
def _gx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("great_expectations")
    except PackageNotFoundError:
        return "none"


def _code_hash(fn: Any) -> str:
    """The function's own code, defaults and closure (a suite built at run time, e.g. by a factory, shares its
    source with its siblings; only these tell them apart)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return repr(fn)
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
    state = repr((code.co_consts, code.co_names, fn.__defaults__, fn.__kwdefaults__, cells))
    return hashlib.sha256(code.co_code + state.encode()).hexdigest()


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _package_hash(module_name: str | None) -> str:
    """A hash of every ``.py`` file of the top-level package that `module_name` belongs to (once per process)."""
    top = (module_name or "").split(".")[0]
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if not path:
        return f"unknown:{top}"
    if top not in _package_hashes:
        root = Path(path)
        files = sorted(root.parent.rglob("*.py")) if root.name == "__init__.py" else [root]
        h = hashlib.sha256()
        for f in files:
            h.update(str(f.relative_to(root.parent)).encode())
            try:
                h.update(f.read_bytes())
            except OSError:
                h.update(b"unreadable")
        _package_hashes[top] = h.hexdigest()
    return _package_hashes[top]
