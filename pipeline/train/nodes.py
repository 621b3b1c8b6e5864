"""Training across several machines: which nodes take part and how `agentrl train` starts its ranks on them.

Read from the environment, not from params.yaml: the machines a run uses do not change what it learns (the
checkpoint key and the results depend on the total number of ranks, ``train.num_ranks``, alone), and params.yaml is a
DVC dependency of the train stage.

- ``AGENTRL_HOSTFILE``: a DeepSpeed hostfile, one ``HOST slots=N`` line per node. Set, ``train.num_ranks`` is the
  number of ranks over all nodes and must equal the sum of the slots.
- ``AGENTRL_NODE_RANK``: this machine's line in the hostfile, counted from 0. Set, `agentrl train` starts only this
  node's ranks (DeepSpeed's ``--no_ssh --node_rank K``) and every node runs `agentrl train` itself, each with its own
  K. Unset, the launcher on the first node starts every node over passwordless ssh (DeepSpeed's default).
- ``AGENTRL_MASTER_ADDR``: the address of the first node, which every rank can reach (needed with
  ``AGENTRL_NODE_RANK``; over ssh DeepSpeed asks the first node for it).
- ``AGENTRL_MASTER_PORT``: the port rank 0 listens on, the same on every node (default 29500, DeepSpeed's).

Without ``AGENTRL_HOSTFILE`` everything runs on this machine and the port is chosen free (:mod:`pipeline.train.main`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.errors import AgentRLError

DEFAULT_MASTER_PORT = 29500
_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


@dataclass(frozen=True)
class Nodes:
    hostfile: Path
    slots: dict[str, int]
    node_rank: int | None
    master_addr: str | None
    master_port: int

    @property
    def world_size(self) -> int:
        return sum(self.slots.values())

    def launcher_args(self) -> list[str]:
        """The DeepSpeed launcher's options for these nodes (in place of the single machine's ``--num_gpus N``)."""
        args = ["--hostfile", str(self.hostfile), "--num_nodes", str(len(self.slots)),
                "--master_port", str(self.master_port)]
        if self.master_addr:
            args += ["--master_addr", self.master_addr]
        if self.node_rank is not None:
            args += ["--no_ssh", "--node_rank", str(self.node_rank)]
        return args


def parse_hostfile(path: Path) -> dict[str, int]:
    """``{host: slots}`` in file order; comments (#) and blank lines skipped; anything else is an AgentRLError."""
    if not path.is_file():
        raise AgentRLError(f"AGENTRL_HOSTFILE: {path} not found")
    slots: dict[str, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m or int(m.group(2)) < 1:
            raise AgentRLError(f"{path}:{n}: expected 'HOST slots=N' with N >= 1, got {line!r}")
        if m.group(1) in slots:
            raise AgentRLError(f"{path}:{n}: host {m.group(1)!r} is listed twice")
        slots[m.group(1)] = int(m.group(2))
    if not slots:
        raise AgentRLError(f"{path}: no 'HOST slots=N' line (AGENTRL_HOSTFILE)")
    return slots


def _int(name: str, value: str, low: int, high: int) -> int:
    try:
        out = int(value)
    except ValueError:
        out = None
    if out is None or not low <= out <= high:
        raise AgentRLError(f"{name}={value!r}: expected a whole number from {low} to {high}")
    return out


def nodes_from_env(num_ranks: int, env: dict | None = None) -> Nodes | None:
    """The nodes of this run from the environment (see the module docstring), None without AGENTRL_HOSTFILE. A
    setting that cannot work is an AgentRLError naming the variable or the file, before any rank starts."""
    env = os.environ if env is None else env
    if not env.get("AGENTRL_HOSTFILE"):
        return None
    path = Path(env["AGENTRL_HOSTFILE"])
    slots = parse_hostfile(path)
    if sum(slots.values()) != num_ranks:
        raise AgentRLError(f"{path} lists {sum(slots.values())} slots on {len(slots)} nodes but train.num_ranks is "
                           f"{num_ranks}: with a hostfile, num_ranks counts the ranks of all nodes")
    rank = env.get("AGENTRL_NODE_RANK")
    node_rank = _int("AGENTRL_NODE_RANK", rank, 0, len(slots) - 1) if rank not in (None, "") else None
    addr = env.get("AGENTRL_MASTER_ADDR") or None
    if node_rank is not None and addr is None:
        raise AgentRLError("AGENTRL_NODE_RANK is set but AGENTRL_MASTER_ADDR is not: every node must be told the "
                           "first node's address")
    port = env.get("AGENTRL_MASTER_PORT")
    master_port = _int("AGENTRL_MASTER_PORT", port, 1, 65535) if port else DEFAULT_MASTER_PORT
    return Nodes(hostfile=path, slots=slots, node_rank=node_rank, master_addr=addr, master_port=master_port)
