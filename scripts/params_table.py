#!/usr/bin/env python
"""The configuration table of docs/configuration.md: every params.yaml key with its type, default and description.

The rows come from the pydantic models' field descriptions (the single source of the documentation), so regenerate the
table whenever a model changes:

    python scripts/params_table.py           # print the table
    python scripts/params_table.py --write   # replace the table in docs/configuration.md

A test fails while docs/configuration.md holds any other table than the one this script generates.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))

from flows.cli import section_models  # noqa: E402

# params.yaml section -> model (flows/cli.py keeps the one mapping; a new phase adds its section there).
SECTIONS: dict[str, type[BaseModel]] = section_models()


def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    if name and not getattr(annotation, "__args__", None):
        return name
    args = typing.get_args(annotation)
    if typing.Literal["auto"] in args:  # a value or 'auto' (pipeline.core.recipe)
        return " | ".join("'auto'" if a == typing.Literal["auto"] else _type_name(
            typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a) for a in args)
    return str(annotation).replace("typing.", "")


def _union_metadata(annotation: Any) -> list[Any]:
    """Bounds declared on a constrained member of a union (``Annotated[int, Field(ge=1)] | Literal['auto']``)."""
    out = []
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Annotated:
            for meta in typing.get_args(arg)[1:]:
                out += list(getattr(meta, "metadata", [meta]))
    return out


def _default(value: Any) -> str:
    """The default as it is written in params.yaml (YAML flow style)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_default(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value
    return json.dumps(value)  # numbers; true/false as YAML spells them


def _bounds(metadata: list[Any]) -> str:
    """Numeric bounds declared on the field (annotated_types Ge/Gt/Le/Lt), e.g. '≥ 1, ≤ 64'."""
    marks = []
    for item in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                marks.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(marks)


def rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str, str]]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        annotation = field.annotation
        default = field.get_default(call_default_factory=True)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.append((key, "section", "", "", field.description or ""))
            out.extend(rows(annotation, key))
        else:
            bounds = _bounds(field.metadata or _union_metadata(annotation))
            out.append((key, _type_name(annotation), _default(default), bounds, field.description or ""))
    return out


def option_rows() -> list[tuple[str, str, str, str, str]]:
    """`build_env.options` of every built-in environment (its Options model), each description naming the
    environment (`env.name`) it applies to; an environment installed as an entry point documents its own."""
    from pipeline.envs.registry import BUILTIN, environment_class

    out = []
    for name in BUILTIN:
        for key, typ, default, bounds, desc in rows(environment_class(name).Options, "build_env.options"):
            out.append((key, typ, default, bounds, f"(env.name {name}) {desc}"))
    return out


def table() -> str:
    lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for section, model in SECTIONS.items():
        lines.append(f"| `{section}` | section | | | {(model.__doc__ or '').strip().splitlines()[0]} |")
        section_rows = []
        for row in rows(model, section):  # the built-in environments' options follow `build_env.options`
            section_rows += [row, *option_rows()] if row[0] == "build_env.options" else [row]
        for key, typ, default, bounds, desc in section_rows:
            shown = f"`{default}`" if default else ""
            lines.append(f"| `{key}` | {typ.replace(' | ', ' or ')} | {shown} | {bounds} | {desc.replace('|', '/')} |")
    return "\n".join(lines)


def table_in(text: str) -> list[str]:
    """The table a page holds: the lines from the generated header row to the last contiguous table row."""
    lines = text.splitlines()
    header = table().splitlines()[0]
    if header not in lines:
        return []
    start = lines.index(header)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def write(doc: Path = DOC) -> None:
    """Replace the table in `doc` (or append one when it has none) with the generated one."""
    text = doc.read_text()
    old = table_in(text)
    new = table()
    if not old:
        doc.write_text(text.rstrip("\n") + "\n\n" + new + "\n")
        return
    lines = text.splitlines()
    start = lines.index(old[0])
    lines[start:start + len(old)] = new.splitlines()
    doc.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table in {DOC.relative_to(ROOT)}")
    if parser.parse_args().write:
        write()
        print(f"wrote the parameter table to {DOC.relative_to(ROOT)}")
    else:
        print(table())
