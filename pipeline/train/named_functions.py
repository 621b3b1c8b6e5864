"""How the kernel's registries (:mod:`pipeline.train.estimators`, :mod:`pipeline.train.credit`) resolve a name from
params: a name registered in the process, ``module:function``, or the name of an installed entry point whose value
is ``module:function``. One resolver for both, so they accept the same forms and fail with the same kind of line.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from pipeline.core.errors import AgentRLError


def installed(group: str) -> dict[str, str]:
    """The entry points of `group`: name -> ``module:function``."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def resolve(spec: str, key: str, what: str, registered: dict, group: str):
    """(function, its registered entry or None) for `spec`, which is not a registered name itself: ``module:function``
    or an entry point of `group`. `key` (the params key) and `what` (``advantage estimator``, ``credit rule``) name it
    in the one :class:`AgentRLError` raised for anything else, which lists the known names."""
    target = spec if ":" in spec else installed(group).get(spec)
    if target is None:
        raise AgentRLError(f"{key}: unknown {what} {spec!r}; choose one of "
                           f"{', '.join(sorted({*registered, *installed(group)}))}, or module:function")
    fn = _function(target, spec, key)
    return fn, next((entry for entry in registered.values() if entry.fn is fn), None)


@functools.lru_cache(maxsize=None)
def _function(target: str, spec: str, key: str) -> Callable:
    """The function ``module:function`` names (imported once: the learner asks for it on every update)."""
    module_name, _, attr = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr, None)
    except Exception as exc:  # the module's own import error, reported rather than raised through
        raise AgentRLError(f"{key}: cannot import {module_name} for {spec!r} "
                           f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if not callable(fn):
        raise AgentRLError(f"{key}: {module_name} has no function {attr!r} ({spec!r})")
    return fn
