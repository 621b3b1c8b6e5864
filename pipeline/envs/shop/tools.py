"""Real tools behind one small interface: a name, a JSON schema of parameters, and `execute`.

Tools: `lookup` (a parameterised read query over the SQLite world), `calc` (a safe arithmetic evaluator: a recursive
descent parser, never `eval`), `search` (BM25 over the document corpus), `convert` (units), `update` (the one write
tool, allowed only on what the task permits) and `answer` (ends the episode; handled by the environment).

A tool never sees unchecked input: the environment validates parameters against the tool's JSON schema first
(`jsonschema`), and a tool reports failure by raising :class:`ToolError`, which the environment turns into an error
observation. Identifiers (table and column names) cannot be bound as SQL parameters, so they come only from the
whitelists below; values always go through `?` placeholders.
"""

from __future__ import annotations

import math
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.envs.shop.world import PRODUCT_FIELDS, SUPPLIER_FIELDS


from pipeline.envs.contract import SafetyViolation, ToolError  # noqa: E402  (the contract's: the runner catches them)


@dataclass
class ToolContext:
    """What a tool may touch during one episode."""

    conn: sqlite3.Connection
    search_index: "SearchIndex"
    allowed_writes: list[dict] = field(default_factory=list)


class Tool(Protocol):
    name: str
    description: str
    parameters: dict

    def execute(self, params: dict, ctx: ToolContext) -> str: ...


# ----------------------------------------------------------------------------------------------------------- numbers
def format_number(x: float) -> str:
    """Canonical text of a number: integers without a decimal point, others rounded to 2 decimals.

    >>> format_number(12.0), format_number(2.5), format_number(1/3)
    ('12', '2.5', '0.33')
    """
    if not math.isfinite(x):
        raise ToolError("result is not a finite number")
    r = round(float(x), 2)
    if r == int(r):
        return str(int(r))
    return f"{r:.2f}".rstrip("0").rstrip(".")


_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(.))")
MAX_EXPR_CHARS = 120
MAX_DEPTH = 24
MAX_MAGNITUDE = 1e15


def safe_calc(expr: str) -> float:
    """Evaluate + - * / ( ) and unary minus over decimal numbers; anything else raises ToolError.

    >>> safe_calc("061-747"), safe_calc("(2+3)*-4"), safe_calc("7/2")
    (-686.0, -20.0, 3.5)
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    return _Arithmetic(_calc_tokens(expr)).value()


def _calc_tokens(expr: str) -> list[tuple[str, str]]:
    """("num", text) and ("op", character) tokens of `expr`, spaces dropped; ToolError for any other character or
    for no token at all."""
    tokens: list[tuple[str, str]] = []
    for num, op in _TOKEN.findall(expr):
        if num:
            tokens.append(("num", num))
        elif op.strip():
            if op not in "+-*/()":
                raise ToolError(f"unsupported character {op!r} in expression")
            tokens.append(("op", op))
    if not tokens:
        raise ToolError("empty expression")
    return tokens


def _in_range(x: float) -> float:
    if not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
        raise ToolError("number out of range")
    return x


class _Arithmetic:
    """A recursive-descent reading of one token list: expression = term {(+|-) term}, term = factor {(*|/) factor},
    factor = (-|+) factor | "(" expression ")" | number; nesting deeper than MAX_DEPTH is refused."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.pos = tokens, 0

    def value(self) -> float:
        """The whole list's value; tokens left over are a ToolError."""
        value = self.expression(0)
        if self.pos != len(self.tokens):
            raise ToolError(f"unexpected {self.tokens[self.pos][1]!r} in expression")
        return value

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def expression(self, depth: int) -> float:
        value = self.term(depth)
        while (t := self.peek()) and t[1] in "+-" and t[0] == "op":
            self.take()
            rhs = self.term(depth)
            value = _in_range(value + rhs if t[1] == "+" else value - rhs)
        return value

    def term(self, depth: int) -> float:
        value = self.factor(depth)
        while (t := self.peek()) and t[0] == "op" and t[1] in "*/":
            self.take()
            rhs = self.factor(depth)
            if t[1] == "/":
                if rhs == 0:
                    raise ToolError("division by zero")
                value = _in_range(value / rhs)
            else:
                value = _in_range(value * rhs)
        return value

    def factor(self, depth: int) -> float:
        if depth > MAX_DEPTH:
            raise ToolError("expression nested too deeply")
        t = self.peek()
        if t is None:
            raise ToolError("expression ends early")
        if t == ("op", "-"):
            self.take()
            return -self.factor(depth + 1)
        if t == ("op", "+"):
            self.take()
            return self.factor(depth + 1)
        if t == ("op", "("):
            self.take()
            value = self.expression(depth + 1)
            if self.peek() != ("op", ")"):
                raise ToolError("missing closing parenthesis")
            self.take()
            return value
        if t[0] == "num":
            self.take()
            return _in_range(float(t[1]))
        raise ToolError(f"unexpected {t[1]!r} in expression")


# ------------------------------------------------------------------------------------------------------------ search
_WORD = re.compile(r"[a-z0-9]+")


def _terms(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class SearchIndex:
    """Okapi BM25 (k1=1.2, b=0.75) over the corpus; immutable after construction, shared by every episode."""

    def __init__(self, corpus: list[dict], k1: float = 1.2, b: float = 0.75):
        self.docs = corpus
        self.k1, self.b = k1, b
        self.tfs = [Counter(_terms(d["title"] + " " + d["text"])) for d in corpus]
        self.lengths = [sum(tf.values()) for tf in self.tfs]
        self.avgdl = sum(self.lengths) / max(1, len(self.lengths))
        df: Counter = Counter()
        for tf in self.tfs:
            df.update(tf.keys())
        n = len(corpus)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}
        self.postings: dict[str, list[int]] = {}
        for i, tf in enumerate(self.tfs):
            for t in tf:
                self.postings.setdefault(t, []).append(i)

    def search(self, query: str, k: int = 1) -> list[dict]:
        scores: dict[int, float] = {}
        for t in set(_terms(query)):
            idf = self.idf.get(t)
            if idf is None:
                continue
            for i in self.postings[t]:
                f = self.tfs[i][t]
                denom = f + self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avgdl)
                scores[i] = scores.get(i, 0.0) + idf * f * (self.k1 + 1) / denom
        best = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        return [self.docs[i] for i, _ in best]


# ------------------------------------------------------------------------------------------------------------- units
UNITS = {  # unit -> (dimension, factor to the base unit)
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
    "m": ("length", 1.0), "km": ("length", 1000.0), "ft": ("length", 0.3048), "mi": ("length", 1609.344),
    "c": ("temperature", None), "f": ("temperature", None),
}


def convert_units(value: float, src: str, dst: str) -> float:
    """Convert between units of one dimension.

    >>> round(convert_units(1, "kg", "lb"), 4), convert_units(100, "c", "f")
    (2.2046, 212.0)
    """
    (dim_a, fa), (dim_b, fb) = UNITS[src], UNITS[dst]
    if dim_a != dim_b:
        raise ToolError(f"cannot convert {dim_a} ({src}) to {dim_b} ({dst})")
    if dim_a == "temperature":
        celsius = value if src == "c" else (value - 32) * 5 / 9
        return celsius if dst == "c" else celsius * 9 / 5 + 32
    return value * fa / fb


# ------------------------------------------------------------------------------------------------------------- tools
_NAME = {"type": "string", "minLength": 1, "maxLength": 64}


class Lookup:
    name = "lookup"
    description = "read one field of a product or supplier from the database"
    parameters = {
        "type": "object",
        "properties": {"name": _NAME, "field": {"enum": list(PRODUCT_FIELDS + SUPPLIER_FIELDS)}},
        "required": ["name", "field"],
        "additionalProperties": False,
    }

    def execute(self, params: dict, ctx: ToolContext) -> str:
        fld, name = params["field"], params["name"]
        table = "products" if fld in PRODUCT_FIELDS else "suppliers"
        # `fld` and `table` come from the whitelists above (checked by the schema); the value is bound.
        row = ctx.conn.execute(f"SELECT {fld} FROM {table} WHERE name = ?", (name,)).fetchone()
        if row is None:
            kind = "product" if table == "products" else "supplier"
            raise ToolError(f"no {kind} named '{name}'")
        value = row[0]
        return format_number(value) if isinstance(value, (int, float)) else str(value)


class Calc:
    name = "calc"
    description = "evaluate an arithmetic expression with + - * / and parentheses"
    parameters = {
        "type": "object",
        "properties": {"expr": {"type": "string", "minLength": 1, "maxLength": MAX_EXPR_CHARS}},
        "required": ["expr"],
        "additionalProperties": False,
    }

    def execute(self, params: dict, ctx: ToolContext) -> str:
        return format_number(safe_calc(params["expr"]))


class Search:
    name = "search"
    description = "search the document corpus and return the best matching document"
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 128}},
        "required": ["query"],
        "additionalProperties": False,
    }

    def execute(self, params: dict, ctx: ToolContext) -> str:
        hits = ctx.search_index.search(params["query"], k=1)
        if not hits:
            raise ToolError("no matching document")
        return hits[0]["text"]


class Convert:
    name = "convert"
    description = "convert a value between units (kg g lb oz m km ft mi c f)"
    parameters = {
        "type": "object",
        "properties": {
            "value": {"type": ["number", "string"]},
            "from": {"enum": list(UNITS)},
            "to": {"enum": list(UNITS)},
        },
        "required": ["value", "from", "to"],
        "additionalProperties": False,
    }

    def execute(self, params: dict, ctx: ToolContext) -> str:
        raw = params["value"]
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ToolError(f"value {str(raw)[:32]!r} is not a number") from None
        if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("value out of range")
        return format_number(convert_units(value, params["from"], params["to"]))


class Update:
    name = "update"
    description = "set the stock of a product (only where the task allows it)"
    parameters = {
        "type": "object",
        "properties": {
            "name": _NAME,
            "field": {"enum": ["stock"]},
            "value": {"type": ["integer", "string"]},
        },
        "required": ["name", "field", "value"],
        "additionalProperties": False,
    }

    def execute(self, params: dict, ctx: ToolContext) -> str:
        name, fld, raw = params["name"], params["field"], params["value"]
        allowed = any(w["table"] == "products" and w["name"] == name and w["field"] == fld for w in ctx.allowed_writes)
        if not allowed:
            raise SafetyViolation(f"writing {fld} of '{name}' is not allowed in this task")
        try:
            value = int(str(raw).strip())
        except ValueError:
            raise ToolError(f"value {str(raw)[:32]!r} is not an integer") from None
        if not 0 <= value <= 100_000:
            raise SafetyViolation(f"stock {value} is outside 0..100000")
        cur = ctx.conn.execute("UPDATE products SET stock = ? WHERE name = ?", (value, name))
        if cur.rowcount != 1:
            raise ToolError(f"no product named '{name}'")
        return f"stock of '{name}' set to {value}"


class Answer:
    name = "answer"
    description = "give the final answer and end the episode"
    parameters = {
        "type": "object",
        # A blank answer is no answer: `"value": ""` (or only whitespace) breaks the schema, so the call is an
        # invalid-parameters error that costs a step and the episode goes on. An answer call that succeeds therefore
        # always carries a non-blank value, which the GX suites rely on ("no empty answers where an answer was given").
        "properties": {"value": {"type": ["string", "number"], "pattern": "\\S"}},
        "required": ["value"],
        "additionalProperties": False,
    }

    def execute(self, params: dict, ctx: ToolContext) -> str:
        return str(params["value"])


def default_tools() -> tuple[Tool, ...]:
    """The tool set in a fixed order: the index of a tool is its `tool` action."""
    return (Lookup(), Calc(), Search(), Convert(), Update(), Answer())


TOOL_NAMES = tuple(t.name for t in default_tools())


def signature(tool: Tool) -> str:
    """Compact signature for the prompt, e.g. `lookup(name, field)`: the schema's properties in order."""
    return f"{tool.name}({', '.join(tool.parameters['properties'])})"
