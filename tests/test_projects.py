"""Projects apart: a phase command acts on the project its params file belongs to, whatever the working directory.

A project is a folder with its own dvc.yaml and params.yaml (the repository root, projects/sql-analyst, ...). Given
the params file of another project, every phase command moves into that project's folder before it reads or writes
anything, so one project's build never lands in another's data/ (flows/cli.py: enter_project).
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import flows.cli as cli

ROOT = Path(__file__).resolve().parents[1]


def two_projects(base: Path) -> tuple[Path, Path]:
    """A repository root and projects/sql-analyst inside it, each with its own dvc.yaml and params.yaml."""
    root, sql = base / "repo", base / "repo" / "projects" / "sql-analyst"
    sql.mkdir(parents=True)
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, root / name)
        shutil.copy2(ROOT / "projects" / "sql-analyst" / name, sql / name)
    return root, sql


def record_calls(command: str, monkeypatch) -> list[tuple[Path, Path]]:
    """Replace the library function that `command` runs (its ``module:function`` in cli.COMMANDS) by one that records
    the working directory and the params file it was called with, and passes (promote's verdict)."""
    seen = []

    def record(params, *rest):
        seen.append((Path.cwd(), Path(params)))
        return True

    module, function = cli.COMMANDS[command].run.split(":")
    monkeypatch.setattr(importlib.import_module(module), function, record)
    return seen


@pytest.mark.parametrize("command", sorted(cli.PROJECT_COMMANDS))
def test_every_phase_command_acts_in_the_folder_of_its_params_file(command, tmp_path, monkeypatch, capsys):
    root, sql = two_projects(tmp_path)
    seen = record_calls(command, monkeypatch)
    monkeypatch.chdir(root)
    assert cli.main([command, "--params", "projects/sql-analyst/params.yaml"]) == 0  # root -> the SQL analyst
    monkeypatch.chdir(sql)
    assert cli.main([command, "--params", "../../params.yaml"]) == 0  # the SQL analyst's folder -> the root
    monkeypatch.chdir(sql)  # (the command moved this process into the root)
    assert cli.main([command, "--params", "params.yaml"]) == 0  # its own folder: nothing moves
    assert [(cwd.resolve(), params.resolve()) for cwd, params in seen] == [
        (sql.resolve(), (sql / "params.yaml").resolve()),
        (root.resolve(), (root / "params.yaml").resolve()),
        (sql.resolve(), (sql / "params.yaml").resolve())]
    err = capsys.readouterr().err
    assert err.count(f"agentrl {command}: acting on the project in") == 2  # said when it moves, not otherwise


def test_a_params_file_outside_any_project_keeps_the_working_directory(tmp_path, monkeypatch):
    """A loose file of overrides (no dvc.yaml beside it) is read from where it lies; the working directory stays
    the project, as before."""
    root, _ = two_projects(tmp_path)
    loose = tmp_path / "overrides" / "params.yaml"
    loose.parent.mkdir()
    shutil.copy2(root / "params.yaml", loose)
    seen = record_calls("evaluate", monkeypatch)
    monkeypatch.chdir(root)
    assert cli.main(["evaluate", "--params", str(loose)]) == 0
    assert [cwd for cwd, _ in seen] == [Path.cwd()] and Path.cwd().resolve() == root.resolve()


@pytest.mark.slow
def test_building_another_project_from_the_root_leaves_the_roots_data_alone(tmp_path):
    """The installed command, from the root, with the SQL analyst's params: the SQL world lands in its own folder;
    the root's data/ and metrics/ (the default project's) are not touched."""
    from test_flow import BIN, clean_env

    root, sql = two_projects(tmp_path)
    params = yaml.safe_load((sql / "params.yaml").read_text())
    params["build_env"].update({"options": {"n_customers": 60, "n_products": 40, "n_orders": 300},
                                "tasks_per_split": {"train": 24, "validation": 8, "test": 8},
                                "probes": {**params["build_env"]["probes"], "tasks": 8}})
    (sql / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "data").mkdir()
    (root / "data" / "mine.txt").write_text("the default project's data")
    before = sorted(p.relative_to(root) for p in root.rglob("*") if "projects" not in p.parts)
    proc = subprocess.run([str(BIN / "agentrl"), "build-env", "--params", "projects/sql-analyst/params.yaml"],
                          cwd=root, env=clean_env(root), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"acting on the project in {sql.resolve()}" in proc.stderr
    assert json.loads((sql / "metrics" / "build_env.json").read_text())["environment"] == "sql"
    assert (sql / "data" / "tasks" / "test.jsonl").is_file()
    after = sorted(p.relative_to(root) for p in root.rglob("*") if "projects" not in p.parts)
    assert after == before and (root / "data" / "mine.txt").read_text() == "the default project's data"
    assert not (root / "metrics").exists()


@pytest.mark.parametrize("project", ["sql-analyst", "calendar"])
def test_every_project_graph_is_the_roots_with_its_code_two_folders_up(project):
    """A project's dvc.yaml is the root's stage for stage (deps, params, outs, metrics), its code paths two folders
    up: a dataset wired into the root's graph (data/incoming, the traffic snapshot data/production) reruns the same
    stages in every project, and the folder it names is kept present by a README of its own."""
    from pipeline.core.graph import stage_order

    folder = ROOT / "projects" / project
    root = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    own = yaml.safe_load((folder / "dvc.yaml").read_text())["stages"]
    assert list(own) == list(root)
    for name, stage in root.items():
        mine = dict(own[name])
        mine["deps"] = [d.removeprefix("../../") for d in mine.get("deps", [])]
        assert mine == {**stage, "deps": stage.get("deps", [])}, name
        local = [d for d in own[name].get("deps", []) if not d.startswith("../../")]
        for dep in local:
            if dep.startswith("data/") and not any(dep.startswith(o) for s in root.values() for o in s.get("outs", [])
                                                   if isinstance(o, str)):
                assert (folder / dep).exists(), f"{project}: the dep {dep} of stage {name} is not in the project"
    assert "data/production" in own["reward_model"]["deps"] and "data/production" in own["train"]["deps"]
    assert stage_order(folder / "dvc.yaml") == stage_order(ROOT / "dvc.yaml")
    params = yaml.safe_load((folder / "params.yaml").read_text())
    assert params["train"]["production_tasks"] == "data/production/snapshot/tasks"
    assert params["reward_model"]["feedback"] == "data/production/snapshot"


def flat(tree: dict, prefix: str = "") -> dict:
    """{'a.b.c': value} for every leaf of a params tree; `build_env.options` is one leaf (each world's own)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name != "build_env.options":
            out.update(flat(value, name + "."))
        else:
            out[name] = value
    return out


# What a project sets apart from the root's recipe: its world and that world's build options, and its own plumbing
# (the DeepSpeed file two folders up, its registry name). Any other difference would be a per-environment recipe.
OWN_KEYS = {"env.name", "build_env.options", "train.deepspeed_config", "deploy.model_name"}
# The one recipe difference a project may still carry: the capability gate report-only (its minimums are reported,
# the run goes on), for a world whose adapted model does not meet them yet; the project's header says so. The SQL
# analyst's committed run gated.
REPORT_ONLY_GATE = {"calendar": {"adapt.gate.enabled", "deploy.gate.require_capability_gate"}, "sql-analyst": set()}


@pytest.mark.parametrize("project", ["sql-analyst", "calendar"])
def test_every_project_runs_the_roots_recipe(project):
    root = flat(yaml.safe_load((ROOT / "params.yaml").read_text()))
    own = flat(yaml.safe_load((ROOT / "projects" / project / "params.yaml").read_text()))
    assert set(own) == set(root), f"{project}: keys the root lacks {set(own) - set(root)}, lacks {set(root) - set(own)}"
    differ = {key for key in root if own[key] != root[key]}
    allowed = OWN_KEYS | REPORT_ONLY_GATE[project]
    assert differ <= allowed, {key: (own[key], root[key]) for key in differ - allowed}
    assert own["train.deepspeed_config"] == "../../" + root["train.deepspeed_config"]
