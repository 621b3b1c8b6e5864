"""agentrl-pipeline: an importable library for training tool-using agents with RL.

Importing the package sets offline and telemetry defaults (with ``os.environ.setdefault``, so an explicit setting by the
user always wins) before any phase can import MLflow, Prefect, DVC, Great Expectations or a model hub client: nothing
may phone home or download at run time.

The library imports no orchestrator: Prefect lives in ``flows/`` only.
"""

from __future__ import annotations

import os
from pathlib import Path

_OFFLINE_DEFAULTS = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "GX_ANALYTICS_ENABLED": "false",
}

for _key, _value in _OFFLINE_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
del _key, _value

_MARKERS = ("params.yaml", "dvc.yaml")


def repo_root(start: str | Path | None = None) -> Path:
    """The project root: the nearest directory at or above `start` (default: cwd) holding params.yaml or dvc.yaml.

    Falls back to `start` itself when no ancestor holds either file, so a phase run from a bare directory writes there.
    """
    here = Path(start if start is not None else os.getcwd()).resolve()
    for candidate in (here, *here.parents):
        if any((candidate / marker).is_file() for marker in _MARKERS):
            return candidate
    return here


__all__ = ["repo_root"]
