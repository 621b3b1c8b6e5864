"""`agentrl report`: the report card of a run, from the metrics files and the MLflow run.

The fast tests read the metrics the repository's committed run wrote (a copy of ``metrics/`` beside this
repository's dvc.yaml) and a real MLflow SQLite store holding a pipeline run with its phase runs; the report of a
tiny project after a real `agentrl run` is in tests/test_flow.py (``test_report_card_of_the_run``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from flows.cli import main
from flows.report import DEFAULT_OUT, collect

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def tracking_store(tmp_path_factory):
    """The suite's MLflow store with its tables and the experiment made once for the module (a migration of several
    seconds that every test here would otherwise pay on first use)."""
    from pipeline.core.tracking import Tracker

    tracker = Tracker(root=tmp_path_factory.mktemp("store-root"))
    tracker.experiment_id(tracker.client())


@pytest.fixture
def project(tmp_path):
    """A project folder with this repository's dvc.yaml and params.yaml and no metrics; its runs go to the suite's
    MLflow store (tests/conftest.py), whose tables exist after the first test that uses it."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, root / name)
    return root


def committed_metrics(root: Path) -> None:
    shutil.copytree(ROOT / "metrics", root / "metrics")


def report(root: Path, *extra: str) -> int:
    return main(["report", "--params", str(root / "params.yaml"), *extra])


def test_report_of_the_committed_run_with_its_mlflow_run(project, capsys):
    from pipeline.core.tracking import Tracker

    committed_metrics(project)
    tracker = Tracker(root=project)
    with tracker.run("pipeline") as parent:
        tracker.set_tags(parent.run_id, {"git.commit": "abc123", "git.dirty": "false", "agentrl.gate": "rejected"})
        for phase in ("build_env", "train"):
            with tracker.run(phase, parent_run_id=parent.run_id):
                pass
    with tracker.run("pipeline"):  # a later run the report must not take: the run record names the first
        pass
    record = json.loads((project / "metrics" / "pipeline_run.json").read_text())
    record["run_id"] = parent.run_id
    (project / "metrics" / "pipeline_run.json").write_text(json.dumps(record))

    assert report(project) == 0
    out = project / DEFAULT_OUT
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    text = out.read_text()
    train = json.loads((project / "metrics" / "train.json").read_text())
    deploy = json.loads((project / "metrics" / "deploy.json").read_text())
    # every phase of the graph has a row, with the run record's time and memory
    for stage, run in record["stages"].items():
        assert f"| {stage} | {run['status']} | {run['seconds']:.1f} | {run['peak_mib']:.0f} |" in text
    assert f"`test.rl.overall.success_rate` {train['test']['rl']['overall']['success_rate']:.4g}" in text
    verdict = "PROMOTED" if deploy["gate"]["passed"] else "REJECTED"
    assert f"version {deploy['version']}: **{verdict}**" in text
    for check in deploy["gate"]["checks"]:
        assert f"| {check['name']} | {'yes' if check['passed'] else 'NO'} |" in text
    assert f"Wall time {record['cost']['total_s']:.1f} s" in text
    assert f"Parent run `{parent.run_id}` (FINISHED)" in text and "Git commit `abc123`." in text
    assert "| build_env | FINISHED |" in text and "| train | FINISHED |" in text
    assert "- `metrics/train_curve.csv`" in text and "- `metrics/evaluate_success.csv`" in text


def test_without_a_run_record_the_latest_pipeline_run_is_described(project, tmp_path):
    from pipeline.core.tracking import Tracker

    committed_metrics(project)
    (project / "metrics" / "pipeline_run.json").unlink()
    tracker = Tracker(root=project)
    client = tracker.client()
    older = client.create_run(tracker.experiment_id(client), run_name="pipeline",
                              start_time=int(time.time() * 1000) - 60_000)  # a minute earlier: no tie on start time
    client.set_terminated(older.info.run_id, "FINISHED")
    with tracker.run("pipeline") as latest:
        pass
    out = tmp_path / "elsewhere" / "card.md"
    assert report(project, "--out", str(out)) == 0
    text = out.read_text()
    assert f"Parent run `{latest.run_id}`" in text
    assert "No run record (`metrics/pipeline_run.json`)" in text
    assert not (project / DEFAULT_OUT).exists()


def test_a_project_without_metrics_is_one_error_line(project, capsys):
    (project / "metrics").mkdir()
    assert report(project) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no metrics of any phase" in err[0], err
    assert str(project / "metrics") in err[0]
    assert not (project / DEFAULT_OUT).exists()


def test_a_corrupt_metrics_file_is_named_and_the_old_report_stays(project, capsys):
    committed_metrics(project)
    old = project / DEFAULT_OUT
    old.write_text("the previous report\n")
    (project / "metrics" / "train.json").write_text('{"updates": 3,')
    assert report(project) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {project / 'metrics' / 'train.json'}: not JSON"), err
    assert old.read_text() == "the previous report\n"


def test_an_unknown_run_id_is_one_error_line(project, capsys):
    from pipeline.core.tracking import Tracker

    committed_metrics(project)
    with Tracker(root=project).run("pipeline"):
        pass
    capsys.readouterr()  # what creating the store logged
    assert report(project, "--run-id", "0123456789abcdef0123456789abcdef") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run 0123456789abcdef0123456789abcdef"), err
    assert not (project / DEFAULT_OUT).exists()


def test_a_run_that_stopped_early_reports_the_phases_it_reached(project):
    committed_metrics(project)
    for name in ("train.json", "evaluate.json", "drift.json", "deploy.json"):
        (project / "metrics" / name).unlink()
    facts = collect(project)
    assert [p for p, f in facts["phases"].items() if f["present"]] == ["build_env", "adapt", "reward_model"]
    assert facts["gate"] is None


def test_a_tracking_server_that_does_not_answer_is_one_error_line(project, monkeypatch, capsys):
    import socket

    committed_metrics(project)
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert report(project) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: agentrl report (the run's MLflow run): the MLflow tracking "
                                               f"server at http://127.0.0.1:{port} did not answer"), err
    assert err[0].endswith("no report was written") and not (project / DEFAULT_OUT).exists()
