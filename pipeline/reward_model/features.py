"""Trajectory features and rule labels of the learned verifier; pure functions over the episode record fields every
environment produces through the pipeline's runner (``steps``: ``[{"action", "observation"}]``; ``calls``,
``verifier``, ``success``), so the model is environment-generic.

Features (:func:`trajectory_keys`): strings, each hashed (CRC-32, stable across processes, unlike ``hash``) into one
of ``dim`` buckets (:func:`hash_keys`), so the model is a sparse logistic regression over them:

- each call's tool name, alone (``tool:``), at its position (``at{i}:``), after the previous one (``bigram:``), first
  and last; its parameter names (``param:tool.key``); a call that is not ``<call>name {json}</call>`` (``invalid``);
  an action repeated verbatim (``repeat``, the redundant call the rule labels punish);
- the words of each observation before the answer (``obs:word``, letters only: error messages, not entity values);
- the answer: whether its value occurs in an earlier observation (``answer_seen``) or in the last one
  (``answer_in_last_obs``), whether it is numeric, or missing (``no_answer``: truncated episode);
- the episode length (``len:n``).

What the policy wrote and saw, never the environment's verdict: the calls' outcomes, the verifier report and the
reward are what the labels are made of (:func:`rule_labels`), so they stay out of the features.

Decision: hashed bag-of-features with a linear model rather than a head on the policy's hidden states: it trains in
seconds on the CPU, works for a policy of any architecture, and does not move when RL changes the policy's weights.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

_CALL = re.compile(r"<call>\s*([A-Za-z_][A-Za-z0-9_]{0,31})\s*(.*?)\s*</call>\s*\Z", re.DOTALL)
_OBS = re.compile(r"\A\s*<obs>(.*)</obs>\s*\Z", re.DOTALL)
_WORD = re.compile(r"[a-z]{2,}")
ANSWER = "answer"
MAX_POSITION = 8  # positions from here on share one bucket


def parse_call(action: str) -> tuple[str, dict] | None:
    """``(tool, params)`` of a ``<call>name {json}</call>`` action, None when it is not one.

    >>> parse_call('<call>lookup {"name": "A", "field": "height"}</call>')
    ('lookup', {'name': 'A', 'field': 'height'})
    >>> parse_call('<call>lookup {oops</call>') is None, parse_call('hello') is None
    (True, True)
    """
    m = _CALL.match(action.strip()) if isinstance(action, str) else None
    if m is None:
        return None
    try:
        params = json.loads(m.group(2)) if m.group(2) else {}
    except ValueError:
        return None
    return (m.group(1), params) if isinstance(params, dict) else None


def observation_text(observation: str) -> str:
    """The text inside ``<obs>...</obs>`` (the whole text when it is not wrapped)."""
    m = _OBS.match(observation or "")
    return m.group(1) if m else (observation or "")


def _norm(value: object) -> str:
    return " ".join(str(value).lower().split())


def trajectory_keys(steps: Sequence[dict]) -> list[str]:
    """The feature strings of one trajectory (see the module docstring); a key may occur more than once."""
    keys = [f"len:{min(len(steps), 2 * MAX_POSITION)}"]
    observations: list[str] = []
    seen_actions: set[str] = set()
    previous, answer = "^", None
    for i, step in enumerate(steps):
        action = str(step.get("action", ""))
        parsed = parse_call(action)
        tool = "invalid" if parsed is None else parsed[0]
        pos = min(i, MAX_POSITION)
        keys += [f"tool:{tool}", f"at{pos}:{tool}", f"bigram:{previous}>{tool}"]
        if i == 0:
            keys.append(f"first:{tool}")
        if action.strip() in seen_actions:
            keys += ["repeat", f"repeat:{tool}"]
        seen_actions.add(action.strip())
        if parsed is not None:
            keys += [f"param:{tool}.{k}" for k in sorted(parsed[1])]
        if tool == ANSWER and parsed is not None:
            answer = parsed[1].get("value")
            break
        obs = observation_text(str(step.get("observation", "")))
        observations.append(_norm(obs))
        keys += [f"obs:{w}" for w in sorted(set(_WORD.findall(obs.lower())))]
        previous = tool
    keys.append(f"last:{previous if answer is None else ANSWER}")
    if answer is None:
        keys.append("no_answer")
    else:
        value = _norm(answer)
        if value and any(value in o for o in observations):
            keys.append("answer_seen")
        if value and observations and value in observations[-1]:
            keys.append("answer_in_last_obs")
        if re.fullmatch(r"-?\d+(\.\d+)?", value):
            keys.append("answer_numeric")
    return keys


def hash_keys(keys: Iterable[str], dim: int) -> list[int]:
    """Bucket of each key: CRC-32 of its UTF-8 bytes modulo `dim`.

    >>> hash_keys(["tool:lookup", "repeat"], 1024) == [zlib.crc32(b"tool:lookup") % 1024, zlib.crc32(b"repeat") % 1024]
    True
    """
    return [zlib.crc32(k.encode("utf-8")) % dim for k in keys]


def featurize(steps: Sequence[dict], dim: int) -> list[int]:
    """The hashed feature indices of one trajectory (repeats count: the model sums their weights)."""
    return hash_keys(trajectory_keys(steps), dim)


def redundant_calls(calls: Sequence[dict]) -> int:
    """Calls that repeat an earlier successful call with the same tool and parameters (the answer excluded).

    >>> redundant_calls([{"tool": "a", "params": {"x": 1}, "outcome": "ok"}, {"tool": "a", "params": {"x": 1},
    ...                  "outcome": "ok"}, {"tool": "a", "params": {"x": 2}, "outcome": "ok"}])
    1
    """
    seen, n = set(), 0
    for c in calls:
        if c.get("tool") in (None, ANSWER):
            continue
        key = (c["tool"], json.dumps(c.get("params"), sort_keys=True))
        if key in seen and c.get("outcome") == "ok":
            n += 1
        seen.add(key)
    return n


def rule_labels(record: dict) -> tuple[int, int]:
    """``(success, sound)`` of one episode record as the rules see it: success is the environment's correctness;
    sound means the rule verifier passed (tool order, parameter validity, safety), no call failed, and no call was
    redundant."""
    verifier = record.get("verifier") or {}
    calls = record.get("calls") or []
    failed = record.get("n_failed", sum(c.get("outcome") not in ("ok", ANSWER) for c in calls))
    sound = bool(verifier.get("passed", False)) and failed == 0 and redundant_calls(calls) == 0
    return int(bool(record["success"])), int(sound)


def ragged(indices: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices and per-trajectory offsets (the EmbeddingBag input) of a batch of feature lists.

    >>> flat, offsets = ragged([[3, 1], [], [2]])
    >>> flat.tolist(), offsets.tolist()
    ([3, 1, 2], [0, 2, 2])
    """
    lengths = [len(x) for x in indices]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if lengths else np.zeros(0, np.int64)
    flat = np.fromiter((i for x in indices for i in x), dtype=np.int64, count=sum(lengths))
    return flat, offsets
