"""The world-neutral part of a question grammar: which frame a question takes.

An environment's grammar (a ``wordings`` module of its own) holds its own frames, synonyms, openers and
closers; every such grammar chooses a frame the same way, here. A frame is ``(template id, text, imperative,
is_fixed)``: the fixed training wordings keep their ids, grammar frame k of a family gets ``base + k``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Frame = tuple[int, str, bool, bool]


def pick(seq: Sequence, rng: np.random.Generator):
    """One element of `seq`, drawn uniformly with `rng` (one ``integers`` draw)."""
    return seq[int(rng.integers(len(seq)))]


def frames_of(fixed: Sequence[str], template_ids: Sequence[int], frames: Sequence[tuple[str, bool]],
              base: int) -> list[Frame]:
    """Every frame a family's question may take: its fixed wordings `template_ids` (texts in `fixed`; imperative
    when they end in a full stop), then its grammar `frames` ((text, imperative) each) with ids from `base`."""
    return ([(t, fixed[t], fixed[t].endswith("."), True) for t in template_ids]
            + [(base + k, f, imp, False) for k, (f, imp) in enumerate(frames)])


def choose_frame(all_frames: Sequence[Frame], n_fixed: int, frame: int | None, rng: np.random.Generator) -> Frame:
    """The frame of one question, from :func:`frames_of` over `n_fixed` fixed wordings: grammar frame `frame` when
    given; the one fixed wording when there is exactly one; otherwise one drawn uniformly from all of them."""
    if frame is not None:
        all_frames = [all_frames[n_fixed + frame]]
    elif n_fixed == 1:
        all_frames = all_frames[:1]
    return pick(all_frames, rng)  # one draw even from one frame: the draws after it stay where they were
