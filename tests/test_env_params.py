"""A new environment under the default params.yaml: the shop's levels are left out with a note, options written for
another environment are named with it, and an expert sees a task's `data` in the same key order in the
demonstrations as in every phase that reads the task file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.build_env.config import BuildEnvConfig
from pipeline.build_env.main import build, resolve_request
from pipeline.core.errors import AgentRLError
from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import ANSWER_SPEC, BuildOptions, BuildResult, Environment, Episode, Task, ToolSpec
from pipeline.envs.taskfile import as_read_back, load_task_file

LOOKUP = ToolSpec("lookup", "a value by two keys", {"type": "object", "properties": {
    "zone": {"type": "string"}, "area": {"type": "string"}}, "required": ["zone", "area"]})


class ThreeOptions(BuildOptions):
    n_rooms: int = 5


class ThreeEpisode(Episode):
    def __init__(self, task):
        self.truth = task.answer

    def call(self, tool, args):
        return f"{args['zone']}/{args['area']}"


class Three(Environment):
    """Three levels, its own options, and a task `data` whose keys are not sorted (zone before area)."""

    name = "three"
    levels = (1, 2, 3)
    Options = ThreeOptions

    @classmethod
    def build(cls, out_dir, request):
        (Path(out_dir) / "three.json").write_text("{}")
        tasks = {}
        for split, n in request.tasks_per_split.items():
            tasks[split] = [Task(f"{split}-{i}", split, 1 + i % 3, f"Where is z{i} a{i}?", f"z{i}/a{i}",
                                 family="where", data={"zone": f"z{i}", "area": f"a{i}"}) for i in range(n)]
        return BuildResult(tasks)

    @classmethod
    def load(cls, world_dir):
        return cls()

    def tools(self):
        return [LOOKUP, ANSWER_SPEC]

    def task_from_dict(self, row):
        return Task.from_dict(row)

    def open_episode(self, task, rng, randomize_values=False):
        return ThreeEpisode(task)

    def expert(self, flaw="none", rng=None):
        return DataOrderExpert()


class DataOrderExpert:
    """Writes its call's parameters in the order of the task's `data` (what a plain expert from the docs does)."""

    def reset(self, task):
        self.task, self.done = task, False

    def act(self, obs, info):
        if not self.done:
            self.done = True
            return "<call>lookup " + json.dumps(dict(self.task.data)) + "</call>"
        return "<call>answer " + json.dumps({"value": info["tool_result"]}) + "</call>"


ENV = EnvConfig(name=f"{__name__}:Three")


def test_the_default_level_mix_keeps_the_environments_levels_with_one_note(capsys):
    cls, request = resolve_request(BuildEnvConfig(options={"n_rooms": 3}), ENV)
    assert request.level_mix == {1: 0.25, 2: 0.25, 3: 0.25} and request.options.n_rooms == 3
    out = capsys.readouterr().out
    assert out.count("build_env.level_mix names levels [4] that environment 'three' does not have") == 1
    assert "build_env.demos.level_coverage names levels [4]" in out


def test_the_shops_options_on_another_environment_name_their_owner():
    with pytest.raises(AgentRLError) as err:
        resolve_request(BuildEnvConfig(options={"n_products": 60, "n_rooms": 3}), ENV)
    msg = str(err.value)
    assert msg.startswith("build_env.options for environment 'three': n_products: unknown key")
    assert "valid keys: n_rooms; n_products: options of environment 'shop'" in msg
    with pytest.raises(ValidationError, match=r"n_products: moved under build_env.options .*options of environment "
                                              r"'shop'"):
        BuildEnvConfig(n_products=60)


def test_the_expert_sees_the_task_files_key_order_in_demonstrations_too(tmp_path):
    cfg = BuildEnvConfig(tasks_per_split={"train": 12, "validation": 3, "test": 3}, demos={"level_coverage": {
        1: 1.0, 2: 1.0, 3: 1.0}}, probes={"enabled": False})
    build(cfg, ENV, tmp_path / "data", tmp_path / "m.json")
    world = Three()
    tasks = {t.task_id: t for t in load_task_file(tmp_path / "data" / "tasks" / "train.jsonl", world)}
    demos = [json.loads(line) for line in (tmp_path / "data" / "demos" / "train.jsonl").read_text().splitlines()]
    assert len(demos) == 12
    for d in demos:
        expert = DataOrderExpert()
        expert.reset(tasks[d["task_id"]])  # the task as RL guidance and evaluation read it
        assert d["steps"][0]["action"] == expert.act({}, {})
    assert list(as_read_back([Task("t", "train", 1, "q", "a", data={"zone": 1, "area": 2})], world)[0].data) == \
        ["area", "zone"]


def test_adapt_reports_and_gates_the_environments_levels_only(capsys):
    from pipeline.adapt import capability

    gate = capability.gate_for_levels({"eval/greedy/success_L1": 0.1, "eval/greedy/success_L4": 0.2,
                                       "eval/greedy/param_acc": 0.4}, Three.levels)
    assert gate == {"eval/greedy/success_L1": 0.1, "eval/greedy/param_acc": 0.4}
    assert "adapt.gate.min keys ['eval/greedy/success_L4'] name levels the environment does not have" in \
        capsys.readouterr().out
    capability.check_gate_keys(gate, Three.levels)
    assert list(capability.per_level_table({"eval/greedy/success_L1": 0.5}, Three.levels)) == ["1", "2", "3"]
