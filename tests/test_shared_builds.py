"""The suite's run-wide shared builds (tests/shared_builds.py): two processes that ask for one build at once get it
built once, and a build that failed is built again by the next process that asks, never read as a build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# A process that asks for the build "b": the build counts itself in `calls` and takes a moment (the other process
# asks meanwhile); with FAIL set it fails half-way.
ASK = """
import json, os, sys, time
from pathlib import Path
from shared_builds import built_once

def build(folder):
    with open(sys.argv[1], "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    (folder / "half").write_text("written")
    time.sleep(1.0)
    if os.environ.get("FAIL"):
        raise RuntimeError("the build failed")
    (folder / "whole").write_text("written")
    return {"by": os.getpid()}

folder, facts = built_once("b", build)
print(json.dumps({"facts": facts, "files": sorted(p.name for p in folder.iterdir())}))
"""


def ask(shared: Path, calls: Path, fail: bool = False) -> subprocess.Popen:
    env = {**os.environ, "AGENTRL_TEST_SHARED": str(shared), "PYTHONPATH": str(TESTS)}
    env.pop("FAIL", None)
    if fail:
        env["FAIL"] = "1"
    return subprocess.Popen([sys.executable, "-c", ASK, str(calls)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_asking_at_once_build_once_and_read_the_same_build(tmp_path):
    calls = tmp_path / "calls"
    procs = [ask(tmp_path / "shared", calls) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    builder = calls.read_text().split()
    assert len(builder) == 1  # one build for both
    answers = [json.loads(out) for out, _ in outs]
    assert answers[0] == answers[1] == {"facts": {"by": int(builder[0])}, "files": ["half", "whole"]}


def test_a_failed_build_is_built_again_by_the_next_process_that_asks(tmp_path):
    calls = tmp_path / "calls"
    failed = ask(tmp_path / "shared", calls, fail=True)
    _, err = failed.communicate(timeout=60)
    assert failed.returncode != 0 and "the build failed" in err
    assert (tmp_path / "shared" / "b" / "half").is_file()  # what the failed build left ...
    assert not (tmp_path / "shared" / "b.done.json").exists()  # ... is not marked as done
    again = ask(tmp_path / "shared", calls)
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert len(calls.read_text().split()) == 2  # built again, from an empty folder
    assert json.loads(out) == {"facts": {"by": again.pid}, "files": ["half", "whole"]}
