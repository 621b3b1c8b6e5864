"""Annealed tool-choice noise (train.exploration): the schedule, the mixture's log-probabilities (hand-computed), a
rollout with ε = 1 that picks tools uniformly, and a tiny training run with the noise on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipeline.policy.sampling import ToolChoiceNoise, mixture_logprobs, mixture_posterior, sample_tokens
from pipeline.train.extensions.tool_noise import annealed_epsilon


def test_annealing_schedule_known_values():
    assert annealed_epsilon(0.4, 0, 10) == pytest.approx(0.4)
    assert annealed_epsilon(0.4, 5, 10) == pytest.approx(0.2)
    assert annealed_epsilon(0.4, 9, 10) == pytest.approx(0.04)
    assert annealed_epsilon(0.4, 12, 10) == 0.0
    assert annealed_epsilon(0.4, 7, 10, anneal=False) == pytest.approx(0.4)


def test_mixture_logprobs_and_posterior_known_values():
    logp = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    # policy branch 0.8, two one-token tools forcing tokens 2 and 3 with 0.1 each
    w = torch.tensor([0.8, 0.1, 0.1], dtype=torch.float64)
    q = mixture_logprobs(logp, w, [None, 2, 3]).exp()
    assert q.tolist() == pytest.approx([0.4, 0.2, 0.2, 0.2])
    post = mixture_posterior(w, logp, [None, 2, 3], 2)  # ∝ [0.8·0.125, 0.1·1, 0.1·0]
    assert post.tolist() == pytest.approx([0.5, 0.5, 0.0])
    # both live branches now follow the policy: q = π
    assert mixture_logprobs(logp, post, [None, None, None]).exp().tolist() == pytest.approx([0.5, 0.25, 0.125, 0.125])


def test_the_recorded_conditionals_multiply_to_the_sequence_mixture():
    """Two-token names [1, 2] and [1, 3], ε = 0.5: P_mix([1, 2]) = 0.5·π(1)·π(2|1) + 0.25 = 0.5·0.1·0.2 + 0.25 = 0.26."""
    p0 = torch.tensor([0.6, 0.1, 0.2, 0.1]).log()
    p1 = torch.tensor([0.2, 0.3, 0.2, 0.3]).log()
    w = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    q0 = mixture_logprobs(p0, w, [None, 1, 1])[1].exp()
    assert float(q0) == pytest.approx(0.55)  # 0.5·0.1 + 0.25 + 0.25
    w = mixture_posterior(w, p0, [None, 1, 1], 1)
    q1 = mixture_logprobs(p1, w, [None, 2, 3])[2].exp()
    assert float(q1) == pytest.approx(0.26 / 0.55)
    assert float(q0 * q1) == pytest.approx(0.26)


class _Stream:
    def __init__(self, ids):
        self.token_ids, self.action_mask = list(ids), [1] * len(ids)


class _Episode:
    tool_names = ("aa", "bb")
    seed = 3


def test_noise_at_epsilon_zero_samples_as_without_it():
    noise = ToolChoiceNoise(call_open_id=3, encode_name=lambda n: {"aa": [7], "bb": [8]}[n])
    noise.reset(0.0)
    g = torch.Generator().manual_seed(0)
    logits, u = torch.randn(5, 12, generator=g), torch.rand(5, generator=g, dtype=torch.float64)
    streams = [_Stream([1, 3]) for _ in range(5)]
    got = noise.sample(logits, u, 0.7, 1.0, streams, [_Episode()] * 5)
    want = sample_tokens(logits, u, 0.7, 1.0, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and noise.stats == {"actions": 0, "noised": 0}


def test_multi_token_names_sharing_a_prefix_are_written_whole_with_the_mixture_logprobs():
    """Names [7, 9], [7, 10] and [11] at ε = 1: every choice writes one whole name and the recorded conditionals
    multiply to 1/3 (the policy branch has weight 0); with ε = 0.5 they multiply to 0.5·π(name) + 0.5/3."""
    names = {"aa": [7, 9], "bb": [7, 10], "cc": [11]}
    for eps in (1.0, 0.5):
        noise = ToolChoiceNoise(call_open_id=3, encode_name=lambda n: names[n])
        noise.reset(eps)
        ep = type("Ep", (), {"tool_names": ("aa", "bb", "cc"), "seed": 0})
        seen = set()
        for seed in range(40):
            ep.seed = seed
            s, logps, pis = _Stream([1, 3]), [], []
            g = torch.Generator().manual_seed(seed)
            for _ in range(2):
                logits = torch.randn(1, 12, generator=g)
                u = torch.rand(1, generator=g, dtype=torch.float64)
                tok, lp = noise.sample(logits, u, 1.0, 1.0, [s], [ep()])
                pis.append(float(torch.log_softmax(logits[0], -1)[int(tok)]))
                s.token_ids.append(int(tok))
                s.action_mask.append(1)
                logps.append(float(lp))
            written = s.token_ids[2:]
            name = next((n for n, q in names.items() if written[:len(q)] == q), None)
            if eps == 1.0:
                assert name is not None
                seen.add(name)
                k = len(names[name])
                assert sum(logps[:k]) == pytest.approx(math.log(1 / 3), abs=1e-6)
            elif name is not None:  # the mixture probability of the name: ε/K from its branch plus π's share
                k = len(names[name])
                assert math.exp(sum(logps[:k])) == pytest.approx(0.5 * math.exp(sum(pis[:k])) + 0.5 / 3, rel=1e-5)
            elif written[0] == 7:  # the shared first token, then another: both two-token branches share it
                assert math.exp(logps[0]) == pytest.approx(0.5 * math.exp(pis[0]) + 2 * 0.5 / 3, rel=1e-5)
            else:  # the policy branch wrote no name's first token: q = (1 − ε)·π
                assert logps[0] == pytest.approx(math.log(0.5) + pis[0], abs=1e-5)
        if eps == 1.0:
            assert seen == set(names)


def test_tool_noise_with_async_rollouts_is_refused():
    from pipeline.train.config import TrainConfig
    from pipeline.train.extensions.tool_noise import ToolNoise

    with pytest.raises(ValueError, match="async_rollouts"):  # the config refuses it, before anything is built
        TrainConfig(async_rollouts=True, max_staleness=1, exploration={"tool_noise": 0.2})
    assert ToolNoise.create(TrainConfig(), None, None) is None  # off by default: no extension at all
    with pytest.raises(ValueError):
        TrainConfig(exploration={"tool_noise": 1.5})


# ------------------------------------------------------------------------------------------- with a real policy
def favour_call(policy_dir: Path, bonus: float) -> None:
    """Rewrite the tiny adapted policy (untied output layer) so that ``<call>`` gets a large logit at every position:
    residual dimension 0 is 1 for every token and nothing writes to it; only ``<call>``'s output row reads it."""
    from pipeline.policy.config import ModelConfig
    from pipeline.policy.model import build_policy, load_policy, save_policy
    from pipeline.policy.tokenizer import CALL_OPEN, marker_ids

    _, tok, _ = load_policy(policy_dir)
    model = build_policy(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_positions=512, seed=0,
                                     tie_embeddings=False), tok)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[marker_ids(tok)[CALL_OPEN], 0] = bonus
    save_policy(model, tok, policy_dir, {"note": "tiny test policy that favours <call>"})


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from test_train import make_project

    root = make_project(tmp_path_factory.mktemp("explore"))
    favour_call(root / "models" / "adapted", bonus=1.2)
    return root


def _engine(project: Path, eps: float, max_steps: int = 1):
    from pipeline.envs.config import EnvConfig
    from pipeline.envs.shop import ShopWorld
    from pipeline.policy.config import RolloutConfig
    from pipeline.policy.model import load_policy
    from pipeline.policy.rollout import RolloutEngine
    from pipeline.train.config import TrainConfig
    from pipeline.train.extensions.tool_noise import attach_tool_noise, begin_update

    model, tok, _ = load_policy(project / "models" / "adapted")
    engine = RolloutEngine(model, tok, ShopWorld.load(project / "data" / "env"), EnvConfig(max_steps=max_steps),
                           RolloutConfig(max_new_tokens=6, batch_size=64, temperature=1.0))
    cfg = TrainConfig(updates=1, exploration={"tool_noise": eps})
    attach_tool_noise(engine, cfg)
    begin_update(engine, cfg, 0)
    return engine, tok


def _first_tool(record: dict, names: dict[str, list[int]], call_id: int) -> tuple[str | None, int]:
    """The tool whose name tokens follow the first sampled <call> of the episode, and the position after <call>."""
    ids, mask = record["token_ids"], record["action_mask"]
    i = next(j for j, (t, m) in enumerate(zip(ids, mask)) if m and t == call_id)
    return next((n for n, seq in names.items() if ids[i + 1:i + 1 + len(seq)] == seq), None), i + 1


def test_a_rollout_with_epsilon_one_picks_the_tools_uniformly(project):
    from pipeline.policy.tokenizer import CALL_OPEN, encode_continuation, marker_ids
    from test_train import read_tasks

    tasks = read_tasks(project / "data" / "tasks" / "train.jsonl")
    n = 300
    ep_tasks, seeds = [tasks[i % len(tasks)] for i in range(n)], list(range(n))
    counts = {}
    for eps in (0.0, 1.0):
        engine, tok = _engine(project, eps)
        names = {tool.name: encode_continuation(tok, tool.name) for tool in engine.runtime.tools()}
        call_id = marker_ids(tok)[CALL_OPEN]
        # the episodes whose (only) action starts with <call>: the tiny policy writes it first most of the time
        records = [r for r in engine.run(ep_tasks, seeds, greedy=False) if r["token_ids"][r["action_mask"].index(1)]
                   == call_id]
        assert len(records) > 0.4 * n
        picks = [_first_tool(r, names, call_id) for r in records]
        counts[eps] = {name: sum(p == name for p, _ in picks) for name in names}
        if eps == 1.0:
            stats = engine.sampling_hook.stats
            assert stats["noised"] == stats["actions"] >= len(records)
            # every action's tool is one of the task's tools, drawn uniformly: chi-square with K − 1 = 5 degrees of
            # freedom below its 0.1 % quantile (20.5), with this fixed seed
            assert sum(counts[eps].values()) == len(records)
            expected = len(records) / len(names)
            chi2 = sum((c - expected) ** 2 / expected for c in counts[eps].values())
            assert chi2 < 20.5, counts[eps]
            # the recorded log-probabilities of the name tokens are the mixture's: with ε = 1, log(1/K) in all
            for r, (name, at) in zip(records, picks):
                assert sum(r["logprobs"][at:at + len(names[name])]) == pytest.approx(math.log(1 / len(names)), abs=1e-5)
    # without noise the random policy almost never writes a tool name after <call>
    assert sum(counts[0.0].values()) < 0.1 * n


def test_a_tiny_training_run_with_tool_noise_anneals_and_reports_it(project, monkeypatch):
    import csv

    from pipeline.train.worker import run_worker

    monkeypatch.chdir(project)
    text = Path("params.yaml").read_text() + "  exploration:\n    tool_noise: 0.5\n"
    Path("params-noise.yaml").write_text(text)
    result = run_worker("params-noise.yaml", ckpt="ckpt-noise", out="models/policy-noise", curve_path="curve-noise.csv",
                        metrics_path="train-noise.json")
    h = result["history"]
    assert [x["explore/epsilon"] for x in h] == pytest.approx([0.5, 0.375, 0.25, 0.125])  # 0.5·(1 − t/4)
    assert all(x["explore/tool_choices"] > 0 for x in h)
    shares = [x["explore/noised_action_share"] for x in h]
    assert 0 < sum(shares) / len(shares) < 0.8
    # the learner reads the recorded mixture log-probabilities: where the policy branch wrote a token that is no tool
    # name, q = (1 − ε_t)·π, so π_θ/q = 1/(1 − ε_t) (2 at ε_0 = 0.5); without noise the ratio stays near 1
    off = run_worker("params.yaml", ckpt="ckpt-plain", out="models/policy-plain", curve_path="curve-plain.csv",
                     metrics_path="train-plain.json")
    assert "explore/epsilon" not in off["history"][0]
    r_on = max(x["offpolicy/is_weight_max"] for x in h)
    r_off = max(x["offpolicy/is_weight_max"] for x in off["history"])
    assert r_on > 1.5 and r_off < 1.2, (r_on, r_off)
    with open("curve-noise.csv") as fh:
        head = next(csv.reader(fh))
    assert "explore_epsilon" in head and "explore_noised_action_share" in head
    with open("curve-plain.csv") as fh:
        assert "explore_epsilon" not in next(csv.reader(fh))
