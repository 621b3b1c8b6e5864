"""The phase graph, read from `dvc.yaml`: the single definition of which phases exist and in which order they run.

DVC runs the stages from `dvc.yaml`; the Prefect flow in `flows/` asks this module for the same stages in the same order,
so the two cannot drift. A stage depends on another when one of its deps overlaps one of the other's outputs (outs,
metrics or plots): the dep lies at or under the output (``data/tasks/train.jsonl`` under ``data/tasks``), or the output
lies under the dep (a dep on all of ``data`` needs every stage writing into it), which is how DVC itself links stages
(``dvc/repo/graph.py``). Ties are broken by the order of the stages in `dvc.yaml`, so the order is deterministic.

Deliberately left out: `foreach`/`matrix` stages and `vars` templating (refused with a clear error; no stage uses
them), and stages from other `dvc.yaml` files in subdirectories.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from pipeline.core.config import yaml_problem
from pipeline.core.errors import AgentRLError

DVC_FILE = "dvc.yaml"
DEFAULT_PARAMS_FILE = "params.yaml"


class GraphError(AgentRLError):
    """`dvc.yaml` is missing, unreadable, or describes an impossible graph (a cycle, overlapping outputs)."""


@dataclass(frozen=True)
class Stage:
    """One stage of `dvc.yaml`; paths are normalised POSIX paths relative to the `dvc.yaml` directory."""

    name: str
    cmd: str
    deps: tuple[str, ...]
    outs: tuple[str, ...]  # outs, metrics and plots that are files or folders
    params: tuple[tuple[str, str], ...]  # (params file, key); the key may be a whole section ("env")
    metrics: tuple[str, ...] = ()  # the `metrics:` files alone (also in outs): what a run summary reads


def _norm(path: str, wdir: str) -> str:
    joined = PurePosixPath(wdir) / PurePosixPath(path.replace("\\", "/"))
    parts: list[str] = []
    for part in joined.parts:
        if part in ("", "."):
            continue
        if part == ".." and parts and parts[-1] != "..":
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def overlaps(a: str, b: str) -> bool:
    """True when path `a` is `b`, lies under `b`, or contains `b`."""
    pa, pb = PurePosixPath(a).parts, PurePosixPath(b).parts
    n = min(len(pa), len(pb))
    return pa[:n] == pb[:n]


def _paths(entries: Any, field: str, stage: str) -> list[str]:
    """Paths from a deps/outs/metrics/plots list; entries are strings or one-key mappings ``{path: {options}}``."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise GraphError(f"{DVC_FILE}: stage '{stage}': '{field}' must be a list, got {type(entries).__name__}")
    paths = []
    for entry in entries:
        if isinstance(entry, str):
            paths.append(entry)
        elif isinstance(entry, dict) and len(entry) == 1:
            paths.append(str(next(iter(entry))))
        else:
            raise GraphError(f"{DVC_FILE}: stage '{stage}': cannot read {field} entry {entry!r}")
    return paths


def _params(entries: Any, stage: str) -> list[tuple[str, str]]:
    """``params:`` entries: a key of params.yaml, or ``{file: [keys]}`` for another params file."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise GraphError(f"{DVC_FILE}: stage '{stage}': 'params' must be a list")
    out: list[tuple[str, str]] = []
    for entry in entries:
        if isinstance(entry, str):
            out.append((DEFAULT_PARAMS_FILE, entry))
        elif isinstance(entry, dict):
            for file, keys in entry.items():
                for key in keys or []:  # an empty list means "every key in the file"
                    out.append((str(file), str(key)))
                if not keys:
                    out.append((str(file), ""))
        else:
            raise GraphError(f"{DVC_FILE}: stage '{stage}': cannot read params entry {entry!r}")
    return out


def parse_stages(document: Any, source: str = DVC_FILE) -> list[Stage]:
    """Stages of a parsed `dvc.yaml` document, in file order."""
    if not isinstance(document, dict) or not isinstance(document.get("stages"), dict):
        raise GraphError(f"{source}: expected a top-level 'stages:' mapping")
    stages = []
    for name, spec in document["stages"].items():
        if not isinstance(spec, dict):
            raise GraphError(f"{source}: stage '{name}' must be a mapping")
        if "foreach" in spec or "matrix" in spec:
            raise GraphError(f"{source}: stage '{name}' uses foreach/matrix, which pipeline.core.graph does not expand")
        if "cmd" not in spec:
            raise GraphError(f"{source}: stage '{name}' has no 'cmd'")
        wdir = str(spec.get("wdir", "."))
        cmd = spec["cmd"]
        outs = [*_paths(spec.get("outs"), "outs", name), *_paths(spec.get("metrics"), "metrics", name)]
        outs += _paths(spec.get("plots"), "plots", name)
        stages.append(
            Stage(
                name=str(name),
                cmd=" && ".join(cmd) if isinstance(cmd, list) else str(cmd),
                deps=tuple(_norm(p, wdir) for p in _paths(spec.get("deps"), "deps", name)),
                outs=tuple(_norm(p, wdir) for p in outs),
                params=tuple(_params(spec.get("params"), name)),
                metrics=tuple(_norm(p, wdir) for p in _paths(spec.get("metrics"), "metrics", name)),
            )
        )
    return stages


def toposort(stages: Sequence[Stage]) -> list[Stage]:
    """Stages ordered so that every stage comes after the stages whose outputs it depends on.

    Raises :class:`GraphError` on a cycle (naming the stages in it) or on two stages whose outputs overlap.
    """
    for i, a in enumerate(stages):
        for b in stages[i + 1 :]:
            clash = [(x, y) for x in a.outs for y in b.outs if overlaps(x, y)]
            if clash:
                x, y = clash[0]
                raise GraphError(f"stages '{a.name}' and '{b.name}' both write '{x}'/'{y}': outputs must not overlap")
    upstream: dict[str, set[str]] = {s.name: set() for s in stages}
    for s in stages:
        for other in stages:
            if any(overlaps(dep, out) for dep in s.deps for out in other.outs):
                upstream[s.name].add(other.name)
    position = {s.name: i for i, s in enumerate(stages)}
    by_name = {s.name: s for s in stages}
    done: list[Stage] = []
    placed: set[str] = set()
    while len(done) < len(stages):
        ready = [n for n in position if n not in placed and upstream[n] <= placed]
        if not ready:
            raise GraphError(f"{DVC_FILE} has a cycle: {_describe_cycle(upstream, placed)}")
        first = min(ready, key=position.__getitem__)
        done.append(by_name[first])
        placed.add(first)
    return done


def _describe_cycle(upstream: dict[str, set[str]], placed: set[str]) -> str:
    """One cycle among the unplaced stages, as 'a -> b -> a' (a depends on b, ...)."""
    start = next(n for n in upstream if n not in placed)
    path = [start]
    while True:
        nxt = min(n for n in upstream[path[-1]] if n not in placed)
        if nxt in path:
            cycle = path[path.index(nxt) :] + [nxt]
            return " -> ".join(cycle) + " (each needs the outputs of the next)"
        path.append(nxt)


def load_stages(path: str | Path = DVC_FILE) -> list[Stage]:
    """The stages of the `dvc.yaml` at `path` in run order."""
    path = Path(path)
    if not path.is_file():
        raise GraphError(f"{path}: not found; the phase graph is defined in dvc.yaml at the repository root")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise GraphError(f"{path}: {yaml_problem(exc)}") from None
    return toposort(parse_stages(document, str(path)))


def stage_order(path: str | Path = DVC_FILE) -> list[str]:
    """Names of the stages of `dvc.yaml` in run order."""
    return [s.name for s in load_stages(path)]


def select(order: Sequence[str], wanted: Iterable[str] | None) -> list[str]:
    """The stages of `wanted` in graph order (all of `order` when `wanted` is None); unknown names are refused."""
    if wanted is None:
        return list(order)
    wanted = list(wanted)
    unknown = [w for w in wanted if w not in order]
    if unknown:
        raise GraphError(f"unknown stage(s) {unknown}; stages in {DVC_FILE}: {list(order)}")
    return [s for s in order if s in wanted]


def stages_from_first_reader(root: str | Path, folders: Sequence[str | Path], fallback: str) -> list[str]:
    """The stages of `root`/dvc.yaml in run order from the first one with a dep on one of `folders` on: what a retrain on
    new data forces. A stage before it reads none of the new data, so rerunning it would only refit the same inputs.
    A graph where no stage reads those folders (or folders outside `root`) gives every stage from `fallback` on."""
    root = Path(root)
    stages = load_stages(root / DVC_FILE)
    inside = []
    for folder in folders:
        try:
            inside.append(Path(folder).resolve().relative_to(root.resolve()).as_posix())
        except ValueError:  # outside the project: no stage's dep
            continue
    order = [s.name for s in stages]
    for i, stage in enumerate(stages):
        if any(overlaps(dep, f) for dep in stage.deps for f in inside):
            return order[i:]
    return order[order.index(fallback):] if fallback in order else order


__all__ = ["GraphError", "Stage", "load_stages", "overlaps", "parse_stages", "select", "stage_order", "stages_from_first_reader",
           "toposort"]
