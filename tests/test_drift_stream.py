"""Episode files streamed in chunks (pipeline.check_drift.episodes): the behaviour-drift test, the consistency probes
and the hidden-state contexts read from a chunked file equal those of the whole list of records, and a record that
breaks the "trajectories" suite in a late chunk is still refused, naming the file and the chunk's lines.

Small on purpose: 50 records in chunks of 7 (eight chunks, the last one short), on a world of build_env's default size.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipeline.check_drift import checks as C
from pipeline.check_drift.config import DriftConfig
from pipeline.check_drift.consistency import Probe, probes_from_episodes
from pipeline.check_drift.features import observation_contexts, trajectory_features
from pipeline.check_drift.main import load_episodes
from pipeline.core.errors import AgentRLError
from pipeline.envs.config import EnvConfig
from pipeline.envs.shop import ShopWorld
from pipeline.envs.shop.tasks import Task
from pipeline.envs.shop.world import generate_world
from pipeline.policy.episodes import evaluate

SIGS = [s.signature() for s in ShopWorld.default().tools()]
CHUNK = 7


@pytest.fixture(scope="module")
def world():
    w = ShopWorld(generate_world(0, n_products=400, n_suppliers=80, heldout_fraction=0.3))
    yield w
    w.close()


@pytest.fixture(scope="module")
def records(world):
    """(tasks, reference records, current records): 50 expert episodes against 50 random ones."""
    sample = C.make_reference_sample(world, 50, seed=7)
    runtime = ShopWorld(world.world)
    try:
        tasks = [Task.from_dict(t) for t in sample.tasks]
        _, expert = evaluate("expert", tasks, runtime, EnvConfig())
        _, rand = evaluate("random", tasks, runtime, EnvConfig())
    finally:
        runtime.close()
    return sample.tasks, expert, rand


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


class _Recording:
    """The world, recording how many records each call of its suite check was given."""

    def __init__(self, world):
        self.world, self.sizes = world, []

    def check_episodes(self, records, *args, **kwargs):
        self.sizes.append(len(records))
        return self.world.check_episodes(records, *args, **kwargs)


def _old_probes(tasks, episodes, window, n, seed, folded=4):
    """The whole-list algorithm the phase used before streaming: every context in a pool, then a sample."""
    questions = {t["task_id"]: t["question"] for t in tasks}
    pool, long = [], []
    for ep in episodes:
        q = questions.get(ep.get("task_id"))
        pairs = tuple((s["action"], s["observation"]) for s in ep.get("steps") or [])
        if q is None or not pairs:
            continue
        pool += [Probe(q, pairs[:k], window, tuple(SIGS)) for k in range(len(pairs))]
        if len(long) < folded:
            long.append(Probe(q, (pairs * (window // len(pairs) + 2))[: window + len(pairs)], window, tuple(SIGS)))
    rng = np.random.default_rng([seed, 8])
    return [pool[i] for i in np.sort(rng.choice(len(pool), size=min(n, len(pool)), replace=False))] + long


def test_chunked_file_gives_the_whole_list_results(records, world, tmp_path):
    tasks, ref, cur = records
    assert len(cur) == 50 and len(ref) == 50
    ref_file = load_episodes(_write(tmp_path / "ref.jsonl", ref), "reference episodes", EnvConfig(), world,
                             chunk_size=CHUNK)
    recording = _Recording(world)
    cur_file = load_episodes(_write(tmp_path / "cur.jsonl", cur), "current episodes", EnvConfig(), recording,
                             chunk_size=CHUNK)
    assert recording.sizes == [7] * 7 + [1]  # every record validated, never more than a chunk at once
    assert len(cur_file) == 50 and bool(cur_file) and list(cur_file) == cur  # iteration re-reads the same records
    whole = trajectory_features(cur)
    for k, s in whole.items():
        pd.testing.assert_series_equal(cur_file.trajectory_features()[k], s, check_names=False)

    cfg = DriftConfig()
    expected = C.trajectory_drift(ref, cur, cfg).to_dict()
    assert C.trajectory_drift(ref_file, cur_file, cfg).to_dict() == expected
    assert expected["status"] == "fail"  # random behaviour: the test has something to find

    old = _old_probes(tasks, ref, window=2, n=24, seed=3)
    assert len(old) == 28
    assert probes_from_episodes(tasks, ref_file, 2, 24, seed=3, signatures=SIGS) == old
    assert probes_from_episodes(tasks, ref, 2, 24, seed=3, signatures=SIGS) == old
    assert observation_contexts(tasks, cur_file, 6, SIGS) == observation_contexts(tasks, cur, 6, SIGS)


def test_a_bad_record_in_a_late_chunk_is_refused(records, world, tmp_path):
    _, _, cur = records
    bad = copy.deepcopy(cur)
    bad[45]["return"] = 9.0  # line 46: the seventh chunk holds lines 43-49
    path = _write(tmp_path / "bad.jsonl", bad)
    with pytest.raises(AgentRLError) as err:
        load_episodes(path, "current episodes", EnvConfig(), world, chunk_size=CHUNK)
    message = str(err.value)
    assert f"{path} lines 43-49" in message and "return" in message
    # unchecked (demonstrations): the same file loads, all 50 records
    assert len(load_episodes(path, "demonstrations", EnvConfig(), world, suite=None, chunk_size=CHUNK)) == 50


def test_an_empty_or_broken_file_names_the_file_and_line(world, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(AgentRLError, match="no current episodes in file"):
        load_episodes(empty, "current episodes", EnvConfig(), world, chunk_size=CHUNK)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"task_id": "a"}\n{not json\n')
    with pytest.raises(AgentRLError, match="broken.jsonl:2: not valid JSON"):
        load_episodes(broken, "current episodes", EnvConfig(), world, chunk_size=CHUNK)
