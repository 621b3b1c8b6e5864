"""The text protocol in which a language-model policy writes an action, and its one parser.

An action is written as

    <call>TOOL {"param": value, ...}</call>

`TOOL` is a tool name; the JSON object holds its parameters (`{}` may be omitted for a tool without any). The
environment answers with ``<obs>RESULT</obs>`` on a new line. Whitespace around the text is ignored; anything else
outside one pair of call markers makes the action invalid.

:func:`parse_action` maps *any* string to either a :class:`ParsedAction` (the Dict action of the Gymnasium space:
`tool` index and canonical `params` JSON text) or an :class:`InvalidAction` with the reason. It never raises and never
evaluates anything: JSON is read by `json.loads` with NaN/Infinity and duplicate keys refused; whether the parameters
fit the tool's schema is checked later, by the environment, against the tool's JSON schema.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
OBS_OPEN, OBS_CLOSE = "<obs>", "</obs>"
# Characters the Text spaces accept: printable ASCII. Anything else in policy text is replaced by '?' before it is
# echoed into the context, so the observation always lies in the observation space.
CHARSET = frozenset(string.printable)
_HEAD = re.compile(r"([A-Za-z_][A-Za-z0-9_]{0,31})\s*(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class ParsedAction:
    tool: int
    name: str
    params: dict
    params_text: str  # canonical JSON of `params`: the `params` part of the Dict action


@dataclass(frozen=True)
class InvalidAction:
    reason: str


def sanitize(text: str) -> str:
    """Replace every character outside the Text charset by '?'."""
    return "".join(c if c in CHARSET else "?" for c in text)


def format_action(name: str, params: dict) -> str:
    """The canonical text of an action (what the expert writes and demonstrations contain)."""
    return f"{CALL_OPEN}{name} {json.dumps(params, ensure_ascii=True)}{CALL_CLOSE}"


def format_observation(result: str) -> str:
    return f"{OBS_OPEN}{result}{OBS_CLOSE}\n"


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate keys")
    return dict(pairs)


def loads_params(text: str) -> dict | InvalidAction:
    """Strict JSON object parsing; returns InvalidAction instead of raising."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        return InvalidAction(f"parameters are not valid JSON ({str(exc)[:80]})")
    if not isinstance(value, dict):
        return InvalidAction(f"parameters must be a JSON object, got {type(value).__name__}")
    return value


def inner_text(text: str) -> str | InvalidAction:
    """The text between the call markers (markers optional), or why there is none."""
    body = text.strip()
    if body.startswith(CALL_OPEN):
        body = body[len(CALL_OPEN):]
        if not body.endswith(CALL_CLOSE):
            return InvalidAction(f"missing {CALL_CLOSE}")
        body = body[: -len(CALL_CLOSE)]
    elif body.endswith(CALL_CLOSE):
        body = body[: -len(CALL_CLOSE)]
    if CALL_OPEN in body or CALL_CLOSE in body:
        return InvalidAction("more than one call in one action")
    return body.strip()


def parse_action(text: object, tool_names: tuple[str, ...], max_chars: int = 256) -> ParsedAction | InvalidAction:
    """Parse policy text into an action; never raises."""
    if not isinstance(text, str):
        return InvalidAction(f"action text must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        return InvalidAction(f"action longer than {max_chars} characters")
    body = inner_text(text)
    if isinstance(body, InvalidAction):
        return body
    m = _HEAD.match(body)
    if not m:
        return InvalidAction("expected a tool name followed by a JSON object")
    name, rest = m.group(1), m.group(2).strip()
    if name not in tool_names:
        return InvalidAction(f"unknown tool {name!r}; tools are {', '.join(tool_names)}")
    params = loads_params(rest) if rest else {}
    if isinstance(params, InvalidAction):
        return params
    canonical = json.dumps(params, ensure_ascii=True, sort_keys=False)
    return ParsedAction(tool_names.index(name), name, params, canonical)


def parse_dict_action(action: object, tool_names: tuple[str, ...], max_chars: int = 256) -> ParsedAction | InvalidAction:
    """Decode the Gymnasium Dict action {'tool': int, 'params': str}; never raises."""
    if not isinstance(action, dict) or set(action) != {"tool", "params"}:
        return InvalidAction("a Dict action needs exactly the keys 'tool' and 'params'")
    tool = action["tool"]
    try:
        idx = int(tool)
    except (TypeError, ValueError):
        return InvalidAction(f"'tool' must be an integer, got {type(tool).__name__}")
    if idx != tool or not 0 <= idx < len(tool_names):
        return InvalidAction(f"'tool' must lie in 0..{len(tool_names) - 1}, got {tool!r}")
    params_text = action["params"]
    if not isinstance(params_text, str):
        return InvalidAction("'params' must be a JSON string")
    if len(params_text) > max_chars:
        return InvalidAction(f"params longer than {max_chars} characters")
    params = loads_params(params_text) if params_text.strip() else {}
    if isinstance(params, InvalidAction):
        return params
    return ParsedAction(idx, tool_names[idx], params, json.dumps(params, ensure_ascii=True))
