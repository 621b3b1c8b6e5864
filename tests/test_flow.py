"""The orchestrated pipeline on a tiny configuration: the whole flow end to end (every phase, lineage tags, registry and
gate, the summary artifact), a phase failure and the resumed rerun, scheduled retraining on undrifted and drifted
data, and `dvc push`/`dvc pull` to the local remote and to an S3 bucket (moto's server, tests/services.py). The
retraining deployment on a Prefect server and worker is in tests/test_prefect_worker.py.

Each project is a temporary copy of this repository's code, dvc.yaml and params.yaml (with tiny sizes), in a git
repository of its own, with its own MLflow store and Prefect home: nothing touches the repository's own state.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows import lineage, summary

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COPIED = ("pipeline", "flows", "configs", "dvc.yaml", ".dvcignore", "prefect.yaml", ".gitignore",
          "data/incoming/README.md",  # data/incoming is a dep of train and check_drift: its README keeps it present
          "data/production/README.md")  # and data/production one of reward_model

# Tiny sizes for every phase (merged into the repository's params.yaml, so new keys there keep their defaults).
TINY = {
    "env": {"max_steps": 3},
    "build_env": {"options": {"n_products": 40, "n_suppliers": 12}, "tasks_per_split": {"train": 120, "validation": 24, "test": 24},
                  "demos": {"level_coverage": {1: 0.3, 2: 0.3, 3: 0.3, 4: 0.3}}},
    "model": {"vocab_size": 400, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_positions": 512,
              "dtype": "fp32"},
    "rollout": {"max_new_tokens": 10, "batch_size": 16, "num_threads": 1},
    "adapt": {"threads": 1, "pretrain": {"steps": 2, "batch_size": 8, "warmup_steps": 1, "max_len": 64, "copy_drills": 8},
              "adapter": {"lora_r": 4, "lora_alpha": 8.0},
              "sft": {"steps": 2, "batch_size": 8, "warmup_steps": 1, "max_len": 256, "log_every": 1,
                      "compile": False, "select_every": 0},
              "eval": {"max_tasks": 4, "sampled_per_task": 1}, "gate": {"enabled": False}},
    "reward_model": {"rollout_tasks": 4, "rollouts_per_task": 1, "epochs": 20},
    "train": {"updates": 2, "tasks_per_update": 2, "group_size": 2, "num_ranks": 1, "checkpoint_every": 2,
              "eval_every": 2, "eval_tasks": 4, "test_tasks": 4},
    "evaluate": {"train_tasks": 4, "max_tasks": 6, "bootstrap_samples": 100, "diversity_tasks": 2, "diversity_seeds": 2},
    "check_drift": {"max_rollout_episodes": 8, "false_alarm_repeats": 2, "false_alarm_sample_size": 60,
                    "mmd_permutations": 50, "max_hidden_samples": 16, "consistency_probes": 8},
    "deploy": {"model_name": "tiny-policy", "precisions": ["fp32", "int8"], "latency_tasks": 2, "max_test_tasks": 24,
               "gate": {"require_capability_gate": False, "bootstrap_samples": 100, "min_paired_tasks": 10},
               "served_check": {"tasks": 2}},
}


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(base.get(key) or {}, value) if isinstance(value, dict) and key in base else value
    return out


def tiny_params() -> dict:
    from pipeline.adapt.config import PretrainConfig

    over = copy.deepcopy(TINY)
    if "copy_drills" not in PretrainConfig.model_fields:  # a key being tuned elsewhere; keep the test independent
        over["adapt"]["pretrain"].pop("copy_drills")
    return merge(yaml.safe_load((ROOT / "params.yaml").read_text()), over)


def make_project(root: Path) -> Path:
    """A copy of the repository's code and graph with tiny params, as a git repository with DVC initialised."""
    root.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name)
    (root / ".dvc").mkdir()
    shutil.copy2(ROOT / ".dvc" / "config", root / ".dvc" / "config")
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "tiny project"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    return root


def clean_env(root: Path) -> dict[str, str]:
    """The environment of a user in `root`: no MLflow store of the test run, Prefect settings, parent run or rank
    variables (a process group of this test process); the run's memo of passed validations is kept."""
    from pipeline.train.distributed import RANK_VARS  # a test that trained in-process leaves its rank variables set

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_TRACKING_URI", "AGENTRL_")) and k not in RANK_VARS}
    if "AGENTRL_VALIDATION_MEMO" in os.environ:  # the run's shared memo (tests/conftest.py), never the user's own
        env["AGENTRL_VALIDATION_MEMO"] = os.environ["AGENTRL_VALIDATION_MEMO"]
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def agentrl(root: Path, *args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "agentrl"), *args], cwd=root, env=env or clean_env(root), capture_output=True,
                          text=True, timeout=timeout)


def mlflow_client(root: Path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def runs(root: Path, name: str) -> list:
    client = mlflow_client(root)
    exp = client.get_experiment_by_name("agentrl")
    return client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'",
                              order_by=["attributes.start_time ASC"])


def versions(root: Path) -> list[str]:
    return sorted((str(v.version) for v in mlflow_client(root).search_model_versions("name = 'tiny-policy'")), key=int)


def champion(root: Path) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(mlflow_client(root).get_model_version_by_alias("tiny-policy", "champion").version)
    except MlflowException:
        return None


def prefect_artifact(root: Path, key: str) -> str:
    """The newest markdown artifact `key` in the project's Prefect database (the temporary server's store)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(root / ".prefect" / "prefect.db")) as db:
        row = db.execute("SELECT data FROM artifact WHERE key = ? ORDER BY created DESC LIMIT 1", (key,)).fetchone()
    assert row is not None, f"no artifact {key}"
    return json.loads(row[0])


def stage_lines(stdout: str) -> dict[str, str]:
    """{stage: status} from the flow's timing table (a stage that ran ends its line with "(peak N MiB)")."""
    from pipeline.core.graph import stage_order

    names = stage_order(ROOT / "dvc.yaml")
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in names and parts[2] == "s":
            out[parts[0]] = re.sub(r"\s*\(peak \d+ MiB\)$", "", " ".join(parts[3:]))
    return out


def write_tasks(root: Path, name: str, kind: str | None, n: int = 120, seed: int = 7) -> Path:
    """A batch of incoming tasks: a fresh sample of the reference generator (kind None) or a drifted one."""
    from pipeline.check_drift.checks import make_drifted_tasks, make_reference_sample
    from pipeline.envs.shop import ShopWorld

    world = ShopWorld.load(root / "data" / "env")
    if kind is None:
        mix = yaml.safe_load((root / "params.yaml").read_text())["build_env"]["level_mix"]
        sample = make_reference_sample(world, n, seed, mix)
    else:
        sample = make_drifted_tasks(world, n, kind, seed=seed)
    path = root / "data" / "incoming" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in sample.tasks))
    return path


# --------------------------------------------------------------------------------------------------------------------
# Cheap checks: summaries, lineage, the retry policy.


def test_headlines_pick_known_figures_and_fall_back_to_scalars(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"verdict": "pass", "failed_checks": [], "checks": {"task_drift": {"status": "pass"}},
                             "seconds": {"total": 1.5}}))
    assert summary.headlines("check_drift", f) == {"verdict": "pass", "failed_checks": [],
                                                   "checks.task_drift.status": "pass", "seconds.total": 1.5}
    f.write_text(json.dumps({"novel": 3, "nested": {"x": 1}, "name": "n"}))
    assert summary.headlines("check_drift", f) == {"novel": 3, "name": "n"}  # a changed format still reports
    assert summary.headlines("deploy", tmp_path / "missing.json") == {}
    # evaluate's headlines separate the seen wordings from the held-out ones (what the test split mixes)
    f.write_text(json.dumps({"flags": {"rl": {"unseen_templates": {"seen_success": 0.9, "unseen_success": 0.1,
                                                                   "per_level": {"1": {}}}}}, "seconds": 2.0}))
    assert summary.headlines("evaluate", f) == {"flags.rl.unseen_templates.seen_success": 0.9,
                                                "flags.rl.unseen_templates.unseen_success": 0.1, "seconds": 2.0}
    # train's headlines put RL's gain beside the headroom that bounds it; a split without held-out wordings has none
    f.write_text(json.dumps({"delta_rl_minus_sft": {"level_4_success": 0.23}, "seen_wording_headroom": {
        "overall": 0.1275, "level_4": 0.36, "level_1": 0.01}}))
    assert summary.headlines("train", f) == {"delta_rl_minus_sft.level_4_success": 0.23,
                                             "seen_wording_headroom.overall": 0.1275,
                                             "seen_wording_headroom.level_4": 0.36}
    f.write_text(json.dumps({"delta_rl_minus_sft": {"level_4_success": 0.23}, "seen_wording_headroom": None}))
    assert summary.headlines("train", f) == {"delta_rl_minus_sft.level_4_success": 0.23}


def test_cost_figures_subtract_the_stages_own_time():
    cost = summary.cost_figures(100.0, {"a": {"command_s": 60.0}, "b": {"command_s": 30.0}, "c": {"command_s": None}})
    assert cost["stage_commands_s"] == 90.0 and cost["overhead_s"] == 10.0 and cost["overhead_share"] == 0.1
    assert cost["peak_rss_self_mib"] > 10  # this interpreter holds more than 10 MiB
    # a stage's recorded peak (its process with the children it ran parts in) counts when larger than any one process
    cost = summary.cost_figures(100.0, {"a": {"command_s": 60.0, "peak_mib": 10**7}})
    assert cost["peak_rss_children_mib"] == 10**7


def test_retries_only_on_transient_steps():
    from flows.pipeline_flow import push_data, read_champion, repro_stage, tag_runs
    from flows.retrain_flow import champion_lineage, drift_check

    assert repro_stage.retries == 0 and drift_check.retries == 0  # stages and checks: bugs or bad data, not luck
    assert all(t.retries >= 2 for t in (push_data, read_champion, tag_runs, champion_lineage))


def test_stage_commands_never_inherit_rank_variables(monkeypatch):
    """A process that ran an in-process rank keeps RANK/WORLD_SIZE/MASTER_PORT in os.environ while its group holds
    that port; a stage that inherited them bound it again (EADDRINUSE). The flow's stage environment drops them."""
    from flows.pipeline_flow import RANK_VARS, stage_env
    from pipeline.train.distributed import RANK_VARS as TRAINER_RANK_VARS

    assert set(RANK_VARS) == set(TRAINER_RANK_VARS)
    for k in RANK_VARS:
        monkeypatch.setenv(k, "29500")
    env = stage_env(".", "sqlite:///x.db", None)
    assert not set(RANK_VARS) & set(env) and env["MLFLOW_TRACKING_URI"] == "sqlite:///x.db"


@pytest.mark.slow
def test_a_terminated_run_stops_the_stage_it_is_running(tmp_path):
    """SIGTERM to `agentrl run` (a scheduler, a container stopping) ends the running stage too, not only the flow: the
    stage's command runs as the child of `dvc repro`, which alone would leave it working after the run said
    "interrupted". The flow sends the stage's process group what Ctrl-C would, then waits for it."""
    import signal
    import time

    root = make_project(tmp_path / "p")
    graph = yaml.safe_load((root / "dvc.yaml").read_text())
    pid_file = root / "stage.pid"
    graph["stages"]["build_env"]["cmd"] = (f"{sys.executable} -c \"import os, time; open('stage.pid', 'w')"
                                           f".write(str(os.getpid())); time.sleep(300)\"")
    (root / "dvc.yaml").write_text(yaml.safe_dump(graph, sort_keys=False))
    run = subprocess.Popen([str(BIN / "agentrl"), "run"], cwd=root, env=clean_env(root), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            assert run.poll() is None, run.communicate()
            time.sleep(0.5)
        stage_pid = int(pid_file.read_text())
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=90)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130 and "interrupted" in err, out[-2000:] + err[-2000:]
    with pytest.raises(ProcessLookupError):  # the stage's command is gone with the run
        os.kill(stage_pid, 0)
    from pipeline.core.lock import lock_path, read_holder

    assert read_holder(lock_path(root)) == {}  # the repository lock is released


def test_prefect_yaml_defines_the_scheduled_retraining_deployment():
    from flows.retrain_flow import deployment_spec

    spec = deployment_spec(ROOT)
    assert spec["entrypoint"] == "flows/retrain_flow.py:retrain_flow"
    assert [s["cron"] for s in spec["schedules"]] == ["0 3 * * *"]
    from prefect.utilities.importtools import import_object

    flow = import_object(str(ROOT / spec["entrypoint"]))  # the entrypoint resolves to the flow
    assert flow.name == "agentrl-retrain" and set(spec["parameters"]) <= set(flow.parameters.properties)


# --------------------------------------------------------------------------------------------------------------------
# The whole flow on a tiny configuration (slow: every phase trains or evaluates a tiny model for real).


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny project after one `agentrl run`: (root, the completed process)."""
    root = make_project(tmp_path_factory.mktemp("flow") / "project")
    proc = agentrl(root, "run")
    return root, proc


@pytest.mark.slow
def test_the_whole_flow_runs_every_phase_registers_and_gates(trained):
    from pipeline.deploy.gate import CHECKS
    from pipeline.core.graph import load_stages

    root, proc = trained
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = load_stages(root / "dvc.yaml")
    names = [s.name for s in stages]
    assert stage_lines(proc.stdout) == {n: "ran" for n in names}
    for k, name in enumerate(names, 1):  # the progress display
        assert f"[{k}/{len(names)}] {name}: running" in proc.stdout and f"[{k}/{len(names)}] {name}: ran in" in proc.stdout
    assert "orchestration overhead" in proc.stdout and "peak memory" in proc.stdout
    peaks = dict(re.findall(r"^(\w+) +[\d.]+ s  ran  \(peak (\d+) MiB\)$", proc.stdout, flags=re.M))
    assert set(peaks) == set(names) and all(int(v) > 50 for v in peaks.values()), peaks  # each stage's own peak
    for stage in stages:  # every phase wrote its metrics
        assert stage.metrics and all((root / m).is_file() for m in stage.metrics), stage.name
    record = json.loads((root / "metrics" / "pipeline_run.json").read_text())  # what bench/targets.py reads
    assert {n: r["status"] for n, r in record["stages"].items()} == {n: "ran" for n in names}
    assert record["failed"] is None and record["cost"]["total_s"] > record["cost"]["stage_commands_s"] > 0
    assert all(abs(record["stages"][n]["peak_mib"] - int(v)) <= 1 for n, v in peaks.items())  # the printed peaks

    # lineage: the git commit and the DVC versions on the parent run and on every phase run
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    (parent,) = runs(root, "pipeline")
    assert parent.info.status == "FINISHED" and parent.data.tags["git.commit"] == head
    produced = lineage.data_versions(root)
    assert set(produced) == {"data/env", "data/tasks", "data/demos", "data/recipe.json", "models/adapted",
                             "models/reward_model", "models/policy"}
    assert lineage.versions_from_tags(parent.data.tags) == produced
    client = mlflow_client(root)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {r.data.tags["agentrl.flow_stage"] for r in children} == set(names)
    for run in children:
        stage = run.data.tags["agentrl.flow_stage"]
        assert run.data.tags["git.commit"] == head
        assert lineage.versions_from_tags(run.data.tags) == lineage.stage_versions(root, stage), stage

    # the registry: one version with every gate tag; champion where the gate says
    deploy = json.loads((root / "metrics" / "deploy.json").read_text())
    # the stage served its version with `agentrl serve` and replayed the episodes (a pass or a named failure)
    served = deploy["served_consistency"]
    assert served["tasks"] == 2 and "hidden_mse" in served and served["replay_identical"], served["reasons"]
    assert versions(root) == ["1"] and deploy["version"] == "1"
    tags = client.get_model_version("tiny-policy", "1").tags
    assert {f"gate.{c}" for c in CHECKS} | {"gate.decision"} <= set(tags)
    assert tags["gate.decision"] == ("promoted" if deploy["gate"]["passed"] else "rejected")
    assert champion(root) == ("1" if deploy["gate"]["passed"] else None)
    assert parent.data.tags["agentrl.gate"] == tags["gate.decision"]

    # the run's summary artifact: every phase, the gate, where to look next
    md = prefect_artifact(root, "agentrl-pipeline-summary")
    assert all(f"| {n} | ran |" in md for n in names)
    assert f"tiny-policy v1: **{'PROMOTED' if deploy['gate']['passed'] else 'REJECTED'}**" in md
    assert "mlflow ui --backend-store-uri" in md and "orchestration overhead" in md
    assert "`verdict` pass" in md  # a headline figure of check_drift


@pytest.mark.slow
def test_report_card_of_the_run(trained):
    """`agentrl report` after the run: every phase with its time and memory and its headline figures, the gate's
    decision, the cost, and the run's own MLflow parent run with its phase runs (flows/report.py)."""
    from pipeline.core.graph import load_stages

    root, run = trained
    assert run.returncode == 0
    proc = agentrl(root, "report")
    out = root / "metrics" / "report.md"
    assert proc.returncode == 0 and proc.stdout.strip() == f"wrote {out}", proc.stderr
    text = out.read_text()
    record = json.loads((root / "metrics" / "pipeline_run.json").read_text())
    parent = runs(root, "pipeline")[0]
    assert record["run_id"] == parent.info.run_id
    assert f"Parent run `{parent.info.run_id}` (FINISHED)" in text
    assert f"Git commit `{parent.data.tags['git.commit']}`" in text
    for stage in load_stages(root / "dvc.yaml"):
        r = record["stages"][stage.name]
        assert f"| {stage.name} | ran | {r['seconds']:.1f} | {r['peak_mib']:.0f} | `{stage.metrics[0]}` |" in text
        assert f"- **{stage.name}**: `" in text  # its headline figures
        assert f"| {stage.name} | FINISHED |" in text  # its MLflow phase run
    gate = summary.gate_decision(root)
    verdict = "UNCHANGED" if gate["unchanged"] else "PROMOTED" if gate["passed"] else "REJECTED"
    assert f"`tiny-policy` version {gate['version']}: **{verdict}" in text
    assert f"Wall time {record['cost']['total_s']:.1f} s" in text
    assert "- `metrics/train_curve.csv`" in text


@pytest.mark.slow
def test_a_failing_phase_stops_the_flow_and_the_rerun_resumes_there(trained):
    root, first = trained
    assert first.returncode == 0
    before_versions, before_champion = versions(root), champion(root)
    lock_before = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    # A corrupted batch of incoming tasks (train, the first stage that reads data/incoming, must refuse it before it
    # trains), and a changed check_drift setting so that DVC reruns that stage after the fix.
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["check_drift"]["seed"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    bad = root / "data" / "incoming" / "corrupt.jsonl"
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('{"task_id": "x", "question": "truncated...\n')

    failed = agentrl(root, "run")
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert "error: stage 'train' failed" in failed.stderr and "corrupt.jsonl" in failed.stderr
    assert "breaks the task schema" in failed.stderr + failed.stdout
    statuses = stage_lines(failed.stdout)
    assert statuses == {"build_env": "up to date", "adapt": "up to date", "reward_model": "up to date",
                        "train": "FAILED"}  # nothing after it ran
    # the failed command's own time is stage time in the cost line, not orchestration overhead
    assert float(re.search(r"stage commands ([0-9.]+) s", failed.stdout).group(1)) > 0
    assert versions(root) == before_versions and champion(root) == before_champion
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert lock["train"] == lock_before["train"] and lock["deploy"] == lock_before["deploy"]
    failed_run = runs(root, "pipeline")[-1]
    assert failed_run.info.status == "FAILED" and failed_run.data.tags["agentrl.failed_stage"] == "train"
    assert "**Failed:** stage 'train' failed" in prefect_artifact(root, "agentrl-pipeline-summary")
    record = json.loads((root / "metrics" / "pipeline_run.json").read_text())
    assert record["stages"]["train"]["status"] == "FAILED" and "stage 'train' failed" in record["failed"]
    assert "deploy" not in record["stages"]

    bad.unlink()  # the fix
    rerun = agentrl(root, "run", "--push")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    # DVC removed train's outputs before the failed command; with its deps back as they were, DVC restores them from
    # its run cache ("ran", no command time) to the same version, so evaluate is up to date
    assert stage_lines(rerun.stdout) == {"build_env": "up to date", "adapt": "up to date", "reward_model": "up to date",
                                         "train": "ran",
                                         "evaluate": "up to date", "check_drift": "ran", "deploy": "ran"}
    assert yaml.safe_load((root / "dvc.lock").read_text())["stages"]["train"] == lock_before["train"]
    # the same policy as the registered one: deploy reran (its drift input changed) and registered nothing
    assert versions(root) == before_versions and champion(root) == before_champion
    assert json.loads((root / "metrics" / "deploy.json").read_text())["unchanged"] == before_versions[-1]
    pushed = lineage.data_versions(root)["models/policy"]  # --push sent every version to the local remote
    assert (root / ".dvc-remote" / "files" / "md5" / pushed[:2] / pushed[2:]).is_file()


@pytest.mark.slow
def test_scheduled_retraining_skips_undrifted_data_and_retrains_on_drift(trained):
    root, first = trained
    assert first.returncode == 0
    incoming = root / "data" / "incoming"
    for old in incoming.glob("*.jsonl"):  # earlier batches go; the folder's README stays
        old.unlink()
    before_versions, before_champion = versions(root), champion(root)

    write_tasks(root, "batch-1.jsonl", None)
    calm = agentrl(root, "schedule", "--once")
    assert calm.returncode == 0, calm.stdout[-3000:] + calm.stderr[-3000:]
    assert "retrain: nothing needed (no drift" in calm.stdout
    record = runs(root, "retrain")[-1]
    assert record.data.tags["retrain.decision"] == "nothing needed" and record.data.metrics["retrain/retrained"] == 0
    assert versions(root) == before_versions and champion(root) == before_champion
    assert "**Decision:** nothing needed" in prefect_artifact(root, "agentrl-retrain-summary")

    (incoming / "batch-1.jsonl").unlink()
    write_tasks(root, "batch-2.jsonl", "level_shift")
    drifted = agentrl(root, "schedule", "--once")
    assert drifted.returncode == 0, drifted.stdout[-3000:] + drifted.stderr[-3000:]
    assert "retrain: retrain (drift found (task_drift" in drifted.stdout
    record = runs(root, "retrain")[-1]
    assert record.data.tags["retrain.decision"] == "retrain" and record.data.metrics["retrain/drift_found"] == 1
    statuses = stage_lines(drifted.stdout)  # forced from the first stage that reads the drifted incoming tasks
    assert statuses == {"build_env": "up to date", "adapt": "up to date", "reward_model": "up to date", "train": "ran",
                        "evaluate": "ran", "check_drift": "ran", "deploy": "ran"}
    used = json.loads((root / "metrics" / "train.json").read_text())["incoming"]  # the retrain trained on the batch
    assert used["files"] == 1 and used["tasks"] > 0 and used["dropped_heldout_entities"] == 0
    new = versions(root)[-1]
    assert versions(root) == [*before_versions, new]  # retrained and registered a challenger ...
    tags = mlflow_client(root).get_model_version("tiny-policy", new).tags
    assert tags["gate.drift"] == "fail" and tags["gate.decision"] == "rejected"  # ... that the gate refused
    assert champion(root) == before_champion
    pipeline_run = runs(root, "pipeline")[-1]  # the retrain's pipeline run nests under the retrain run
    assert pipeline_run.data.tags["mlflow.parentRunId"] == record.info.run_id


@pytest.mark.slow
def test_a_drift_alarm_on_shifted_served_traffic_triggers_retraining_on_the_snapshot(trained, tmp_path):
    from test_snapshot import calm_traffic, shifted_traffic

    root, first = trained
    assert first.returncode == 0
    for old in (root / "data" / "incoming").glob("*.jsonl"):  # no incoming batch: only the alarm can trigger
        old.unlink()
    from pipeline.check_drift.checks import make_reference_sample
    from pipeline.envs.shop import ShopWorld

    world = ShopWorld.load(root / "data" / "env")
    mix = yaml.safe_load((root / "params.yaml").read_text())["build_env"]["level_mix"]
    fresh = make_reference_sample(world, 24, 11, mix).tasks  # new tasks of the training world, asked in full
    world.close()
    capture = tmp_path / "traffic"
    calm_traffic(root, capture, asked=fresh)  # they become the snapshot's tasks
    shifted_traffic(capture)  # then long questions answered in one call
    snap = agentrl(root, "snapshot", "--capture", str(capture))
    assert snap.returncode == 0, snap.stdout[-3000:] + snap.stderr[-3000:]
    assert "drift alarm: RAISED (question_chars_ks" in snap.stdout
    assert (root / "data" / "production" / "snapshot.dvc").is_file()
    manifest = json.loads((root / "data" / "production" / "snapshot" / "snapshot.json").read_text())
    before_versions = versions(root)

    alarmed = agentrl(root, "schedule", "--once")
    assert alarmed.returncode == 0, alarmed.stdout[-3000:] + alarmed.stderr[-3000:]
    assert "retrain: retrain (drift alarm on served traffic (question_chars_ks" in alarmed.stdout
    statuses = stage_lines(alarmed.stdout)  # forced from the first stage that reads the snapshot: the reward model's
    assert statuses == {"build_env": "up to date", "adapt": "up to date", **dict.fromkeys(  # feedback
        ("reward_model", "train", "evaluate", "check_drift", "deploy"), "ran")}
    record = runs(root, "retrain")[-1]
    assert record.data.tags["retrain.alarm_snapshot"] == manifest["digest"]
    assert record.data.metrics["retrain/drift_alarm"] == 1 and record.data.metrics["retrain/drift_found"] == 0
    used = json.loads((root / "metrics" / "train.json").read_text())["incoming"]  # train read the snapshot's tasks
    assert "data/production/snapshot/tasks" in used["dir"] and used["files"] == 1
    assert used["read"] == manifest["tasks"] > 0 and used["tasks"] > 0  # they joined the RL pool
    assert len(versions(root)) == len(before_versions) + 1  # a challenger was retrained, registered and gated

    again = agentrl(root, "schedule", "--once")  # the same snapshot's alarm is not acted on twice
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "retrain: nothing needed" in again.stdout
    assert "already acted on by run" in prefect_artifact(root, "agentrl-retrain-summary")


@pytest.mark.slow
def test_a_reference_version_the_workspace_moved_past_is_restored_from_the_dvc_cache(trained, tmp_path):
    from flows.retrain_flow import reference_path

    root, first = trained
    assert first.returncode == 0
    champion_tasks = lineage.data_versions(root)["data/tasks"]
    # A workspace whose data/tasks has moved on (another hash in dvc.lock), sharing the project's DVC cache.
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / ".dvc").symlink_to(root / ".dvc")
    (moved / "dvc.lock").write_text((root / "dvc.lock").read_text().replace(champion_tasks, "0" * 32 + ".dir"))
    path, source = reference_path(moved, "data/tasks/train.jsonl", {"data/tasks": champion_tasks}, moved / "scratch")
    assert source == f"DVC cache ({champion_tasks})" and Path(path).is_relative_to(moved / "scratch")
    assert Path(path).read_bytes() == (root / "data" / "tasks" / "train.jsonl").read_bytes()
    # the workspace copy is used when it is the champion's version; a version missing from the cache is refused
    assert reference_path(root, "data/tasks/train.jsonl", {"data/tasks": champion_tasks}, tmp_path)[0] == \
        str(root / "data" / "tasks" / "train.jsonl")
    from pipeline.core.errors import AgentRLError

    with pytest.raises(AgentRLError, match="not in the DVC cache.*dvc fetch"):
        reference_path(root, "data/tasks/train.jsonl", {"data/tasks": "f" * 32 + ".dir"}, tmp_path)


@pytest.mark.services
@pytest.mark.slow
@pytest.mark.parametrize("remote", ["local", "s3"])
def test_dvc_push_and_pull_restore_data_and_models_byte_for_byte(trained, remote):
    """The project's default local remote, and a bucket on an S3 endpoint (moto's server, tests/services.py) added
    as a user would (`dvc remote add`, `dvc remote modify endpointurl`; in .dvc/config.local here, so the project's
    config stays as it is for the other tests)."""
    root, first = trained
    assert first.returncode == 0
    dvc = [sys.executable, "-m", "dvc"]
    files = lambda: {p.relative_to(root).as_posix(): p.read_bytes()  # noqa: E731  (DVC's files, not git's)
                     for d in ("models", "data/tasks") for p in sorted((root / d).rglob("*"))
                     if p.is_file() and p.name != ".gitignore"}
    before = files()
    with contextlib.ExitStack() as stack:
        extra: list[str] = []
        if remote == "s3":
            from services import s3_keys, s3_server

            endpoint = stack.enter_context(s3_server("agentrl-dvc"))
            for args in (("remote", "add", "--local", "s3", "s3://agentrl-dvc/cache"),
                         ("remote", "modify", "--local", "s3", "endpointurl", endpoint)):
                subprocess.run([*dvc, *args], cwd=root, check=True, capture_output=True, timeout=120)
            stack.callback(lambda: (root / ".dvc" / "config.local").unlink(missing_ok=True))
            extra = ["-r", "s3"]
        env = clean_env(root)  # after s3_server: it carries the bucket's credentials
        run = lambda *args: subprocess.run([*dvc, *args], cwd=root, env=env, capture_output=True, text=True,  # noqa: E731
                                           timeout=300)
        push = run("push", *extra)
        assert push.returncode == 0, push.stderr
        if remote == "s3":
            assert any(k.startswith("cache/files/md5/") for k in s3_keys(endpoint, "agentrl-dvc", "cache/"))
        else:
            assert (root / ".dvc-remote" / "files" / "md5").is_dir()
        shutil.rmtree(root / "models")
        shutil.rmtree(root / "data" / "tasks")
        shutil.rmtree(root / ".dvc" / "cache")
        pull = run("pull", *extra)
        assert pull.returncode == 0, pull.stderr
        status = run("status", "--json")
    assert json.loads(status.stdout) == {}  # every output is back at the version dvc.lock records
    assert files() == before  # byte for byte
    assert lineage.cache_file(root, lineage.data_versions(root)["models/policy"]).is_file()


# --------------------------------------------------------------------------------------------------------------------
# The retraining deployment on a real `prefect server`: served by `agentrl schedule`, triggered by hand.
