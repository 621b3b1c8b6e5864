"""Foundation: config loading, params.yaml ↔ models ↔ dvc.yaml, the CLI, the tracker, the phase graph and the flow."""

from __future__ import annotations

import ast
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from pipeline import repo_root
from flows.cli import COMMANDS, LOCKED, PARAMS, Arg, Command, build_parser, main
from pipeline.core.config import DEFAULT_PARAMS, ConfigError, load_section, read_params
from pipeline.envs.config import EnvConfig
from pipeline.build_env.config import BuildEnvConfig
from pipeline.core.graph import (GraphError, load_stages, parse_stages, select, stage_order,
                                 stages_from_first_reader, toposort)
from pipeline.core.errors import AgentRLError
from pipeline.core.tracking import NullRun, NullTracker, RunHandle, Tracker, flatten, namespaced, tracking_enabled

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"env": EnvConfig, "build_env": BuildEnvConfig}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --------------------------------------------------------------------------------------------------------------------
# The package: offline by default, and no orchestrator or heavy import behind the library's front doors.


def test_import_sets_offline_defaults_without_overriding_the_user_and_stays_light():
    probe = (
        "import os, sys, pipeline, flows.cli, pipeline.core.tracking, pipeline.core.graph, flows\n"
        "keys = ['MLFLOW_DISABLE_TELEMETRY', 'PREFECT_SERVER_ANALYTICS_ENABLED', 'DVC_NO_ANALYTICS',"
        " 'HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE', 'GX_ANALYTICS_ENABLED']\n"
        "print({k: os.environ.get(k) for k in keys})\n"
        "print(sorted(m for m in ('mlflow', 'prefect', 'great_expectations', 'dvc', 'torch') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "DVC_", "HF_", "GX_"))}
    env["HF_HUB_OFFLINE"] = "0"  # a user's explicit choice wins
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    settings, heavy = (ast.literal_eval(line) for line in proc.stdout.splitlines())
    assert settings == {
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_DATASETS_OFFLINE": "1",
        "GX_ANALYTICS_ENABLED": "false",
    }
    assert heavy == []


def test_the_repository_tracks_no_symbolic_links():
    # Two experiment folders once leaked into commits as symlinks (configs/configs, a loop; data/data, dangling):
    # a clean clone then broke every test that copies the project.
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in listing.splitlines() if line.startswith("120000 ")]
    assert not links, f"tracked symbolic links: {links}"


def test_dvc_config_turns_analytics_off():
    text = (ROOT / ".dvc" / "config").read_text()
    assert "analytics = false" in text and "check_update = false" in text


# --------------------------------------------------------------------------------------------------------------------
# Config loading: every bad input names the key and says what is wrong.


def test_unknown_key_names_it_and_suggests_the_closest(tmp_path):
    params = write(tmp_path / "params.yaml", "env:\n  max_step: 5\n")
    with pytest.raises(ConfigError) as err:
        load_section(EnvConfig, "env", params)
    msg = str(err.value)
    assert "env.max_step: unknown key" in msg
    assert "did you mean 'max_steps'" in msg


def test_unknown_nested_key_is_found_inside_its_subsection(tmp_path):
    params = write(tmp_path / "params.yaml", "build_env:\n  demos:\n    redundant_call_probability: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_section(BuildEnvConfig, "build_env", params)
    assert "build_env.demos.redundant_call_probability: unknown key" in str(err.value)
    assert "did you mean 'redundant_call_prob'" in str(err.value)


def test_wrong_type_names_key_and_value(tmp_path):
    params = write(tmp_path / "params.yaml", "env:\n  max_steps: eight\n")
    with pytest.raises(ConfigError) as err:
        load_section(EnvConfig, "env", params)
    msg = str(err.value)
    assert "env.max_steps" in msg and "'eight'" in msg and "integer" in msg


def test_malformed_yaml_reports_the_line(tmp_path):
    params = write(
        tmp_path / "params.yaml",
        """\
        env:
          max_steps: 8
         history_window: 6
        """,
    )
    with pytest.raises(ConfigError) as err:
        load_section(EnvConfig, "env", params)
    assert "malformed YAML" in str(err.value)
    assert "line 3" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [("safety", -1.0, "greater than or equal to 0"), ("correctness", 0, "greater than 0"), ("efficiency", 101, "less than or equal to 100")],
)
def test_out_of_range_reward_weight_is_refused(tmp_path, key, value, expected):
    params = write(tmp_path / "params.yaml", f"env:\n  reward:\n    {key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_section(EnvConfig, "env", params)
    assert f"env.reward.{key}" in str(err.value)
    assert expected in str(err.value)


def test_missing_params_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_section(EnvConfig, "env", tmp_path / "nope.yaml")


# --------------------------------------------------------------------------------------------------------------------
# params.yaml mirrors the models, and dvc.yaml declares what the phases read.


RECIPE_AUTO = {"env": ("max_steps", "max_policy_chars", "max_action_chars"), "rollout": ("max_new_tokens",)}


@pytest.mark.parametrize("section", SECTIONS)
def test_params_yaml_holds_every_key_with_the_model_default(section):
    model = SECTIONS[section]
    params = read_params(ROOT / "params.yaml")
    raw = params[section]
    # Same keys, same values, all the way down: params.yaml is the model's defaults written out.
    expected = model().model_dump()
    if section == "build_env":
        # `build_env.options` belongs to the environment (its Options model checks it when the phase runs; the
        # config's default {} means "the environment's defaults"): params.yaml writes the chosen environment's
        # defaults out, key for key.
        from pipeline.envs.registry import environment_class

        expected["options"] = environment_class(params["env"]["name"]).Options().model_dump()
    # ... except the recipe's keys (docs/recipe.md): params.yaml derives them (`auto`), while the models keep the
    # default shop run's numbers for a config built in code, where there is no data to derive them from.
    for key in RECIPE_AUTO.get(section, ()):
        expected[key] = "auto"
    if section == "adapt":
        expected["gate"]["min"] = "auto"
    assert raw == expected
    assert load_section(model, section, ROOT / "params.yaml", resolve=False).model_dump() == expected


def test_configuration_page_holds_exactly_the_parameter_table_the_configs_generate():
    # The configs' field descriptions are the one source of docs/configuration.md's table; a config edited without
    # regenerating the table (python scripts/params_table.py --write) leaves the page describing keys, defaults or
    # bounds that are gone, or missing new ones.
    import importlib.util

    spec = importlib.util.spec_from_file_location("params_table", ROOT / "scripts" / "params_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = module.table().splitlines()
    shown = module.table_in((ROOT / "docs" / "configuration.md").read_text())
    assert shown, "docs/configuration.md has no parameter table: run python scripts/params_table.py --write"
    stale = [row for row in shown if row not in generated]
    missing = [row for row in generated if row not in shown]
    fix = "regenerate it with python scripts/params_table.py --write"
    assert not stale, f"docs/configuration.md has rows the configs no longer generate ({fix}): {stale[:3]}"
    assert not missing, f"docs/configuration.md lacks rows the configs generate ({fix}): {missing[:3]}"
    assert shown == generated, f"docs/configuration.md's parameter table is out of order ({fix})"


def _lookup(data: dict, dotted: str) -> bool:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_dvc_params_exist_and_every_section_belongs_to_a_stage():
    params = read_params(ROOT / "params.yaml")
    declared = set()
    for stage in load_stages(ROOT / "dvc.yaml"):
        for file, key in stage.params:
            assert file == "params.yaml", f"{stage.name} reads {file}"
            assert _lookup(params, key), f"dvc.yaml stage {stage.name} declares {key}, which params.yaml lacks"
            declared.add(key.split(".")[0])
    assert set(params) <= declared, f"params.yaml sections no stage declares: {set(params) - declared}"


def _sections_read_by(module_path: Path, sections: set[str]) -> set[str]:
    """Section names a phase module reads: string literals that name a params.yaml section passed to a call
    (`load_section(EnvConfig, "env", ...)`) or used as a subscript (`params["env"]`)."""
    tree = ast.parse(module_path.read_text())
    found = set()
    for node in ast.walk(tree):
        args: list[ast.AST] = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "load_section":
            args = [*node.args, *(kw.value for kw in node.keywords)]
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "params":
            args = [node.slice]
        found |= {a.value for a in args if isinstance(a, ast.Constant) and a.value in sections}
    return found


def test_every_section_a_phase_reads_is_declared_in_its_stage():
    params = read_params(ROOT / "params.yaml")
    checked = 0
    for stage in load_stages(ROOT / "dvc.yaml"):
        assert f"pipeline/{stage.name}" in stage.deps, f"stage {stage.name} does not list its own package"
        # every module of the phase's package (the train phase's ranks read the params in pipeline/train/worker.py)
        phase_files = sorted((ROOT / "pipeline" / stage.name).glob("*.py"))
        declared = {key.split(".")[0] for _, key in stage.params}
        for path in phase_files:
            read = _sections_read_by(path, set(params))
            assert read <= declared, f"stage {stage.name} reads {read - declared} without declaring it in dvc.yaml"
            checked += 1
    assert checked >= 1


def test_build_env_stage_declares_its_sections_code_and_outputs():
    (stage,) = [s for s in load_stages(ROOT / "dvc.yaml") if s.name == "build_env"]
    assert {key for _, key in stage.params} == {"env", "build_env"}
    assert "pipeline/build_env" in stage.deps and "pipeline/envs" in stage.deps
    assert {"data/env", "data/tasks", "data/demos", "metrics/build_env.json"} <= set(stage.outs)
    raw = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["build_env"]
    assert raw["metrics"] == [{"metrics/build_env.json": {"cache": False}}]


# --------------------------------------------------------------------------------------------------------------------
# CLI


def test_help_exits_zero_and_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("build-env", "adapt", "train", "check-drift", "eval", "run", "stages"):
        assert command in out


def _subcommands() -> list[str]:
    action = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(action.choices)


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert f"agentrl {command}" in capsys.readouterr().out


def signature_in_source(target: str) -> inspect.Signature:
    """The signature of the top-level function ``module:function`` of this repository, read from the module's source
    without importing it or its package (the phases import torch and more; defaults stand as None)."""
    module, function = target.split(":")
    tree = ast.parse((ROOT / f"{module.replace('.', '/')}.py").read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    positional, keyword = node.args.args, node.args.kwonlyargs
    first_default = len(positional) - len(node.args.defaults)
    return inspect.Signature(
        [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           default=None if i >= first_default else inspect.Parameter.empty)
         for i, a in enumerate(positional)]
        + [inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY,
                             default=inspect.Parameter.empty if d is None else None)
           for a, d in zip(keyword, node.args.kw_defaults)])


def test_every_table_entry_names_a_function_that_takes_what_it_passes():
    """An entry of cli.COMMANDS that names its library function as ``module:function``: the function exists, and the
    parsed arguments the entry passes exist on its parser and bind to the function's parameters in order. A command
    that locks or acts on its project takes --params."""
    choices = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name, command in COMMANDS.items():  # the lock and the project folder are the params file's folder
        if command.project or command.name in LOCKED:
            assert "params" in {a.dest for a in choices[name]._actions}, name
    phases = {name: command for name, command in COMMANDS.items() if isinstance(command.run, str)}
    assert {"build-env", "adapt", "train", "deploy", "promote", "serve", "eval"} <= set(phases)
    for name, command in phases.items():
        assert set(command.passes) <= {a.dest for a in choices[name]._actions}, name
        signature_in_source(command.run).bind(*command.passes)
    with pytest.raises(TypeError):  # the check can fail: a function given more than it takes
        signature_in_source("pipeline.deploy.main:rollback_main").bind("params", "version")


DEMO_CALLS = []


def demo_phase(params_path: str, times: int) -> bool:
    """The library function of the command test_a_new_command_is_one_table_entry adds: passes when `times` is even."""
    DEMO_CALLS.append((params_path, times))
    return times % 2 == 0


def test_a_new_command_is_one_table_entry(monkeypatch, capsys):
    """One entry in cli.COMMANDS gives the command its help, its arguments and its dispatch (its function, called with
    the arguments it passes; a verdict that fails exits 1)."""
    demo = Command("demo", help="a demonstration command", description="Run the demonstration.",
                   run=f"{__name__}:demo_phase", passes=("params", "times"), verdict=True,
                   arguments=(PARAMS, Arg("--times", type=int, default=2, metavar="N", help="how often")))
    monkeypatch.setitem(COMMANDS, "demo", demo)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "demo        a demonstration command" in capsys.readouterr().out
    DEMO_CALLS.clear()
    assert main(["demo"]) == 0 and main(["demo", "--times", "3", "--params", "p.yaml"]) == 1
    assert DEMO_CALLS == [(str(DEFAULT_PARAMS), 2), ("p.yaml", 3)]


def test_installed_entry_point_runs():
    exe = Path(sys.executable).parent / "agentrl"
    proc = subprocess.run([str(exe), "eval", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--policy" in proc.stdout and "model directory" in proc.stdout


def test_eval_refuses_an_unknown_policy(capsys, tmp_path):
    params = write(tmp_path / "params.yaml", "env: {}\n")
    code = main(["eval", "--policy", "oracle", "--tasks", "t.jsonl", "--out", "o.json", "--params", str(params)])
    assert code == 2
    assert "unknown policy 'oracle': not one of expert, random and not a model directory" in capsys.readouterr().err


def test_user_errors_print_one_line_and_exit_2(tmp_path, capsys):
    bad = write(tmp_path / "params.yaml", "env: [unclosed\n")
    assert main(["run", "--params", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "malformed YAML at line" in err
    assert "Traceback" not in err


def test_run_refuses_params_dvc_would_not_read(tmp_path, capsys):
    other = write(tmp_path / "other.yaml", "env: {}\n")
    assert main(["run", "--params", str(other)]) == 2
    assert "dvc exp run -S" in capsys.readouterr().err
    lone = write(tmp_path / "params.yaml", "env: {}\n")  # no dvc.yaml beside it
    assert main(["run", "--params", str(lone)]) == 2
    assert "no dvc.yaml next to params.yaml" in capsys.readouterr().err


def test_stages_prints_the_graph_and_reports_a_cycle(tmp_path, capsys):
    assert main(["stages", "--dvc-yaml", str(ROOT / "dvc.yaml")]) == 0
    assert "1. build_env: agentrl build-env" in capsys.readouterr().out
    cyclic = write(
        tmp_path / "dvc.yaml",
        """\
        stages:
          a: {cmd: x, deps: [y], outs: [x]}
          b: {cmd: y, deps: [x], outs: [y]}
        """,
    )
    assert main(["stages", "--dvc-yaml", str(cyclic)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cycle" in err and "a -> b -> a" in err


# --------------------------------------------------------------------------------------------------------------------
# Tracking: a real SQLite MLflow store.


def test_flatten_and_namespace():
    assert flatten({"a": {"b": {"c": 1}}, "d": 2}) == {"a.b.c": 1, "d": 2}
    assert namespaced({"x": 1, "env": {"sps": 2}, "data/n": True}, "build_env") == {
        "build_env/x": 1.0,
        "env/sps": 2.0,
        "data/n": 1.0,
    }
    with pytest.raises(TypeError, match="'data/name'"):
        namespaced({"data/name": "abc"}, "p")


def test_tracker_logs_params_metrics_artifacts_and_tags_to_sqlite(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = Tracker(root=tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("alpha")
    (tmp_path / "metrics.json").write_text('{"n": 3}')

    with tracker.run("build_env", params={"env": {"max_steps": 8, "reward": {"safety": 1.0}}, "seed": 0}) as run:
        run.log_metrics({"data/n_tasks": 4800, "rows": 7})
        run.log_metrics({"train/loss": 2.0}, step=0)
        run.log_metrics({"train/loss": 1.5}, step=1)
        run.log_artifact(tmp_path / "metrics.json")
        run.log_artifact(tmp_path / "out", artifact_path="data")
        run.log_dict({"levels": {"1": 0.25}}, "summary/levels.json")
        run.set_tags({"data": {"version": "abc123"}})

    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    logged = client.get_run(run.run_id)
    assert logged.info.status == "FINISHED"
    assert logged.info.run_name == "build_env"
    assert logged.data.params == {"env.max_steps": "8", "env.reward.safety": "1.0", "seed": "0"}
    assert logged.data.metrics["data/n_tasks"] == 4800
    assert logged.data.metrics["build_env/rows"] == 7  # a bare key gets the phase as its namespace
    history = client.get_metric_history(run.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 1.5)]
    assert logged.data.tags["data.version"] == "abc123"
    assert logged.data.tags["agentrl.phase"] == "build_env"
    assert "mlflow.parentRunId" not in logged.data.tags

    names = {a.path for a in client.list_artifacts(run.run_id)}
    assert names == {"metrics.json", "data", "summary"}
    assert [a.path for a in client.list_artifacts(run.run_id, "data")] == ["data/a.txt"]
    local = client.download_artifacts(run.run_id, "summary/levels.json", str(tmp_path / "dl"))
    assert json.loads(Path(local).read_text()) == {"levels": {"1": 0.25}}

    experiment = client.get_experiment_by_name("agentrl")
    assert experiment.artifact_location == (tmp_path / "mlartifacts").as_uri()
    stored = Path(urlparse(logged.info.artifact_uri).path)
    assert stored.is_relative_to(tmp_path / "mlartifacts")  # artefacts sit next to the store, not in the cwd
    assert (stored / "data" / "a.txt").read_text() == "alpha"


def test_tracker_nests_under_a_parent_and_marks_failures(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = Tracker(root=tmp_path)
    with tracker.run("pipeline") as parent:
        monkeypatch.setenv("AGENTRL_PARENT_RUN_ID", parent.run_id)
        with tracker.run("build_env") as child:
            child.log_metrics({"data/n": 1})
        with pytest.raises(RuntimeError, match="boom"):
            with tracker.run("train") as failed:
                raise RuntimeError("boom")
        monkeypatch.delenv("AGENTRL_PARENT_RUN_ID")

    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    exp_id = client.get_experiment_by_name("agentrl").experiment_id
    children = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'")
    assert {r.info.run_id for r in children} == {child.run_id, failed.run_id}
    assert client.get_run(failed.run_id).info.status == "FAILED"
    assert client.get_run(child.run_id).info.status == "FINISHED"
    assert client.get_run(parent.run_id).info.status == "FINISHED"


def test_default_store_is_sqlite_in_the_repo(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    (tmp_path / "params.yaml").write_text("{}\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert repo_root() == tmp_path.resolve()
    tracker = Tracker()
    assert tracker.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert tracker.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()


def test_null_tracker_mirrors_the_real_interface_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    public = lambda cls: {n: inspect.signature(f) for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}  # noqa: E731
    assert public(NullRun) == public(RunHandle)
    params_of = lambda f: list(inspect.signature(f).parameters.values())  # noqa: E731
    assert params_of(NullTracker.run) == params_of(Tracker.run)
    with NullTracker().run("build_env", params={"a": 1}) as run:
        run.log_params({"b": 2})
        run.log_metrics({"x": 1.0}, step=3)
        run.log_artifact(tmp_path / "missing")
        run.log_dict({"a": 1}, "a.json")
        run.set_tags({"t": 1})
    assert run.run_id is None
    assert not (tmp_path / "mlflow.db").exists()


def test_tracking_switch_turns_phase_runs_off_and_refuses_what_needs_the_store(tmp_path, monkeypatch, capsys):
    from pipeline.deploy.registry import ModelRegistry

    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    for value, on in (("on", True), ("ON ", True), ("", True), ("off", False), ("0", False), ("false", False)):
        monkeypatch.setenv("AGENTRL_TRACKING", value)
        assert tracking_enabled() is on
    monkeypatch.setenv("AGENTRL_TRACKING", "sometimes")
    with pytest.raises(AgentRLError, match="AGENTRL_TRACKING='sometimes': expected 'on'"):
        tracking_enabled()

    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    with Tracker(root=tmp_path).run("train", params={"a": 1}) as run:
        run.log_metrics({"train/x": 1.0}, step=0)
    assert isinstance(run, NullRun) and run.run_id is None
    with pytest.raises(AgentRLError, match="the model registry .* AGENTRL_TRACKING=off"):
        ModelRegistry("agentrl-policy")
    assert not store.exists()
    assert main(["run", "--params", str(repo_root() / "params.yaml")]) == 2
    assert "agentrl run" in capsys.readouterr().err and not store.exists()
    assert main(["serve", "--params", str(repo_root() / "params.yaml")]) == 2
    assert "serving models:/" in capsys.readouterr().err and not store.exists()

    monkeypatch.delenv("AGENTRL_TRACKING")
    with Tracker(root=tmp_path).run("train") as run:  # back on: a real run in the store
        pass
    assert run.run_id and store.exists()


# --------------------------------------------------------------------------------------------------------------------
# The phase graph.

GRAPH = """\
stages:
  report:
    cmd: python report.py
    deps: [models/policy, metrics/eval.json]
  train:
    cmd: python train.py
    deps: [src/train.py, ./data/demos]
    outs: [models/policy]
  build:
    cmd: python build.py
    deps: [src/build.py]
    outs: [data/demos, {data/tasks: {persist: true}}]
  eval:
    cmd: python eval.py
    deps: [models/policy, data/tasks/test.jsonl]
    metrics: [{metrics/eval.json: {cache: false}}]
  lint:
    cmd: ruff check
  census:
    cmd: du -s data
    wdir: data
    deps: [.]
"""


def test_toposort_orders_by_deps_and_outs(tmp_path):
    stages = load_stages(write(tmp_path / "dvc.yaml", GRAPH))
    order = [s.name for s in stages]
    # build first (no upstream); eval needs train (models/policy) and build (data/tasks/test.jsonl is under data/tasks);
    # report needs train and eval; census depends on all of data/ (build's outputs lie under it); ties in file order.
    assert order == ["build", "train", "eval", "report", "lint", "census"]
    by_name = {s.name: s for s in stages}
    assert by_name["train"].deps == ("src/train.py", "data/demos")
    assert by_name["eval"].outs == ("metrics/eval.json",)
    assert by_name["census"].deps == ("data",)


def test_toposort_is_independent_of_file_order(tmp_path):
    doc = yaml.safe_load(GRAPH)
    reversed_doc = {"stages": dict(reversed(list(doc["stages"].items())))}
    order = [s.name for s in toposort(parse_stages(reversed_doc))]
    position = {n: i for i, n in enumerate(order)}
    for before, after in [("build", "train"), ("train", "eval"), ("build", "eval"), ("eval", "report"), ("build", "census")]:
        assert position[before] < position[after]


def test_cycle_is_an_error_naming_its_stages(tmp_path):
    path = write(
        tmp_path / "dvc.yaml",
        """\
        stages:
          ok: {cmd: a, outs: [base]}
          first: {cmd: b, deps: [base, second.out], outs: [first.out]}
          second: {cmd: c, deps: [first.out/part], outs: [second.out]}
        """,
    )
    with pytest.raises(GraphError, match=r"cycle: first -> second -> first"):
        load_stages(path)


def test_graph_refuses_missing_file_overlapping_outs_and_unknown_stages(tmp_path):
    with pytest.raises(GraphError, match="not found"):
        load_stages(tmp_path / "dvc.yaml")
    path = write(tmp_path / "dvc.yaml", "stages:\n  a: {cmd: x, outs: [data]}\n  b: {cmd: y, outs: [data/sub]}\n")
    with pytest.raises(GraphError, match="outputs must not overlap"):
        load_stages(path)
    with pytest.raises(GraphError, match=r"unknown stage\(s\) \['nope'\]"):
        select(["a", "b"], ["nope"])
    assert select(["a", "b", "c"], ["c", "a"]) == ["a", "c"]


def test_the_project_graph():
    assert stage_order(ROOT / "dvc.yaml")[0] == "build_env"


# --------------------------------------------------------------------------------------------------------------------
# The Prefect flow, end to end on a small DVC repository of its own (slow: it starts Prefect's local server).

STAGE_SCRIPT = """\
import json, pathlib, sys
import yaml
from pipeline.core.tracking import Tracker

name = sys.argv[1]
params = yaml.safe_load(pathlib.Path("params.yaml").read_text())
with open("ran.log", "a") as log:
    log.write(name + "\\n")
if params["fail"].get(name):
    print(f"stage {name} refuses: fail.{name} is set", file=sys.stderr)
    sys.exit(3)
pathlib.Path(name).mkdir(exist_ok=True)
(pathlib.Path(name) / "out.txt").write_text(f"{name} {params['value']}")
with Tracker().run(name) as run:
    run.log_metrics({"demo/value": params["value"]})
"""


def _mini_repo(root: Path) -> None:
    py = sys.executable
    write(root / "stage.py", STAGE_SCRIPT)
    write(root / "params.yaml", "value: 1\nfail: {first: false, second: false, third: false}\n")
    # Written out of order: the flow must take its order from deps/outs, not from the file.
    write(
        root / "dvc.yaml",
        f"""\
        stages:
          third:
            cmd: {py} stage.py third
            deps: [stage.py, second]
            params: [fail.third]
            outs: [third]
          first:
            cmd: {py} stage.py first
            deps: [stage.py]
            params: [value, fail.first]
            outs: [first]
          second:
            cmd: {py} stage.py second
            deps: [stage.py, first/out.txt]
            params: [fail.second]
            outs: [second]
        """,
    )
    for cmd in (["git", "init", "-q"], [py, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)


def _agentrl_run(root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING_URI", "AGENTRL_"))
           or k == "AGENTRL_VALIDATION_MEMO"}  # the run's shared memo (tests/conftest.py)
    exe = Path(sys.executable).parent / "agentrl"
    return subprocess.run([str(exe), "run"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_flow_runs_stages_in_graph_order_skips_up_to_date_and_stops_at_a_failure(tmp_path):
    from mlflow.tracking import MlflowClient

    _mini_repo(tmp_path)
    first = _agentrl_run(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "ran.log").read_text().split() == ["first", "second", "third"]
    lock = yaml.safe_load((tmp_path / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"first", "second", "third"}
    assert (tmp_path / ".prefect").is_dir()  # Prefect's state stays in the project
    for name in ("first", "second", "third"):  # the wall-time table
        assert any(line.startswith(name) and line.rstrip().endswith("ran") for line in first.stdout.splitlines())
    assert any(line.startswith("total") for line in first.stdout.splitlines())

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("agentrl")
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.`agentrl.phase` = 'pipeline'")
    children = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == ["first", "second", "third"]
    assert parent.info.status == "FINISHED"
    assert set(parent.data.metrics) >= {"pipeline/first_wall_s", "pipeline/total_wall_s"}

    again = _agentrl_run(tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (tmp_path / "ran.log").read_text().split() == ["first", "second", "third"]  # nothing reran
    assert sum(line.rstrip().endswith("up to date") for line in again.stdout.splitlines()) == 3

    # A change upstream reruns `first`; `second` fails, so the flow stops and `third` never runs.
    write(tmp_path / "params.yaml", "value: 2\nfail: {first: false, second: true, third: false}\n")
    failed = _agentrl_run(tmp_path)
    assert failed.returncode == 1
    assert "error: stage 'second' failed" in failed.stderr
    assert "stage second refuses: fail.second is set" in failed.stderr  # the stage's own output, in the message
    table = [line.split() for line in failed.stdout.splitlines() if line.split()[:1] in (["first"], ["second"], ["third"])]
    assert [(row[0], row[-1]) for row in table] == [("first", "ran"), ("second", "FAILED")]
    assert (tmp_path / "ran.log").read_text().split() == ["first", "second", "third", "first", "second"]
    assert (tmp_path / "first" / "out.txt").read_text() == "first 2"


def test_a_retrain_forces_the_stages_from_the_first_that_reads_the_new_data(tmp_path):
    def retrain_stages(root, folders):
        return stages_from_first_reader(root, folders, "adapt")  # the retraining flow's fallback (RETRAIN_FROM)

    order = ["build_env", "adapt", "reward_model", "train", "evaluate", "check_drift", "deploy"]
    shutil.copy2(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    assert retrain_stages(tmp_path, [tmp_path / "data/incoming"]) == order[3:]  # train reads the incoming tasks
    assert retrain_stages(tmp_path, [tmp_path / "data/incoming", tmp_path / "data/production/snapshot"]) == order[2:]
    # no stage reads the folders (one outside the project): every stage from adapt on, as a graph without such deps
    assert retrain_stages(tmp_path, [tmp_path.parent / "elsewhere"]) == order[1:]
    graph = {"stages": {"prepare": {"cmd": "true", "deps": ["src"], "outs": ["data/clean"]},
                        "fit": {"cmd": "true", "deps": ["data/clean", "feeds/new"], "outs": ["model"]},
                        "ship": {"cmd": "true", "deps": ["model"], "outs": ["shipped"]}}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(graph))
    assert retrain_stages(tmp_path, [tmp_path / "feeds/new/batch"]) == ["fit", "ship"]
    assert retrain_stages(tmp_path, [tmp_path / "unread"]) == ["prepare", "fit", "ship"]
