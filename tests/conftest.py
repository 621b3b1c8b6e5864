"""Shared fixtures and the suite's MLflow store.

`pytest_configure` points MLFLOW_TRACKING_URI at a SQLite store in a temporary folder for the whole run (and
`pytest_unconfigure` restores the environment and removes it): no test writes into the repository's own
`mlflow.db`/`mlartifacts`, whichever phase it runs. A test that needs a store of its own can still point
MLFLOW_TRACKING_URI elsewhere with monkeypatch.

The memo of passed validations (`pipeline.core.validation_memo`) lives in that folder too, one for the run and
its workers: the many tiny projects the tests build from the same seeds validate the same data once. So do the builds
that several modules share (``AGENTRL_TEST_SHARED``, tests/shared_builds.py): a tiny project through its first
phases, an uninterrupted training run, each built once per run.

`fixed_seeds` is autouse: every test starts from the same global random state (Python, NumPy, torch), so a test's
draw is the same in CI as here and in any order; a test that means to range over draws parametrizes its seeds.
"""

from __future__ import annotations

import os
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
    if not hasattr(config, "workerinput") or not os.environ.get("AGENTRL_VALIDATION_MEMO"):
        # one memo of passed validations for the whole run, shared by the xdist workers (they inherit this
        # process's environment) and by every child process; never the user's own (pipeline.core.validation_memo)
        mp.setenv("AGENTRL_VALIDATION_MEMO", str(store / "validation-memo"))
    if not hasattr(config, "workerinput") or not os.environ.get("AGENTRL_TEST_SHARED"):
        mp.setenv("AGENTRL_TEST_SHARED", str(store / "shared"))  # the run's shared builds (tests/shared_builds.py)
    config.stash[_STORE] = (store, mp)
    one_torch_thread_per_worker()


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


@pytest.fixture
def installed_package(tmp_path, monkeypatch):
    """A function that installs a one-module package on this process's path as an installed distribution would be:
    ``install(package, source, group, entries)`` writes ``<package>/__init__.py`` holding `source` and a dist-info
    folder whose entry points of `group` are `entries` (name -> ``module:function``), so importlib.metadata finds
    them. The modules are forgotten afterwards."""
    import importlib
    import sys

    made = []

    def install(package: str, source: str, group: str, entries: dict[str, str]) -> None:
        site = tmp_path / "site"
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text(source)
        info = site / f"{package}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 0.1\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
        (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
        made.append(package)

    yield install
    for package in made:
        sys.modules.pop(package, None)


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


# Modules that take longest, longest first (from `--durations` of a full run). Under `pytest -n 2 --dist loadfile
# --no-loadscope-reorder` (scripts/test) each module runs whole on one worker, in collection order; starting the long
# ones first keeps the two workers busy to the end instead of leaving one module running alone (xdist's own order,
# by number of tests, started the whole-pipeline modules last). Order only: a module missing here runs after these.
LONG_FIRST = ("test_flow", "test_adapt", "test_train", "test_foreign_model", "test_prefect_worker", "test_outages",
              "test_kills", "test_serve", "test_production", "test_live",
              "test_deploy", "test_registry_shared", "test_env_plugins", "test_deploy_kill", "test_registry_check",
              "test_env_calendar", "test_foundation",
              "test_faults", "test_train_nodes", "test_replay", "test_served_check", "test_build_env",
              "test_scale_out", "test_task_generator", "test_inputs", "test_context_actions", "test_validation",
              "test_drift", "test_snapshot", "test_estimators", "test_vs_trl")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the long modules first (see LONG_FIRST); the order within a module is kept (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def one_torch_thread_per_worker() -> None:
    """An xdist worker uses one torch thread: two workers on two cores each with a pool of two only wait on each
    other's OpenMP barriers."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


# The fast set (`scripts/test --fast`, docs/testing.md) stays fast only if a long test is marked when it is written.
# Every run lists the unmarked tests whose own call took longer than this, so a new one shows up at once (setup is
# left out: a module's shared fixture is built in the setup of whichever of its tests runs first).
FAST_LIMIT_S = 5.0
_unmarked_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and not {"slow", "services"} & set(report.keywords):
        _unmarked_seconds[report.nodeid] = _unmarked_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    long = sorted(((s, n) for n, s in _unmarked_seconds.items() if s > FAST_LIMIT_S), reverse=True)
    if long:
        terminalreporter.section("unmarked tests over the fast set's limit")
        terminalreporter.write_line(f"{len(long)} test(s) not marked slow or services took over {FAST_LIMIT_S:.0f} s; "
                                    "mark them, or make them faster:")
        for seconds, nodeid in long:
            terminalreporter.write_line(f"  {seconds:6.1f} s  {nodeid}")
