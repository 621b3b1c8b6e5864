"""Faults while a phase writes: a process killed mid-write, a disk that fills up, a pipeline run killed mid-stage.

The guarantee (pipeline/core/atomic.py): every output file and folder appears whole or not at all, and a write that
runs out of room is one ``error:`` line naming the path with the previous output left byte-identical.

- A writer SIGKILLed in the middle of a file or a folder leaves the previous version in place (child processes that
  block inside the write and are killed there).
- A full disk is simulated portably with ``RLIMIT_FSIZE`` in a child process (with SIGXFSZ ignored, a write past the
  limit fails with EFBIG, as one on a full disk fails with ENOSPC): the task-file writer, a metrics writer and a
  model folder writer raise :class:`DiskFullError` naming their path, and `agentrl build-env` exits 2 with one
  ``error:`` line and leaves ``data/`` and ``metrics/`` as they were. No root, no tmpfs: CI runs it.
- `agentrl run` killed with SIGKILL (the whole process group: flow, DVC, the stage command) while the `build_env`
  stage generates: no half-written ``data/`` output is visible, and the rerun finishes with files byte-identical to
  an uninterrupted build of the same params. `build_env` is the stage of this kind that a test can afford (the
  stages after it each train a model first); train's own restart is its checkpoint mechanism (tests/test_train.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "AGENTRL_TRACKING": "off", "PYTHONWARNINGS": "ignore"}
    env.update(extra)
    return env


def limit_file_size(limit: int):
    """preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, so the process is not killed)."""
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def files(root: Path) -> dict[str, str]:
    """sha256 of every visible file under `root` (hidden names: temporaries of a killed writer, DVC's own)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)}


# ------------------------------------------------------------------------------------- a writer killed mid-write

KILLED_WRITERS = {
    # write_tasks: the file is written line by line; task 50's to_dict blocks after 49 lines went out
    "task_file": """
        from pipeline.envs.contract import Task
        from pipeline.envs.taskfile import write_tasks

        class Blocking(Task):
            def to_dict(self):
                if self.task_id == "t50":
                    print("ready", flush=True)
                    time.sleep(600)
                return super().to_dict()

        write_tasks([Blocking(f"t{i}", "train", 1, "Q" * 100, "3") for i in range(100)], target)
    """,
    # replace_dir (model folders): the new folder is half built when the process dies
    "model_folder": """
        from pipeline.core.atomic import replace_dir

        def write(tmp):
            tmp.mkdir()
            (tmp / "model.safetensors").write_bytes(b"new" * 1000)
            print("ready", flush=True)
            time.sleep(600)

        replace_dir(target, write)
    """,
}


@pytest.mark.parametrize("writer", KILLED_WRITERS)
def test_a_writer_killed_mid_write_leaves_the_previous_output(writer, tmp_path):
    target = tmp_path / ("out.jsonl" if writer == "task_file" else "model")
    if writer == "task_file":
        target.write_text('{"old": 1}\n')
    else:
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"old")
    before = files(tmp_path)
    code = "import sys, time\nfrom pathlib import Path\ntarget = Path(sys.argv[1])\n" + textwrap.dedent(
        KILLED_WRITERS[writer])
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)], env=child_env(), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
        assert hidden, "the writer builds its output beside the target"  # the new version is being written ...
        assert files(tmp_path) == before  # ... and is not visible yet
    finally:
        proc.kill()
        proc.wait()
    assert files(tmp_path) == before  # the killed write left the previous version in place


# --------------------------------------------------------------------------------------------------- a full disk

FULL_DISK_WRITERS = {
    "task_file": ("out.jsonl", """
        from pipeline.envs.contract import Task
        from pipeline.envs.taskfile import write_tasks
        write_tasks([Task(f"t{i}", "train", 1, "Q" * 100, "3") for i in range(200)], target)
    """),
    "metrics": ("metrics.json", """
        from pipeline.core.atomic import write_json
        write_json(target, {"values": list(range(20000))})
    """),
    "model_folder": ("reward_model", """
        from pipeline.reward_model import model as M
        M.save(M.RewardModel(20000), target, {"env": "shop"})
    """),
}


@pytest.mark.parametrize("writer", FULL_DISK_WRITERS)
def test_a_full_disk_fails_the_write_naming_the_path_and_keeps_the_old_output(writer, tmp_path):
    name, body = FULL_DISK_WRITERS[writer]
    target = tmp_path / name
    if writer == "model_folder":
        target.mkdir()
        (target / "weights.safetensors").write_bytes(b"old weights")
    else:
        target.write_text('{"old": 1}\n')
    before = files(tmp_path)
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        from pipeline.core.atomic import DiskFullError
        target = Path(sys.argv[1])
        try:
    """) + textwrap.indent(textwrap.dedent(body), "    ") + textwrap.dedent("""
        except DiskFullError as exc:
            print(f"error: {exc}")
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(target)], env=child_env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=limit_file_size(16 * 1024))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"error: {target}: cannot write it: file too large"), proc.stdout + proc.stderr
    assert files(tmp_path) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the failed write cleaned up after itself


# ------------------------------------------------------------------------- stages: a full disk, a killed pipeline


def tiny_params() -> dict:
    from test_flow import tiny_params as flow_params

    return flow_params()


def reference_build(params: dict, out: Path) -> dict[str, str]:
    """The files of an uninterrupted build_env with `params`, in process."""
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build
    from pipeline.envs.config import EnvConfig

    build(BuildEnvConfig(**params["build_env"]), EnvConfig(**params["env"]), out / "data", out / "metrics.json")
    return files(out / "data")


@pytest.mark.slow
def test_build_env_on_a_full_disk_is_one_error_line_and_keeps_the_previous_data(tmp_path):
    params = {k: v for k, v in tiny_params().items() if k in ("env", "build_env")}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    first = subprocess.run([str(BIN / "agentrl"), "build-env"], cwd=tmp_path, env=child_env(), capture_output=True,
                           text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {**files(tmp_path / "data"), **files(tmp_path / "metrics")}
    params["build_env"]["seed"] = 1  # another build, which would change every output
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    full = subprocess.run([str(BIN / "agentrl"), "build-env"], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=600, preexec_fn=limit_file_size(8 * 1024))
    assert full.returncode == 2, full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert errors[0].startswith("error: data: cannot write it: write failed (disk full, file too large"), errors
    assert {**files(tmp_path / "data"), **files(tmp_path / "metrics")} == before


@pytest.mark.slow
def test_a_run_killed_mid_stage_reruns_to_the_same_outputs(tmp_path):
    """SIGKILL to the whole `agentrl run` while build_env generates; the rerun's outputs equal an uninterrupted
    build's, byte for byte, and nothing half-written was visible in between."""
    from test_flow import clean_env, make_project

    root = make_project(tmp_path / "project")
    params = yaml.safe_load((root / "params.yaml").read_text())
    reference = reference_build(params, tmp_path / "reference")
    reference_metrics = json.loads((tmp_path / "reference" / "metrics.json").read_text())["checksums"]

    run = subprocess.Popen([str(BIN / "agentrl"), "run", "--stage", "build_env"], cwd=root, env=clean_env(root),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    staging = root / "data" / ".staging-build_env"
    try:
        deadline = time.time() + 600
        while not (staging / "tasks").is_dir():  # the stage is writing its outputs
            assert run.poll() is None, f"agentrl run ended ({run.returncode}) before build_env wrote anything"
            assert time.time() < deadline, "build_env did not start writing within 600 s"
            time.sleep(0.05)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    for out in ("env", "tasks", "demos"):  # an output is absent (DVC removed it, the stage never published) or whole
        visible = files(root / "data" / out)
        assert visible == {k.split("/", 1)[1]: v for k, v in reference.items() if k.startswith(f"{out}/")} \
            or not visible, out
    metrics = root / "metrics" / "build_env.json"
    assert not metrics.exists() or json.loads(metrics.read_text())["checksums"] == reference_metrics

    rerun = subprocess.run([str(BIN / "agentrl"), "run", "--stage", "build_env"], cwd=root, env=clean_env(root),
                           capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    # data/incoming and data/production hold the project's own files (READMEs), not build_env's outputs
    assert {k: v for k, v in files(root / "data").items()
            if not k.startswith(("incoming/", "production/"))} == reference
    assert json.loads(metrics.read_text())["checksums"] == reference_metrics
    assert not staging.exists()
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["build_env"]
    assert {"data/env", "data/tasks", "data/demos"} <= {o["path"] for o in lock["outs"]}
