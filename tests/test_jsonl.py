"""pipeline.core.jsonl, the one JSON Lines reader: what it accepts, and the one-line error for each kind of bad file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import iter_numbered_jsonl, read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def test_reads_objects_and_skips_blank_lines(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"a": 1}\n\n  \n{"b": "é"}\n')
    assert read_jsonl(f) == [{"a": 1}, {"b": "é"}]
    assert [i for i, _ in iter_numbered_jsonl(f)] == [1, 4]


@pytest.mark.parametrize("content, message", [
    (b'{"a": 1}\n{"a": \n', r"b.jsonl:2: not valid JSON \(Expecting value at column 7\)"),
    (b'{"a": 1}\n[1, 2]\n', r"b.jsonl:2: expected a JSON object, got list"),
    (b'{"a": "\xff\xfe"}\n', r"b.jsonl:1: not UTF-8 text \(byte 8 of the line\)"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", r"b.jsonl:1: JSON nested too deeply to read"),
])
def test_a_bad_line_is_refused_naming_the_file_and_the_line(tmp_path, content, message):
    f = tmp_path / "b.jsonl"
    f.write_bytes(content)
    with pytest.raises(AgentRLError, match=message):
        read_jsonl(f)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(AgentRLError, match=r"c.jsonl: demonstrations not found; run `agentrl build-env`"):
        read_jsonl(tmp_path / "c.jsonl", "demonstrations", hint="run `agentrl build-env`")
    (tmp_path / "d.jsonl").write_text("\n")
    with pytest.raises(AgentRLError, match=r"d.jsonl: no tasks in file"):
        read_jsonl(tmp_path / "d.jsonl", "tasks")
    assert read_jsonl(tmp_path / "d.jsonl", allow_empty=True) == []


def test_agentrl_eval_refuses_a_task_file_that_is_not_utf8_with_one_error_line(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"task_id": "\xff"}\n')
    out = subprocess.run([sys.executable, "-m", "flows.cli", "eval", "--policy", "expert", "--tasks", str(tasks),
                          "--out", str(tmp_path / "out.json")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"error: {tasks}:1: not UTF-8 text (byte 14 of the line)"]
    assert not (tmp_path / "out.json").exists()
