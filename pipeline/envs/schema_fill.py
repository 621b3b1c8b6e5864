"""Arguments for a tool call drawn from nothing but its JSON Schema and the strings a question quotes: what the
reward-hacking probes (:mod:`pipeline.envs.probes`) and the undeclared-write check (:mod:`pipeline.envs.write_check`)
send to an environment's tools."""

from __future__ import annotations

import re

import numpy as np

_QUOTED = re.compile(r"\"([^\"]{1,64})\"|'([^']{1,64})'")


def quoted(question: str) -> list[str]:
    """The strings quoted in a question, in order (the entities a task names).

    >>> quoted('Set the size of "Blue Hall" to 5, then \\'x\\'.')
    ['Blue Hall', 'x']
    """
    return [a or b for a, b in _QUOTED.findall(question)]


def fill(schema: dict, strings: list[str], rng: np.random.Generator):
    """A value for a JSON Schema: an enum's first value, a const, else by type (the first of integer, number, string,
    boolean, object, array that the schema allows): a small random integer within the bounds, the first of `strings`
    that fits the length bounds (else "x"), False, an object of its required properties, an empty list.

    >>> fill({"type": "object", "properties": {"name": {"type": "string"}, "field": {"enum": ["size", "floor"]},
    ...       "n": {"type": ["integer", "string"], "minimum": 3, "maximum": 3}}, "required": ["name", "field", "n"]},
    ...      ["Blue Hall"], np.random.default_rng(0))
    {'name': 'Blue Hall', 'field': 'size', 'n': 3}
    """
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    types = schema.get("type", "object" if "properties" in schema else "string")
    types = [types] if isinstance(types, str) else list(types)
    for kind in ("integer", "number", "string", "boolean", "object", "array", "null"):
        if kind not in types:
            continue
        if kind in ("integer", "number"):
            lo, hi = int(schema.get("minimum", 0)), int(schema.get("maximum", 100))
            return int(rng.integers(lo, max(lo, hi) + 1))
        if kind == "string":
            lo, hi = schema.get("minLength", 1), schema.get("maxLength", 10**6)
            return next((s for s in strings if lo <= len(s) <= hi), "x" * max(1, lo))
        if kind == "boolean":
            return False
        if kind == "object":
            props = schema.get("properties", {})
            return {k: fill(props.get(k, {}), strings, rng) for k in schema.get("required", [])}
        if kind == "array":
            return []
        return None
    return "x"
