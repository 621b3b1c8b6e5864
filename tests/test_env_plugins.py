"""Environments from outside the repository, and the checks the pipeline runs on any environment before it trusts it
(pipeline/envs/checks.py).

The environment here is a throwaway package written into a temporary folder (the `Arith` example of
docs/environments.md, with build options and `request_task` for serving), with a ``<name>-0.1.dist-info`` folder whose
``entry_points.txt`` registers it in the group ``agentrl.environments``: on the Python path it is an installed
package as far as ``importlib.metadata`` can tell. Its broken variants live in a second module next to it and are
named by ``module:Class``. Nothing here is a stub: the builds, checks, episodes and the command line are the real ones.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from pipeline.build_env.config import BuildEnvConfig
from pipeline.build_env.main import build
from pipeline.core.errors import AgentRLError
from pipeline.envs.checks import check_environment, sample, tool_problems
from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import ANSWER_SPEC, ToolSpec
from pipeline.envs.registry import EnvironmentError_

PACKAGE = '''\
"""A complete environment from outside the repository: add two numbers with a tool."""
import json
import re
from pathlib import Path

from pipeline.envs.contract import (ANSWER_SPEC, BuildOptions, BuildResult, Environment, Episode, SafetyViolation,
                                    Task, ToolSpec)

ADD = ToolSpec("add", "add two integers", {"type": "object", "properties": {"a": {"type": "integer"},
               "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": False})


def make_task(task_id, split, a, b):
    return Task(task_id, split, 1, f"What is {a} plus {b}?", str(a + b), family="add", min_calls=2,
                data={"a": a, "b": b})


class ArithOptions(BuildOptions):
    offset: int = 7


class ArithEpisode(Episode):
    def __init__(self, task):
        self.truth = task.answer

    def call(self, tool, args):
        if abs(args["a"]) > 10**6 or abs(args["b"]) > 10**6:
            raise SafetyViolation("numbers above a million are not allowed")
        return str(args["a"] + args["b"])


class Arith(Environment):
    name = "arith"
    description = "add two numbers with the add tool"
    levels = (1,)
    Options = ArithOptions

    @classmethod
    def build(cls, out_dir, request):
        b = request.seed + request.options.offset
        tasks = {s: [make_task(f"{s}-{i}", s, i, b) for i in range(n)] for s, n in request.tasks_per_split.items()}
        (Path(out_dir) / "world.json").write_text(json.dumps({"seed": request.seed}))
        return BuildResult(tasks, counts={"worlds": 1}, files=[Path(out_dir) / "world.json"])

    @classmethod
    def load(cls, world_dir):
        json.loads((Path(world_dir) / "world.json").read_text())
        return cls()

    def tools(self):
        return [ADD, ANSWER_SPEC]

    def task_from_dict(self, row):
        return Task.from_dict(row)

    def open_episode(self, task, rng, randomize_values=False):
        return ArithEpisode(task)

    def expert(self, flaw="none", rng=None):
        return ArithExpert()

    def request_task(self, request):
        m = re.fullmatch(r"What is (-?\\d+) plus (-?\\d+)\\?", str(request.get("question", "")).strip())
        if m is None:
            raise ValueError("arith serves questions of the form 'What is A plus B?'")
        return make_task(str(request.get("task_id", "request")), "test", int(m[1]), int(m[2]))


class ArithExpert:
    def reset(self, task):
        self.task, self.added = task, False

    def act(self, obs, info):
        if not self.added:
            self.added = True
            return "<call>add " + json.dumps({"a": self.task.data["a"], "b": self.task.data["b"]}) + "</call>"
        return "<call>answer " + json.dumps({"value": info["tool_result"]}) + "</call>"
'''

# Each class breaks one rule of the contract (the test that uses it says which).
VARIANTS = '''\
import dataclasses
import json

from agentrl_arith import ADD, Arith, ArithEpisode, ArithExpert
from pipeline.envs.contract import ANSWER_SPEC, Environment, ToolSpec


class NoEpisode(Environment):
    name = "no_episode"
    levels = (1,)
    build, load, tools, task_from_dict = Arith.build, Arith.load, Arith.tools, Arith.task_from_dict


class BadSchema(Arith):
    def tools(self):
        return [ToolSpec("add", "add", {"type": "object", "properties": {"a": {"type": "integr"}}}), ANSWER_SPEC]


class NotAnObject(Arith):
    def tools(self):
        return [ToolSpec("add", "add", {"type": "array", "items": {"type": "integer"}}), ANSWER_SPEC]


class NoAnswer(Arith):
    def tools(self):
        return [ADD]


class TwoAdds(Arith):
    def tools(self):
        return [ADD, ADD, ANSWER_SPEC]


class BadToolName(Arith):
    def tools(self):
        return [dataclasses.replace(ADD, name="add two"), ANSWER_SPEC]


class WastefulExpert(Arith):  # one redundant add: correct, but 3 calls for min_calls 2
    def expert(self, flaw="none", rng=None):
        return RedundantExpert()


class RedundantExpert(ArithExpert):
    def act(self, obs, info):
        if self.added and not getattr(self, "repeated", False):
            self.repeated = True
            return "<call>add " + json.dumps({"a": self.task.data["a"], "b": self.task.data["b"]}) + "</call>"
        return super().act(obs, info)


class WrongExpert(Arith):  # answers one more than the sum on the third test task
    def expert(self, flaw="none", rng=None):
        return OffByOne()


class OffByOne(ArithExpert):
    def act(self, obs, info):
        text = super().act(obs, info)
        if self.task.task_id == "test-2" and text.startswith("<call>answer"):
            return "<call>answer " + json.dumps({"value": str(int(info["tool_result"]) + 1)}) + "</call>"
        return text


class SharedIds(Arith):
    @classmethod
    def build(cls, out_dir, request):
        result = Arith.build(out_dir, request)
        result.tasks["test"][0] = dataclasses.replace(result.tasks["test"][0], task_id="train-1")
        return result


class MissingSplit(Arith):
    @classmethod
    def build(cls, out_dir, request):
        result = Arith.build(out_dir, request)
        del result.tasks["validation"]
        return result


class BadField(Arith):
    @classmethod
    def build(cls, out_dir, request):
        result = Arith.build(out_dir, request)
        result.tasks["validation"][1] = dataclasses.replace(result.tasks["validation"][1], min_calls="2")
        return result


class Raising(Arith):  # its tool raises an unexpected exception
    def open_episode(self, task, rng, randomize_values=False):
        return RaisingEpisode(task)


class RaisingEpisode(ArithEpisode):
    def call(self, tool, args):
        if args["a"] == 0:
            raise RuntimeError("the adder broke")
        return super().call(tool, args)


class NotText(Arith):  # its tool returns an int
    def open_episode(self, task, rng, randomize_values=False):
        return NotTextEpisode(task)


class NotTextEpisode(ArithEpisode):
    def call(self, tool, args):
        return args["a"] + args["b"]
'''

SPLITS3 = {"train": 6, "validation": 3, "test": 3}


def write_package(root: Path, entry_points: str = "arith = agentrl_arith:Arith") -> Path:
    """The package, its variants and a dist-info folder declaring `entry_points` in agentrl.environments."""
    (root / "agentrl_arith").mkdir(parents=True)
    (root / "agentrl_arith" / "__init__.py").write_text(PACKAGE)
    (root / "arith_variants.py").write_text(VARIANTS)
    info = root / "agentrl_arith-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: agentrl-arith\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[agentrl.environments]\n{entry_points}\n")
    return root


@pytest.fixture
def site(tmp_path, monkeypatch):
    """The package on this process's path (and forgotten afterwards)."""
    root = write_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    yield root
    for name in ("agentrl_arith", "arith_variants"):
        sys.modules.pop(name, None)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def build_arith(root: Path, name: str = "arith", options: dict | None = None, **env) -> dict:
    cfg = BuildEnvConfig(tasks_per_split=SPLITS3, level_mix={1: 1.0}, options=options or {},
                         demos={"level_coverage": {1: 1.0}})
    return build(cfg, EnvConfig(name=name, **env), root / "data", root / "metrics" / "build_env.json")


# ------------------------------------------------------------------------------------------------ found and checked
def test_the_entry_point_is_found_built_and_checked(site, tmp_path):
    from pipeline.envs.registry import environment_class, list_environments

    rows = {r["name"]: r for r in list_environments()}
    assert rows["arith"] == {"name": "arith", "source": "entry point", "target": "agentrl_arith:Arith", "ok": True,
                             "description": "add two numbers with the add tool"}
    assert environment_class("arith") is environment_class("agentrl_arith:Arith")
    metrics = build_arith(tmp_path, options={"offset": 3})
    assert metrics["environment"] == "arith" and metrics["baselines"]["test/expert"]["success_rate"] == 1.0
    first = json.loads((tmp_path / "data/tasks/test.jsonl").read_text().splitlines()[0])
    assert first["question"] == "What is 0 plus 3?" and first["answer"] == "3"
    assert metrics["counts"]["demos"] == SPLITS3["train"]


@pytest.fixture
def built(site, tmp_path):
    """A good build of arith in tmp_path; yields the bytes of data/ and metrics/ to compare with."""
    build_arith(tmp_path)
    return tmp_path, tree(tmp_path / "data"), tree(tmp_path / "metrics")


@pytest.mark.parametrize("name, message", [
    ("arith_variants:NoEpisode", "breaks the contract: methods not implemented: open_episode"),
    ("json:JSONDecoder", "'JSONDecoder' is not a subclass of pipeline.envs.contract.Environment"),
    ("no_such_env", "unknown environment 'no_such_env': not a built-in, not an installed entry point"),
    ("arith_variants:BadSchema", "environment 'arith': tools(): tool 'add': parameters are not a valid JSON Schema "
                                 "(Draft 2020-12) at properties/a/type: 'integr' is not valid"),
    ("arith_variants:NotAnObject", "tool 'add': parameters must be a JSON Schema of \"type\": \"object\", got type "
                                   "'array'"),
    ("arith_variants:NoAnswer", "no 'answer' tool among ['add']"),
    ("arith_variants:TwoAdds", "tool names ['add'] occur more than once"),
    ("arith_variants:BadToolName", "tool name 'add two' is not an identifier"),
    ("arith_variants:SharedIds", "task id 'train-1' occurs in train and test (task ids must be unique across splits)"),
    ("arith_variants:MissingSplit", "must build tasks for every split ['train', 'validation', 'test'], got "
                                    "{'train': 6, 'test': 3}"),
    ("arith_variants:BadField", "validation task #1 ('validation-1') attribute 'min_calls' must be int, got str"),
    ("arith_variants:WastefulExpert", "its expert does not reach the top return on train task 'train-0': correct "
                                      "answer '7' (truth '7'), 3 calls for min_calls 2, 0 failed, return 1.038 of "
                                      "1.100; steps: <call>add {\"a\": 0, \"b\": 7}</call> -> <obs>7</obs>; "
                                      "<call>add {\"a\": 0, \"b\": 7}</call> -> <obs>7</obs>; <call>answer"),
    ("arith_variants:WrongExpert", "its expert does not reach the top return on test task 'test-2': wrong answer "
                                   "'10' (truth '9'), 2 calls for min_calls 2"),
])
def test_a_broken_environment_is_refused_by_name_and_the_previous_data_stays(built, name, message):
    root, data, metrics = built
    with pytest.raises(EnvironmentError_) as err:
        build_arith(root, name)
    assert message in str(err.value), str(err.value)
    assert isinstance(err.value, AgentRLError) and "\n" not in str(err.value)
    assert tree(root / "data") == data and tree(root / "metrics") == metrics  # byte for byte
    assert not (root / "data" / ".staging-build_env").exists()


def test_build_options_with_an_unknown_key_are_refused_naming_it(built):
    root, data, _ = built
    with pytest.raises(AgentRLError, match=r"build_env.options for environment 'arith': ofset: unknown key \(did "
                                           r"you mean 'offset'\?\); valid keys: offset"):
        build_arith(root, options={"ofset": 3})
    assert tree(root / "data") == data


def test_tool_schemas_are_checked_as_json_schemas():
    good = ToolSpec("lookup", "x", {"type": "object", "properties": {"n": {"type": "string", "minLength": 1}}})
    assert tool_problems([good, ANSWER_SPEC]) == []
    bad = ToolSpec("lookup", "x", {"type": "object", "properties": {"n": {"minLength": -1}}})
    (problem,) = tool_problems([bad, ANSWER_SPEC])
    assert problem.startswith("tool 'lookup': parameters are not a valid JSON Schema (Draft 2020-12) at "
                              "properties/n/minLength: -1 is less than the minimum of 0"), problem
    assert tool_problems((good,)) == ["no 'answer' tool among ['lookup'] (use contract.ANSWER_SPEC)"]
    assert tool_problems([good, "answer"]) == ["tool #1 is a str, not a ToolSpec",
                                               "no 'answer' tool among ['lookup'] (use contract.ANSWER_SPEC)"]


def test_the_expert_is_checked_on_a_sample_covering_every_level_and_family(site, tmp_path):
    from agentrl_arith import Arith

    from pipeline.envs.contract import Task

    tasks = [Task(f"t{i}", "train", 1 + (i >= 90), "q", "a", family="late" if i == 95 else "x") for i in range(100)]
    ids = [t.task_id for t in sample(tasks)]
    assert ids == [f"t{i}" for i in range(0, 90, 5)] + ["t90", "t95"]  # first of each (level, family), then spaced
    tasks = Arith.build(tmp_path, _request(train=50, validation=5, test=5)).tasks
    assert check_environment(Arith(), tasks, EnvConfig()) == {"tasks": 60, "expert_episodes": 20 + 5 + 5}


def _request(**n):
    from agentrl_arith import ArithOptions

    from pipeline.envs.contract import BuildRequest

    return BuildRequest(0, {"train": 3, "validation": 3, "test": 3, **n}, {1: 1.0}, ArithOptions())


def test_the_expert_check_lifts_budgets_and_faults_but_keeps_the_reward(site, tmp_path):
    """A run's tiny budget or injected faults do not make a good environment fail; its reward weights set the top."""
    from agentrl_arith import Arith

    tasks = Arith.build(tmp_path, _request()).tasks
    harsh = EnvConfig(max_steps=1, max_policy_chars=64, tool_failure_rate=0.9, tool_latency_s=5.0, tool_timeout_s=0.1,
                      reward={"user_experience": 0.0})
    assert check_environment(Arith(), tasks, harsh) == {"tasks": 9, "expert_episodes": 9}


# ------------------------------------------------------------------------------------- what the runner guarantees
def test_a_tool_that_raises_is_an_error_observation_and_the_episode_goes_on(site, tmp_path):
    from arith_variants import Raising

    from pipeline.envs.runner import AgentEnv

    world = Raising()
    (task,) = [t for t in Raising.build(tmp_path, _request(train=2)).tasks["train"] if t.data["a"] == 0]
    env = AgentEnv(world=world, tasks=[task])
    env.reset(seed=0, options={"task": task})
    _, _, terminated, truncated, info = env.step('<call>add {"a": 0, "b": 7}</call>')
    assert info["outcome"] == "tool_error"
    assert info["observation_text"] == "<obs>error: add failed (RuntimeError)</obs>\n"
    assert not terminated and not truncated
    _, _, terminated, _, info = env.step('<call>add {"a": 1, "b": 6}</call>')  # the next call works
    assert info["outcome"] == "ok" and info["tool_result"] == "7"
    _, _, terminated, _, info = env.step('<call>answer {"value": "7"}</call>')
    assert terminated and info["is_success"] and info["n_failed"] == 1
    env.close()
    # the check reports the failing tool through the expert's steps instead of crashing
    with pytest.raises(EnvironmentError_, match=r"on train task 'train-0': wrong answer .* 1 failed.*"
                                                r"<call>add \{\"a\": 0, \"b\": 7\}</call> -> <obs>error: add failed "
                                                r"\(RuntimeError\)</obs>"):
        check_environment(world, Raising.build(tmp_path, _request(train=2)).tasks, EnvConfig())


def test_a_tool_that_returns_no_text_is_an_error_in_the_runner_and_the_rollout_engine(site, tmp_path):
    from arith_variants import NotText

    from pipeline.envs.runner import AgentEnv
    from pipeline.policy.config import ModelConfig, RolloutConfig
    from pipeline.policy.model import build_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.policy.tokenizer import train_tokenizer

    world = NotText()
    tasks = NotText.build(tmp_path, _request(train=2)).tasks["train"]
    env = AgentEnv(world=world, tasks=tasks)
    env.reset(seed=0, options={"task": tasks[1]})  # the first episode of this world
    _, _, terminated, _, info = env.step('<call>add {"a": 1, "b": 7}</call>')
    assert info["outcome"] == "tool_error" and not terminated
    assert info["observation_text"] == "<obs>error: add failed (returned int, not text)</obs>\n"
    env.close()

    tok = train_tokenizer([t.question for t in tasks] + ['<call>add {"a": 1, "b": 7}</call>'], vocab_size=300)
    model = build_policy(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_positions=256, dtype="fp32"),
                         tok)
    engine = RolloutEngine(model, tok, world, EnvConfig(max_steps=3), RolloutConfig(max_new_tokens=8, batch_size=2))
    records = engine.demonstrate(tasks, [0, 1], world.expert)
    for rec in records:
        assert [c["outcome"] for c in rec["calls"]] == ["tool_error", "answer"] and not rec["success"]
        assert "returned int, not text" in rec["steps"][0]["observation"]
    assert len(engine.run(tasks, [0, 1])) == 2  # sampled episodes on this world end normally too


def test_the_check_leaves_the_shop_build_byte_identical(tmp_path, monkeypatch):
    """The expert check draws nothing from the build's generators and writes nothing: the shop's data and metrics
    (timings aside) are those of a build without it."""
    import pipeline.build_env.main as build_env

    cfg = BuildEnvConfig(options={"n_products": 40, "n_suppliers": 12},
                         tasks_per_split={"train": 40, "validation": 12, "test": 12})
    checked = build(cfg, EnvConfig(max_steps=3), tmp_path / "a" / "data", tmp_path / "a" / "m.json")
    monkeypatch.setattr(build_env, "check_environment", lambda *a, **k: None)
    unchecked = build(cfg, EnvConfig(max_steps=3), tmp_path / "b" / "data", tmp_path / "b" / "m.json")
    assert tree(tmp_path / "a" / "data") == tree(tmp_path / "b" / "data")
    drop = lambda m: {k: v for k, v in m.items() if k != "seconds"}  # noqa: E731
    assert drop(checked) == drop(unchecked)
    assert checked["counts"]["demos"] > 0


# ---------------------------------------------------------------------------------------------- the command line
def _cli_env(site: Path, root: Path) -> dict:
    from test_flow import clean_env

    env = clean_env(root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return env


def test_agentrl_envs_lists_installed_environments_and_flags_a_broken_one(tmp_path):
    from test_flow import agentrl

    site = write_package(tmp_path / "site", "arith = agentrl_arith:Arith\nbroken = arith_variants:NoEpisode")
    proc = agentrl(tmp_path, "envs", env=_cli_env(site, tmp_path), timeout=120)
    assert proc.returncode == 1, proc.stderr  # one environment does not keep the contract
    lines = proc.stdout.splitlines()
    assert any(line.split() == ["shop", "ok", "built-in", "pipeline.envs.shop:ShopWorld"] for line in lines), lines
    i = next(i for i, line in enumerate(lines) if line.startswith("arith "))
    assert lines[i].split() == ["arith", "ok", "entry", "point", "agentrl_arith:Arith"]
    assert lines[i + 1].strip() == "add two numbers with the add tool"
    j = next(i for i, line in enumerate(lines) if line.startswith("broken "))
    assert lines[j].split() == ["broken", "BAD", "entry", "point", "arith_variants:NoEpisode"]
    assert "breaks the contract: methods not implemented: open_episode" in lines[j + 1]
    assert lines[-1].startswith("name one in params.yaml `env.name`")


def _arith_params() -> dict:
    from test_flow import merge, tiny_params

    params = merge(tiny_params(), {"env": {"name": "arith"}, "adapt": {"eval": {"max_tasks": 2}},
                                   "train": {"eval_tasks": 2, "test_tasks": 2}})
    params["build_env"] = {**params["build_env"], "options": {"offset": 7}, "level_mix": {1: 1.0},
                           "tasks_per_split": {"train": 12, "validation": 4, "test": 4},
                           "demos": {**params["build_env"]["demos"], "level_coverage": {1: 1.0}}}
    for key in ("n_products", "n_suppliers"):  # the shop's options, wherever the tiny params still keep them
        params["build_env"].pop(key, None)
    params["deploy"] = {**params["deploy"], "max_test_tasks": 4, "latency_tasks": 1}
    return params


@pytest.mark.services
@pytest.mark.slow
def test_an_environment_from_outside_runs_the_unchanged_command_line(tmp_path):
    from deploy_support import free_port, wait_http, write_metrics
    from test_flow import ROOT, agentrl, champion

    # A user's project: params.yaml and the DeepSpeed configs, the installed library (no copy of it: the training
    # ranks would import a copy from the working directory), the environment's package on PYTHONPATH.
    site = write_package(tmp_path / "site")
    root = tmp_path / "project"
    shutil.copytree(ROOT / "configs", root / "configs")
    (root / "params.yaml").write_text(yaml.safe_dump(_arith_params(), sort_keys=False))
    env = _cli_env(site, root)
    run = lambda *args: agentrl(root, *args, env=env, timeout=600)  # noqa: E731

    proc = run("envs")
    assert proc.returncode == 0 and "agentrl_arith:Arith" in proc.stdout, proc.stdout + proc.stderr
    proc = run("build-env")
    assert proc.returncode == 0, proc.stderr
    assert "\nbuild_env: environment arith: 1 worlds, tasks 12/4/4" in proc.stdout, proc.stdout
    assert proc.stdout.startswith("build_env: warning: reward-hacking probe 'attempt_writes' did not run"), proc.stdout
    data = tree(root / "data")

    # a broken environment named by module:Class: one error line, exit 2, the published data untouched
    broken = _arith_params()
    broken["env"]["name"] = "arith_variants:WastefulExpert"
    (root / "broken.yaml").write_text(yaml.safe_dump(broken, sort_keys=False))
    proc = run("build-env", "--params", "broken.yaml")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: build_env: environment 'arith': its expert does not reach the top return"), proc.stderr
    assert tree(root / "data") == data

    proc = run("eval", "--policy", "expert", "--tasks", "data/tasks/test.jsonl", "--out", "metrics/expert.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((root / "metrics/expert.json").read_text())["overall"]["success_rate"] == 1.0
    for phase, out in (("adapt", "models/adapted"), ("train", "models/policy")):
        proc = run(phase)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert (root / out / "policy.json").is_file()

    with tempfile.TemporaryDirectory() as tmp:  # deploy reads the drift verdict check-drift would have written
        write_metrics(Path(tmp))
        shutil.copy(Path(tmp) / "drift.json", root / "metrics" / "drift.json")
    proc = run("deploy")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert champion(root) == "1"

    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "agentrl"), "serve", "--port", str(port)], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/ready", timeout=120, proc=server)
        r = httpx.post(f"{base}/solve", json={"question": "What is 3 plus 4?"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["success"] is None and body["n_calls"] == len(body["trajectory"]) >= 1
        task = json.loads((root / "data/tasks/test.jsonl").read_text().splitlines()[0])
        r = httpx.post(f"{base}/solve", json=task, timeout=60)
        assert r.status_code == 200 and isinstance(r.json()["success"], bool), r.text
        r = httpx.post(f"{base}/solve", json={"question": "What is the price of a kettle?"}, timeout=60)
        assert r.status_code == 422 and "arith serves questions of the form" in r.json()["error"], r.text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
