"""The default recipe's derivations (pipeline.core.recipe, pipeline.adapt.recipe): known answers, overrides, and
the resolution every phase loads its `env` and `rollout` sections with."""

from __future__ import annotations

import json

import pytest

from pipeline.adapt.config import GateConfig
from pipeline.adapt.recipe import gate_recipe, level_coverage
from pipeline.core import recipe as R
from pipeline.core.config import ConfigError, load_section
from pipeline.envs.config import EnvConfig
from pipeline.policy.config import RolloutConfig


def demo(*actions: str, level: int = 1) -> dict:
    return {"level": level, "steps": [{"action": a, "observation": "<obs>x</obs>\n"} for a in actions]}


def test_limits_from_known_demonstrations():
    demos = [demo("a" * 82, "b" * 30), demo("c" * 10, "d" * 10, "e" * 10, "f" * 10, "g" * 10)]
    got = R.derive_data_recipe(demos, task_min_calls=[2, 3, 4])
    assert got["env.max_action_chars"]["value"] == 256           # 2 x 82 = 164 -> 256
    assert got["env.max_action_chars"]["evidence"]["longest_action_chars"] == 82
    assert got["env.max_steps"]["value"] == 8                    # 2 x 4
    assert got["env.max_steps"]["evidence"]["longest_demo_calls"] == 5
    assert got["env.max_policy_chars"]["value"] == 512           # 4 x 112 = 448 -> 512
    assert all(e["source"] == "derived" for e in got.values())


def test_rules_at_their_edges():
    assert R.derive_action_chars([64])["value"] == 128           # 2 x 64 is a power of two already
    assert R.derive_action_chars([3])["value"] == 16             # clamped up to the field's minimum
    assert R.derive_action_chars([3])["evidence"]["clamped_from"] == 8
    assert R.derive_steps([40])["value"] == 64                   # 80 clamped to the field's maximum
    assert R.derive_steps([3], [6])["evidence"]["demos_at_budget"] == 1
    assert R.derive_max_new_tokens([31, 5])["value"] == 48       # 1.5 x 31 = 46.5 -> 48
    assert R.derive_max_new_tokens([32])["value"] == 48
    assert R.derive_max_new_tokens([33])["value"] == 64
    with pytest.raises(R.RecipeError, match="env.max_action_chars"):
        R.derive_action_chars([])


def test_demonstrations_fit_the_limits_derived_from_them():
    """build_env makes the demonstrations before their limits exist; the limits must not cut any of them."""
    demos = [demo(*("y" * k for k in (5, 90, 17))) for _ in range(3)]
    got = R.derive_data_recipe(demos, [3])
    assert max(len(s["action"]) for d in demos for s in d["steps"]) <= got["env.max_action_chars"]["value"]
    assert max(sum(len(s["action"]) for s in d["steps"]) for d in demos) <= got["env.max_policy_chars"]["value"]
    assert max(len(d["steps"]) for d in demos) <= got["env.max_steps"]["value"]


def test_set_values_win_and_are_reported():
    cfg = EnvConfig(max_steps=12, max_action_chars="auto", max_policy_chars="auto")
    resolved, recipe = R.data_recipe(cfg, [demo("a" * 50)], [2])
    assert resolved.max_steps == 12 and resolved.max_action_chars == 128 and resolved.max_policy_chars == 256
    assert recipe["env.max_steps"] == {"value": 12, "source": "set", "evidence": {"derived": 4}}
    assert recipe["env.max_action_chars"]["source"] == "derived"
    with pytest.raises(R.RecipeError, match="env.max_steps: auto needs the expert's demonstrations"):
        R.data_recipe(EnvConfig(max_steps="auto"), [], [2])


def test_provisional_budget_before_the_demonstrations():
    cfg = R.provisional(EnvConfig(max_steps="auto", max_action_chars="auto", max_policy_chars=900), [3, 2])
    assert (cfg.max_steps, cfg.max_action_chars, cfg.max_policy_chars) == (6, 4096, 900)


def test_gate_relative_to_expert_and_chance():
    got = R.derive_gate({1: 1.0, 2: 1.0, 3: 0.6, 4: 0.03}, {1: 1.0, 2: 1.0, 3: 0.9, 4: 1.0},
                        {1: 0.0, 2: 0.5, 3: 0.0, 4: 0.0}, n_tools=5, fraction=0.4)
    assert got["value"] == {"eval/greedy/success_L1": 0.4, "eval/greedy/success_L2": 0.7,
                            "eval/greedy/success_L3": 0.36, "eval/greedy/tool_first_acc": 0.52,
                            "eval/greedy/param_acc": 0.4}
    assert got["evidence"]["untaught_levels"] == [4]
    with pytest.raises(R.RecipeError, match="adapt.gate.min"):
        R.derive_gate({1: 0.1}, {1: 1.0}, {1: 0.0}, 5, 0.4)


def test_gate_recipe_from_demonstrations_and_baselines():
    demos = [demo("a", level=1), demo("a", level=1), demo("a", level=2)]
    assert level_coverage(demos, [1, 1, 2, 2, 2, 2]) == {1: 1.0, 2: 0.25}
    base = {"expert": {"per_level_success": {"1": 1.0, "2": 1.0}}, "random": {"per_level_success": {"1": 0.0}}}
    got = gate_recipe(GateConfig(min="auto", fraction=0.5), demos, [1, 1, 2, 2, 2, 2], base, 2, "validation")
    assert got["value"] == {"eval/greedy/success_L1": 0.5, "eval/greedy/tool_first_acc": 0.75,
                            "eval/greedy/param_acc": 0.5}
    hand = gate_recipe(GateConfig(min={"eval/greedy/success": 0.2}), demos, [1], None, 2, "validation")
    assert hand == {"value": {"eval/greedy/success": 0.2}, "source": "set", "evidence": {}}
    with pytest.raises(R.RecipeError, match="adapt.gate.min: auto needs the expert"):
        gate_recipe(GateConfig(min="auto"), demos, [1], None, 2, "validation")
    off = gate_recipe(GateConfig(min="auto", enabled=False), demos, [1], None, 2, "validation")
    assert off["value"] == {} and "skipped" in off["evidence"]


def test_every_phase_resolves_auto_from_the_recorded_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("env: {max_steps: auto, max_action_chars: 300}\nrollout: {max_new_tokens: auto}\n")
    with pytest.raises(ConfigError, match="env.max_steps: auto: .*recipe.json not found"):
        load_section(EnvConfig, "env")
    assert load_section(EnvConfig, "env", resolve=False).max_steps == "auto"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "recipe.json").write_text(json.dumps(R.derive_data_recipe([demo("a" * 40)], [5])))
    env = load_section(EnvConfig, "env")
    assert (env.max_steps, env.max_action_chars) == (10, 300)   # the hand-set key is not touched
    with pytest.raises(ConfigError, match="rollout.max_new_tokens: auto: .*policy.json not found"):
        load_section(RolloutConfig, "rollout")
    (tmp_path / "models" / "adapted").mkdir(parents=True)
    (tmp_path / "models" / "adapted" / "policy.json").write_text(json.dumps({"vocab_size": 9}))
    with pytest.raises(ConfigError, match="records no value"):
        load_section(RolloutConfig, "rollout")
    (tmp_path / "models" / "adapted" / "policy.json").write_text(
        json.dumps({"recipe": {R.TOKEN_KEY: R.derive_max_new_tokens([40])}}))
    assert load_section(RolloutConfig, "rollout").max_new_tokens == 64


def test_unresolved_config_is_refused():
    with pytest.raises(R.RecipeError, match="env.max_action_chars: auto was not resolved"):
        R.require_resolved(EnvConfig(max_action_chars="auto"), "env")
    R.require_resolved(EnvConfig(), "env")


def test_mlflow_params_and_description():
    recipe = {"env.max_steps": R.entry(8, "derived"), "adapt.gate.min": R.entry({"eval/greedy/param_acc": 0.4}, "set")}
    assert R.mlflow_params(recipe) == {"recipe/max_steps": 8, "recipe/max_steps_source": "derived",
                                       "recipe/gate_min": '{"eval/greedy/param_acc": 0.4}',
                                       "recipe/gate_min_source": "set"}
    assert R.describe(recipe) == "env.max_steps 8 (derived); adapt.gate.min param_acc 0.4 (set)"
