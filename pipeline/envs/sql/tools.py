"""The SQL analyst's tools and the guarded query runner.

Tools: ``list_tables`` (no parameters), ``describe_table`` (`table`), ``query`` (`sql`, written by the policy) and
``answer`` (:data:`pipeline.envs.contract.ANSWER_SPEC`). Every schema is strict (``additionalProperties: false``).

Safety rules of ``query`` (a refused query is never executed and raises :class:`SafetyViolation`):

1. the text must start (after comments and blanks) with ``SELECT``, ``WITH`` or ``VALUES``;
2. exactly one statement: anything after the first ``;`` other than blanks and comments is refused (Python's sqlite3
   prepares only the first statement and reports the rest, which is then never prepared);
3. an SQLite authorizer (``set_authorizer``) admits only SQLITE_SELECT, SQLITE_READ of the main database,
   SQLITE_RECURSIVE (recursive CTEs) and SQLITE_FUNCTION for the functions of :data:`ALLOWED_FUNCTIONS`; it denies
   every write, DDL, PRAGMA, ATTACH (so also ``VACUUM INTO``), transaction and any other function
   (``load_extension``, ``zeroblob``, ``randomblob``...);
4. functions that touch files in SQLite's shell or its extensions (:data:`FILE_FUNCTIONS`: ``readfile``,
   ``writefile``, ``edit``, ``fts3_tokenizer``...) are refused by name, even though this build of SQLite lacks them
   and would only say "no such function"; so are the table-valued PRAGMA functions (``pragma_table_info``...);
5. the connection itself is read-only (URI ``mode=ro``), attaches nothing (``SQLITE_LIMIT_ATTACHED`` 0), and caps a
   string or blob at 1 MB and the SQL text at 4000 characters.

Limits (:class:`QueryLimits`): a progress handler interrupts a query running longer than `timeout_s` (ToolError
"query timed out after ..."), counting the time spent fetching rows; at most `max_rows` rows are shown, with a first
line saying how many there were ("57 rows, first 20 shown"); counting stops at `count_cap` rows.

Rendering: one value alone is shown as is (``42``, ``1234.5``); otherwise a header line ``col | col`` and one line per
row. Numbers are rounded to 2 decimals (integers without a point), cells cut at 60 characters. The pipeline shows the
policy at most ~200 characters of any result, so the compact form matters.
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from dataclasses import dataclass

from pipeline.envs.contract import ANSWER_SPEC, SafetyViolation, ToolError, ToolSpec

MAX_SQL_CHARS = 4000
ALLOWED_FUNCTIONS = frozenset({
    # aggregates and window functions
    "avg", "count", "max", "min", "sum", "total", "group_concat", "string_agg", "row_number", "rank", "dense_rank",
    "ntile", "lag", "lead", "first_value", "last_value", "nth_value", "percent_rank", "cume_dist",
    # scalars
    "abs", "round", "length", "lower", "upper", "substr", "substring", "trim", "ltrim", "rtrim", "replace", "instr",
    "coalesce", "ifnull", "nullif", "iif", "like", "glob", "typeof", "printf", "format", "char", "unicode", "hex",
    "quote", "sign", "likely", "unlikely", "likelihood",
    # dates and maths
    "date", "time", "datetime", "julianday", "strftime", "unixepoch", "sqrt", "pow", "power", "floor", "ceil",
    "ceiling", "exp", "ln", "log", "log10", "log2", "mod", "pi",
})
FILE_FUNCTIONS = frozenset({
    "readfile", "writefile", "edit", "lsmode", "fts3_tokenizer", "load_extension", "zipfile", "sqlar_compress",
    "sqlar_uncompress", "sqlite_dbpage", "fsdir", "shell_add_schema", "shell_escape_crnl", "shell_idquote",
})
_ACTION_NAMES = {getattr(sqlite3, n): n[len("SQLITE_"):].replace("_", " ") for n in (
    "SQLITE_CREATE_INDEX", "SQLITE_CREATE_TABLE", "SQLITE_CREATE_TEMP_INDEX", "SQLITE_CREATE_TEMP_TABLE",
    "SQLITE_CREATE_TEMP_TRIGGER", "SQLITE_CREATE_TEMP_VIEW", "SQLITE_CREATE_TRIGGER", "SQLITE_CREATE_VIEW",
    "SQLITE_DELETE", "SQLITE_DROP_INDEX", "SQLITE_DROP_TABLE", "SQLITE_DROP_TEMP_INDEX", "SQLITE_DROP_TEMP_TABLE",
    "SQLITE_DROP_TEMP_TRIGGER", "SQLITE_DROP_TEMP_VIEW", "SQLITE_DROP_TRIGGER", "SQLITE_DROP_VIEW", "SQLITE_INSERT",
    "SQLITE_PRAGMA", "SQLITE_READ", "SQLITE_SELECT", "SQLITE_TRANSACTION", "SQLITE_UPDATE", "SQLITE_ATTACH",
    "SQLITE_DETACH", "SQLITE_ALTER_TABLE", "SQLITE_REINDEX", "SQLITE_ANALYZE", "SQLITE_CREATE_VTABLE",
    "SQLITE_DROP_VTABLE", "SQLITE_FUNCTION", "SQLITE_SAVEPOINT", "SQLITE_RECURSIVE") if hasattr(sqlite3, n)}
_COMMENTS = re.compile(r"\s*(?:--[^\n]*(?:\n|\Z)|/\*.*?(?:\*/|\Z))", re.DOTALL)
_LEAD = re.compile(r"[\s(]*([A-Za-z]+)")
_LITERALS = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"")
_CALLS = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_NO_SUCH_FUNCTION = re.compile(r"no such function: (\w+)")
_PRAGMA_FUNCTION = re.compile(r"\bpragma_\w+", re.IGNORECASE)


def tool_specs() -> list[ToolSpec]:
    """Every tool of the SQL analyst, ``answer`` last."""
    return [
        ToolSpec("list_tables", "list the tables of the database",
                 {"type": "object", "properties": {}, "additionalProperties": False}),
        ToolSpec("describe_table", "show a table's columns with their types and its row count",
                 {"type": "object", "properties": {"table": {"type": "string", "minLength": 1, "maxLength": 64}},
                  "required": ["table"], "additionalProperties": False}),
        ToolSpec("query", "run one read-only SQL SELECT on the database and show the result rows",
                 {"type": "object",
                  "properties": {"sql": {"type": "string", "minLength": 1, "maxLength": MAX_SQL_CHARS,
                                         "pattern": "\\S"}},
                  "required": ["sql"], "additionalProperties": False}),
        ANSWER_SPEC,
    ]


TOOL_NAMES = tuple(t.name for t in tool_specs())


# ------------------------------------------------------------------------------------------------------- rendering
def format_number(x: float) -> str:
    """Integers without a point, other numbers rounded to 2 decimals.

    >>> format_number(12.0), format_number(2.5), format_number(1/3), format_number(-0.001)
    ('12', '2.5', '0.33', '0')
    """
    if not math.isfinite(x):
        return str(x)
    r = round(float(x), 2)
    if r == int(r):
        return str(int(r))
    return f"{r:.2f}".rstrip("0").rstrip(".")


def cell(v: object) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, float)):
        return format_number(v)
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    text = " ".join(str(v).split())
    return text if len(text) <= 60 else text[:57] + "..."


def render(columns: list[str], rows: list[tuple], n_rows: int, capped: bool) -> str:
    """The text the policy sees (see the module docstring)."""
    if n_rows == 0:
        return "(no rows)"
    if len(columns) == 1 and n_rows == 1:
        return cell(rows[0][0])
    lines = [" | ".join(columns)] + [" | ".join(cell(v) for v in r) for r in rows]
    if n_rows > len(rows):
        lines.insert(0, f"{'more than ' if capped else ''}{n_rows} rows, first {len(rows)} shown")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- guarding
@dataclass(frozen=True)
class QueryLimits:
    timeout_s: float = 1.0  # wall-clock limit of one query, fetching included
    max_rows: int = 20  # rows shown
    count_cap: int = 10_000  # rows counted at most


def strip_comments(sql: str) -> str:
    out, pos = [], 0
    while pos < len(sql):
        m = _COMMENTS.match(sql, pos)
        if m and m.group(0).strip():
            out.append(" ")
            pos = m.end()
            continue
        out.append(sql[pos])
        pos += 1
    return "".join(out)


def precheck(sql: str) -> None:
    """Rules 1 and 4 of the module docstring, on the text alone (SafetyViolation)."""
    m = _LEAD.match(strip_comments(sql))
    word = m.group(1).upper() if m else ""
    if word not in ("SELECT", "WITH", "VALUES"):
        raise SafetyViolation(f"refused: only read-only SELECT queries are allowed (the query starts with "
                              f"{word or 'no keyword'!r})")
    code = _LITERALS.sub("''", sql)
    m = _PRAGMA_FUNCTION.search(code)
    if m:
        raise SafetyViolation(f"refused: PRAGMA functions ({m.group(0).lower()}) are not allowed; use describe_table")
    for name in _CALLS.findall(code):
        if name.lower() in FILE_FUNCTIONS:
            raise SafetyViolation(f"refused: function {name.lower()}() touches files or extensions and is not allowed")


class Guard:
    """The authorizer callback; remembers the first thing it denied (SQLite stops at the first denial), for the error
    message. A write to SQLite's own schema table is what DROP and CREATE first attempt, so it is named as such."""

    def __init__(self) -> None:
        self.denied: str | None = None

    def __call__(self, action: int, arg1, arg2, dbname, source) -> int:
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_READ and dbname in (None, "main"):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and str(arg2).lower() in ALLOWED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if self.denied is None:
            if action == sqlite3.SQLITE_FUNCTION:
                self.denied = f"function {str(arg2).lower()}() is not allowed"
            elif arg1 in ("sqlite_master", "sqlite_temp_master") and action != sqlite3.SQLITE_READ:
                self.denied = "changing the schema is not allowed (read-only SELECT queries only)"
            else:
                what = _ACTION_NAMES.get(action, f"action {action}")
                target = " ".join(str(a) for a in (arg1, dbname if action == sqlite3.SQLITE_READ else None) if a)
                on = f" on {target}" if target else ""
                self.denied = f"{what}{on} is not allowed (read-only SELECT queries only)"
        return sqlite3.SQLITE_DENY


class QueryRunner:
    """One episode's guarded, read-only connection (see the module docstring)."""

    def __init__(self, conn: sqlite3.Connection, limits: QueryLimits = QueryLimits()):
        self.conn, self.limits = conn, limits
        self.guard = Guard()
        self._deadline = math.inf
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_CHARS)
        conn.set_authorizer(self.guard)
        conn.set_progress_handler(self._tick, 1000)

    def _tick(self) -> int:
        return 1 if time.monotonic() > self._deadline else 0

    def run(self, sql: str) -> str:
        precheck(sql)
        self.guard.denied = None
        start = time.monotonic()
        self._deadline = start + self.limits.timeout_s
        try:
            cur = self.conn.execute(sql)
            columns = [d[0] for d in cur.description or ()]
            rows, n = [], 0
            for row in cur:
                if n < self.limits.max_rows:
                    rows.append(row)
                n += 1
                if n >= self.limits.count_cap:
                    break
            cur.close()
        except sqlite3.Error as exc:
            raise self._explain(exc, time.monotonic() - start) from None
        finally:
            self._deadline = math.inf
        return render(columns, rows, n, capped=n >= self.limits.count_cap)

    def _explain(self, exc: sqlite3.Error, elapsed: float) -> ToolError:
        msg = str(exc)
        if self.guard.denied is not None:
            return SafetyViolation(f"refused: {self.guard.denied}")
        if "one statement at a time" in msg:
            return SafetyViolation("refused: one statement per query (found another statement after ';')")
        if msg == "interrupted" or elapsed > self.limits.timeout_s:
            return ToolError(f"query timed out after {self.limits.timeout_s:g} s")
        m = _NO_SUCH_FUNCTION.search(msg)
        if m and m.group(1).lower() in FILE_FUNCTIONS:
            return SafetyViolation(f"refused: function {m.group(1).lower()}() is not allowed")
        return ToolError(f"SQL error: {msg}")

    def close(self) -> None:
        self.conn.close()
