"""Extension `slicing` (``train.sampling.slice_turns`` > 0; docs/design.md §3.4): a token segment with more
turns than that is trained as rows of at most that many turns each, every row with the segment's prompt as context
and then its window of turns (:func:`pipeline.train.batch.slice_rows`), so a long episode's late turns are trained
with the memory of a short one. The learner reads :attr:`Slicing.slice_turns` when it lays out the batch; the
metric ``sampling/slice_rows`` counts the rows slicing added.
"""

from __future__ import annotations

from pipeline.train.extensions.base import Extension


class Slicing(Extension):
    name = "slicing"
    curve_keys = ("sampling/slice_rows",)

    def __init__(self, slice_turns: int):
        self.slice_turns = slice_turns

    @classmethod
    def create(cls, cfg, env_cfg, runtime, options=None):
        return cls(cfg.sampling.slice_turns) if cfg.sampling.slice_turns > 0 else None

    def after_advantages(self, u: int, records: list[dict], scores, batch, adv, dist) -> dict:
        return {"sampling/slice_rows": int(batch.sliced)} if batch.sliced else {}
