"""Every input a user hands the pipeline is refused cleanly: a params file, incoming task files, demonstrations,
episode files, a model folder, a registry URI. Each case runs a real `agentrl` command and checks the contract of
flows/cli.py: exit status 2, exactly one stderr line starting with ``error:`` that names the file, key or URI, no
traceback, and nothing written or changed (output files absent, inputs byte-identical, the registry as it was).

Most cases call ``flows.cli.main([...])`` in this process (the same parser, dispatch and error handling as the
installed command, without a 2-4 s interpreter start per case); :func:`test_the_installed_command_refuses_each_kind`
runs one case of each kind through the installed `agentrl` executable in a subprocess, where a traceback or a wrong
exit status would show exactly as a user sees it. Task files have their own tests (tests/test_jsonl.py,
tests/test_env.py); the Great Expectations type checks of the task, demonstration and episode columns are tested here
on one record per column.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL_NAME = "tiny-inputs"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------------------- helpers


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (the state that a refused command must leave as it was)."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_refused(rc: int, stderr: str, *names: str) -> None:
    """The CLI contract for bad input: status 2, one `error:` line that names each of `names`, no traceback."""
    assert rc == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    for name in names:
        assert name in errors[0], (name, errors[0])


def run_cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(list(args))
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ params.yaml

HUGE_PARAMS = 2 << 20  # bytes: twice the limit of pipeline.core.config.MAX_PARAMS_BYTES


def _alias_bomb() -> str:
    """A YAML alias chain whose value, expanded, has 9**8 leaves (its repr in an error message would never end)."""
    lines = ["build_env:", "  seed: 0", "check_drift:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join([*lines, "env:", "  name: *a8", ""])


# id: (file content, or None for a folder; what the error line must name besides the file)
PARAMS_CASES = {
    "not_utf8": (b"env:\n  name: sh\xffop\n", "not UTF-8"),
    "yaml_syntax": (b"env:\n  max_steps: [8\n", "malformed YAML"),
    "section_is_a_list": (b"env:\n  - max_steps\n  - 8\n", "env: expected a mapping, got list"),
    "wrong_type": (b"env:\n  max_steps: [1, 2]\n", "env.max_steps"),
    "unknown_key": (b"build_env:\n  sead: 1\n", "build_env.sead"),
    "unknown_section": (b"buld_env:\n  seed: 1\n", "unknown section 'buld_env'"),
    "duplicate_key": (b"build_env:\n  seed: 1\n  seed: 2\n", "'seed' given twice"),
    "deep_nesting": (b"env: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
    "huge_file": (b"build_env:\n  seed: 0\n" + b"#" * HUGE_PARAMS + b"\n", "at most"),
    "alias_bomb": (_alias_bomb().encode(), "params.yaml:env"),
    "a_directory": (None, "is a folder"),
}


@pytest.mark.parametrize("case", PARAMS_CASES)
def test_a_bad_params_file_is_one_error_line_and_writes_nothing(case, tmp_path, monkeypatch, capsys):
    content, expected = PARAMS_CASES[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    params = tmp_path / "params.yaml"
    if content is None:
        params.mkdir()
    else:
        params.write_bytes(content)
    rc, err = run_cli(capsys, "build-env", "--params", str(params))
    assert_refused(rc, err, str(params), expected)
    assert len(err) < 2000  # a rejected value is shown shortened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # no data/, no metrics/


def test_the_sections_a_params_file_may_hold_are_the_repository_s():
    from pipeline.core.config import SECTIONS

    assert set(yaml.safe_load((ROOT / "params.yaml").read_text())) == set(SECTIONS)


# ------------------------------------------------------------------- a tiny project: data, a policy, a registry


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A tiny project (tests/deploy_support.py: real build_env data, an untrained tiny policy, also as
    models/adapted) with its params.yaml, and a SQLite MLflow registry holding one version with alias `champion`."""
    from deploy_support import ENV, ROLL, build_project
    from mlflow.tracking import MlflowClient

    root = build_project(tmp_path_factory.mktemp("inputs") / "project")
    shutil.copytree(root / "models" / "policy", root / "models" / "adapted")
    params = {"env": ENV.model_dump(), "rollout": ROLL.model_dump(),
              "deploy": {"model_name": MODEL_NAME, "policy": "models/policy"},
              "check_drift": {"policy": "models/none", "min_samples": 2}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model(MODEL_NAME)
    version = client.create_model_version(MODEL_NAME, (root / "models" / "policy").as_uri())
    client.set_registered_model_alias(MODEL_NAME, "champion", version.version)
    return root


def registry_state(root: Path) -> dict:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    model = client.get_registered_model(MODEL_NAME)
    versions = client.search_model_versions(f"name = '{MODEL_NAME}'")
    return {"aliases": dict(model.aliases), "tags": dict(model.tags),
            "versions": sorted((v.version, v.current_stage, tuple(sorted(v.tags.items()))) for v in versions)}


@pytest.fixture()
def in_project(project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    return project


def one_task(root: Path) -> dict:
    return json.loads((root / "data" / "tasks" / "train.jsonl").read_text().splitlines()[0])


# ---------------------------------------------------------------------------------------- data/incoming task files

# id: (file bytes from one valid task record, what the error line must name besides the file)
INCOMING_CASES = {
    "not_utf8": (lambda t: b'{"task_id": "\xff"}\n', "not UTF-8"),
    "not_json": (lambda t: json.dumps(t).encode()[:-5] + b"\n", "not valid JSON"),
    "level_as_string": (lambda t: json.dumps({**t, "level": str(t["level"])}).encode() + b"\n", "level must be"),
    "deep_nesting": (lambda t: b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}\n", "nested too deeply"),
    "an_array_line": (lambda t: b"[1, 2]\n", "expected a JSON object"),
}


@pytest.mark.parametrize("case", INCOMING_CASES)
def test_a_bad_incoming_task_file_stops_train_before_it_trains(case, in_project, monkeypatch, capsys):
    make, expected = INCOMING_CASES[case]
    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    bad = in_project / "data" / "incoming" / f"{case}.jsonl"
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(make(one_task(in_project)))
    before = snapshot(in_project / "data", in_project / "models")
    try:
        rc, err = run_cli(capsys, "train")
        assert_refused(rc, err, str(Path("data") / "incoming" / f"{case}.jsonl"), expected)
        assert snapshot(in_project / "data", in_project / "models") == before
        assert not (in_project / "metrics" / "train_curve.csv").exists()
        assert not (in_project / "checkpoints").exists()
    finally:
        bad.unlink()


# ----------------------------------------------------------------------------------- demonstrations, episode files


def test_a_demonstration_with_a_wrong_json_type_stops_adapt(in_project, monkeypatch, capsys):
    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    demos = in_project / "data" / "demos" / "train.jsonl"
    good = demos.read_bytes()
    lines = good.decode().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "success": "yes"})
    demos.write_text("\n".join(lines) + "\n")
    before = snapshot(in_project / "data", in_project / "models", in_project / "metrics")
    try:
        rc, err = run_cli(capsys, "adapt")
        assert_refused(rc, err, str(Path("data") / "demos" / "train.jsonl"))
        assert "column='success'" in err  # the Great Expectations type check names the column
        assert snapshot(in_project / "data", in_project / "models", in_project / "metrics") == before
    finally:
        demos.write_bytes(good)


# id: (episode file bytes from one valid demonstration record, what the error must name)
EPISODE_CASES = {
    "not_json": (lambda d: b"{episode\n", "not valid JSON"),
    "n_calls_as_string": (lambda d: json.dumps({**d, "n_calls": str(d["n_calls"])}).encode() + b"\n", "n_calls"),
}


@pytest.mark.parametrize("case", EPISODE_CASES)
def test_a_bad_episode_file_stops_check_drift(case, in_project, monkeypatch, capsys, tmp_path):
    make, expected = EPISODE_CASES[case]
    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    demo = json.loads((in_project / "data" / "demos" / "train.jsonl").read_text().splitlines()[0])
    episodes = tmp_path / "episodes.jsonl"
    episodes.write_bytes(make(demo))
    params = yaml.safe_load((in_project / "params.yaml").read_text())
    params["check_drift"]["reference_trajectories"] = str(episodes)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    before = snapshot(in_project / "data", in_project / "models")
    rc, err = run_cli(capsys, "check-drift", "--params", str(tmp_path / "params.yaml"))
    assert_refused(rc, err, str(episodes))
    assert expected in err
    assert snapshot(in_project / "data", in_project / "models") == before
    # check_drift records the refusal as its verdict (the gate reads it); that is the only file it writes
    assert json.loads((in_project / "metrics" / "drift.json").read_text())["verdict"] == "error"


# --------------------------------------------------------------------------------------------------- model folders


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:3000])


# id: (how to break a copy of a valid policy folder, what the error line must name besides the folder)
MODEL_CASES = {
    "missing_folder": (lambda m: shutil.rmtree(m), "not a model directory"),
    "no_config": (lambda m: (m / "config.json").unlink(), "config.json missing"),
    "corrupt_config": (lambda m: (m / "config.json").write_text('{"model_type": '), "cannot load the model"),
    "config_is_an_array": (lambda m: (m / "config.json").write_text("[1, 2]"), "cannot load the model"),
    "garbage_weights": (lambda m: _garbage(m / "model.safetensors"), "cannot load the model"),
    "truncated_weights": (lambda m: _truncate(m / "model.safetensors"), "cannot load the model"),
    "tokenizer_not_json": (lambda m: (m / "tokenizer.json").write_text("not json"), "cannot load the tokenizer"),
    "policy_json_not_utf8": (lambda m: (m / "policy.json").write_bytes(b"\xff\xfe"), "policy.json: not UTF-8"),
    "policy_json_an_array": (lambda m: (m / "policy.json").write_text("[1]"), "policy.json: expected a JSON object"),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_broken_model_folder_is_refused_by_eval(case, in_project, monkeypatch, capsys, tmp_path):
    breaks, expected = MODEL_CASES[case]
    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    model = tmp_path / "model"
    shutil.copytree(in_project / "models" / "policy", model)
    breaks(model)
    out = tmp_path / "out.json"
    rc, err = run_cli(capsys, "eval", "--policy", str(model), "--tasks", "data/tasks/test.jsonl", "--out", str(out))
    assert_refused(rc, err, str(model), expected)
    assert "\n " not in err.split("error:", 1)[1].strip()  # one line: a library's multi-line message is cut
    assert not out.exists()


@pytest.mark.parametrize("case", ["a_folder", "under_a_file"])
def test_an_output_path_that_cannot_be_written_is_refused_before_anything_runs(case, in_project, monkeypatch, capsys,
                                                                                 tmp_path):
    monkeypatch.setenv("AGENTRL_TRACKING", "off")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "a_file").write_text("keep\n")
    out = tmp_path / ("a_folder" if case == "a_folder" else "a_file/out.json")
    before = snapshot(tmp_path)
    rc, err = run_cli(capsys, "eval", "--policy", "expert", "--tasks", "data/tasks/test.jsonl", "--out", str(out))
    assert_refused(rc, err, str(out))
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "a_folder"]


# ---------------------------------------------------------------------------------------------------- registry URIs

# id: (command line, what the error line must name)
REGISTRY_CASES = {
    "unknown_model": (["serve", "--model-uri", "models:/nope@champion"], "models:/nope@champion"),
    "unknown_version": (["serve", "--model-uri", f"models:/{MODEL_NAME}/999"], f"models:/{MODEL_NAME}/999"),
    "unknown_alias": (["serve", "--model-uri", f"models:/{MODEL_NAME}@bogus"], f"models:/{MODEL_NAME}@bogus"),
    "bad_run_uri": (["serve", "--model-uri", "runs:/bad/.."], "runs:/bad/.."),
    "garbage_uri": (["serve", "--model-uri", "::garbage::"], "::garbage::"),
    "empty_uri": (["serve", "--model-uri", ""], "--model-uri is empty"),
    "promote_unknown_version": (["promote", "--version", "999"], "no version 999"),
    "promote_unknown_alias": (["promote", "--alias", "bogus"], "alias 'bogus'"),
}


@pytest.mark.parametrize("case", REGISTRY_CASES)
def test_a_bad_registry_uri_is_refused_and_the_registry_is_untouched(case, in_project, capsys):
    args, expected = REGISTRY_CASES[case]
    before = registry_state(in_project)
    rc, err = run_cli(capsys, *args, "--port", "1") if args[0] == "serve" else run_cli(capsys, *args)
    assert_refused(rc, err, expected)
    assert registry_state(in_project) == before


# ------------------------------------------------------------------------------- the installed command, per kind


def _subprocess_cases(root: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    bad_params = tmp / "params.yaml"
    bad_params.write_bytes(b"env:\n  name: sh\xffop\n")
    model = tmp / "model"
    shutil.copytree(root / "models" / "policy", model)
    (model / "tokenizer.json").write_text("not json")
    return {
        "params": (["build-env", "--params", str(bad_params)], str(bad_params)),
        "params_folder": (["build-env", "--params", str(tmp)], str(tmp)),
        "model_folder": (["eval", "--policy", str(model), "--tasks", "data/tasks/test.jsonl", "--out",
                          str(tmp / "out.json")], str(model)),
        "registry_uri": (["serve", "--model-uri", f"models:/{MODEL_NAME}/999", "--port", "1"],
                         f"models:/{MODEL_NAME}/999"),
        "incoming": (["train"], "data/incoming/x.jsonl"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["params", "model_folder", "registry_uri", "incoming"])
def test_the_installed_command_refuses_each_kind(kind, project, tmp_path):
    args, expected = _subprocess_cases(project, tmp_path)[kind]
    incoming = project / "data" / "incoming" / "x.jsonl"
    before, registry = snapshot(project / "data", project / "models"), registry_state(project)
    if kind == "incoming":
        incoming.parent.mkdir(exist_ok=True)
        incoming.write_text(json.dumps({**one_task(project), "min_calls": "2"}) + "\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    if kind != "registry_uri":
        env["AGENTRL_TRACKING"] = "off"
    try:
        proc = subprocess.run([str(BIN / "agentrl"), *args], cwd=project, env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        incoming.unlink(missing_ok=True)
    assert_refused(proc.returncode, proc.stderr, expected)
    assert snapshot(project / "data", project / "models") == before and registry_state(project) == registry
    assert not (tmp_path / "out.json").exists()


# ------------------------------------------------------- Great Expectations: the JSON type of every typed column


def _typed_columns(suite: str, **params) -> list[str]:
    """The columns `suite` checks with expect_column_values_to_be_in_type_list (GX on the pandas backend)."""
    from pipeline.core.validation import get_suite

    return [e.column for e in get_suite(suite).build(**params)
            if type(e).__name__ == "ExpectColumnValuesToBeInTypeList"]


def _wrong_value(value):
    """A value of another JSON type than `value`'s: a string for a number or a flag, a number for a string."""
    return 7 if isinstance(value, str) else "7"


def _each_column_wrong_once(records: list[dict], columns: list[str]) -> list[dict]:
    """Copies of `records[0]`, one per column, each with that column of the wrong JSON type (and its own id), after
    the valid `records`."""
    out = copy.deepcopy(records)
    for i, col in enumerate(columns):
        rec = copy.deepcopy(records[0])
        rec[col] = _wrong_value(rec[col])
        out.append(rec)
    return out


def _suite_records(root: Path, suite: str) -> tuple[list[dict], str]:
    """Valid records of `suite` from the tiny project: its tasks, its demonstrations, or the expert's episodes."""
    if suite == "tasks":
        return [json.loads(line) for line in (root / "data" / "tasks" / "train.jsonl").read_text().splitlines()[:3]], \
            "task_id"
    if suite == "demonstrations":
        return [json.loads(line) for line in (root / "data" / "demos" / "train.jsonl").read_text().splitlines()[:3]], \
            "demo_id"
    from deploy_support import ENV
    from pipeline.envs.shop import ShopWorld
    from pipeline.envs.taskfile import load_task_file
    from pipeline.policy.episodes import evaluate

    world = ShopWorld.load(root / "data" / "env")
    try:
        _, records = evaluate("expert", load_task_file(root / "data" / "tasks" / "test.jsonl", world)[:2], world, ENV)
    finally:
        world.close()
    return records, "task_id"


@pytest.mark.parametrize("suite", ["tasks", "demonstrations", "evaluation"])
def test_every_column_fails_validation_with_a_value_of_another_json_type(suite, project):
    """Each added record breaks one column: a scalar column's type expectation names that row alone; a nested
    column (a plan, a list of steps) fails the structural expectations derived from it on that row."""
    from pipeline.core.validation import flatten_records, validate
    from pipeline.envs.demo_suite import register
    from pipeline.envs.shop.suites import register_suites

    register()
    register_suites()
    records, id_col = _suite_records(project, suite)
    assert validate(flatten_records(records, suite), suite, dataset=suite).success
    # `verifier` (the environment's free-form verdict details) is the one column no suite constrains
    columns = [c for c in records[0] if c not in (id_col, "verifier")]
    typed = set(_typed_columns(suite))
    scalar = [c for c in columns if not isinstance(records[0][c], (list, dict))]
    assert set(scalar) <= typed, set(scalar) - typed  # the suite checks the JSON type of every scalar column
    bad = _each_column_wrong_once(records, columns)
    for i, rec in enumerate(bad[len(records):]):
        rec[id_col] = f"{rec[id_col]}-bad{i}"
    report = validate(flatten_records(bad, suite), suite, dataset=suite)
    type_rows = {r["kwargs"]["column"]: [row["row"] for row in r["unexpected_rows"]] for r in report.failures
                 if r["expectation"] == "expect_column_values_to_be_in_type_list"}
    assert type_rows == {c: [len(records) + columns.index(c)] for c in scalar}, report.describe()
    failing_rows = {row["row"] for r in report.failures for row in r["unexpected_rows"]}
    assert failing_rows == set(range(len(records), len(bad))), report.describe()  # every bad row, no valid one
