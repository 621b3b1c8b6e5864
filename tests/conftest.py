"""Shared fixtures and the suite's MLflow store.

`pytest_configure` points MLFLOW_TRACKING_URI at a SQLite store in a temporary folder for the whole run (and
`pytest_unconfigure` restores the environment and removes it): no test writes into the repository's own
`mlflow.db`/`mlartifacts`, whichever phase it runs. A test that needs a store of its own can still point
MLFLOW_TRACKING_URI elsewhere with monkeypatch.

`fixed_seeds` is autouse: every test starts from the same global random state (Python, NumPy, torch), so a test's
draw is the same in CI as here and in any order; a test that means to range over draws parametrizes its seeds.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Export a fresh SQLite MLflow store for the whole run (see the module docstring)."""
    store = Path(tempfile.mkdtemp(prefix="agentrl-test-mlflow-"))
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store / 'mlflow.db'}")
    mp.delenv("AGENTRL_PARENT_RUN_ID", raising=False)
    mp.delenv("AGENTRL_TRACKING", raising=False)  # a user's switch must not turn the suite's tracking off
    config.stash[_STORE] = (store, mp)


def pytest_unconfigure(config: pytest.Config) -> None:
    store, mp = config.stash.get(_STORE, (None, None))
    if mp is not None:
        mp.undo()
        shutil.rmtree(store, ignore_errors=True)


_STORE = pytest.StashKey[tuple]()


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
