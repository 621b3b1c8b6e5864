"""One registered model shared by several pipelines (repositories, hosts) on one MLflow tracking server.

- The registry lease (pipeline/deploy/lease.py): real processes taking it on a real `mlflow server` never overlap;
  a holder killed with SIGKILL blocks no one; a holder of another host blocks until its lease expires; a holder
  that ran past its lease writes nothing more.
- Two real `agentrl deploy` processes, from two project copies, judge their policies against the same champion and
  then publish at the same moment: the champion moves by compare-and-set, the loser says so in one line, judges again
  against the winner and is promoted after it; every version in the history was judged against the one before it,
  and `agentrl registry check` finds nothing. A deploy whose champion moves again while it judges again stops with
  one error line and leaves its version superseded. A hand promote outrun once judges again and is promoted.
- `agentrl registry check` lists, and with --repair fixes, each kind of damage a stopped command or a writer that
  skips the lease leaves (tests/test_registry_check.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deploy_support import ENV, ROLL, build_project, deploy_config, mlflow_server, nudged_policy, tracking_uri, \
    write_params

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(precisions=["fp32"], serve_precision="fp32", max_test_tasks=4, latency_tasks=0,
             gate={"min_paired_tasks": 4})  # what a deploy measures is not the point here

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("shared_server")) as uri, tracking_uri(uri):
        yield uri


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return build_project(tmp_path_factory.mktemp("shared_project"))


def child_env(uri: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    env.pop("AGENTRL_LOCK", None)
    return env


# ----------------------------------------------------------------------------------------------------------- lease
# Takes the lease `rounds` times; inside it appends "in <pid>" and "out <pid>" to a log with a pause between.
LEASE_TAKER = """
import os, sys, time
from pipeline.core.tracking import mlflow_client
from pipeline.deploy.lease import RegistryLease

uri, name, log, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = mlflow_client(uri, registry_uri=uri)
for _ in range(rounds):
    with RegistryLease(client, name, "test"):
        with open(log, "a") as f:
            f.write(f"in {os.getpid()}\\n")
        time.sleep(0.3)
        with open(log, "a") as f:
            f.write(f"out {os.getpid()}\\n")
"""


def test_the_lease_serialises_takers_in_separate_processes(server, tmp_path):
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", LEASE_TAKER, server, "leased-model", str(log), "3"],
                              env=child_env(server), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    lines = log.read_text().split()
    events = list(zip(lines[0::2], lines[1::2]))
    assert len(events) == 18
    for (kind_in, pid_in), (kind_out, pid_out) in zip(events[0::2], events[1::2]):
        assert (kind_in, kind_out) == ("in", "out") and pid_in == pid_out, events  # no two holders at once
    assert len({pid for _, pid in events}) == 3


def test_a_killed_holder_blocks_no_one_a_remote_one_until_it_expires_and_a_late_holder_writes_nothing(server):
    import time

    from pipeline.core.tracking import mlflow_client
    from pipeline.deploy.lease import TICKET_SOURCE, LeaseBusy, LeaseLost, RegistryLease, lease_name

    client = mlflow_client(server, registry_uri=server)
    name = "lease-faults"
    # a holder SIGKILLed inside the lease: its ticket stays, its process is gone, the next taker goes ahead
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, signal, sys
        from pipeline.core.tracking import mlflow_client
        from pipeline.deploy.lease import RegistryLease
        lease = RegistryLease(mlflow_client(sys.argv[1], registry_uri=sys.argv[1]), sys.argv[2], "killed")
        lease.acquire()
        print("held", lease.ticket, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """), server, name], env=child_env(server), stdout=subprocess.PIPE, text=True)
    out, _ = holder.communicate(timeout=120)
    assert holder.returncode == -signal.SIGKILL and out.startswith("held")
    left = [str(mv.version) for mv in client.search_model_versions(f"name='{lease_name(name)}'")]
    assert left == [out.split()[1]]  # the dead holder's ticket is still there
    with RegistryLease(client, name, "after the kill", wait_s=5) as lease:
        assert lease.blocker() is None

    # a live holder on another host: refused while its lease runs, taken once it has expired
    other = client.create_model_version(lease_name(name), TICKET_SOURCE, await_creation_for=0, tags={
        "command": "deploy", "pid": "1", "host": "another-host", "started": "now"})
    with pytest.raises(LeaseBusy, match=f"held by ticket {other.version} of `agentrl deploy` .* on another-host"):
        RegistryLease(client, name, "impatient", ttl_s=60, wait_s=1).acquire()
    with RegistryLease(client, name, "patient", ttl_s=1, wait_s=30) as lease:
        assert lease.ticket > int(other.version)
    client.delete_model_version(lease_name(name), other.version)

    # a holder that ran past three quarters of its lease refuses to write
    lease = RegistryLease(client, name, "slow", ttl_s=4)
    with lease:
        lease.check()
        time.sleep(3.1)  # past 3 of its 4 s
        with pytest.raises(LeaseLost, match="ran out"):
            lease.check()
    assert [str(mv.version) for mv in client.search_model_versions(f"name='{lease_name(name)}'")] == left


# --------------------------------------------------------------------------------------------- racing deploys
# `agentrl deploy` that, once it has judged its policy and before it creates its version, waits until `n` processes
# have reached the same point (files in a barrier folder): the deploys then publish at the same moment.
RACING_DEPLOY = """
import os, sys, time
from pathlib import Path
import pipeline.deploy.registry as registry

barrier, n = Path(sys.argv[1]), int(sys.argv[2])
real = registry.ModelRegistry.create_version

def create_version(self, *args, **kwargs):
    (barrier / str(os.getpid())).touch()
    while len(list(barrier.iterdir())) < n:
        time.sleep(0.05)
    return real(self, *args, **kwargs)

registry.ModelRegistry.create_version = create_version
from flows.cli import main
sys.exit(main(["deploy", "--params", sys.argv[3]]))
"""


def copy_project(project: Path, dest: Path, name: str, delta: float) -> Path:
    """Another repository: the project's data and metrics, its own policy (other weights, the same episodes)."""
    shutil.copytree(project, dest, ignore=shutil.ignore_patterns("models", ".agentrl", "mlflow.db"))
    policy = nudged_policy(project, dest / "models" / "policy", delta)
    write_params(dest, deploy_config(dest, name, policy=policy, **SMALL))
    return dest / "params.yaml"


@pytest.mark.slow
def test_two_deploys_racing_from_two_repositories_promote_one_after_the_other(server, project, tmp_path):
    from pipeline.deploy.main import deploy
    from pipeline.deploy.registry import ModelRegistry
    from pipeline.deploy.registry_check import check

    name = "policy-shared"
    metrics = project / "metrics"
    assert deploy(deploy_config(project, name, **SMALL), ENV, ROLL, metrics, tmp_path / "d.json")["decision"].passed
    params = [copy_project(project, tmp_path / f"repo{i}", name, (i + 1) * 1e-6) for i in range(2)]
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACING_DEPLOY, str(barrier), "2", str(p)], cwd=p.parent,
                              env=child_env(server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in params]
    results = [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]
    assert [rc for rc, _, _ in results] == [0, 0], results

    registry = ModelRegistry(name)
    champion, history = registry.alias_version("champion"), registry.history()
    assert history[0] == "1" and sorted(history[1:]) == ["2", "3"] and champion == history[-1]
    winner, loser = history[1], history[2]
    for before, version in zip(history, history[1:]):  # each champion was judged against the one before it
        tags = registry.tags(version)
        assert tags["gate.champion_at_decision"] == before and tags["gate.decision"] == "promoted", (version, tags)
    again = [line for _, out, _ in results for line in out.splitlines() if "judging" in line]
    assert again == [f"deploy: {name}: the champion moved from v1 to v{winner} (another pipeline) while v{loser} was "
                     f"judged: judging v{loser} again against v{winner}"], results
    assert check(registry, min_age_s=0, say=lambda line: None) == []  # no orphan, nothing half-moved


class Interleaved:
    """A second pipeline, in another repository, that deploys its own policy (a real deploy against the same server)
    just before the first one's alias moves, each time one is about to happen."""

    def __init__(self, project: Path, tmp: Path, name: str):
        self.project, self.tmp, self.name, self.done = project, tmp, name, []

    def deploy(self) -> None:
        from pipeline.deploy.main import deploy

        i = len(self.done) + 1
        out = deploy(deploy_config(self.project, self.name, policy=nudged_policy(self.project, self.tmp / f"o{i}",
                                                                                  (10 + i) * 1e-6), **SMALL),
                     ENV, ROLL, self.project / "metrics", self.tmp / f"other{i}.json")
        assert out["decision"].passed
        self.done.append(out["version"])


def test_a_deploy_whose_champion_moves_again_while_it_judges_again_stops_with_one_line(server, project, tmp_path):
    from pipeline.deploy.main import deploy
    from pipeline.deploy.registry import ModelRegistry
    from pipeline.core.errors import AgentRLError
    from pipeline.deploy.registry_check import check

    name = "policy-outrun"
    metrics = project / "metrics"
    assert deploy(deploy_config(project, name, **SMALL), ENV, ROLL, metrics, tmp_path / "d.json")["decision"].passed
    other = Interleaved(project, tmp_path, name)

    class Outrun(ModelRegistry):  # the real registry; the other pipeline promotes before each of our alias moves
        def publish(self, *args, **kwargs):
            other.deploy()
            return super().publish(*args, **kwargs)

        def promote_version(self, *args, **kwargs):
            other.deploy()
            return super().promote_version(*args, **kwargs)

    with pytest.raises(AgentRLError) as err:
        deploy(deploy_config(project, name, policy=nudged_policy(project, tmp_path / "mine", 5e-6), **SMALL), ENV,
               ROLL, metrics, tmp_path / "mine.json", registry=Outrun(name))
    registry = ModelRegistry(name)
    mine = str(max(int(mv.version) for mv in registry.client.search_model_versions(f"name='{name}'")
                   if mv.version not in other.done and mv.version != "1"))
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"the champion of {name!r} moved from v{other.done[0]} to v{other.done[1]} while v{mine} was judged against "
        f"v{other.done[0]}"), message
    assert message.endswith(f"`agentrl promote --version {mine}`")
    assert registry.alias_version("champion") == other.done[1] and registry.history() == ["1", *other.done]
    tags = registry.tags(mine)
    assert tags["gate.decision"] == "superseded" and tags["gate.superseded_by"] == other.done[1]
    assert tags["gate.champion_at_decision"] == other.done[0]  # the second judgement, against the first competitor
    assert not (tmp_path / "mine.json").exists()
    assert check(registry, min_age_s=0, say=lambda line: None) == []


def test_a_hand_promote_outrun_once_judges_again_and_is_promoted(server, project, tmp_path):
    from pipeline.deploy.main import deploy
    from pipeline.deploy.registry import ModelRegistry, promote
    from pipeline.deploy.registry_check import check

    name = "policy-hand"
    metrics = project / "metrics"
    assert deploy(deploy_config(project, name, **SMALL), ENV, ROLL, metrics, tmp_path / "d.json")["decision"].passed
    mine = deploy(deploy_config(project, name, policy=nudged_policy(project, tmp_path / "mine", 7e-6), **SMALL,
                                promote=False), ENV, ROLL, metrics, tmp_path / "mine.json")["version"]
    other = Interleaved(project, tmp_path, name)

    class OutrunOnce(ModelRegistry):  # the other pipeline promotes just before our first champion move only
        def promote_version(self, *args, **kwargs):
            if not other.done:
                other.deploy()
            return super().promote_version(*args, **kwargs)

    lines: list[str] = []
    decision = promote(OutrunOnce(name), deploy_config(project, name, **SMALL).gate, version=mine,
                       notify=lines.append)
    assert lines == [f"{name}: the champion moved from v1 to v{other.done[0]} (another pipeline) while v{mine} was "
                     f"judged: judging v{mine} again against v{other.done[0]}"]
    registry = ModelRegistry(name)
    assert decision.passed and decision.champion == other.done[0]
    assert registry.alias_version("champion") == mine and registry.history() == ["1", other.done[0], mine]
    assert registry.tags(mine)["gate.champion_at_decision"] == other.done[0]
    assert registry.tags(mine)["gate.decision"] == "promoted"
    assert check(registry, min_age_s=0, say=lambda line: None) == []
