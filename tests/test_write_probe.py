"""An environment written from the docs, whose write tool is declared as the docs show a tool (no ``writes=True``):
`build_env` finds the tool by what it does (pipeline.envs.write_check), the write probe calls it, and a read-only
environment's build says loudly that the write probe did not run."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.build_env.config import BuildEnvConfig
from pipeline.build_env.main import build
from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import ANSWER_SPEC, BuildResult, Environment, Episode, Task, ToolSpec
from pipeline.envs.write_check import undeclared_writes

ACCOUNT = {"type": "object", "properties": {"account": {"type": "string"}}, "required": ["account"],
           "additionalProperties": False}
BALANCE = ToolSpec("balance", "the balance of an account", ACCOUNT)
DEPOSIT = ToolSpec("deposit", "add an amount to an account",  # a write tool, not declared as one
                   {"type": "object", "properties": {"account": {"type": "string"}, "amount": {"type": "integer"}},
                    "required": ["account", "amount"], "additionalProperties": False})


class LedgerEpisode(Episode):
    def __init__(self, balances, truth):
        self.balances, self.truth = dict(balances), truth

    def call(self, tool, args):
        if tool == "deposit":
            self.balances[args["account"]] = self.balances.get(args["account"], 0) + args["amount"] + 1
            return "ok"
        return str(self.balances.get(args["account"], 0))


class Ledger(Environment):
    name = "ledger"
    levels = (1,)
    read_only = False

    def __init__(self, balances):
        self.balances = balances

    @classmethod
    def build(cls, out_dir, request):
        balances = {f"acct-{i}": 10 * i + 3 for i in range(40)}
        (Path(out_dir) / "ledger.json").write_text(json.dumps(balances))
        tasks, k = {}, 0
        for split, n in request.tasks_per_split.items():
            tasks[split] = []
            for _ in range(n):
                acct = f"acct-{k % 40}"
                tasks[split].append(Task(f"{split}-{k}", split, 1, f"What is the balance of '{acct}'?",
                                         str(balances[acct]), family="balance", data={"account": acct}))
                k += 1
        return BuildResult(tasks, counts={"accounts": 40})

    @classmethod
    def load(cls, world_dir):
        return cls(json.loads((Path(world_dir) / "ledger.json").read_text()))

    def tools(self):
        return [BALANCE, ANSWER_SPEC] if self.read_only else [BALANCE, DEPOSIT, ANSWER_SPEC]

    def task_from_dict(self, row):
        return Task.from_dict(row)

    def open_episode(self, task, rng, randomize_values=False):
        return LedgerEpisode(self.balances, task.answer)

    def expert(self, flaw="none", rng=None):
        return LedgerExpert()


class ReadOnlyLedger(Ledger):
    name = "ledger_ro"
    read_only = True


class LedgerExpert:
    def reset(self, task):
        self.task, self.asked = task, False

    def act(self, obs, info):
        if not self.asked:
            self.asked = True
            return '<call>balance ' + json.dumps({"account": self.task.data["account"]}) + '</call>'
        return '<call>answer ' + json.dumps({"value": info["tool_result"]}) + '</call>'


CFG = BuildEnvConfig(tasks_per_split={"train": 30, "validation": 4, "test": 4}, level_mix={1: 1.0},
                     demos={"level_coverage": {1: 0.5}}, probes={"tasks": 12})


def test_the_undeclared_write_tool_is_found_by_what_it_does(tmp_path):
    world_dir = tmp_path / "w"
    world_dir.mkdir()
    from pipeline.envs.contract import BuildRequest

    built = Ledger.build(world_dir, BuildRequest(0, {"train": 6, "validation": 1, "test": 1}, {1: 1.0},
                                                 Ledger.Options()))
    assert undeclared_writes(Ledger.load(world_dir), built.tasks["train"]) == ["deposit"]
    assert undeclared_writes(ReadOnlyLedger.load(world_dir), built.tasks["train"]) == []


def test_build_env_runs_the_write_probe_with_the_undeclared_tool_and_says_so(tmp_path, capsys):
    metrics = build(CFG, EnvConfig(name=f"{__name__}:Ledger"), tmp_path / "data", tmp_path / "m.json")
    wp = metrics["reward_hacking_probes"]["write_probe"]
    assert wp == {"ran": True, "declared": [], "undeclared": ["deposit"]}
    writes = metrics["reward_hacking_probes"]["probes"]["attempt_writes"]
    assert writes["n"] == 12 and "skipped" not in writes
    assert "tools ['deposit'] change an episode's state but their ToolSpec does not say writes=True" in \
        capsys.readouterr().out


def test_a_read_only_environment_says_loudly_that_the_write_probe_did_not_run(tmp_path, capsys):
    metrics = build(CFG, EnvConfig(name=f"{__name__}:ReadOnlyLedger"), tmp_path / "data", tmp_path / "m.json")
    assert metrics["reward_hacking_probes"]["write_probe"] == {"ran": False, "declared": [], "undeclared": []}
    assert "reward-hacking probe 'attempt_writes' did not run" in capsys.readouterr().out
