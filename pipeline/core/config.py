"""Configuration: one validated config object per phase, loaded from its `params.yaml` section.

Every phase reads exactly one section of `params.yaml` through :func:`load_section` (the `env` section, which describes
the environment every phase acts in, is shared and read next to a phase's own). Each section is a pydantic model with
``extra="forbid"``: an unknown or mistyped key fails with a :class:`ConfigError` that names the key, the section and the
closest valid spelling. Every field carries a description, so ``agentrl params --help``-style documentation and the
README table come from one place.

Deliberately left out: environment-variable overrides of individual keys (DVC would not see them, so a run could not be
reproduced from `params.yaml` alone).
"""

from __future__ import annotations

import difflib
import reprlib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

DEFAULT_PARAMS = Path("params.yaml")


class ConfigError(ValueError):
    """A `params.yaml` (or any config source) that cannot be used; the message says what and where."""


class PhaseConfig(BaseModel):
    """Base of every phase config: unknown keys are errors, assignments are validated, instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


C = TypeVar("C", bound=PhaseConfig)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """``malformed YAML at line L, column C: <what the parser said>``, for an error message that names the file."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"malformed YAML{where}: {getattr(exc, 'problem', None) or exc}"


# The top-level sections a params file may hold: one per phase config, plus `model` and `rollout` (the policy's, read
# by several phases) and `env` (shared). A key outside them is a typo of one (`buld_env:`) that would otherwise leave
# that phase silently on its defaults; tests/test_inputs.py checks that the repository's params.yaml holds exactly these.
SECTIONS = ("env", "build_env", "model", "rollout", "adapt", "reward_model", "train", "evaluate", "check_drift", "deploy")
# A params file is a few kilobytes of hand-written settings; PyYAML's pure-Python parser needs minutes for tens of
# megabytes, so anything past this size is refused before it is parsed (a file dumped there by mistake, not settings).
MAX_PARAMS_BYTES = 1 << 20


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently, so the first
    value a user wrote would be ignored without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {first} and {key_node.start_mark.line + 1})",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_params(path: str | Path = DEFAULT_PARAMS, *, only_known: bool = True) -> dict[str, Any]:
    """Read a params file as a mapping of known sections.

    A missing file, a folder, a file larger than :data:`MAX_PARAMS_BYTES`, text that is not UTF-8, malformed or too
    deeply nested YAML, a key given twice, a top level that is not a mapping and (with `only_known`, what every phase
    reads with) a section name outside :data:`SECTIONS` are each a :class:`ConfigError` naming the file (and the line
    or the key). `agentrl run` reads with ``only_known=False``: it orchestrates whatever stages a `dvc.yaml` lists,
    whose own scripts may read sections of their own; a mistyped phase section still stops the phase that reads the
    file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a params file")
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    size = path.stat().st_size
    if size > MAX_PARAMS_BYTES:
        raise ConfigError(f"{path}: {size} bytes; a params file is at most {MAX_PARAMS_BYTES} bytes")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (line {line}, byte {exc.start + 1} of the file)") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply to read") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    unknown = [k for k in data if k not in SECTIONS] if only_known else []
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), SECTIONS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{path}: unknown section {unknown[0]!r}{hint}; valid sections: {', '.join(SECTIONS)}")
    return data


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The valid field names at `loc` inside `model` (for 'did you mean' hints)."""
    current: Any = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        annotation = fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if current is None:
            return []
    fields = getattr(current, "model_fields", None)
    return list(fields) if fields else []


AUTO_TAG = "literal['auto']"  # pydantic's name of the `Literal["auto"]` member of a union (pipeline.core.recipe)


def _fold_auto(errors: list[dict]) -> list[dict]:
    """A key typed ``<value> | 'auto'`` that fits neither gets one error per union member; keep the value's errors,
    at the key's own location, saying that 'auto' is the other choice."""
    auto_at = {tuple(e["loc"][:-1]) for e in errors if e["loc"] and e["loc"][-1] == AUTO_TAG}
    out = []
    for e in errors:
        loc = tuple(e["loc"])
        if loc and loc[-1] == AUTO_TAG:
            continue
        base = next((b for b in auto_at if loc[:len(b)] == b and len(loc) > len(b)), None)
        if base is not None:
            e = {**e, "loc": base + loc[len(base) + 1:], "msg": f"{e['msg']}, or 'auto'"}
        out.append(e)
    return out


def format_validation_error(exc: ValidationError, model: type[BaseModel], where: str) -> str:
    lines = []
    for err in _fold_auto(exc.errors()):
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc)
        full = f"{where}.{key}" if key else where
        if err["type"] == "extra_forbidden":
            valid = _field_names(model, loc)
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"{full}: unknown key{hint}; valid keys: {', '.join(valid)}")
        else:
            got = err.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {_short_repr(got)})"
            lines.append(f"{full}: {err['msg']}{got_s}")
    # the first line names the file and section (and the key, when there is one), so an `error:` line alone says
    # where to look
    if len(lines) == 1:
        return f"invalid configuration: {lines[0]}"
    return f"invalid configuration in {where}:\n  " + "\n  ".join(lines)


def _short_repr(value: Any) -> str:
    """A bounded repr of a rejected value: a YAML alias chain can make a value whose full repr never ends."""
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlevel, r.maxlist, r.maxdict = 80, 80, 2, 4, 4
    return r.repr(value)


def parse_section(model: type[C], data: Any, where: str) -> C:
    """Validate `data` as `model`; errors name every offending key under `where` (e.g. 'params.yaml:build_env')."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model, where)) from None


def load_section(model: type[C], section: str, path: str | Path = DEFAULT_PARAMS, *, resolve: bool = True) -> C:
    """Load and validate one `params.yaml` section; a missing section means all defaults.

    With `resolve` (what every phase reads with), an ``auto`` key of the `env` or `rollout` section takes the value
    the run's recipe recorded (:func:`pipeline.core.recipe.resolve`: data/recipe.json, models/adapted/policy.json);
    a record that is missing is a ConfigError naming the key. The phase that derives a value reads its section with
    ``resolve=False``."""
    from pipeline.core.recipe import RecipeError, resolve as resolve_recipe

    data = read_params(path)
    cfg = parse_section(model, data.get(section), f"{path}:{section}")
    if not resolve:
        return cfg
    try:
        return resolve_recipe(cfg, section)
    except RecipeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
