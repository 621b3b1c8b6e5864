"""Decoding constrained by the tools' JSON Schemas (pipeline.policy.constrain, `rollout.constrain: schema`): the
grammar accepts every expert action of the three built-in environments and refuses what breaks a schema; an
untrained model's actions under it always parse and pass their schemas; its recorded log-probabilities are those of
the masked distribution; the same seeds give the same episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.envs.calendar import CalendarOptions, CalendarWorld
from pipeline.envs.config import EnvConfig
from pipeline.envs.contract import BuildRequest, ToolSpec
from pipeline.envs.prompt import render_header
from pipeline.envs.runner import AgentEnv, toolset
from pipeline.envs.shop import ShopWorld
from pipeline.envs.sql import SqlAnalyst, SqlOptions
from pipeline.policy.config import ModelConfig, RolloutConfig
from pipeline.policy.constrain import CallConstraint, action_grammar, check_demonstrations, violations
from pipeline.policy.episodes import run_episode
from pipeline.policy.model import build_policy
from pipeline.policy.rollout import RolloutEngine
from pipeline.policy.scoring import sequence_logprobs
from pipeline.policy.tokenizer import CALL_CLOSE, CALL_OPEN, encode_action, marker_ids, train_tokenizer

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_positions=512, seed=0)
MIX = {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
SIZES = {"train": 24, "validation": 4, "test": 4}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def open_world(name: str, root: Path):
    if name == "shop":
        return ShopWorld.default()
    cls, options = ((SqlAnalyst, SqlOptions(n_customers=200, n_products=96, n_orders=1500, max_rows=5))
                    if name == "sql" else (CalendarWorld, CalendarOptions(n_people=60, weeks=2)))
    out = root / name
    out.mkdir()
    result = cls.build(out, BuildRequest(0, dict(SIZES), dict(MIX), options))
    world = cls.load(out)
    world.built_tasks = result.tasks["train"]
    return world


def shop_tasks(world):
    from pipeline.envs.shop.tasks import generate_tasks
    return generate_tasks(world.world, "train", 24, MIX, 0, world.solve)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Per built-in environment: (world, its training tasks, the expert's episodes on them)."""
    root = tmp_path_factory.mktemp("constrain")
    out = {}
    for name in ("shop", "sql", "calendar"):
        world = open_world(name, root)
        tasks = shop_tasks(world) if name == "shop" else world.built_tasks
        env = AgentEnv(world=world, tasks=tasks, config=EnvConfig(max_steps=12, max_action_chars=512))
        out[name] = (world, tasks, [run_episode(env, world.expert(), t, i) for i, t in enumerate(tasks)])
    yield out
    for world, _, _ in out.values():
        world.close()


@pytest.fixture(scope="module")
def tokenizer(worlds):
    texts = []
    for world, tasks, episodes in worlds.values():
        sigs = [s.signature() for s in world.tools()]
        texts += [render_header(t.question, sigs) for t in tasks]
        texts += [s["action"] + s["observation"] for ep in episodes for s in ep["steps"]]
    return train_tokenizer(texts, vocab_size=700)


@pytest.fixture(scope="module")
def constraint(tokenizer):
    ids = marker_ids(tokenizer)
    return CallConstraint(tokenizer, len(tokenizer), ids[CALL_OPEN], ids[CALL_CLOSE])


@pytest.mark.parametrize("name", ["shop", "sql", "calendar"])
def test_every_expert_action_of_each_world_is_accepted(worlds, tokenizer, constraint, name):
    world, tasks, episodes = worlds[name]
    n = 0
    for task, ep in zip(tasks, episodes):
        assert ep["success"], ep["task_id"]
        specs = toolset(world, task).specs
        actions = [encode_action(tokenizer, s["action"]) for s in ep["steps"]]
        assert violations(constraint, specs, actions) == [], (name, [s["action"] for s in ep["steps"]])
        n += len(actions)
    assert n >= 2 * len(tasks)


SPECS = [ToolSpec("lookup", "d", {"type": "object", "properties": {"name": {"type": "string"},
                                                                    "field": {"type": "string", "enum": ["a", "bb"]}},
                                  "required": ["name", "field"], "additionalProperties": False}),
         ToolSpec("count", "d", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                         "maximum": 9}},
                                 "required": ["n"], "additionalProperties": False})]


@pytest.mark.parametrize("text, ok", [
    ('<call>lookup {"name": "x y", "field": "bb"}</call>', True),
    ('<call>count {"n": 7}</call>', True),
    ('<call>lookup {"field": "bb", "name": "x y"}</call>', False),   # the schema's property order
    ('<call>lookup {"name": "x y", "field": "c"}</call>', False),    # not in the enum
    ('<call>lookup {"name": "x y"}</call>', False),                  # a required property missing
    ('<call>count {"n": 12}</call>', False),                         # above the maximum
    ('<call>count {"n": "7"}</call>', False),                        # the wrong type
    ('<call>count {"n":7}</call>', False),                           # not the demonstrations' separators
    ('<call>search {"n": 7}</call>', False),                         # no such tool
    ('<call>count {"n": 7, "m": 1}</call>', False),                  # no additional properties
])
def test_the_grammar_knows_the_schemas(tokenizer, constraint, text, ok):
    ids = encode_action(tokenizer, text)
    assert (violations(constraint, SPECS, [ids]) == []) is ok


def test_grammar_text_names_each_tool_and_embeds_its_schema():
    g = action_grammar(SPECS, 3, 4)
    assert g.startswith("start: <[3]> call <[4]>\n")
    assert '"lookup "' in g and '"count "' in g and g.count("%json") == 2


def engine_run(worlds, tokenizer, name: str, constrain: str, greedy: bool, n: int = 12):
    world, tasks, _ = worlds[name]
    model = build_policy(TINY, tokenizer)
    roll = RolloutConfig(max_new_tokens=96, batch_size=4, temperature=1.0, constrain=constrain)
    engine = RolloutEngine(model, tokenizer, world, EnvConfig(max_steps=3, max_action_chars=512), roll)
    return engine, engine.run(tasks[:n], list(range(n)), greedy=greedy)


@pytest.mark.parametrize("name", ["shop", "calendar"])
def test_an_untrained_model_under_the_constraint_writes_only_valid_calls(worlds, tokenizer, name):
    _, free = engine_run(worlds, tokenizer, name, "none", greedy=False)
    engine, held = engine_run(worlds, tokenizer, name, "schema", greedy=False)

    def errors(records):
        return [a for r in records for a in r["actions"] if a["tool"] is None and not a["token_limit"]]

    assert len(errors(free)) > 0  # without it, an untrained model writes unparsable text
    assert errors(held) == []
    calls = [a for r in held for a in r["actions"] if a["tool"] is not None]
    assert len(calls) >= 12
    # every finished call passed its tool's schema: none was refused as invalid parameters
    invalid = [c for r in held for c in r["calls"] if c.get("outcome") == "invalid_params"]
    assert invalid == []
    assert engine.constraint.stats["actions"] >= len(calls) and engine.constraint.stats["dropped"] == 0


def test_recorded_logprobs_are_the_masked_distributions(worlds, tokenizer):
    engine, held = engine_run(worlds, tokenizer, "calendar", "schema", greedy=False, n=4)
    rec = held[0]
    free = sequence_logprobs(engine.model, rec["token_ids"], rec["action_mask"],  # the unconstrained policy's
                             segments=rec["segments"]).detach()
    mask = torch.tensor(rec["action_mask"], dtype=torch.bool)
    recorded = torch.tensor(rec["logprobs"])
    # masking renormalises over the allowed tokens: log μ = log π − log Z with Z <= 1, equal where nothing was masked
    assert bool((recorded[mask] >= free[mask] - 1e-4).all())
    assert bool((recorded[mask] > free[mask] + 1e-3).any())


def test_same_seeds_same_constrained_episodes(worlds, tokenizer):
    _, a = engine_run(worlds, tokenizer, "calendar", "schema", greedy=False, n=6)
    _, b = engine_run(worlds, tokenizer, "calendar", "schema", greedy=False, n=6)
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
    _, g = engine_run(worlds, tokenizer, "calendar", "schema", greedy=True, n=6)
    assert all(a["tool"] is not None or a["token_limit"] for r in g for a in r["actions"])


def test_unknown_constrain_value_is_refused():
    with pytest.raises(ValueError, match="constrain"):
        RolloutConfig(constrain="regex")
    assert json.loads(json.dumps(RolloutConfig(constrain="schema").model_dump()))["constrain"] == "schema"


def test_greedy_masks_only_rows_whose_best_token_the_grammar_refuses(tokenizer, constraint):
    """keep= (greedy): the chosen tokens equal those of masking every row; rows whose best token is allowed pay no
    mask."""
    text = '<call>lookup {"name": "x y", "field": "bb"}</call>'
    ids = encode_action(tokenizer, text)
    gen = torch.Generator().manual_seed(0)
    for cut in range(1, len(ids) - 1):  # each state along a valid action
        keys = [("full", cut), ("keep", cut)]
        for k in keys:
            constraint.mask_(torch.zeros(1, len(tokenizer)), [(k, SPECS, True)])
            for t in ids[:cut]:
                constraint.consume(k, t)
        for _ in range(5):
            logits = torch.randn(1, len(tokenizer), generator=gen)
            logits[0, ids[cut]] += 8.0 * float(torch.rand(1, generator=gen) < 0.5)  # sometimes the valid token leads
            before = constraint.stats["masked_tokens"]
            full = constraint.mask_(logits.clone(), [(keys[0], SPECS, False)]).argmax(-1)
            masked_full = constraint.stats["masked_tokens"] - before
            kept = constraint.mask_(logits.clone(), [(keys[1], SPECS, False)], keep=logits.argmax(-1)).argmax(-1)
            masked_keep = constraint.stats["masked_tokens"] - before - masked_full
            assert int(full) == int(kept)
            assert masked_full == 1 and masked_keep == int(int(logits.argmax()) != int(full))
        for k in keys:
            constraint.end(k)


def test_a_schema_the_grammar_cannot_take_is_one_clear_error(tokenizer, constraint):
    from pipeline.core.errors import AgentRLError

    odd = [ToolSpec("find", "d", {"type": "object", "properties": {"q": {"type": "string", "pattern": "(?<=x)y"}},
                                  "required": ["q"], "additionalProperties": False})]
    with pytest.raises(AgentRLError, match=r"tools find cannot be decoded under: .*look-around.*rollout.constrain: none"):
        constraint.mask_(torch.zeros(1, len(tokenizer)), [("odd", odd, True)])


def test_demonstrations_the_grammar_refuses_are_one_error_before_training(worlds, tokenizer):
    """Under the constraint, adapt checks the demonstrations first: an expert that writes a call's parameters out of
    its schema's order would teach the model actions it may never write."""
    world, tasks, episodes = worlds["shop"]
    by_id = {t.task_id: t for t in tasks}
    demos = [{"task_id": t.task_id, "steps": [dict(s) for s in ep["steps"]]} for t, ep in zip(tasks, episodes)]
    specs_of = lambda task_id: toolset(world, by_id[task_id]).specs  # noqa: E731
    n = check_demonstrations(tokenizer, len(tokenizer), demos, specs_of)
    assert n == sum(len(ep["steps"]) for ep in episodes)
    swapped = None
    for d in demos:  # the first call with two parameters, written in the reverse order
        for s in d["steps"]:
            name, _, args = s["action"][len("<call>"):-len("</call>")].partition(" ")
            params = json.loads(args)
            if len(params) >= 2 and swapped is None:
                swapped = (d["task_id"], f"<call>{name} {json.dumps(dict(reversed(list(params.items()))))}</call>")
                s["action"] = swapped[1]
    assert swapped is not None
    from pipeline.core.errors import AgentRLError

    with pytest.raises(AgentRLError, match=r"refuses 1 of the \d+ demonstrated actions.*" + swapped[0]):
        check_demonstrations(tokenizer, len(tokenizer), demos, specs_of)
