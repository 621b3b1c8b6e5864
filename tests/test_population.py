"""Population training (train.population): the behaviour features and diversity (hand-computed), the members'
configs, bad config, and a tiny population of two trained end to end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipeline.train.config import PopulationConfig
from pipeline.train.extensions.population import (cosine, member_configs, member_diversity,
                                       pairwise_diversity, trajectory_features)


def test_trajectory_features_count_tools_and_bigrams():
    phi = trajectory_features(["lookup", "calc", None, "answer"])
    assert phi == Counter({"tool:lookup": 1, "tool:calc": 1, "tool:<invalid>": 1, "tool:answer": 1,
                           "bigram:<start>>lookup": 1, "bigram:lookup>calc": 1, "bigram:calc><invalid>": 1,
                           "bigram:<invalid>>answer": 1})
    assert trajectory_features([]) == Counter()


def test_diversity_known_values():
    a = {"0:t1": trajectory_features(["lookup", "answer"]), "1:t2": trajectory_features(["search", "answer"])}
    b = {"0:t1": trajectory_features(["search", "answer"]), "1:t2": trajectory_features(["search", "answer"])}
    # t1: the vectors share only tool:answer; each has four features of count 1: cos = 1/(2·2) = 0.25
    assert cosine(a["0:t1"], b["0:t1"]) == pytest.approx(0.25)
    assert cosine(a["1:t2"], b["1:t2"]) == 1.0
    assert member_diversity(a, b) == pytest.approx((0.75 + 0.0) / 2)
    c = {"0:t1": Counter(), "1:t2": trajectory_features(["answer"])}
    # an empty trajectory against a non-empty one is fully different (1); 'answer' alone (two features) against
    # search, answer (four) share tool:answer: cos = 1/(√2·2)
    assert member_diversity(b, c) == pytest.approx((1.0 + 1 - 1 / (2 ** 0.5 * 2)) / 2)
    assert pairwise_diversity([a, b, c]) == pytest.approx({"0-1": 0.375, "0-2": member_diversity(a, c),
                                                          "1-2": member_diversity(b, c)})
    with pytest.raises(ValueError, match="same tasks"):
        member_diversity(a, {"9:x": Counter()})


def test_member_configs_and_bad_population_config():
    from pipeline.train.config import TrainConfig

    cfg = TrainConfig(seed=5, population={"size": 3})
    assert [m.seed for m in member_configs(cfg)] == [5, 6, 7]
    cfg = TrainConfig(population={"size": 2, "vary": "entropy", "entropy_coefs": [0.0, 0.05]})
    assert [(m.seed, m.entropy_coef) for m in member_configs(cfg)] == [(0, 0.0), (0, 0.05)]
    with pytest.raises(ValueError, match="one entropy coefficient per member"):
        PopulationConfig(size=2, vary="entropy", entropy_coefs=[0.01])
    with pytest.raises(ValueError, match="only read with vary: entropy"):
        PopulationConfig(size=2, entropy_coefs=[0.01, 0.02])
    with pytest.raises(ValueError):
        PopulationConfig(size=0)
    # a member whose entropy coefficient contradicts the section is refused with the section's reason
    cfg = TrainConfig(entropy_target=1.0, entropy_coef_max=0.05,
                      population={"size": 2, "vary": "entropy", "entropy_coefs": [0.0, 0.5]})
    with pytest.raises(ValueError, match="entropy_coef_max"):
        member_configs(cfg)


def test_a_population_of_two_trains_both_keeps_the_best_and_reports_diversity(tmp_path, monkeypatch):
    from pipeline.policy.model import load_policy
    from pipeline.train.worker import run_worker
    from test_train import make_project

    proj = make_project(tmp_path / "p", updates=2)
    monkeypatch.chdir(proj)
    text = (Path("params.yaml").read_text() + "  population:\n    size: 2\n    vary: entropy\n"
            "    entropy_coefs: [0.0, 0.05]\n  skip_zero_variance_groups: false\n")
    Path("params.yaml").write_text(text)
    result = run_worker("params.yaml")
    assert result["completed"]
    m = json.loads(Path("metrics/train.json").read_text())
    pop = m["population"]
    assert pop["size"] == 2 and len(pop["members"]) == 2 and pop["vary"] == "entropy"
    assert [x["entropy_coef"] for x in pop["members"]] == [0.0, 0.05]
    values = [x["best_val_success"] for x in pop["members"]]
    assert pop["selected"] == max(range(2), key=lambda i: (values[i], -i))
    assert m["best_val_success"] == values[pop["selected"]]
    assert all(x["evals"] and x["updates_run"] == 2 for x in pop["members"])
    assert set(pop["diversity"]) == {"0-1"} and 0.0 <= pop["diversity"]["0-1"] <= 1.0
    # each member trained in its own checkpoint folder; the selected member's kept policy is models/policy
    folders = sorted(p for p in (proj / "checkpoints" / "train").iterdir() if (p / "policy").is_dir())
    assert len(folders) == 2
    weights = [load_policy(f / "policy")[0].state_dict() for f in folders]
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # the members differ
    out = load_policy("models/policy")[0].state_dict()
    matches = [all(torch.equal(w[k], out[k]) for k in out) for w in weights]
    assert sum(matches) >= 1
    chosen_dir = next(f for f in folders if json.loads((f / "policy" / "policy.json").read_text())[
        "train_config"]["entropy_coef"] == pop["members"][pop["selected"]]["entropy_coef"])
    assert all(torch.equal(load_policy(chosen_dir / "policy")[0].state_dict()[k], out[k]) for k in out)
