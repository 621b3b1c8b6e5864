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


def read_params(path: str | Path = DEFAULT_PARAMS) -> dict[str, Any]:
    """Read a params file as a mapping; a missing, unparsable or non-mapping file is a :class:`ConfigError`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {yaml_problem(exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
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


def format_validation_error(exc: ValidationError, model: type[BaseModel], where: str) -> str:
    lines = []
    for err in exc.errors():
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
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{full}: {err['msg']}{got_s}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


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


def load_section(model: type[C], section: str, path: str | Path = DEFAULT_PARAMS) -> C:
    """Load and validate one `params.yaml` section; a missing section means all defaults."""
    data = read_params(path)
    return parse_section(model, data.get(section), f"{path}:{section}")
