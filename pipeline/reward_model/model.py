"""The learned verifier: two logistic heads (success, process soundness) over hashed trajectory features, and the
metrics it is judged by (held-out AUC, accuracy, calibration). Pure functions except :func:`save` / :func:`load`.

The model is ``p_h = σ(b_h + Σ_{i ∈ features} W[i, h])`` for the heads h = success, sound: an ``EmbeddingBag`` of
sums, i.e. logistic regression on feature counts, fitted full-batch with Adam on the mean binary cross-entropy plus
``l2 · ||W||²``. Decision: logistic regression, not an MLP: on a few thousand trajectories it is as accurate here, its
probabilities are calibrated by construction (the loss is a proper scoring rule), and it trains in seconds.

Files: ``reward_model.safetensors`` (the weights) and ``reward_model.json`` (hash dimension, heads, the environment it
was trained on, the training summary).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.core.errors import AgentRLError
from pipeline.reward_model.features import featurize, ragged

HEADS = ("success", "sound")
WEIGHTS_FILE, META_FILE = "reward_model.safetensors", "reward_model.json"
UNUSED_FILE = "unused.json"  # what the stage writes instead of a model when no run reads one


class RewardModel(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.weight = torch.nn.EmbeddingBag(dim, len(HEADS), mode="sum")
        self.bias = torch.nn.Parameter(torch.zeros(len(HEADS)))
        torch.nn.init.zeros_(self.weight.weight)

    def forward(self, flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Logits, (trajectories, heads)."""
        return self.weight(flat, offsets) + self.bias

    def logits(self, indices: list[list[int]]) -> torch.Tensor:
        flat, offsets = ragged(indices)
        return self(torch.from_numpy(flat), torch.from_numpy(offsets))

    @torch.no_grad()
    def predict(self, indices: list[list[int]]) -> np.ndarray:
        """Probabilities, (trajectories, heads)."""
        if not indices:
            return np.zeros((0, len(HEADS)))
        return torch.sigmoid(self.logits(indices)).double().numpy()

    def predict_steps(self, trajectories: list[list[dict]]) -> np.ndarray:
        """Probabilities of trajectories given as their ``steps``."""
        return self.predict([featurize(s, self.dim) for s in trajectories])


def fit(indices: list[list[int]], labels: np.ndarray, dim: int, *, epochs: int, lr: float, l2: float,
        seed: int, known: np.ndarray | None = None) -> tuple[RewardModel, list[float]]:
    """Fit the model on feature lists and (n, heads) 0/1 labels; returns it and the loss per epoch. `known` (n,
    heads) of 0/1 marks the labels that exist (a person's feedback labels success only): the loss is the mean over
    the known ones; None: all are."""
    torch.manual_seed(seed)
    model = RewardModel(dim)
    flat, offsets = (torch.from_numpy(a) for a in ragged(indices))
    y = torch.as_tensor(np.asarray(labels, dtype=np.float32))
    w = None if known is None else torch.as_tensor(np.asarray(known, dtype=np.float32))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(flat, offsets), y, weight=w,
                                                                    reduction="sum" if w is not None else "mean")
        if w is not None:
            loss = loss / w.sum().clamp(min=1.0)
        loss = loss + l2 * model.weight.weight.pow(2).sum()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model.eval(), losses


# --------------------------------------------------------------------------------------------------- metrics (pure)
def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counting half (Mann-Whitney U
    from average ranks). None when one class is absent.

    >>> auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
    0.75
    """
    scores, labels = np.asarray(scores, float), np.asarray(labels, int)
    n_pos, n_neg = int(labels.sum()), int((1 - labels).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average rank over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[labels == 1].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int) -> float | None:
    """ECE = Σ_b (n_b / n) · |mean label_b − mean prob_b| over `bins` equal-width probability bins (a probability of
    exactly 1 goes to the last bin). None for no data.

    >>> expected_calibration_error(np.array([0.1, 0.1, 0.9, 0.9]), np.array([0, 1, 1, 1]), 2)
    0.25
    """
    probs, labels = np.asarray(probs, float), np.asarray(labels, float)
    if len(probs) == 0:
        return None
    which = np.minimum((probs * bins).astype(int), bins - 1)
    ece = 0.0
    for b in range(bins):
        m = which == b
        if m.any():
            ece += m.sum() / len(probs) * abs(labels[m].mean() - probs[m].mean())
    return float(ece)


def head_metrics(probs: np.ndarray, labels: np.ndarray, bins: int) -> dict:
    """AUC, accuracy at 0.5, Brier score, ECE, positive rate and mean prediction of one head."""
    probs, labels = np.asarray(probs, float), np.asarray(labels, int)
    if len(probs) == 0:
        return {"n": 0}
    return {"n": int(len(probs)), "auc": auc(probs, labels), "accuracy": float(((probs >= 0.5) == labels).mean()),
            "brier": float(((probs - labels) ** 2).mean()), "ece": expected_calibration_error(probs, labels, bins),
            "positive_rate": float(labels.mean()), "mean_prediction": float(probs.mean())}


# ------------------------------------------------------------------------------------------------------------ files
def save(model: RewardModel, out_dir: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    from pipeline.core.atomic import replace_dir

    def write(tmp: Path) -> None:  # the folder is swapped in whole (pipeline.core.atomic)
        tmp.mkdir()
        save_file({"weight": model.weight.weight.detach().contiguous(), "bias": model.bias.detach().contiguous()},
                  str(tmp / WEIGHTS_FILE))
        (tmp / META_FILE).write_text(json.dumps({**meta, "dim": model.dim, "heads": list(HEADS)}, indent=2,
                                                sort_keys=True) + "\n")

    replace_dir(Path(out_dir), write)


def load(path: str | Path) -> tuple[RewardModel, dict]:
    """The model and its metadata; a missing or foreign folder is an :class:`AgentRLError`."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / UNUSED_FILE).is_file() and not (path / WEIGHTS_FILE).is_file():
        raise AgentRLError(f"{path} holds no trained verifier: the `reward_model` stage ran while no run read one "
                           f"(train.learned_reward.coef was 0); run it again now that coef is set (`agentrl "
                           f"reward-model`)")
    if not (path / WEIGHTS_FILE).is_file() or not (path / META_FILE).is_file():
        raise AgentRLError(f"reward model not found in {path} (expected {WEIGHTS_FILE} and {META_FILE}); run the "
                           f"`reward_model` stage first (`agentrl reward-model`)")
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("heads") != list(HEADS):
        raise AgentRLError(f"{path}: reward model heads {meta.get('heads')} are not {list(HEADS)}")
    model = RewardModel(int(meta["dim"]))
    tensors = load_file(str(path / WEIGHTS_FILE))
    with torch.no_grad():
        model.weight.weight.copy_(tensors["weight"])
        model.bias.copy_(tensors["bias"])
    return model.eval(), meta
