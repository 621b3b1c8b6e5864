"""Extension `replay` (``train.sampling.replay``; docs/design.md §3.4): a replay store of past episodes with
prioritised sampling, the mixing ratio of new and replayed episodes, and the glue that puts replayed episodes into an
update with their stored advantage, their recorded behaviour log-probabilities and a per-row importance weight.
Trajectory slicing is :mod:`pipeline.train.extensions.slicing`; adversarial task sampling is
:mod:`pipeline.train.extensions.adversarial`. All keys live in ``train.sampling``
(:class:`pipeline.train.config.SamplingConfig`).

Decisions:

- **What is stored.** After an update learned, every new episode of every rank (gathered, so the store is the same
  on every rank and rank 0's checkpoint holds it) whose advantage is not zero: the policy's own sampled episodes
  only (expert demonstrations and replayed copies are not stored again). Episodes of zero-variance groups carry no
  signal and are not stored. Capacity ``capacity`` episodes, first in first out.
- **δ_i** is the episode's mean |advantage| over its action tokens as the learner computed it when the episode was
  new: |score − group baseline| for grpo/rloo, the mean |per-turn advantage| with `turn_credit`, the mean |whitened
  GAE advantage| for PPO. p(i) = (|δ_i|^α + ε) / Σ_j (|δ_j|^α + ε); priorities are not refreshed later.
- **Advantage of a replayed episode.** grpo/rloo: the advantage stored with it (its group is gone; its group-relative
  standing is what it was), per turn with `turn_credit`. PPO: recomputed by GAE with today's value head (its TD
  errors change as V does), from its return normalised with the normaliser's current window (replayed returns do
  not enter the window again); PPO with a per-turn credit rule (turn, event) is refused (by
  :class:`pipeline.train.config.TrainConfig`).
- **Importance weight of the priority sampling**, w_i = (N·p(i))^(−β_is) / max_j w_j over the episodes drawn this
  update (Schaul et al. 2016). It multiplies the replayed rows' loss weights (new rows weigh 1); the policy loss is a
  weighted mean, so w_i sets a replayed row's share relative to the other rows and the step size is not shrunk.
- **Behaviour policy.** A replayed episode keeps its recorded ``logprobs`` and ``policy_version``; the learner reads
  the recorded log-probabilities as π_behaviour for it, as for an asynchronous batch: the truncated weight
  min(`is_clip`, π/π_behaviour) multiplies its tokens. The one-forward step is correct for such rows too: there
  π_old (PPO's proximal policy) = π_θ before the step, while the behaviour correction compares π_θ with the recorded
  log-probabilities, not with π_old (tests/test_replay.py checks this on a real loop).
- **Age.** An episode older than ``max_age`` policy versions (update − its ``policy_version``) is evicted before each
  draw (counted in ``replay/dropped_stale``): beyond that the truncated weights are mostly clipped. `max_staleness`
  keeps its meaning (the age of a new batch); ``max_age`` is the replay's own bound.
- **Mixing ratio.** With N_new new episodes (all ranks) and N_store episodes in the store,
  β = clip(N_new / (N_new + N_store), β_min, β_max) is the share of new episodes, so round(N_new·(1 − β)/β) episodes
  are replayed (at most N_store, drawn without replacement), the draw split over ranks (rank r takes every r-th).
  β_max = 1 and β_min = 0.5 replay the whole store while it is small and at most as many as are new once it is large.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pipeline.train.extensions.base import Extension


# torch is imported inside the functions that need it, so that reading the pure functions stays light


# ------------------------------------------------------------------------------------------------- pure functions
def priorities(deltas, alpha: float, eps: float) -> np.ndarray:
    """p(i) = (|δ_i|^α + ε) / Σ_j (|δ_j|^α + ε).

    >>> priorities([1.0, 3.0], 1.0, 0.0).tolist()
    [0.25, 0.75]
    """
    raw = np.abs(np.asarray(deltas, dtype=np.float64)) ** alpha + eps
    return raw / raw.sum()


def priority_weights(p: np.ndarray, picked: np.ndarray, beta: float) -> np.ndarray:
    """w_i = (N·p(i))^(−β) / max_j w_j over the `picked` indices (N = len(p)).

    >>> priority_weights(np.array([0.25, 0.75]), np.array([0, 1]), 1.0).tolist()
    [1.0, 0.3333333333333333]
    """
    if len(picked) == 0:
        return np.zeros(0)
    w = (len(p) * p[picked]) ** (-beta)
    return w / w.max()


def mix_count(n_new: int, n_store: int, beta_min: float, beta_max: float) -> tuple[float, int]:
    """(β, episodes to replay): β = clip(n_new/(n_new + n_store), β_min, β_max), replayed = min(n_store,
    round(n_new·(1 − β)/β)).

    >>> mix_count(16, 8, 0.5, 1.0)
    (0.6666666666666666, 8)
    >>> mix_count(16, 100, 0.5, 1.0)
    (0.5, 16)
    """
    if n_new + n_store == 0:
        return 1.0, 0
    beta = float(np.clip(n_new / (n_new + n_store), beta_min, beta_max))
    return beta, min(n_store, int(round(n_new * (1.0 - beta) / beta)))


def episode_deltas(adv, mask, episode, n_episodes: int):
    """(episodes,) mean |advantage| over each episode's action tokens (`mask` > 0), over all its rows; 0 for an
    episode without any. Tensors: adv, mask (rows, T), episode (rows,).

    >>> import torch
    >>> episode_deltas(torch.tensor([[1., -3., 0.], [2., 0., 0.]]), torch.tensor([[1., 1., 0.], [1., 0., 0.]]),
    ...                torch.tensor([0, 1]), 3).tolist()
    [2.0, 2.0, 0.0]
    """
    import torch

    m = (mask > 0).float()
    total = torch.zeros(n_episodes).index_add_(0, episode, (adv.abs() * m).sum(1).float())
    count = torch.zeros(n_episodes).index_add_(0, episode, m.sum(1))
    return total / count.clamp(min=1.0)


# --------------------------------------------------------------------------------------------------- the store
class ReplayStore:
    """Past episodes with their δ, stored advantage and update; first in, first out. Its own generator draws, so
    replay does not move the task plan's; the same on every rank."""

    def __init__(self, capacity: int, seed: int):
        self.capacity = capacity
        self.entries: deque[dict] = deque(maxlen=capacity)
        self.rng = np.random.default_rng([seed, 13])

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, items: list[dict]) -> None:
        """`items`: dicts with ``record``, ``delta``, ``adv`` (float or None), ``turn_adv`` (list or None), ``stored``."""
        self.entries.extend(items)

    def evict_stale(self, u: int, max_age: int) -> int:
        keep = [e for e in self.entries if u - e["record"]["policy_version"] <= max_age]
        dropped = len(self.entries) - len(keep)
        self.entries = deque(keep, maxlen=self.capacity)
        return dropped

    def draw(self, n: int, alpha: float, eps: float, beta_is: float) -> tuple[np.ndarray, np.ndarray]:
        """`n` distinct entry indices by priority, and their importance weights."""
        if n <= 0 or not self.entries:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        p = priorities([e["delta"] for e in self.entries], alpha, eps)
        picked = self.rng.choice(len(p), size=min(n, len(p)), replace=False, p=p)
        return picked, priority_weights(p, picked, beta_is)

    def state_dict(self) -> dict:
        return {"entries": list(self.entries), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.entries = deque(state["entries"], maxlen=self.capacity)
        self.rng.bit_generator.state = state["rng"]


# -------------------------------------------------------------------------------------------- loop and learner glue
def mix_replay(store: ReplayStore, records: list[dict], u: int, cfg, dist) -> tuple[list[dict], dict]:
    """Update `u`'s records followed by this rank's share of the replayed episodes (marked ``replayed``, with
    ``replay_weight``, ``replay_adv``, ``replay_turn_adv``), and the replay metrics."""
    sc = cfg.sampling
    dropped = store.evict_stale(u, sc.max_age)
    n_new = len(records) * dist.world_size
    beta, n_rep = mix_count(n_new, len(store), sc.beta_min, sc.beta_max)
    picked, weights = store.draw(n_rep, sc.alpha, sc.eps, sc.beta_is)
    replayed = []
    for j in range(dist.rank, len(picked), dist.world_size):
        e = store.entries[int(picked[j])]
        replayed.append({**e["record"], "replayed": True, "replay_weight": float(weights[j]),
                         "replay_adv": e["adv"], "replay_turn_adv": e["turn_adv"], "group": f"replay-{j}"})
    ages = [u - store.entries[int(i)]["record"]["policy_version"] for i in picked]
    return records + replayed, {
        "replay/size": len(store), "replay/replayed": len(picked), "replay/beta": beta,
        "replay/share_new": n_new / (n_new + len(picked)), "replay/dropped_stale": dropped,
        "replay/priority_weight_mean": float(weights.mean()) if len(picked) else 0.0,
        "replay/mean_age": float(np.mean(ages)) if ages else 0.0,
    }


def _pad_cat(a, rows: list[list[float]]):
    import torch

    width = max([a.shape[1]] + [len(r) for r in rows])
    out = torch.zeros(a.shape[0] + len(rows), width, dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    for i, r in enumerate(rows):
        out[a.shape[0] + i, : len(r)] = torch.tensor(r, dtype=a.dtype)
    return out


def replay_scores(records: list[dict], score, normalizer):
    """`score` (the learner's scoring, :func:`pipeline.train.advantages.score_episodes`) of the new records (a prefix
    of `records`), extended by the replayed ones: their stored advantage (grpo/rloo), or their return normalised with
    the window of `normalizer` (None: off) before this batch (PPO, episode credit). Exactly `score(records)` when
    nothing is replayed."""
    import torch

    n_new = next((i for i, r in enumerate(records) if r.get("replayed")), len(records))
    if n_new == len(records):
        return score(records)
    rep = records[n_new:]
    shift, scale = normalizer.affine() if normalizer is not None else (0.0, 1.0)
    sc = score(records[:n_new])
    rep_scores = torch.tensor([(r["return"] - shift) / scale for r in rep], dtype=sc.scores.dtype)
    sc.scores = torch.cat([sc.scores, rep_scores])
    sc.zero_var = torch.cat([sc.zero_var, torch.zeros(len(rep), dtype=torch.bool)])
    if sc.episode_adv is not None:
        sc.episode_adv = torch.cat([sc.episode_adv, torch.tensor([r["replay_adv"] for r in rep],
                                                                 dtype=sc.episode_adv.dtype)])
    if sc.turn_adv is not None:
        sc.turn_adv = _pad_cat(sc.turn_adv, [r["replay_turn_adv"] for r in rep])
        sc.turn_mask = _pad_cat(sc.turn_mask, [[1.0] * len(r["replay_turn_adv"]) for r in rep])
    return sc  # PPO with per-turn credit and replay never gets here: TrainConfig refuses it


def weigh_rows(loss_mask, records: list[dict], batch):
    """The (rows, T) loss weights with every replayed row multiplied by its episode's priority importance weight."""
    if not any(r.get("replayed") for r in records):
        return loss_mask
    import torch

    w = torch.tensor([float(r.get("replay_weight", 1.0)) for r in records], dtype=loss_mask.dtype)
    return loss_mask * w[batch.episode][:, None]


def remember(store: ReplayStore, records: list[dict], sc, batch, adv, u: int, dist) -> dict:
    """After update `u`'s advantages: its new episodes with a signal go into the replay store (every rank's, in
    rank order), and the update's replay metrics."""
    import torch

    from pipeline.train import core_algos as A

    deltas = episode_deltas(adv, batch.mask, batch.episode, len(records))
    items = []
    for e, r in enumerate(records):
        if r.get("replayed") or r.get("demonstrated") or float(deltas[e]) <= 0:
            continue
        n_turns = int(A.turn_ids(torch.tensor(r["action_mask"])).max()) + 1
        items.append({"record": {k: v for k, v in r.items() if k != "group"}, "delta": float(deltas[e]),
                      "adv": float(sc.episode_adv[e]) if sc.episode_adv is not None else None,
                      "turn_adv": sc.turn_adv[e, :n_turns].tolist() if sc.turn_adv is not None else None,
                      "stored": u})
    gathered = [it for part in dist.all_gather(items) for it in part]
    store.add(gathered)
    replayed_rows = torch.tensor([bool(r.get("replayed")) for r in records])[batch.episode]
    return {"replay/stored": len(gathered), "replay/size_after": len(store),
            "replay/delta_mean": float(np.mean([it["delta"] for it in gathered])) if gathered else 0.0,
            "replay/rows_trained": int(replayed_rows.sum())}


class Replay(Extension):
    """On when ``train.sampling.replay``; its state is the :class:`ReplayStore`."""

    name = "replay"
    curve_keys = ("replay/replayed", "replay/share_new", "replay/priority_weight_mean", "replay/mean_age",
                  "replay/dropped_stale")

    def __init__(self, cfg):
        self.cfg = cfg
        self.store = ReplayStore(cfg.sampling.capacity, cfg.seed)
        self.normalizer = None

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(cfg) if cfg.sampling.replay else None

    def attach(self, loop) -> None:
        self.normalizer = loop.learner_state.normalizer  # a replayed PPO episode's score uses its window

    def before_learn(self, loop, u: int, records: list[dict], own: list[dict]) -> tuple[list[dict], dict]:
        return mix_replay(self.store, records, u, self.cfg, loop.dist)

    def score(self, records: list[dict], score):
        return replay_scores(records, score, self.normalizer)

    def row_weights(self, loss_mask, records: list[dict], batch):
        return weigh_rows(loss_mask, records, batch)

    def after_advantages(self, u: int, records: list[dict], scores, batch, adv, dist) -> dict:
        return remember(self.store, records, scores, batch, adv, u, dist)

    def state_dict(self) -> dict:
        return self.store.state_dict()

    def load_state_dict(self, state: dict, loop) -> None:
        self.store.load_state_dict(state)
