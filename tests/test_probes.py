"""The scratch-run probe (scripts/probes/scratch_run.py) refuses bad input before it creates or runs anything.

Only its argument handling is tested here (no phase runs): overrides reach the right key, every section is validated
with the config's own message, and an existing folder or a data folder built from other params is refused untouched.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scratch_run", ROOT / "scripts/probes/scratch_run.py")
scratch_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scratch_run)


def test_overrides_set_level_keys_as_params_yaml_writes_them():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    scratch_run.set_key(params, "build_env.demos.level_coverage.3", 0.12)
    scratch_run.set_key(params, "adapt.gate.min.eval/greedy/success_L3", 0)
    assert params["build_env"]["demos"]["level_coverage"] == {1: 1.0, 2: 1.0, 3: 0.12, 4: 0.03}
    assert params["adapt"]["gate"]["min"]["eval/greedy/success_L3"] == 0
    scratch_run.validate(params)  # a valid override passes


def test_bad_overrides_stop_before_the_folder_is_made(tmp_path):
    folder = tmp_path / "scratch"
    with pytest.raises(SystemExit, match="did you mean 'level_coverage'"):
        scratch_run.main([str(folder), "-S", "build_env.demos.level_coverag.3=0.1"])
    with pytest.raises(SystemExit, match=r"level_coverage values must lie in \[0, 1\]"):
        scratch_run.main([str(folder), "-S", "build_env.demos.level_coverage.3=1.5"])
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        scratch_run.main([str(folder), "-S", "train.updates"])
    with pytest.raises(SystemExit, match="unknown params.yaml section"):
        scratch_run.main([str(folder), "-S", "trian.updates=3"])
    assert not folder.exists()


def test_an_existing_folder_and_mismatched_data_are_refused_untouched(tmp_path):
    existing = tmp_path / "done"
    existing.mkdir()
    (existing / "keep.txt").write_text("results\n")
    with pytest.raises(SystemExit, match="exists"):
        scratch_run.main([str(existing)])
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]

    source = tmp_path / "source"
    (source / "data/tasks").mkdir(parents=True)
    (source / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    new = tmp_path / "new"
    with pytest.raises(SystemExit, match=r"differs in \['build_env'\]"):
        scratch_run.main([str(new), "--data-from", str(source), "-S", "build_env.demos.level_coverage.3=0.12"])
    assert not new.exists()


def test_summary_needs_a_folder(tmp_path):
    with pytest.raises(SystemExit, match="no such folder"):
        scratch_run.main([str(tmp_path / "missing"), "--summary"])
    assert scratch_run.summary(tmp_path) == f"{tmp_path}: no metrics yet"
