"""The rollout engine: masks, batched == unbatched, recorded == recomputed log-probabilities, seeds, segments."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pipeline.envs.config import EnvConfig
from pipeline.envs.runner import AgentEnv
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.expert import ExpertPolicy
from pipeline.envs.prompt import render_header
from pipeline.envs.protocol import sanitize
from pipeline.envs.shop.tasks import generate_tasks
from pipeline.core.errors import AgentRLError
from pipeline.policy.episodes import run_episode, summarize
from pipeline.policy.config import ModelConfig, RolloutConfig
from pipeline.policy.model import build_policy
from pipeline.policy.rollout import ModelPolicy, RolloutEngine
from pipeline.policy.sampling import filtered_logprobs, sample_tokens
from pipeline.policy.scoring import sequence_logprobs, split_segments
from pipeline.policy.tokenizer import encode_context, train_tokenizer

TINY = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_positions=512, seed=0)
ENV = EnvConfig(max_steps=4)
ROLL = RolloutConfig(max_new_tokens=10, batch_size=6)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def runtime():
    rt = ShopWorld.default()
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def tasks(runtime):
    return generate_tasks(runtime.world, "train", 40, {1: 1, 2: 1, 3: 1, 4: 1}, 0, runtime.solve)


@pytest.fixture(scope="module")
def tokenizer(runtime, tasks):
    sigs = [s.signature() for s in runtime.tools()]
    texts = [f"{d['title']}\n{d['text']}" for d in runtime.world.corpus]
    texts += [render_header(t.question, sigs) for t in tasks]
    env = AgentEnv(world=runtime, tasks=tasks)
    for i, t in enumerate(tasks):
        texts += [s["action"] + s["observation"] for s in run_episode(env, ExpertPolicy(), t, i)["steps"]]
    return train_tokenizer(texts, vocab_size=600)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_policy(TINY, tokenizer)


@pytest.fixture(scope="module")
def sampled(model, tokenizer, runtime, tasks):
    engine = RolloutEngine(model, tokenizer, runtime, ENV, ROLL.model_copy(update={"temperature": 1.3}))
    return engine.run(tasks[:10], list(range(10)), policy_version=3)


def action_runs(rec: dict) -> list[list[int]]:
    """Maximal runs of mask-1 tokens: one per action."""
    runs, cur = [], []
    for t, m in zip(rec["token_ids"], rec["action_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


# ------------------------------------------------------------------------------------------------------------ records
def test_records_feed_summarize_and_carry_the_run_episode_fields(sampled, runtime, tasks):
    env = AgentEnv(world=runtime, tasks=tasks, config=ENV)
    reference = run_episode(env, ExpertPolicy(), tasks[0], 0)
    for rec in sampled:
        assert set(reference) <= set(rec)
        assert {"token_ids", "logprobs", "action_mask", "segments", "policy_version", "actions"} <= set(rec)
        assert len(rec["token_ids"]) == len(rec["logprobs"]) == len(rec["action_mask"])
        assert rec["policy_version"] == 3 and len(rec["actions"]) == len(rec["steps"]) == rec["n_calls"]
    assert [r["task_id"] for r in sampled] == [t.task_id for t in tasks[:10]]
    assert summarize(sampled)["overall"]["n"] == 10


def test_actions_cut_at_max_new_tokens_are_marked_in_the_records(sampled, model, tokenizer, runtime):
    stop = RolloutEngine(model, tokenizer, runtime, ENV, ROLL).stop_ids
    flags = [a["token_limit"] for rec in sampled for a in rec["actions"]]
    cut = [len(run) == ROLL.max_new_tokens and run[-1] not in stop for rec in sampled for run in action_runs(rec)]
    assert flags == cut and any(flags)


def test_mask_is_one_exactly_on_sampled_tokens_and_they_decode_to_the_actions(sampled, tokenizer):
    for rec in sampled:
        runs = action_runs(rec)
        assert len(runs) == len(rec["steps"])
        for run, step in zip(runs, rec["steps"]):
            text = tokenizer.decode(run, clean_up_tokenization_spaces=False)
            assert sanitize(text.strip())[:ENV.max_action_chars] == step["action"]  # the env's normalisation only
            assert len(run) <= ROLL.max_new_tokens
        # everything unmasked is prompt or observation: the first segment starts with the env's first context
        unmasked = [t for t, m in zip(rec["token_ids"], rec["action_mask"]) if not m]
        assert all(lp == 0.0 for lp, m in zip(rec["logprobs"], rec["action_mask"]) if not m)
        assert all(lp < 0.0 for lp, m in zip(rec["logprobs"], rec["action_mask"]) if m)
        assert tokenizer.decode(unmasked).startswith("<bos>You are an agent")


def test_observations_follow_their_actions_in_the_token_stream(sampled, tokenizer):
    for rec in sampled:
        if len(rec["segments"]) > 1:
            continue
        stream = tokenizer.decode(rec["token_ids"][1:], clean_up_tokenization_spaces=False)
        pos = 0
        for step in rec["steps"][:-1]:
            pos = stream.index(step["observation"], pos) + len(step["observation"])


def test_recorded_logprobs_equal_a_recomputing_forward_pass(sampled, model):
    with torch.no_grad():
        for rec in sampled:
            lp = sequence_logprobs(model, rec["token_ids"], rec["action_mask"], temperature=1.3,
                                   segments=rec["segments"])
            torch.testing.assert_close(lp, torch.tensor(rec["logprobs"]), atol=1e-4, rtol=0)


def test_top_p_logprobs_are_those_of_the_nucleus_actually_sampled(model, tokenizer, runtime, tasks):
    cfg = ROLL.model_copy(update={"temperature": 0.8, "top_p": 0.7})
    recs = RolloutEngine(model, tokenizer, runtime, ENV, cfg).run(tasks[:4], [11, 12, 13, 14])
    with torch.no_grad():
        for rec in recs:
            lp = sequence_logprobs(model, rec["token_ids"], rec["action_mask"], 0.8, 0.7, segments=rec["segments"])
            torch.testing.assert_close(lp, torch.tensor(rec["logprobs"]), atol=1e-4, rtol=0)


def test_batched_generation_equals_unbatched_generation(model, tokenizer, runtime, tasks):
    """Left padding, per-row positions, rows finishing at different times and slot refills change nothing."""
    run = lambda bs: RolloutEngine(model, tokenizer, runtime, ENV, ROLL.model_copy(update={"batch_size": bs})).run(
        tasks[:8], list(range(8)), greedy=True)  # noqa: E731
    one, many = run(1), run(5)
    for a, b in zip(one, many):
        assert a["token_ids"] == b["token_ids"] and a["steps"] == b["steps"]
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-5, rtol=0)


def test_same_seeds_same_episodes_other_seeds_other_episodes(model, tokenizer, runtime, tasks, sampled):
    engine = RolloutEngine(model, tokenizer, runtime, ENV, ROLL.model_copy(update={"temperature": 1.3}))
    again = engine.run(tasks[:10], list(range(10)), policy_version=3)
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in sampled]
    assert [r["logprobs"] for r in again] == [r["logprobs"] for r in sampled]
    other = engine.run(tasks[:10], list(range(100, 110)))
    assert [r["token_ids"] for r in other] != [r["token_ids"] for r in sampled]
    # an episode's randomness is its own: the same (task, seed) in another batch gives the same episode
    alone = engine.run([tasks[3]], [3])[0]
    assert alone["token_ids"] == sampled[3]["token_ids"]


def test_folded_history_starts_a_new_segment_that_recomputes_exactly(model, tokenizer, runtime, tasks):
    env = EnvConfig(max_steps=5, history_window=1)
    recs = RolloutEngine(model, tokenizer, runtime, env, ROLL).run(tasks[:4], [1, 2, 3, 4])
    folded = [r for r in recs if len(r["segments"]) > 1]
    assert folded, "with a window of one pair every episode of 3+ steps folds"
    with torch.no_grad():
        for rec in folded:
            pieces = split_segments(rec["token_ids"], rec["token_ids"], rec["segments"])
            assert all(p[0] == tokenizer.bos_token_id for p in pieces)
            lp = sequence_logprobs(model, rec["token_ids"], rec["action_mask"], segments=rec["segments"])
            torch.testing.assert_close(lp, torch.tensor(rec["logprobs"]), atol=1e-4, rtol=0)


def test_segments_never_outgrow_the_model(tokenizer, runtime, tasks):
    small = build_policy(TINY.model_copy(update={"max_positions": 256}), tokenizer)
    cfg = RolloutConfig(max_new_tokens=40, batch_size=3)
    recs = RolloutEngine(small, tokenizer, runtime, EnvConfig(max_steps=8), cfg).run(tasks[:3], [0, 1, 2])
    for rec in recs:
        starts = rec["segments"] + [len(rec["token_ids"])]
        assert max(b - a for a, b in zip(starts[:-1], starts[1:])) <= 256
    with torch.no_grad():
        lp = sequence_logprobs(small, recs[0]["token_ids"], recs[0]["action_mask"], segments=recs[0]["segments"])
    torch.testing.assert_close(lp, torch.tensor(recs[0]["logprobs"]), atol=1e-4, rtol=0)


def test_batch_recomputation_with_left_padding(sampled, model):
    recs = [r for r in sampled if len(r["segments"]) == 1][:3]
    T = max(len(r["token_ids"]) for r in recs)
    ids = torch.zeros(len(recs), T, dtype=torch.long)
    mask, attn = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, r in enumerate(recs):
        n = len(r["token_ids"])
        ids[i, T - n:], mask[i, T - n:] = torch.tensor(r["token_ids"]), torch.tensor(r["action_mask"])
        attn[i, T - n:] = 1
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, mask, temperature=1.3, attention_mask=attn)
    for i, r in enumerate(recs):
        torch.testing.assert_close(lp[i, T - len(r["token_ids"]):], torch.tensor(r["logprobs"]), atol=1e-4, rtol=0)


def test_recomputation_is_differentiable(sampled, model):
    rec = sampled[0]
    lp = sequence_logprobs(model, rec["token_ids"], rec["action_mask"], segments=rec["segments"])
    lp.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------------- sampling
def test_filtered_logprobs_known_answer():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    lp = filtered_logprobs(logits, 1.0, 0.7)
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.5 / 0.8, 0.3 / 0.8])) and lp[0, 2] == -math.inf
    assert torch.allclose(filtered_logprobs(logits, 2.0).exp().sum(), torch.tensor(1.0))


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().expand(20000, 3)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok, lp = sample_tokens(logits, u, 1.0, 1.0, greedy=False)
    freq = torch.bincount(tok, minlength=3).float() / len(tok)
    assert torch.allclose(freq, probs, atol=0.015)
    assert torch.allclose(lp, probs.log()[tok])
    tok, _ = sample_tokens(logits[:4], torch.tensor([0.0, 0.099, 0.1, 0.95], dtype=torch.float64), 1.0, 1.0, False)
    assert tok.tolist() == [0, 0, 1, 2]
    g, glp = sample_tokens(logits[:2], u[:2], 1.0, 1.0, greedy=True)
    assert g.tolist() == [1, 1] and torch.allclose(glp, probs.log()[1].expand(2))


# ------------------------------------------------------------------------------------------------ single episode / misc
def test_model_policy_plays_run_episode_and_matches_the_engine_greedily(model, tokenizer, runtime, tasks):
    env = AgentEnv(world=runtime, tasks=tasks, config=ENV)
    policy = ModelPolicy(model, tokenizer, ROLL, greedy=True)
    rec = run_episode(env, policy, tasks[5], 5)
    engine = RolloutEngine(model, tokenizer, runtime, ENV, ROLL).run([tasks[5]], [5], greedy=True)[0]
    # the engine keeps the policy's own tokens; ModelPolicy re-encodes the context: equal whenever the env did not
    # have to normalise an action, which holds for the first action at least
    assert rec["steps"][0] == engine["steps"][0]


def test_complete_writes_one_action_per_context(model, tokenizer):
    engine = RolloutEngine(model, tokenizer, cfg=ROLL)
    out = engine.complete(["You are an agent.\nTask: x\n", "Task: y\n"], seeds=[0, 1], greedy=True)
    assert len(out) == 2 and all(isinstance(o["text"], str) and sum(o["action_mask"]) >= 1 for o in out)
    assert out[0]["token_ids"][: len(encode_context(tokenizer, out[0]["context"]))] == encode_context(
        tokenizer, out[0]["context"])


def test_bad_calls_are_clear_errors(model, tokenizer, runtime, tasks):
    with pytest.raises(AgentRLError, match="one seed per episode"):
        RolloutEngine(model, tokenizer, runtime, ENV, ROLL).run(tasks[:2], [0])
    with pytest.raises(AgentRLError, match="2 tasks but 1 options"):
        RolloutEngine(model, tokenizer, runtime, ENV, ROLL).run(tasks[:2], [0, 1], options=[None])
    with pytest.raises(AgentRLError, match="needs an environment"):
        RolloutEngine(model, tokenizer, cfg=ROLL).run(tasks[:1], [0])
    assert RolloutEngine(model, tokenizer, runtime, ENV, ROLL).run([], []) == []


def test_bf16_rollouts_run_and_stay_close(model, tokenizer, runtime, tasks):
    recs = RolloutEngine(model, tokenizer, runtime, ENV, ROLL.model_copy(update={"dtype": "bf16"})).run(
        tasks[:2], [0, 1], greedy=True)
    with torch.no_grad():
        lp = sequence_logprobs(model, recs[0]["token_ids"], recs[0]["action_mask"], segments=recs[0]["segments"])
    assert (lp - torch.tensor(recs[0]["logprobs"])).abs().max() < 0.1


def test_num_threads_applies_during_the_run_only(model, tokenizer, runtime, tasks):
    before = torch.get_num_threads()
    seen = []
    engine = RolloutEngine(model, tokenizer, runtime, ENV, ROLL.model_copy(update={"num_threads": 2}))
    forward = engine._forward
    engine._forward = lambda *a, **k: (seen.append(torch.get_num_threads()), forward(*a, **k))[1]
    engine.run(tasks[:1], [0])
    assert set(seen) == {2} and torch.get_num_threads() == before


def test_tool_threads_step_a_decode_steps_environments_side_by_side_and_change_no_episode(model, tokenizer, runtime,
                                                                                         tasks, monkeypatch):
    """rollout.tool_threads: the environment steps of the actions that end in one decode step overlap (each step
    here sleeps, as a slow tool would), and the episodes equal those of steps taken one after another."""
    import threading
    import time

    from pipeline.policy.episode_drivers import EnvEpisode

    real, lock, live = EnvEpisode.step, threading.Lock(), {"now": 0, "peak": 0}

    def slow_step(self, text, token_limit=False):
        with lock:
            live["now"] += 1
            live["peak"] = max(live["peak"], live["now"])
        time.sleep(0.02)
        with lock:
            live["now"] -= 1
        return real(self, text, token_limit)

    monkeypatch.setattr(EnvEpisode, "step", slow_step)
    out = {}
    for n in (0, 4):
        live["peak"] = 0
        engine = RolloutEngine(model, tokenizer, runtime, ENV, ROLL.model_copy(update={"tool_threads": n}))
        out[n] = (engine.run(tasks[:12], list(range(30, 42))), live["peak"])
    assert out[0][1] == 1, "with tool_threads 0 the engine steps one environment at a time"
    assert out[4][1] > 1, "with tool_threads 4 the steps of one decode step should overlap"
    assert_same_episodes(out[4][0], out[0][0])
    assert [r["success"] for r in out[4][0]] == [r["success"] for r in out[0][0]]


# ------------------------------------------------------------------------------------------------ shared prompt prefix
def run_both(model, tokenizer, runtime, tasks, seeds, env=ENV, **update) -> tuple[list[dict], list[dict], dict]:
    """The same run with the prefix cache on and off; returns both records and the 'on' engine's stats."""
    out = {}
    for on in (True, False):
        engine = RolloutEngine(model, tokenizer, runtime, env, ROLL.model_copy(update={**update, "prefix_cache": on}))
        out[on] = (engine.run(tasks, seeds, greedy=update.get("greedy")), engine.stats)
    return out[True][0], out[False][0], out[True][1]


def assert_same_episodes(on: list[dict], off: list[dict]) -> None:
    for a, b in zip(on, off, strict=True):
        assert a["token_ids"] == b["token_ids"] and a["action_mask"] == b["action_mask"]
        assert a["actions"] == b["actions"] and a["steps"] == b["steps"] and a["segments"] == b["segments"]
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-5, rtol=0)


def test_prefix_cache_changes_no_greedy_episode(model, tokenizer, runtime, tasks):
    """Batch 5 of 12 episodes: later episodes take freed slots and reuse the prefix of the first five prompts."""
    on, off, stats = run_both(model, tokenizer, runtime, tasks[:12], list(range(12)), greedy=True, batch_size=5)
    assert stats["prefix_tokens"] >= 50  # the system line and the tool list
    assert stats["prefix_reused_tokens"] >= 12 * stats["prefix_tokens"] * 0.9
    assert_same_episodes(on, off)


def test_prefix_cache_changes_no_sampled_episode_and_recomputes_exactly(model, tokenizer, runtime, tasks):
    on, off, stats = run_both(model, tokenizer, runtime, tasks[:10], list(range(50, 60)), temperature=1.3)
    assert stats["prefix_reused_tokens"] > 0
    assert_same_episodes(on, off)
    with torch.no_grad():
        for rec in on:
            lp = sequence_logprobs(model, rec["token_ids"], rec["action_mask"], temperature=1.3,
                                   segments=rec["segments"])
            torch.testing.assert_close(lp, torch.tensor(rec["logprobs"]), atol=1e-4, rtol=0)
            assert all(m == (lp_ < 0.0) for lp_, m in zip(rec["logprobs"], rec["action_mask"]))


def test_prefix_cache_serves_new_segments_of_folded_histories(model, tokenizer, runtime, tasks):
    on, off, stats = run_both(model, tokenizer, runtime, tasks[:4], [1, 2, 3, 4],
                              env=EnvConfig(max_steps=5, history_window=1), greedy=True)
    assert any(len(r["segments"]) > 1 for r in on)
    rebased_prompts = sum(len(r["segments"]) for r in on)  # first prompts and re-based contexts
    assert stats["prefix_reused_tokens"] >= rebased_prompts * stats["prefix_tokens"] * 0.9
    assert_same_episodes(on, off)


def test_prefix_cache_with_one_episode_or_nothing_shared(model, tokenizer, runtime, tasks):
    on, off, stats = run_both(model, tokenizer, runtime, [tasks[7]], [7], greedy=True)
    assert stats["prefix_tokens"] == 0 and stats["prefix_reused_tokens"] == 0
    assert_same_episodes(on, off)
    contexts = ["You are an agent.\nTask: x\n", "Task: y\n", "Something else entirely\n"]
    engines = [RolloutEngine(model, tokenizer, cfg=ROLL.model_copy(update={"prefix_cache": on})) for on in (1, 0)]
    a, b = [e.complete(contexts, seeds=[0, 1, 2], greedy=True) for e in engines]
    assert engines[0].stats["prefix_tokens"] == 0  # <bos> alone is not worth a forward
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]


def test_prefix_is_compared_as_token_ids_and_covers_what_each_prompt_shares(model, tokenizer, runtime, tasks):
    """Prompts whose common text ends inside a word that BPE merges differently ("sear" / "search"), a prompt that is
    the whole shared prefix, and prompts (started later in freed slots) that share only part of it."""
    head = AgentEnv(world=runtime, tasks=tasks, config=ENV).reset(seed=0, options={"task": tasks[0]})[0]["context"]
    short, long_ = encode_context(tokenizer, head + "sear"), encode_context(tokenizer, head + "search")
    assert long_[: len(short)] != short  # the text "...sear" is shared, its last tokens are not
    contexts = [head + "sear", head + "search", head, head, head[:40] + "elsewhere", head[:-10]]
    for bs in (2, 6):
        engines = [RolloutEngine(model, tokenizer, cfg=ROLL.model_copy(update={"prefix_cache": on, "batch_size": bs}))
                   for on in (True, False)]
        a, b = [e.complete(contexts, seeds=list(range(6)), greedy=True) for e in engines]
        assert engines[0].stats["prefix_reused_tokens"] > 0
        for x, y in zip(a, b, strict=True):
            assert x["token_ids"] == y["token_ids"] and x["text"] == y["text"]
            torch.testing.assert_close(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), atol=1e-5, rtol=0)


def test_shared_prefix_covers_the_common_token_ids_short_of_the_last_token(model, tokenizer):
    engine = RolloutEngine(model, tokenizer, cfg=ROLL)
    prompts = [[1] + list(range(10, 30)) + [5], [1] + list(range(10, 30)) + [6, 7]]
    prefix = engine._shared_prefix(prompts)
    assert prefix.ids == prompts[0][:21] and prefix.cache.get_seq_length() == 21
    assert prefix.covers(prompts[1]) == 21
    assert prefix.covers(prompts[0][:21]) == 20  # the last token is always prefilled: it samples the action
    assert prefix.covers([1, 10, 11, 99, 12]) == 3
    assert prefix.covers([2] + prompts[0][1:]) == 0
    assert engine._shared_prefix([prompts[0]]) is None and engine._shared_prefix([[1, 2, 3], [1, 2, 4]]) is None


def test_prefix_follows_weights_updated_in_place_between_calls(model, tokenizer, runtime, tasks):
    """RL updates the policy in place between calls of one engine: the prefix must be that of the current weights."""
    policy = copy.deepcopy(model)
    engine = RolloutEngine(policy, tokenizer, runtime, ENV, ROLL)
    before = engine.run(tasks[:4], [0, 1, 2, 3], greedy=True)
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)
    after = engine.run(tasks[:4], [0, 1, 2, 3], greedy=True)
    assert engine.stats["prefix_reused_tokens"] > 0
    off = RolloutEngine(policy, tokenizer, runtime, ENV, ROLL.model_copy(update={"prefix_cache": False}))
    assert_same_episodes(after, off.run(tasks[:4], [0, 1, 2, 3], greedy=True))
    assert [r["logprobs"] for r in after] != [r["logprobs"] for r in before]


def test_a_side_forward_extends_its_rows_histories_in_place():
    """SlotCache.history copies each row's last n columns once into a buffer with room for the chunk; the side
    forward's update writes the chunk there (no concatenation, no new buffer), after the histories unchanged."""
    from pipeline.policy.kv_cache import SlotCache

    g = torch.Generator().manual_seed(0)
    cache = SlotCache(2, 3)
    for i in range(2):  # 5 columns in every row of every layer
        cache.update(torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 2, 5, 4, generator=g), i)
    side = cache.history([2, 0], 3, 2)
    for i, (layer, dst) in enumerate(zip(cache.layers, side.layers)):
        buffer = dst.kbuf
        new_k, new_v = torch.randn(2, 2, 2, 4, generator=g), torch.randn(2, 2, 2, 4, generator=g)
        keys, values = side.update(new_k, new_v, i)
        assert dst.kbuf is buffer and keys.shape == (2, 2, 5, 4)
        assert torch.equal(keys[:, :, :3], layer.keys[[2, 0], :, 2:]) and torch.equal(keys[:, :, 3:], new_k)
        assert torch.equal(values[:, :, :3], layer.values[[2, 0], :, 2:]) and torch.equal(values[:, :, 3:], new_v)


def test_growing_rows_to_the_left_reallocates_the_cache_a_logarithmic_number_of_times(monkeypatch):
    """Rows that grow by chunks (SlotCache.place -> ensure_length) move the whole cache only when the free columns on
    the left run out; the room made is half the used length again, so 200 growths of 10 columns (2,000 columns)
    copy the cache a handful of times, not once every few chunks."""
    from pipeline.policy.kv_cache import SlotLayer

    layer = SlotLayer(2)
    layer.update(torch.zeros(2, 1, 10, 4), torch.zeros(2, 1, 10, 4))
    moves = []
    real = SlotLayer._realloc
    monkeypatch.setattr(SlotLayer, "_realloc", lambda self, *a, **k: (moves.append(a), real(self, *a, **k)))
    for n in range(20, 2010, 10):
        layer.ensure_length(n)
        assert layer.get_seq_length() == n and layer.keys.shape[2] == n
    assert len(moves) <= 12, len(moves)


def test_records_are_episode_records_as_declared(sampled, model, tokenizer, runtime, tasks):
    """Every key the runner, the engine and demonstrations write is declared in EpisodeRecord, with its type."""
    from pipeline.policy.record import EPISODE_KEYS, STREAM_KEYS, record_problems

    for rec in sampled:
        assert record_problems(rec, EPISODE_KEYS + STREAM_KEYS) == []
    env = AgentEnv(world=runtime, tasks=tasks, config=ENV)
    assert record_problems(run_episode(env, ExpertPolicy(), tasks[0], 0)) == []
    engine = RolloutEngine(model, tokenizer, runtime, ENV, ROLL)
    demos = engine.demonstrate(tasks[:3], [0, 1, 2], ExpertPolicy)
    assert all(record_problems(d, EPISODE_KEYS + STREAM_KEYS) == [] and d["demonstrated"] for d in demos)
    bad = {**sampled[0], "sucess": True, "level": "1"}
    del bad["seed"]
    assert record_problems(bad, EPISODE_KEYS + STREAM_KEYS) == ["missing 'seed'", "'level' is str, not int",
                                                          "undeclared key 'sucess'"]
