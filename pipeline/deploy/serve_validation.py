"""What `agentrl serve` checks before a request may reach the batcher: the body's size, its JSON, the request's fields,
and the API key.

Why here and not in the model: a request that fails inside an episode fails the whole generation batch it shares with
other clients' requests (a 500 for all of them), so every field is checked first and a refusal is a 4xx naming the
field. What is refused, and with which status:

- a body over ``max_body_bytes`` (declared in Content-Length, or counted while a chunked body streams in): 413, at
  once, without buffering more than the limit; uvicorn discards the rest as it arrives, so a client that is still
  sending (even a declared gigabyte, or one that stalls) reads the 413 rather than a reset connection;
- a body that is not JSON (bad UTF-8, NaN or Infinity, a number of more than 4300 digits, nesting that the parser
  cannot follow): 400;
- JSON that nests deeper than :data:`MAX_DEPTH` levels (no task field needs more; deeper objects would overflow the
  recursion of the cache key's encoder later) or holds a string with an unpaired UTF-16 surrogate (``"\\ud800"`` is
  valid JSON but cannot be encoded as UTF-8, so the answer that echoes it would fail): 422;
- the fields every request shares (:class:`RequestFields`, pydantic, strict JSON types): ``question`` a non-blank
  string of at most ``max_question_chars``; ``seed`` an integer in [0, 2**32 - 1] (the range every seeded generator
  of the rollout accepts: torch refuses negative seeds and seeds past 64 bits, a 500 before); ``task_id`` a string of
  at most :data:`MAX_TASK_ID_CHARS` or an integer within 64 bits; ``answer`` (ground truth) a string of at most
  ``max_question_chars``, an integer within 64 bits or a finite number; booleans are none of these: 422. Unknown
  fields and the environment's own fields (``allowed_writes``, a complete task record, a mixed deployment's ``env``)
  are the environment's to check (:meth:`request_task`), also a 422.

The API key (:func:`serving_key`): read from the environment variable ``api_key_env`` names, never from params.yaml.
Without one the server binds loopback addresses only; with one, a request to /solve, /ready or /stats needs
``Authorization: Bearer <key>``, compared with :func:`hmac.compare_digest` (constant time, on bytes so that a
non-ASCII header is a 401, not a TypeError). /health stays open: liveness probes carry no credentials and it reveals
nothing.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.core.errors import AgentRLError

MAX_DEPTH = 16  # a complete task record nests 5 levels (record, plan, step, params, a list value)
MAX_TASK_ID_CHARS = 256
SEED_MAX = 2**32 - 1
INT64 = 2**63 - 1
MIN_KEY_CHARS = 16
LOOPBACK_NAMES = ("localhost",)


class Refusal(Exception):
    """A request answered with `status` and ``{"error": message}``; `kind` counts it in /stats."""

    def __init__(self, status: int, message: str, kind: str):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


# ------------------------------------------------------------------------------------------------------------ body
async def read_body(request, cfg) -> bytes:
    """The request body, at most ``cfg.max_body_bytes``; a larger one (declared or counted) is a 413 Refusal. The
    rest is not read here: uvicorn reads and discards what the client still sends after the answer, so the client reads
    the 413 rather than a reset connection (closing a socket with unread data would make the kernel send RST)."""
    stream = request.stream()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
        raise Refusal(413, f"request body of {declared} bytes exceeds the limit of {cfg.max_body_bytes} bytes "
                           f"(deploy.serve.max_body_bytes)", "too_large")
    body = bytearray()
    async for chunk in stream:
        body += chunk
        if len(body) > cfg.max_body_bytes:
            raise Refusal(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes "
                               f"(deploy.serve.max_body_bytes)", "too_large")
    return bytes(body)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes) -> Any:
    """The JSON value of `body` (400 when it is not JSON), checked for depth and encodable strings (422)."""
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise Refusal(400, "body is not valid JSON: it nests too deeply to parse", "bad_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, integers of > 4300 digits
        raise Refusal(400, f"body is not valid JSON: {str(exc)[:200]}", "bad_json") from None
    stack = [(obj, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise Refusal(422, f"{_field(where)}: JSON nests more than {MAX_DEPTH} levels deep", "invalid")
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, where)
                stack.append((v, f"{where}.{k[:40]}" if where else k[:40], depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return obj


def _field(where: str) -> str:
    return f"field {where!r}" if where else "the body"


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise Refusal(422, f"{_field(where)}: a string holds an unpaired UTF-16 surrogate (not encodable as UTF-8)",
                      "invalid") from None


# ---------------------------------------------------------------------------------------------------------- fields
class RequestFields(BaseModel):
    """The fields every request shares, with strict JSON types; the rest is the environment's (extra="allow")."""

    model_config = ConfigDict(extra="allow", strict=True)

    question: str = Field(min_length=1, description="The task's question.")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Seed of the episode (null: the model's).")
    task_id: str | int | None = Field(None, description="The caller's id, echoed in the answer.")
    answer: str | int | float | None = Field(None, description="Ground truth (optional).")

    @field_validator("question")
    @classmethod
    def _question(cls, v: str, info) -> str:
        if not v.strip():
            raise ValueError("must not be blank")
        limit = (info.context or {}).get("max_chars")
        if limit is not None and len(v) > limit:
            raise ValueError(f"has {len(v)} characters, more than the {limit} allowed (deploy.serve."
                             f"max_question_chars)")
        return v

    @field_validator("task_id")
    @classmethod
    def _task_id(cls, v):
        if isinstance(v, str) and len(v) > MAX_TASK_ID_CHARS:
            raise ValueError(f"has {len(v)} characters, more than the {MAX_TASK_ID_CHARS} allowed")
        if isinstance(v, int) and not -INT64 - 1 <= v <= INT64:
            raise ValueError("must be an integer within 64 bits")
        return v

    @field_validator("answer")
    @classmethod
    def _answer(cls, v, info):
        limit = (info.context or {}).get("max_chars")
        if isinstance(v, str) and limit is not None and len(v) > limit:
            raise ValueError(f"has {len(v)} characters, more than the {limit} allowed")
        if isinstance(v, int) and not -INT64 - 1 <= v <= INT64:
            raise ValueError("must be an integer within 64 bits")
        if isinstance(v, float) and not math.isfinite(v):  # unreachable through parse_json; direct callers
            raise ValueError("must be a finite number")
        return v


UNION_TYPES = {"task_id": "must be a string or an integer", "answer": "must be a string or a number"}


def _describe(errors: list[dict]) -> str:
    """One line naming each failing field once (a union field's per-member type errors become one)."""
    seen, parts = set(), []
    for err in errors:
        field = str(err["loc"][0]) if err["loc"] else "body"
        if field in seen:
            continue
        seen.add(field)
        if err["type"] == "missing":
            parts.append(f"field {field!r} is required")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if field in UNION_TYPES and err["type"] in ("string_type", "int_type", "float_type"):
            msg = UNION_TYPES[field]
        got = err.get("input")
        shown = repr(got) if len(repr(got)) <= 48 else f"a {type(got).__name__} of {len(repr(got))} characters"
        parts.append(f"field {field!r}: {msg[:1].lower()}{msg[1:]} (got {shown})")
    return "; ".join(parts)


def validate_request(obj: Any, max_question_chars: int, world, default_seed: int) -> tuple[Any, int, bool]:
    """(task, seed, has_truth) of one parsed JSON request, or a 422 :class:`Refusal` naming the field."""
    from pipeline.deploy.pyfunc import RequestError, parse_task  # here: importing mlflow.pyfunc warns on stderr

    if isinstance(obj, str):
        obj = {"question": obj}
    if not isinstance(obj, dict):
        raise Refusal(422, f"a task must be a JSON object with a 'question' (or a string), got "
                           f"{type(obj).__name__}", "invalid")
    try:
        fields = RequestFields.model_validate(obj, context={"max_chars": max_question_chars})
    except ValidationError as exc:
        raise Refusal(422, _describe(exc.errors()), "invalid") from None
    try:
        task = parse_task(obj, max_question_chars, world)
    except RequestError as exc:
        raise Refusal(422, str(exc)[:500], "invalid") from None
    seed = default_seed if fields.seed is None else fields.seed
    return task, seed, fields.answer is not None


# ------------------------------------------------------------------------------------------------------------- key
def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serving_key(host: str, cfg) -> bytes | None:
    """The API key from ``$<cfg.api_key_env>`` (None when unset or empty); an AgentRLError when binding `host` needs
    one and there is none, or the key is too short to resist guessing."""
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        if not is_loopback(host):
            raise AgentRLError(f"serve: binding {host!r} (not a loopback address) requires an API key: set the "
                               f"environment variable {cfg.api_key_env} (deploy.serve.api_key_env names it), or "
                               f"bind 127.0.0.1")
        return None
    if len(key) < MIN_KEY_CHARS:
        raise AgentRLError(f"serve: the API key in {cfg.api_key_env} has {len(key)} characters; use at least "
                           f"{MIN_KEY_CHARS} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return key.encode("utf-8")


def authorized(headers, key: bytes | None) -> bool:
    """Whether a request's headers carry `key` as ``Authorization: Bearer <key>`` (always true without a key)."""
    if key is None:
        return True
    scheme, _, given = headers.get("authorization", "").partition(" ")
    # Starlette decodes header bytes as latin-1: encoding back gives the bytes the client sent
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1"), key)


__all__ = ["MAX_DEPTH", "RequestFields", "Refusal", "authorized", "is_loopback", "parse_json",
           "read_body", "serving_key", "validate_request"]
