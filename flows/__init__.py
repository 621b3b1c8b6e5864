"""Prefect flows that compose the phases; the only package that imports an orchestrator.

Importing this package does not import Prefect: `agentrl run` first calls :func:`use_project_prefect_home` so that
Prefect's database, logs and result storage live under the repository (``.prefect/``), then imports
``flows.pipeline_flow``. Prefect reads these settings when it is imported, which is why the order matters.
"""

from __future__ import annotations

import os
from pathlib import Path


def use_project_prefect_home(root: str | Path) -> None:
    """Keep Prefect's state under `root`/.prefect unless the user chose another place (setdefault, never override)."""
    home = Path(root).resolve() / ".prefect"
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(home / "storage"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary server's first start runs its database migrations: about 11 s on an idle 2-core machine, and
    # past Prefect's default 20 s limit on a loaded one (seen in CI). Give it room.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


def project_params(params_path: str | Path) -> Path:
    """The absolute path of a project's params.yaml, checked before Prefect starts anything.

    The stages run through `dvc repro`, which reads the params.yaml next to dvc.yaml, so another file name cannot be
    honoured; a missing or malformed file fails here with a ConfigError rather than inside the first stage.
    """
    from pipeline.core.config import read_params
    from pipeline.core.errors import AgentRLError

    params = Path(params_path).resolve()
    if params.name != "params.yaml":
        raise AgentRLError(
            f"{params}: the dvc.yaml stages read the params.yaml next to dvc.yaml; "
            "edit it, or try other values with `dvc exp run -S section.key=value`"
        )
    read_params(params, only_known=False)  # the stages of a dvc.yaml may read sections of their own
    if not (params.parent / "dvc.yaml").is_file():
        raise AgentRLError(f"{params.parent}: no dvc.yaml next to {params.name}; run from the repository root")
    return params
