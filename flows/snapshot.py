"""`agentrl snapshot`: the library's snapshot of captured traffic (:mod:`pipeline.deploy.snapshot`), then recorded
by DVC.

Why `dvc add` and not a stage of dvc.yaml: the snapshot's source, the capture folder, lives outside the repository's
history and changes with every request (retention even deletes its oldest segments), so a stage that read it could
not be reproduced: `dvc repro` would make a new dataset each time, or fail once the segments are gone. A snapshot is
therefore an input of the pipeline, like any raw data set DVC tracks: ``dvc add data/production/snapshot`` puts it
in the DVC cache and writes ``data/production/snapshot.dvc`` (commit it with git), and the stages that read it
(`reward_model`, `train`) list ``data/production`` among their deps, so a new snapshot reruns them and `dvc repro`
stays reproducible from the committed ``.dvc`` file. ``data/production/README.md`` stays in git beside it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.core.errors import AgentRLError


def dvc_add(root: Path, path: str) -> str:
    """``dvc add PATH`` in the project `root`; the `.dvc` file written. AgentRLError with DVC's own words on failure."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "add", "--quiet", path], cwd=root, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise AgentRLError(f"snapshot: written to {path}, but `dvc add {path}` failed: "
                           f"{said[-1] if said else 'exit ' + str(proc.returncode)}")
    return f"{path}.dvc"


def run_snapshot(params: str, capture_dir: str | None = None) -> dict:
    """Snapshot (the library), then ``dvc add`` when the project is a DVC repository and ``deploy.snapshot.dvc``."""
    from pipeline.core.config import load_section
    from pipeline.deploy.config import DeployConfig
    from pipeline.deploy.snapshot import main

    manifest = main(params, capture_dir)
    cfg = load_section(DeployConfig, "deploy", params).snapshot
    root = Path.cwd()
    if cfg.dvc and (root / ".dvc").is_dir() and not Path(cfg.out).is_absolute():
        dvc_file = dvc_add(root, cfg.out)
        print(f"snapshot: recorded by DVC in {dvc_file} (commit it with git; `dvc push` sends the data)", flush=True)
    return manifest


__all__ = ["dvc_add", "run_snapshot"]
