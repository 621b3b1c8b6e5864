"""The learner's view of a batch of episode records: right-padded token rows (:class:`Batch`, one row per token
segment of an episode), the grouping of episodes, and the length-sorted chunks the learner forwards one at a time.

Trajectory slicing (`train.sampling.slice_turns` = K > 0, docs/design.md §3.4): a token segment with more than K turns
(sampled actions) is trained as several rows, each holding the action tokens of at most K consecutive turns
(:func:`slice_rows`). A slice's context is its segment's prompt (the tokens before the segment's first action: task,
tool list and, in a folded segment, the summary) followed by the window's own tokens, from the observation that
precedes its first turn to its last action (the last window runs to the segment's end); the turns in between are
left out. So no row is longer than the prompt plus K turns, whatever the episode's length, and every action token is
trained once. The cost: the policy is scored on a shorter context than it sampled from, so π_θ/π_behaviour also
measures that difference; the truncated importance weight (`train.is_clip`) bounds it, and the learner's one-forward
step reads the recorded log-probabilities as π_behaviour for these rows as for every other. Slices keep their
episode's index and turn numbers, so advantages, per-turn credit and GAE (over the episode's rows in order) are
unchanged.

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
    sliced: int = 0  # rows that trajectory slicing added (train.sampling.slice_turns)

    @property
    def n_rows(self) -> int:
        return self.ids.shape[0]

    def select(self, rows: torch.Tensor) -> "Batch":
        return Batch(self.ids[rows], self.attn[rows], self.mask[rows], self.sample_logp[rows], self.episode[rows],
                     self.turn[rows], self.sliced)


def slice_rows(action_mask: list[int], start: int, end: int, k: int) -> list[list[int]]:
    """Token positions of the rows of the segment [`start`, `end`) of an episode with this `action_mask`, each row
    with at most `k` turns' action tokens (`k` = 0: the whole segment, one row). A row is the segment's prompt (the
    positions before its first action token) followed by its window (module docstring).

    >>> slice_rows([0, 0, 1, 0, 1, 1, 0, 1, 0], 0, 9, 1)
    [[0, 1, 2], [0, 1, 3, 4, 5], [0, 1, 6, 7, 8]]
    >>> slice_rows([0, 0, 1, 0, 1, 1, 0, 1, 0], 0, 9, 2)
    [[0, 1, 2, 3, 4, 5], [0, 1, 6, 7, 8]]
    """
    whole = list(range(start, end))
    m = action_mask[start:end]
    turn_ends = [i for i in range(len(m)) if m[i] and (i + 1 == len(m) or not m[i + 1])]  # last token of each turn
    if k <= 0 or len(turn_ends) <= k:
        return [whole]
    prompt = whole[: m.index(1)]
    rows, lo = [], len(prompt)
    for w in range(0, len(turn_ends), k):
        hi = turn_ends[w + k - 1] + 1 if w + k < len(turn_ends) else len(m)
        rows.append(prompt + whole[lo:hi])
        lo = hi
    return rows


def collate_records(records: list[dict], pad_id: int, slice_turns: int = 0) -> Batch:
    """Rollout records (``token_ids``, ``action_mask``, ``logprobs``, optional ``segments``) as one padded batch;
    an episode the environment folded into several segments gives one row per segment, and with `slice_turns` > 0
    a segment of more turns one row per window of at most that many turns (:func:`slice_rows`)."""
    rows, segments = [], 0
    for e, r in enumerate(records):
        starts = list(r.get("segments") or [0]) + [len(r["token_ids"])]
        turns = A.turn_ids(torch.tensor(r["action_mask"])).tolist()  # over the whole episode, across its segments
        for a, b in zip(starts[:-1], starts[1:]):
            if b <= a:
                continue
            segments += 1
            if slice_turns <= 0:
                rows.append((e, r["token_ids"][a:b], r["action_mask"][a:b], r["logprobs"][a:b], turns[a:b]))
                continue
            for pos in slice_rows(r["action_mask"], a, b, slice_turns):  # the prompt holds no action token
                rows.append((e, *([seq[p] for p in pos] for seq in (r["token_ids"], r["action_mask"],
                                                                      r["logprobs"], turns))))
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
    return Batch(ids, attn, mask, logp * mask, ep, turn, len(rows) - segments)


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
