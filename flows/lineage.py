"""Lineage for the flows: which data and model versions a run used (DVC hashes from `dvc.lock`) and which code (git).

DVC already records, per stage, the md5 of every dependency and output in `dvc.lock`; this module reads them back so
the flows can put them on MLflow runs as tags (``agentrl.data.<path>`` = md5, ``.dir`` for a folder), and restores an
old version of a tracked folder or file from DVC's content-addressed cache (``.dvc/cache/files/md5/ab/cdef...``) so the
retraining flow can compare new data with the data the champion was trained on, even after the workspace moved on.

Deliberately left out: fetching from a DVC remote (run ``dvc fetch`` first when the local cache was cleared) and the
``params`` section of `dvc.lock` (params are logged on each phase run already).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from pipeline.core.errors import AgentRLError

LOCK_FILE = "dvc.lock"
TRACKED_ROOTS = ("data", "models")  # versioned outputs worth recording; code deps are covered by the git commit
DATA_TAG = "agentrl.data."


def _lock(root: Path) -> dict:
    path = root / LOCK_FILE
    if not path.is_file():
        return {}
    return (yaml.safe_load(path.read_text()) or {}).get("stages", {}) or {}


def _tracked(path: str) -> bool:
    return path.split("/", 1)[0] in TRACKED_ROOTS


def stage_versions(root: str | Path, stage: str) -> dict[str, str]:
    """{path: md5} of the data/ and models/ deps and outs of `stage` as `dvc.lock` records them ({} before its first run)."""
    entry = _lock(Path(root)).get(stage, {})
    out: dict[str, str] = {}
    for item in [*entry.get("deps", []), *entry.get("outs", [])]:
        if _tracked(item.get("path", "")) and item.get("md5"):
            out[item["path"]] = item["md5"]
    return out


def data_versions(root: str | Path) -> dict[str, str]:
    """{path: md5} of every data/ and models/ output of every stage in `dvc.lock`: the versions a pipeline run produced."""
    out: dict[str, str] = {}
    for entry in _lock(Path(root)).values():
        for item in entry.get("outs", []):
            if _tracked(item.get("path", "")) and item.get("md5"):
                out[item["path"]] = item["md5"]
    return out


def version_tags(versions: dict[str, str]) -> dict[str, str]:
    """MLflow tags for data versions: ``agentrl.data.data/tasks`` -> ``<md5>.dir``."""
    return {DATA_TAG + path: md5 for path, md5 in sorted(versions.items())}


def versions_from_tags(tags: dict[str, str]) -> dict[str, str]:
    """The inverse of :func:`version_tags`."""
    return {k[len(DATA_TAG):]: v for k, v in tags.items() if k.startswith(DATA_TAG)}


def git_state(root: str | Path) -> dict[str, str]:
    """``git.commit`` (HEAD, or 'none' before the first commit) and ``git.dirty`` ('true' when tracked files changed)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False)

    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {"git.commit": "unknown", "git.dirty": "unknown"}
    commit = head.stdout.strip() if head.returncode == 0 else "none"
    dirty = "unknown" if status.returncode != 0 else str(bool(status.stdout.strip())).lower()
    return {"git.commit": commit or "none", "git.dirty": dirty}


def cache_file(root: Path, md5: str) -> Path:
    """Where DVC 3 keeps the object `md5` in the project's local cache."""
    digest = md5.removesuffix(".dir")
    suffix = ".dir" if md5.endswith(".dir") else ""
    return root / ".dvc" / "cache" / "files" / "md5" / digest[:2] / (digest[2:] + suffix)


def restore(root: str | Path, path: str, md5: str, dest: str | Path) -> Path:
    """The version `md5` of the tracked `path` (a file or a ``.dir`` folder), copied from the DVC cache to `dest`.

    Returns `dest`. A version missing from the cache is an AgentRLError that says how to get it back.
    """
    root, dest = Path(root), Path(dest)
    obj = cache_file(root, md5)
    if not obj.is_file():
        raise AgentRLError(f"{path} version {md5} is not in the DVC cache ({obj}); run `dvc fetch` to get it from "
                           "the remote, or retrain so the current data becomes the reference")
    if not md5.endswith(".dir"):
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(obj, dest)
        return dest
    entries = json.loads(obj.read_text())
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for entry in entries:
        src = cache_file(root, entry["md5"])
        if not src.is_file():
            raise AgentRLError(f"{path}/{entry['relpath']} (of version {md5}) is not in the DVC cache; run `dvc fetch`")
        target = tmp / entry["relpath"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.replace(dest)
    return dest


def at_version(root: str | Path, path: str, md5: str | None, scratch: str | Path) -> tuple[Path, str]:
    """The tracked `path` at version `md5`: the workspace copy when it is that version (or `md5` is None: unknown),
    else a copy restored from the DVC cache under `scratch`. Returns (path, where it came from)."""
    root = Path(root)
    current = {**data_versions(root), **_all_dep_versions(root)}.get(path)
    if md5 is None:
        return root / path, "workspace (the champion's version is not recorded)"
    if current == md5:
        return root / path, f"workspace ({md5})"
    dest = Path(scratch) / md5.removesuffix(".dir") / Path(path).name
    if not dest.exists():
        restore(root, path, md5, dest)
    return dest, f"DVC cache ({md5})"


def _all_dep_versions(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in _lock(root).values():
        for item in entry.get("deps", []):
            if _tracked(item.get("path", "")) and item.get("md5"):
                out[item["path"]] = item["md5"]
    return out


__all__ = ["DATA_TAG", "at_version", "cache_file", "data_versions", "git_state", "restore", "stage_versions",
           "version_tags", "versions_from_tags"]
