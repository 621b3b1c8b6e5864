"""The learner's view of a batch of episode records: right-padded token rows (:class:`Batch`, one row per token
segment of an episode), the grouping of episodes, and the length-sorted chunks the learner forwards one at a time.

Only tensors and bookkeeping; the forwards, losses and advantages live in :mod:`pipeline.train.learner` and
:mod:`pipeline.train.advantages`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.train import core_algos as A


@dataclass
class Batch:
    """Right-padded rows (one per token segment of an episode): all tensors (rows, T) unless noted."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor  # 1 on action tokens (what the policy sampled)
    sample_logp: torch.Tensor  # the sampler's log-probabilities, 0 off the action tokens
    episode: torch.Tensor  # (rows,) index of the episode each row belongs to
    turn: torch.Tensor  # the episode's turn index of each action token (core_algos.turn_ids), else -1

    @property
    def n_rows(self) -> int:
        return self.ids.shape[0]

    def select(self, rows: torch.Tensor) -> "Batch":
        return Batch(self.ids[rows], self.attn[rows], self.mask[rows], self.sample_logp[rows], self.episode[rows],
                     self.turn[rows])


def collate_records(records: list[dict], pad_id: int) -> Batch:
    """Rollout records (``token_ids``, ``action_mask``, ``logprobs``, optional ``segments``) as one padded batch;
    an episode the environment folded into several segments gives one row per segment."""
    rows = []
    for e, r in enumerate(records):
        starts = list(r.get("segments") or [0]) + [len(r["token_ids"])]
        turns = A.turn_ids(torch.tensor(r["action_mask"])).tolist()  # over the whole episode, across its segments
        for a, b in zip(starts[:-1], starts[1:]):
            if b > a:
                rows.append((e, r["token_ids"][a:b], r["action_mask"][a:b], r["logprobs"][a:b], turns[a:b]))
    T = max(len(row[1]) for row in rows)
    n = len(rows)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    attn = torch.zeros(n, T, dtype=torch.long)
    mask = torch.zeros(n, T)
    logp = torch.zeros(n, T)
    ep = torch.zeros(n, dtype=torch.long)
    turn = torch.full((n, T), -1, dtype=torch.long)
    for i, (e, t, m, lp, tu) in enumerate(rows):
        ids[i, : len(t)] = torch.tensor(t)
        attn[i, : len(t)] = 1
        mask[i, : len(t)] = torch.tensor(m, dtype=torch.float32)
        logp[i, : len(t)] = torch.tensor(lp, dtype=torch.float32)
        turn[i, : len(t)] = torch.tensor(tu, dtype=torch.long)
        ep[i] = e
    return Batch(ids, attn, mask, logp * mask, ep, turn)


def group_ids_of(records: list[dict]) -> torch.Tensor:
    """(episodes,) group index of each record, numbered in order of first appearance of its ``group``."""
    keys: dict = {}
    return torch.tensor([keys.setdefault(r["group"], len(keys)) for r in records])


def length_chunks(lengths: torch.Tensor, rows: torch.Tensor, k: int) -> list[torch.Tensor]:
    """`rows` sorted by `lengths` (longest first) and split into `k` chunks of near-equal row counts (some empty when
    there are fewer rows than chunks): rows of similar length share a chunk, so each is padded only to its own
    longest row."""
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    return list(torch.tensor_split(order, k))
