"""DeepSpeed across nodes: the hostfile settings of `agentrl train` (pipeline/train/nodes.py), bad ones refused with
one error line, and a real two-node launch over loopback: one launcher per "node" (`--no_ssh --node_rank K`), each in
its own checkout, with `models/` and `checkpoints/` on storage both see (symlinks here, a shared file system across
machines), whose checkpoint a single node with two ranks resumes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import AgentRLError
from pipeline.train.nodes import DEFAULT_MASTER_PORT, nodes_from_env
from test_train import make_project

BIN = Path(sys.executable).parent


def test_hostfile_settings_give_the_launcher_its_nodes_and_bad_ones_are_refused(tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text("# two machines\nnode-a slots=2\n\nnode-b slots=2\n")
    assert nodes_from_env(4, {}) is None  # no hostfile: this machine only
    over_ssh = nodes_from_env(4, {"AGENTRL_HOSTFILE": str(hosts)})
    assert over_ssh.slots == {"node-a": 2, "node-b": 2} and over_ssh.world_size == 4
    assert over_ssh.launcher_args() == ["--hostfile", str(hosts), "--num_nodes", "2",
                                        "--master_port", str(DEFAULT_MASTER_PORT)]
    by_hand = nodes_from_env(4, {"AGENTRL_HOSTFILE": str(hosts), "AGENTRL_NODE_RANK": "1",
                                 "AGENTRL_MASTER_ADDR": "10.0.0.1", "AGENTRL_MASTER_PORT": "29612"})
    assert by_hand.launcher_args() == ["--hostfile", str(hosts), "--num_nodes", "2", "--master_port", "29612",
                                       "--master_addr", "10.0.0.1", "--no_ssh", "--node_rank", "1"]
    bad_line = tmp_path / "bad"
    bad_line.write_text("node-a slots=2\nnode-b 2\n")
    twice = tmp_path / "twice"
    twice.write_text("node-a slots=1\nnode-a slots=1\n")
    base = {"AGENTRL_HOSTFILE": str(hosts)}
    for env, message in [
        ({**base}, "lists 4 slots on 2 nodes but train.num_ranks is 2"),
        ({"AGENTRL_HOSTFILE": str(tmp_path / "missing")}, "missing not found"),
        ({"AGENTRL_HOSTFILE": str(bad_line)}, "bad:2: expected 'HOST slots=N'"),
        ({"AGENTRL_HOSTFILE": str(twice)}, "twice:2: host 'node-a' is listed twice"),
        ({**base, "AGENTRL_NODE_RANK": "2", "AGENTRL_MASTER_ADDR": "h"}, "AGENTRL_NODE_RANK='2': expected a whole"),
        ({**base, "AGENTRL_NODE_RANK": "one", "AGENTRL_MASTER_ADDR": "h"}, "AGENTRL_NODE_RANK='one'"),
        ({**base, "AGENTRL_NODE_RANK": "0"}, "AGENTRL_MASTER_ADDR is not"),
        ({**base, "AGENTRL_MASTER_PORT": "0"}, "AGENTRL_MASTER_PORT='0'"),
    ]:
        with pytest.raises(AgentRLError, match=message.replace("(", r"\(")):
            nodes_from_env(2 if "num_ranks is 2" in message else 4, env)


@pytest.mark.slow  # about 25 s on a loaded machine: a tiny project and an `agentrl` process
def test_agentrl_train_refuses_a_hostfile_that_does_not_fit_and_writes_nothing(tmp_path):
    project = make_project(tmp_path / "p", ranks=2, updates=2)
    (tmp_path / "hostfile").write_text("node-a slots=1\nnode-b slots=2\n")
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    env = {**child_env(), "AGENTRL_HOSTFILE": str(tmp_path / "hostfile"), "AGENTRL_NODE_RANK": "0",
           "AGENTRL_MASTER_ADDR": "127.0.0.1"}
    out = subprocess.run([str(BIN / "agentrl"), "train"], cwd=project, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [f"error: {tmp_path / 'hostfile'} lists 3 slots on 2 nodes but "
                                               f"train.num_ranks is 2: with a hostfile, num_ranks counts the ranks of "
                                               f"all nodes"]
    assert sorted(p.relative_to(project) for p in project.rglob("*") if ".agentrl" not in p.parts) == \
        [p for p in before if ".agentrl" not in p.parts]


def child_env(extra: dict | None = None) -> dict:
    from pipeline.train.distributed import child_env as env

    return env({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra or {})})


@pytest.mark.slow
def test_two_nodes_on_loopback_write_a_checkpoint_that_one_node_with_two_ranks_resumes(tmp_path):
    from pipeline.train.distributed import free_port
    from pipeline.train.main import launcher_command

    node0 = make_project(tmp_path / "node0", ranks=2, updates=4)
    node1 = tmp_path / "node1"  # the second machine's checkout: code and params of its own, shared outputs
    shutil.copytree(node0, node1, ignore=shutil.ignore_patterns("models"))
    (node0 / "checkpoints").mkdir()
    for shared in ("models", "checkpoints"):
        (node1 / shared).symlink_to(node0 / shared)
    hosts = tmp_path / "hostfile"
    hosts.write_text("node-0 slots=1\nnode-1 slots=1\n")
    port = free_port()
    procs = []
    for k, root in enumerate((node0, node1)):
        env = child_env({"AGENTRL_HOSTFILE": str(hosts), "AGENTRL_NODE_RANK": str(k),
                         "AGENTRL_MASTER_ADDR": "127.0.0.1", "AGENTRL_MASTER_PORT": str(port)})
        cmd = launcher_command("params.yaml", 2, 0, ["--stop-after", "2"], nodes_from_env(2, env))
        assert cmd[1:cmd.index("--module")] == ["--hostfile", str(hosts), "--num_nodes", "2", "--master_port",
                                                str(port), "--master_addr", "127.0.0.1", "--no_ssh", "--node_rank",
                                                str(k)]
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:  # a launcher and its ranks, should one node hang waiting for the other
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "dist_world_size=2" in logs[1] and "update 2/4" in logs[0]  # one rank on each node, rank 0 on node 0
    (ckpt,) = (node0 / "checkpoints" / "train").iterdir()
    assert (ckpt / "latest").read_text().strip() == "update-2"
    shards = sorted(p.name for p in (ckpt / "update-2").glob("*optim_states.pt"))
    assert len(shards) == 2 and "rank_0" in shards[0] and "rank_1" in shards[1]  # ZeRO shards of both nodes' ranks

    # one machine, two ranks (train.num_ranks: 2 without a hostfile): the same checkpoint key, resumed at update 2
    out = subprocess.run([str(BIN / "agentrl"), "train"], cwd=node0, env=child_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "at update 2" in out.stdout and "update 3/4" in out.stdout and "update 1/4" not in out.stdout
    metrics = json.loads((node0 / "metrics" / "train.json").read_text())
    assert metrics["world_size"] == 2 and metrics["updates"] == 4
    assert (ckpt / "latest").read_text().strip() == "update-4"
    assert (node0 / "metrics" / "train_curve.csv").read_text().count("\n") == 5  # header + updates 1-4
