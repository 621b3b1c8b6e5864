"""bench/scale.py refuses a bad --before file or --policy folder with one error line, before any section runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, says", [
    (["--only", "build_env", "--before", "missing.json"], "--before missing.json"),
    (["--only", "build_env", "--before", "empty.json"], "--before empty.json"),
    (["--only", "rollout", "--policy", "no-policy"], "--policy no-policy"),
])
def test_bad_input_is_one_error_line_before_any_measurement(tmp_path, args, says):
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "no-policy").mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), *args, "--plots", str(tmp_path / "img")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert "load average" not in proc.stdout and not (tmp_path / "img").exists()  # nothing ran, nothing written
