"""The extension protocol of the RL loop (pipeline/train/extensions): a default config builds no extension (the run is
the kernel alone), the built-in ones come from their own keys, names that are no extension are refused with one clear
line, and an extension a user names in `train.extensions` (``module:Class``) runs in a real tiny loop: its options
reach it, its hooks run on every update, its figures reach the history, its state rides in the checkpoint, and its
stop reason ends the run the way early stopping does."""

from __future__ import annotations

import pytest

from pipeline.core.errors import AgentRLError
from pipeline.envs.config import EnvConfig
from pipeline.train.config import TrainConfig
from pipeline.train.extensions import BUILTIN, curve_keys, extension_class, make_extensions
from pipeline.train.extensions.base import Extension


class StopAtUpdate(Extension):
    """Counts the updates it saw and the episodes it observed, and stops the run at update `stop_at`."""

    name = "stop_at_update"
    curve_keys = ("custom/updates_seen",)  # a column of metrics/train_curve.csv; custom/episodes_seen is not

    def __init__(self, stop_at: int):
        self.stop_at, self.updates, self.episodes, self.calls = stop_at, 0, 0, []

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(int(options["stop_at"]))

    def begin_update(self, loop, u):
        self.calls.append(("begin_update", u))

    def observe(self, loop, u, records):
        self.episodes += len(records)
        return {"custom/episodes_seen": self.episodes}

    def after_learn(self, loop, u, records):
        self.updates += 1
        return {"custom/updates_seen": self.updates}

    def should_stop(self, loop, u, metrics):
        return f"custom stop at update {u + 1}" if u + 1 >= self.stop_at else None

    def state_dict(self):
        return {"updates": self.updates, "episodes": self.episodes}

    def load_state_dict(self, state, loop):
        self.updates, self.episodes = state["updates"], state["episodes"]


class SameName(StopAtUpdate):
    """Another class whose state would land under the same checkpoint key."""


class NotAnExtension:
    pass


def test_a_default_config_builds_no_extension_and_each_switch_builds_its_own():
    assert make_extensions(TrainConfig(), EnvConfig(), None) == []  # the kernel alone: nothing is called
    on = TrainConfig(exploration={"tool_noise": 0.1}, sampling={"adversarial": True, "replay": True, "slice_turns": 2},
                     reward={"weighting": "softmax"})
    assert [e.name for e in make_extensions(on, EnvConfig(), None)] == ["tool_noise", "adversarial",
                                                                       "reward_weighting", "replay", "slicing"]
    assert len({extension_class(s).name for s in BUILTIN}) == len(BUILTIN)  # one checkpoint key each
    # a population trains the stage (several runs), not the loop: no hook of any run, and a size of 1 leaves the
    # stage one run
    from pipeline.train.extensions.population import Population

    assert make_extensions(TrainConfig(population={"size": 2}), EnvConfig(), None) == []
    assert Population.train_stage(TrainConfig(), None) is None


def test_the_curve_columns_are_the_ones_the_extensions_declare():
    builtin = curve_keys(TrainConfig())
    assert builtin == tuple(k for s in BUILTIN for k in extension_class(s).curve_keys)  # built-in order, no repeat
    assert {"explore/epsilon", "reward_model/score", "reward/w_safety", "credit/event_turns_per_episode",
            "replay/replayed", "sampling/slice_rows", "sampling/adversarial_planned_weight",
            "taskgen/generated"} <= set(builtin)
    user = TrainConfig(extensions={"tests.test_extensions:StopAtUpdate": {"stop_at": 1}})
    assert curve_keys(user) == builtin + ("custom/updates_seen",)


def test_every_built_in_hook_keeps_the_protocols_signature():
    """A method of a built-in extension named like a hook is that hook: the loop calls it with the protocol's
    arguments (a method of the same name with other parameters would be called by the loop by mistake)."""
    import inspect

    hooks = {n: inspect.signature(f) for n, f in vars(Extension).items() if inspect.isfunction(f)}
    for spec in BUILTIN:
        cls = extension_class(spec)
        for name, base in hooks.items():
            own = vars(cls).get(name)
            if inspect.isfunction(own):
                assert list(inspect.signature(own).parameters) == list(base.parameters), (spec, name)


def test_names_that_are_no_extension_are_refused():
    with pytest.raises(AgentRLError, match="unknown extension 'curiosity'.*agentrl.extensions"):
        extension_class("curiosity")
    with pytest.raises(AgentRLError, match="cannot import no_such_module"):
        extension_class("no_such_module:Thing")
    with pytest.raises(AgentRLError, match="has no attribute 'Missing'"):
        extension_class("tests.test_extensions:Missing")
    with pytest.raises(AgentRLError, match="not a subclass of pipeline.train.extensions.base.Extension"):
        extension_class("tests.test_extensions:NotAnExtension")
    twice = TrainConfig(extensions={"tests.test_extensions:StopAtUpdate": {"stop_at": 1},
                                    "tests.test_extensions:SameName": {"stop_at": 1}})
    with pytest.raises(AgentRLError, match="two extensions are named 'stop_at_update'"):
        make_extensions(twice, EnvConfig(), None)


def test_a_user_extension_runs_in_the_loop_and_stops_it(tmp_path, monkeypatch):
    import torch

    from tests.test_train import make_project
    from pipeline.train.worker import run_worker

    root = make_project(tmp_path / "ext")
    monkeypatch.chdir(root)
    text = (root / "params.yaml").read_text() + "  extensions:\n    tests.test_extensions:StopAtUpdate: {stop_at: 3}\n"
    (root / "params-ext.yaml").write_text(text)
    result = run_worker("params-ext.yaml", ckpt="ckpt", out="models/policy-ext")
    h = result["history"]
    assert [x["update"] for x in h] == [1, 2, 3]  # 4 updates asked, stopped after the third
    assert [x["custom/updates_seen"] for x in h] == [1, 2, 3]
    assert [x["custom/episodes_seen"] for x in h] == [4, 8, 12]  # 2 tasks × group 2 per update, one rank
    es = result["early_stopping"]
    assert es["stopped"] and es["stop_update"] == 3 and es["reason"] == "custom stop at update 3"
    assert result["completed"] and (root / "models/policy-ext").is_dir()  # the best validated policy is the output
    (ckpt,) = (root / "ckpt").glob("*/update-3")  # the final checkpoint holds the extension's state
    client = torch.load(next(ckpt.glob("*model_states.pt")), weights_only=False)
    assert client["extensions"] == {"stop_at_update": {"updates": 3, "episodes": 12}}
    header = (root / "metrics/train_curve.csv").read_text().splitlines()[0].split(",")
    assert "custom_updates_seen" in header and "custom_episodes_seen" not in header  # the declared column only


def _module_imports(path, package: str) -> set[str]:
    """The modules of `package` that `path` imports at module level (imports inside functions are left out: they
    run when called, not when the module loads)."""
    import ast

    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports never run
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith(package)}


def test_the_train_package_has_no_import_circle_and_its_config_is_the_leaf():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    modules = {}
    for f in sorted((root / "pipeline" / "train").rglob("*.py")):
        name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = f
    graph = {m: {d for d in _module_imports(f, "pipeline.train") if d in modules and d != m}
             for m, f in modules.items()}
    assert graph["pipeline.train.config"] == set()  # the leaf: it imports nothing of its own package
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import circle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    # the kernel names no extension: it reaches them only through the protocol and the registry
    for kernel in ("loop", "learner", "advantages", "sampling"):
        named = {d for d in graph[f"pipeline.train.{kernel}"] if d.startswith("pipeline.train.extensions.")}
        assert named == set(), (kernel, named)
