"""Context management and task decomposition as actions (env.context_actions): BM25 retrieval, the long-term memory
and its meta-memory, note folding, plan checking, long shop tasks with the expert, the rollout engine's records, and
a tiny training run with the switch on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipeline.envs.config import EnvConfig
from pipeline.envs.context_actions import NOTED, ContextActionsConfig, context_metrics, note_of
from pipeline.envs.memory import MemoryStore, bm25_scores, rank, terms
from pipeline.envs.prompt import render_context, render_header
from pipeline.envs.runner import AgentEnv
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.tasks import LONG_FAMILY, generate_tasks
from pipeline.envs.verifier import ANSWER, OK, TOOL_ERROR, match_plan

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
LONG_ENV = dict(max_steps=32, max_policy_chars=4000)


@pytest.fixture(scope="module")
def shop():
    world = ShopWorld.default()
    yield world
    world.close()


@pytest.fixture(scope="module")
def long_tasks(shop):
    tasks = generate_tasks(shop.world, "train", 8, {1: 1, 2: 1, 3: 1, 4: 1}, 0, shop.solve, long_share=0.25,
                           long_lookups=20)
    return [t for t in tasks if t.family == LONG_FAMILY]


def on(tmp_path: Path, **keys) -> dict:
    return {"enabled": True, "memory_path": str(tmp_path / "memory.sqlite"), **keys}


# ------------------------------------------------------------------------------------------------------- retrieval
def test_bm25_scores_and_ranking_known_answers():
    docs = [["a", "b"], ["b", "c", "c"]]  # N = 2, average length 2.5, k1 = 1.2, b = 0.75
    # "c" is in one document: idf = ln(1 + 1.5 / 1.5) = ln 2; doc 2: f = 2, |d| = 3 -> 2 * 2.2 / (2 + 1.2 * 1.15)
    assert bm25_scores(["c"], docs).tolist() == pytest.approx([0.0, math.log(2) * 4.4 / 3.38])
    # "b" is in both: idf = ln(1 + 0.5 / 2.5) = ln 1.2; the shorter document scores higher
    assert bm25_scores(["b", "b"], docs).tolist() == pytest.approx(
        [math.log(1.2) * 2.2 / 2.02, math.log(1.2) * 2.2 / 2.38])
    assert bm25_scores(["z"], docs).tolist() == [0.0, 0.0] and bm25_scores(["a"], []).tolist() == []
    texts = ["stock of wild torch is 12", "price of wild torch is 320", "kettle price 536"]
    assert rank("wild torch price", texts, 3) == [1, 0, 2]
    assert rank("kettle", texts, 3) == [2] and rank("lamp", texts, 3) == []
    assert rank("a", ["b a", "a b"], 2) == [1, 0]  # a tie goes to the alphabetically first text
    assert rank("wild torch price", texts, 1) == [1]
    assert terms('Price of "Wild Torch" = 320.5') == ["price", "of", "wild", "torch", "320", "5"]


def test_memory_sees_only_notes_of_episodes_that_ended_before_it_began_and_keeps_access_statistics(shop, tmp_path):
    cfg = EnvConfig(context_actions=on(tmp_path))
    task = shop.builtin_tasks["train"][0]
    early, writer = AgentEnv(world=shop, tasks=[task], config=cfg), AgentEnv(world=shop, tasks=[task], config=cfg)
    early.reset(seed=0)
    writer.reset(seed=1)
    *_, info = writer.step('<call>remember {"text": "wild torch price is 320"}</call>')
    assert info["events"] == ["remember"]
    *_, info = early.step('<call>recall {"query": "torch price"}</call>')  # written, but not yet ended
    assert info["tool_result"] == "no note matches" and info["events"] == ["recall_miss"]
    *_, info = writer.step('<call>answer {"value": "x"}</call>')
    assert info["context_actions"]["remembered"] == 1 and info["context_actions"]["memory_notes"] == 1
    *_, info = early.step('<call>recall {"query": "torch price"}</call>')  # began before the writer ended
    assert info["tool_result"] == "no note matches"
    late = AgentEnv(world=shop, tasks=[task], config=cfg)
    late.reset(seed=2)
    *_, info = late.step('<call>recall {"query": "what is the torch price"}</call>')
    assert info["tool_result"] == "1) wild torch price is 320" and info["events"] == ["recall_hit"]
    *_, info = late.step(f'<call>answer {{"value": "{task.answer}"}}</call>')
    assert info["is_success"] and info["context_actions"]["recall_hits"] == 1
    store = MemoryStore(str(tmp_path / "memory.sqlite"))  # the file, read by another connection
    (note,) = store.notes()
    assert (note["text"], note["source"], note["reads"], note["hits"]) == ("wild torch price is 320",
                                                                           task.task_id, 1, 1)
    assert note["last_used"] is not None
    assert store.stats() == {"notes": 1, "notes_read": 1, "reads": 1, "hits": 1, "utility": 1.0}
    for env in (early, writer, late):
        env.close()


# ------------------------------------------------------------------------------------------------------------ note
def test_a_note_replaces_the_turns_up_to_it_and_the_context_is_exactly_header_note_and_later_turns(shop, tmp_path):
    pairs = [("<call>a {}</call>", "<obs>1</obs>\n"), ("<call>b {}</call>", "<obs>2</obs>\n"),
             ("<call>note {}</call>", "<obs>noted</obs>\n"), ("<call>c {}</call>", "<obs>3</obs>\n")]
    header = render_header("Q?", ["a()"])
    assert render_context("Q?", ["a()"], pairs, 6, ("kept: 1, 2", 3)) == (
        header + "Note: kept: 1, 2\n<call>c {}</call><obs>3</obs>\n")
    assert render_context("Q?", ["a()"], pairs, 6) == header + "".join(a + o for a, o in pairs)  # no note: as before
    # the window applies to the turns after the note: the oldest of them folds into the summary line
    assert render_context("Q?", ["a()"], pairs + [("<call>d {}</call>", "<obs>4</obs>\n")], 1, ("n", 3)) == (
        header + "Note: n\nState: earlier calls and results: c {} -> 3\n<call>d {}</call><obs>4</obs>\n")

    recorded = [("<call>a {}</call>", "<obs>1</obs>\n"), ('<call>note {"text": "one"}</call>', f"<obs>{NOTED}</obs>\n"),
                ('<call>note {"text": "two"}</call>', "<obs>error: invalid parameters</obs>\n")]
    assert note_of(recorded) == ("one", 2) and note_of(recorded[:1]) is None  # a failed note is no note

    task = shop.builtin_tasks["train"][0]
    env = AgentEnv(world=shop, tasks=[task], config=EnvConfig(context_actions=on(tmp_path, tools=["note"])))
    obs, info = env.reset(seed=0)
    sigs = env.tools.signatures
    assert sigs[-1] == "note(text)" and info["context_actions"] == {"tools": ["note"], "history_window": 6}
    step = shop.reference_calls(task)[0]
    lookup = f'<call>{step[0]} {{"name": "{step[1]["name"]}", "field": "{step[1]["field"]}"}}</call>'
    obs, _, _, _, info = env.step(lookup)
    assert not info["context_folded"] and obs["context"].endswith(info["observation_text"])
    obs, _, _, _, info = env.step('<call>note {"text": "the answer is ' + task.answer + '"}</call>')
    assert obs["context"] == render_header(task.question, sigs) + f"Note: the answer is {task.answer}\n"
    assert info["context_folded"] and info["events"] == ["note"] and info["outcome"] == OK
    before = obs["context"]
    obs, _, done, _, info = env.step(f'<call>answer {{"value": "{task.answer}"}}</call>')
    assert not info["context_folded"] and obs["context"] == before + info["action_text"] + info["observation_text"]
    assert done and info["is_success"] and info["context_actions"]["notes"] == 1
    # a note costs a step but no efficiency: 2 environment calls = min_calls
    assert info["reward_components"]["efficiency"] == 0.0 and info["n_calls"] == 3
    env.close()
    counted = EnvConfig(context_actions=on(tmp_path, tools=["note"], count_in_efficiency=True))
    env = AgentEnv(world=shop, tasks=[task], config=counted)
    env.reset(seed=0)
    for text in (lookup, '<call>note {"text": "x"}</call>', f'<call>answer {{"value": "{task.answer}"}}</call>'):
        *_, info = env.step(text)
    assert info["reward_components"]["efficiency"] == pytest.approx(-1 / 8)
    env.close()


def test_bad_context_action_parameters_and_config_are_refused(shop, tmp_path):
    task = shop.builtin_tasks["train"][0]
    env = AgentEnv(world=shop, tasks=[task], config=EnvConfig(context_actions=on(tmp_path)))
    env.reset(seed=0)
    *_, info = env.step('<call>plan {"steps": []}</call>')
    assert info["outcome"] == "invalid_params" and info["events"] == []
    *_, info = env.step('<call>note {"text": "   "}</call>')
    assert info["outcome"] == "invalid_params"
    env.close()
    with pytest.raises(ValueError, match="at most once"):
        ContextActionsConfig(tools=["note", "note"])
    with pytest.raises(ValueError):
        ContextActionsConfig(tools=["forget"])
    off = AgentEnv(world=shop, tasks=[task])  # the default offers none of them
    obs, info = off.reset(seed=0)
    assert "note(" not in obs["context"] and "context_actions" not in info
    *_, info = off.step('<call>note {"text": "x"}</call>')
    assert info["outcome"] == "invalid_action" and "events" not in info
    off.close()


# ------------------------------------------------------------------------------------------------------------ plan
def test_plan_sub_goals_complete_in_order_by_later_successful_calls():
    def call(tool, outcome=OK, **params):
        return {"tool": tool, "params": params, "outcome": outcome}

    calls = [call("lookup", name="Kettle"), call("lookup", TOOL_ERROR, name="Wild Torch"),
             call("lookup", name="Wild Torch", field="price"), call("calc", expr="1+2"), call("answer", ANSWER, value=3)]
    assert match_plan(["lookup wild torch", "calc", "answer"], calls) == [2, 3, 4]
    assert match_plan(["calc", "lookup"], calls) == [3, None]  # a sub-goal is done only after the previous one
    assert match_plan(["search"], calls) == [None] and match_plan([], calls) == []


def test_plan_events_reach_the_step_info(shop, tmp_path):
    task = next(t for t in shop.builtin_tasks["train"] if t.family == "lookup_calc")
    env = AgentEnv(world=shop, tasks=[task], config=EnvConfig(context_actions=on(tmp_path, tools=["plan"])))
    env.reset(seed=0)
    events = []
    for tool, params in [("plan", {"steps": ["lookup", "calc", "answer"]})] + shop.reference_calls(task):
        from pipeline.envs.protocol import format_action

        *_, info = env.step(format_action(tool, params))
        events.append(info["events"])
    assert events == [["plan"], ["subgoal_done"], ["subgoal_done"], ["subgoal_done", "plan_complete"]]
    assert info["is_success"] and info["context_actions"]["plan_steps"] == info["context_actions"]["plan_completed"] == 3
    assert info["verifier"]["passed"]
    env.close()


# ------------------------------------------------------------------------------------------------------ long tasks
def _expert_contexts(shop, task, cfg: EnvConfig) -> tuple[dict, list[str], str]:
    """The expert's episode: the last info, its action texts, and the context it wrote its calc from."""
    env = AgentEnv(world=shop, tasks=[task], config=cfg)
    obs, info = env.reset(seed=0)
    expert, actions, at_calc, done, history = shop.expert(), [], None, False, []
    expert.reset(task)
    while not done:
        # a recorded episode's contexts replay from its steps alone (note_of: the note in force), as SFT replays them
        assert obs["context"] == render_context(task.question, env.tools.signatures, history, cfg.history_window,
                                                note_of(history))
        text = expert.act(obs, info)
        if text.startswith("<call>calc"):
            at_calc = obs["context"]
        actions.append(text)
        obs, _, term, trunc, info = env.step(text)
        history.append((info["action_text"], info["observation_text"]))
        done = term or trunc
    env.close()
    return info, actions, at_calc


def test_long_tasks_need_notes_the_expert_writes_them_and_the_default_build_is_unchanged(shop, long_tasks, tmp_path):
    task = long_tasks[0]
    assert task.min_calls == 22 and len(task.entities) == 20
    field, table = task.plan[0]["params"]["field"], {p["name"]: p for p in shop.world.products}
    values = [str(table[name][field]) for name in task.entities]
    first = f'"name": "{task.entities[0]}"'
    info, actions, at_calc = _expert_contexts(shop, task, EnvConfig(**LONG_ENV))
    assert info["is_success"] and not any(a.startswith(("<call>note", "<call>plan")) for a in actions)
    assert first not in at_calc  # without notes the first lookups fell out of the summary line too
    info_on, actions_on, at_calc_on = _expert_contexts(shop, task, EnvConfig(**LONG_ENV, context_actions=on(tmp_path)))
    assert info_on["is_success"] and actions_on[0] == '<call>plan {"steps": ["lookup", "calc", "answer"]}</call>'
    notes = [a for a in actions_on if a.startswith("<call>note")]
    assert notes and info_on["context_actions"]["notes"] == len(notes)
    assert info_on["context_actions"]["plan_completed"] == 3
    visible = at_calc_on.split("Note: ")[1]
    assert all(v in visible for v in values) and len(at_calc_on) < len(at_calc)
    assert info_on["reward_components"]["efficiency"] == 0.0  # the plan and notes cost steps, not efficiency
    # a share of 0 draws exactly the default tasks; with long tasks, the regular ones are the default's first ones
    default = generate_tasks(shop.world, "train", 8, {1: 1, 2: 1, 3: 1, 4: 1}, 0, shop.solve)
    assert generate_tasks(shop.world, "train", 8, {1: 1, 2: 1, 3: 1, 4: 1}, 0, shop.solve, long_share=0.0) == default
    with_long = generate_tasks(shop.world, "train", 8, {1: 1, 2: 1, 3: 1, 4: 1}, 0, shop.solve, long_share=0.25)
    assert with_long[:6] == default[:6] and [t.family for t in with_long[6:]] == [LONG_FAMILY] * 2
    assert all(shop.verify_task(t) for t in with_long[6:])


# -------------------------------------------------------------------------------------------- rollout and training
@pytest.fixture(scope="module")
def tiny_policy(shop, long_tasks):
    from pipeline.envs.context_actions import context_specs
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.episodes import run_episode
    from pipeline.policy.model import build_policy
    from pipeline.policy.tokenizer import train_tokenizer

    sigs = [s.signature() for s in shop.tools()] + [s.signature() for s in context_specs(ContextActionsConfig())]
    texts = [f"{d['title']}\n{d['text']}" for d in shop.world.corpus]
    tasks = shop.builtin_tasks["train"][:20] + long_tasks[:1]
    texts += [render_header(t.question, sigs) for t in tasks]
    env = AgentEnv(world=shop, tasks=tasks, config=EnvConfig(**LONG_ENV))
    for i, t in enumerate(tasks):
        texts += [s["action"] + s["observation"] for s in run_episode(env, shop.expert(), t, i)["steps"]]
    tok = train_tokenizer(texts + ['<call>note {"text": "price so far: 1"}</call>'], vocab_size=600)
    torch.manual_seed(0)
    return build_policy(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_positions=1024, seed=0), tok), tok


def test_the_rollout_engine_records_step_events_and_starts_a_segment_at_a_note(shop, long_tasks, tiny_policy,
                                                                                 tmp_path):
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.rollout import RolloutEngine

    model, tok = tiny_policy
    cfg = EnvConfig(**LONG_ENV, context_actions=on(tmp_path))
    engine = RolloutEngine(model, tok, shop, cfg, RolloutConfig(max_new_tokens=12, batch_size=4))
    (demo,) = engine.demonstrate(long_tasks[:1], [0], shop.expert)
    assert demo["success"] and len(demo["step_events"]) == len(demo["steps"]) == len(demo["step_rewards"])
    assert demo["step_events"][0] == ["plan"] and demo["step_events"][-1] == ["subgoal_done", "plan_complete"]
    n_notes = sum(ev == ["note"] for ev in demo["step_events"])
    report = shop.check_episodes([demo], "trajectories", "demo", cfg, require_tokens=True)  # the shop's GX suite
    assert report.success, report
    assert n_notes >= 1 and len(demo["segments"]) == 1 + n_notes  # the only re-bases are the notes here
    sampled = engine.run(shop.builtin_tasks["train"][:4], [0, 1, 2, 3])
    for rec in sampled:  # the model's own episodes carry the fields too
        assert len(rec["step_events"]) == len(rec["steps"]) and set(rec["context_actions"]) >= {"notes", "recalls"}
    mets = context_metrics([demo])
    assert mets["context/plan_steps"] == 3 and mets["context/plan_completion"] == 1.0
    assert mets["context/notes"] == n_notes and mets["context/episodes_with_actions_share"] == 1.0
    assert context_metrics([{k: v for k, v in r.items() if k not in ("context_actions", "step_events")}
                            for r in sampled]) == {}
    off = RolloutEngine(model, tok, shop, EnvConfig(**LONG_ENV), RolloutConfig(max_new_tokens=12, batch_size=4))
    (plain,) = off.demonstrate(long_tasks[:1], [0], shop.expert)
    assert "step_events" not in plain and "context_actions" not in plain and len(plain["steps"]) == 22


TRAIN_YAML = """
env:
  max_steps: 3
  context_actions:
    enabled: true
    memory_path: {memory}
rollout:
  max_new_tokens: 10
  batch_size: 8
train:
  algorithm: rloo
  updates: 2
  tasks_per_update: 2
  group_size: 2
  checkpoint_every: 2
  eval_every: 2
  eval_tasks: 4
  test_tasks: 4
  lr: 0.01
  deepspeed_config: {repo}/configs/deepspeed_zero2.json
"""


@pytest.mark.slow
def test_a_tiny_training_run_with_the_context_actions_on_reports_them_per_update(tmp_path, monkeypatch):
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build
    from pipeline.envs.context_actions import context_specs
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy, save_policy
    from pipeline.policy.tokenizer import corpus_texts, train_tokenizer
    from pipeline.train.worker import run_worker

    build(BuildEnvConfig(options={"n_products": 40, "n_suppliers": 10},
                         tasks_per_split={"train": 12, "validation": 4, "test": 4}),
          EnvConfig(), tmp_path / "data", tmp_path / "metrics" / "build_env.json")
    world = ShopWorld.load(tmp_path / "data" / "env")
    sigs = [s.signature() for s in world.tools()] + [s.signature() for s in context_specs(ContextActionsConfig())]
    world.close()
    tok = train_tokenizer(corpus_texts(tmp_path / "data", sigs), vocab_size=400)
    torch.manual_seed(0)
    model = build_policy(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_positions=512, seed=0), tok)
    save_policy(model, tok, tmp_path / "models" / "adapted", {"note": "tiny random test policy"})
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "params.yaml").write_text(TRAIN_YAML.format(memory=tmp_path / "mem.sqlite", repo=repo))
    monkeypatch.chdir(tmp_path)
    result = run_worker("params.yaml", ckpt="ckpt-ctx", out="models/policy-ctx", stop_after=1)
    h = result["history"][0]
    # only an episode that ran with the context actions reports them
    assert "context/plan_completion" in h and "context/memory_notes" in h and "context/context_calls" in h
    assert (tmp_path / "mem.sqlite").exists()
    assert any(k.startswith("tools/share_") for k in h)


def test_a_tiny_build_with_long_tasks_and_the_actions_on_validates_and_its_demonstrations_use_them(tmp_path):
    import json

    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.build_env.main import build

    cfg = BuildEnvConfig(options={"n_products": 40, "n_suppliers": 10, "long_task_share": 0.25, "long_task_lookups": 8},
                         tasks_per_split={"train": 16, "validation": 4, "test": 4},
                         demos={"family_coverage": {LONG_FAMILY: 1.0}})
    env_cfg = EnvConfig(max_steps=16, history_window=3, context_actions=on(tmp_path))
    metrics = build(cfg, env_cfg, tmp_path / "data", tmp_path / "metrics" / "build_env.json")
    assert metrics["validation"]["expectations_failed"] == 0
    tasks = [json.loads(line) for line in (tmp_path / "data" / "tasks" / "train.jsonl").read_text().splitlines()]
    long_ids = {t["task_id"] for t in tasks if t["family"] == LONG_FAMILY}
    assert len(long_ids) == 4 and all(t["min_calls"] == 10 for t in tasks if t["task_id"] in long_ids)
    demos = [json.loads(line) for line in (tmp_path / "data" / "demos" / "train.jsonl").read_text().splitlines()]
    long_demos = [d for d in demos if d["task_id"] in long_ids]
    assert long_demos and all(d["steps"][0]["action"].startswith("<call>plan") for d in long_demos)
    assert all(any(s["action"].startswith("<call>note") for s in d["steps"]) for d in long_demos)
    assert not any(s["action"].startswith(("<call>note", "<call>plan")) for d in demos if d["task_id"] not in long_ids
                   for s in d["steps"])
