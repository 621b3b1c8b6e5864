"""Shared fixtures.

`mlflow_tmp_uri` is autouse: no test writes into the repository's own `mlflow.db`/`mlartifacts`, whichever phase it
runs. A test that needs a store of its own can still point MLFLOW_TRACKING_URI elsewhere with monkeypatch.

`fixed_seeds` is autouse: every test starts from the same global random state (Python, NumPy, torch), so a test's
draw is the same in CI as here and in any order; a test that means to range over draws parametrizes its seeds.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def mlflow_tmp_uri(tmp_path_factory: pytest.TempPathFactory):
    """A SQLite MLflow store in a session temp dir, exported as MLFLOW_TRACKING_URI for the whole test session."""
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    uri = f"sqlite:///{db}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.delenv("AGENTRL_PARENT_RUN_ID", raising=False)
        mp.delenv("AGENTRL_TRACKING", raising=False)  # a user's switch must not turn the suite's tracking off
        yield uri


@pytest.fixture(autouse=True)
def fixed_seeds():
    """Seed the global generators before each test (see the module docstring)."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one torch thread (restored afterwards): tiny matrices gain nothing from a second
    thread, and on a loaded machine OpenMP's barrier waits make every small op cost a scheduler slice. A module opts
    in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
