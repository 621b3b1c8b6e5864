"""User-facing errors.

:class:`AgentRLError` is the base of every error that means "the input was wrong" rather than "the code is wrong": a
corrupt task file, data that fails validation, a missing phase output. The CLI prints its message as ``error: ...`` and
exits 2 without a traceback; anything else is a bug and keeps its traceback. (`pipeline.core.config.ConfigError` predates this
and subclasses ``ValueError``; the CLI treats it the same way.)
"""

from __future__ import annotations


class AgentRLError(Exception):
    """Base of user-facing errors: the message alone must tell the user what to fix."""


__all__ = ["AgentRLError"]
