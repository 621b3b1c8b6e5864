"""Train/serve consistency (docs/design.md §5.3.1): the training path and the serving path must see the
same state.

For a probe set of raw observations (a question, the history of (action, observation) pairs, the history window and
the tool signatures), :func:`check_consistency` runs both paths and compares, stage by stage:

1. **prompts**: ``train_preprocess(...)`` and ``serve_preprocess(...)`` (both with the signature of
   :func:`pipeline.envs.prompt.render_context`, the one prompt function) must return identical text;
2. **token ids**: ``train_encode(tokenizer, text)`` and ``serve_encode(tokenizer, text)`` must return identical ids;
3. **hidden states**: the mean-pooled last hidden state of the training model on the training ids and of the serving
   model (default: the same model; pass a quantised or bf16 copy to check it) on the serving ids must have a mean
   squared difference below ``mse_threshold`` for every probe.

The check fails on the first probe (lowest index) that fails any stage, and shows it: the probe's index, the stage,
and both texts around the first differing character (or both id runs around the first differing token, or the MSE).
Without a model and tokenizer only stage 1 runs, and the report says which stages were skipped.

The phase (:mod:`pipeline.check_drift.main`) runs stages 1 and 2 against the configured serving preprocess; stage 3
is for callers with a distinct serving model. The model that is actually served -- the registered pyfunc behind
`agentrl serve` -- is checked by the deploy phase, with latency and deployed episodes replayed in the training
environment (:mod:`pipeline.deploy.served_check`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.core.errors import AgentRLError

SNIPPET = 40  # characters shown on each side of the first difference
TOKEN_SNIPPET = 6  # token ids shown on each side of the first difference


class ConsistencyError(AgentRLError):
    """The training and serving paths disagree; the message shows the first differing probe."""


@dataclass(frozen=True)
class Probe:
    """One raw observation, the arguments of render_context."""

    question: str
    history: tuple[tuple[str, str], ...]
    window: int
    tool_signatures: tuple[str, ...]

    def args(self) -> tuple:
        return self.question, list(self.tool_signatures), [tuple(p) for p in self.history], self.window


@dataclass(frozen=True)
class Mismatch:
    """The first probe on which the paths disagree."""

    index: int
    stage: str  # "prompt", "tokens" or "hidden"
    position: int | None  # first differing character (prompt) or token (tokens)
    train: str
    serve: str
    detail: str = ""

    def describe(self) -> str:
        unit = "character" if self.stage == "prompt" else "token"
        where = f" at {unit} {self.position}" if self.position is not None else ""
        text = f"probe {self.index}: {self.stage} differ{where}"
        if self.detail:
            text += f" ({self.detail})"
        return f"{text}\n  train: {self.train}\n  serve: {self.serve}"


@dataclass(frozen=True)
class ConsistencyReport:
    n_probes: int
    prompts_identical: bool
    tokens_identical: bool | None  # None: not checked
    hidden_mse_max: float | None
    hidden_mse_mean: float | None
    mse_threshold: float
    mismatch: Mismatch | None = None
    skipped: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.mismatch is None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = "pass" if self.passed else "fail"
        d["message"] = self.describe()
        return d

    def describe(self) -> str:
        if self.passed:
            checked = ["prompts"] + (["token ids"] if self.tokens_identical is not None else []) + (
                [f"hidden states (max MSE {self.hidden_mse_max:.2e} < {self.mse_threshold:g})"]
                if self.hidden_mse_max is not None else [])
            skipped = f"; not checked: {'; '.join(self.skipped)}" if self.skipped else ""
            return f"train/serve consistent on {self.n_probes} probes: {', '.join(checked)}{skipped}"
        return "train/serve paths differ: " + self.mismatch.describe()

    def raise_if_failed(self) -> "ConsistencyReport":
        if not self.passed:
            raise ConsistencyError(self.describe())
        return self


# --------------------------------------------------------------------------------------------------------- helpers
def _first_difference(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _around(text: str, pos: int, width: int = SNIPPET) -> str:
    lo, hi = max(0, pos - width), min(len(text), pos + width)
    return ("..." if lo else "") + repr(text[lo:hi])[1:-1] + ("..." if hi < len(text) else "")


def _ids_around(ids: Sequence[int], pos: int, tokenizer=None, width: int = TOKEN_SNIPPET) -> str:
    lo, hi = max(0, pos - width), min(len(ids), pos + width)
    run = list(ids[lo:hi])
    text = f"{'... ' if lo else ''}{run}{' ...' if hi < len(ids) else ''}"
    if tokenizer is not None and pos < len(ids):
        text += f" (token {pos} = {tokenizer.convert_ids_to_tokens(int(ids[pos]))!r})"
    return text


def as_probe(obs: Probe | Mapping, signatures: Sequence[str] = ()) -> Probe:
    """A :class:`Probe` from itself or a mapping with question, history, window and tool_signatures (default
    `signatures`)."""
    if isinstance(obs, Probe):
        return obs
    sigs = obs.get("tool_signatures") or signatures
    if not sigs:
        raise AgentRLError("a probe needs tool_signatures (the environment's tool list)")
    return Probe(obs["question"], tuple(tuple(p) for p in obs.get("history", ())), int(obs["window"]), tuple(sigs))


def resolve_callable(spec: str) -> Callable:
    """Import 'module:function' (the `serving_preprocess` setting); failures are AgentRLError naming the setting."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise AgentRLError(f"check_drift.serving_preprocess={spec!r}: cannot import it ({exc})") from None
    if not callable(fn):
        raise AgentRLError(f"check_drift.serving_preprocess={spec!r} is not a function")
    return fn


def probes_from_episodes(tasks: Sequence[dict], episodes: Iterable[dict], window: int, n: int, seed: int = 0,
                         folded: int = 4, signatures: Sequence[str] = ()) -> list[Probe]:
    """Probe observations from episode records: the context before every step of every episode whose task is
    known, a fixed-seed sample of `n` of them; plus `folded` synthetic probes whose history (an episode's steps
    repeated) is longer than `window`, so the folded-summary branch of the prompt is always exercised.

    `episodes` is read twice (a list, or an episode file that re-reads itself): once to count the contexts and draw
    which `n` to take, once to build only those, so memory holds the sample, not every step of every episode."""
    sigs = tuple(signatures)
    questions = {t["task_id"]: t["question"] for t in tasks}

    def usable(ep: dict):
        q = questions.get(ep.get("task_id"))
        pairs = tuple((s["action"], s["observation"]) for s in ep.get("steps") or [])
        return (q, pairs) if q is not None and pairs else (None, ())

    long: list[Probe] = []
    total = 0
    for ep in episodes:
        q, pairs = usable(ep)
        if not pairs:
            continue
        total += len(pairs)
        if len(long) < folded:
            reps = window // len(pairs) + 2
            long.append(Probe(q, (pairs * reps)[: window + len(pairs)], window, sigs))
    rng = np.random.default_rng([seed, 8])
    if not total:
        pool = [Probe(t["question"], (), window, sigs) for t in tasks]
        return [pool[i] for i in np.sort(rng.choice(len(pool), size=min(n, len(pool)), replace=False))] + long
    wanted = np.sort(rng.choice(total, size=min(n, total), replace=False)).tolist()
    picked: list[Probe] = []
    start, j = 0, 0
    for ep in episodes:
        if j == len(wanted):
            break
        q, pairs = usable(ep)
        end = start + len(pairs)
        while j < len(wanted) and wanted[j] < end:
            picked.append(Probe(q, pairs[: wanted[j] - start], window, sigs))
            j += 1
        start = end
    return picked + long


# ------------------------------------------------------------------------------------------------------ the check
def check_consistency(probe_observations: Sequence[Probe | Mapping], train_preprocess: Callable | None = None,
                      serve_preprocess: Callable | None = None, model=None, tokenizer=None,
                      mse_threshold: float = 1e-6, *, train_encode: Callable | None = None,
                      serve_encode: Callable | None = None, serve_model=None, batch_size: int = 32,
                      max_tokens: int = 512) -> ConsistencyReport:
    """Compare the training and serving paths on `probe_observations` (see the module docstring).

    `train_preprocess` defaults to :func:`pipeline.envs.prompt.render_context` and `serve_preprocess` to the same
    function; `train_encode`/`serve_encode` ``(tokenizer, text) -> ids`` to the policy's ``encode_context``;
    `serve_model` to `model`. Without `tokenizer` only the prompts are compared; without `model` no hidden states."""
    from pipeline.check_drift.features import clip_ids, default_encode, hidden_states_from_ids
    from pipeline.envs.prompt import render_context

    probes = [as_probe(p) for p in probe_observations]
    if not probes:
        raise AgentRLError("the consistency check needs at least one probe observation")
    train_preprocess = train_preprocess or render_context
    serve_preprocess = serve_preprocess or train_preprocess
    mismatches: list[Mismatch] = []

    train_text = [train_preprocess(*p.args()) for p in probes]
    serve_text = [serve_preprocess(*p.args()) for p in probes]
    bad_prompt = [i for i, (a, b) in enumerate(zip(train_text, serve_text)) if a != b]
    if bad_prompt:
        i = bad_prompt[0]
        pos = _first_difference(train_text[i], serve_text[i])
        detail = (f"lengths {len(train_text[i])} and {len(serve_text[i])}; {len(bad_prompt)} of {len(probes)} "
                  f"probes differ")
        mismatches.append(Mismatch(i, "prompt", pos, _around(train_text[i], pos), _around(serve_text[i], pos), detail))

    skipped: list[str] = []
    tokens_identical = mse_max = mse_mean = None
    if tokenizer is None:
        skipped.append("token ids and hidden states (no tokenizer)")
    else:
        train_encode, serve_encode = train_encode or default_encode, serve_encode or train_encode or default_encode
        train_ids = [train_encode(tokenizer, t) for t in train_text]
        serve_ids = [serve_encode(tokenizer, t) for t in serve_text]
        bad_ids = [i for i, (a, b) in enumerate(zip(train_ids, serve_ids)) if list(a) != list(b)]
        tokens_identical = not bad_ids
        if bad_ids:
            i = bad_ids[0]
            pos = _first_difference(train_ids[i], serve_ids[i])
            mismatches.append(Mismatch(i, "tokens", pos, _ids_around(train_ids[i], pos, tokenizer),
                                       _ids_around(serve_ids[i], pos, tokenizer),
                                       f"{len(train_ids[i])} and {len(serve_ids[i])} tokens; {len(bad_ids)} of "
                                       f"{len(probes)} probes differ"))
        if model is None:
            skipped.append("hidden states (no model)")
        else:
            a = hidden_states_from_ids(model, [clip_ids(x, max_tokens) for x in train_ids], batch_size)
            b = hidden_states_from_ids(serve_model if serve_model is not None else model,
                                       [clip_ids(x, max_tokens) for x in serve_ids], batch_size)
            mse = ((a.astype(np.float64) - b) ** 2).mean(axis=1)
            mse_max, mse_mean = float(mse.max()), float(mse.mean())
            over = np.flatnonzero(~(mse < mse_threshold))
            if len(over):
                i = int(over[0])
                mismatches.append(Mismatch(i, "hidden", None, f"features of {len(train_ids[i])} tokens",
                                           f"features of {len(serve_ids[i])} tokens",
                                           f"MSE {mse[i]:.3e} >= threshold {mse_threshold:g}; {len(over)} of "
                                           f"{len(probes)} probes over it"))
    first = min(mismatches, key=lambda m: (m.index, ("prompt", "tokens", "hidden").index(m.stage)), default=None)
    return ConsistencyReport(len(probes), not bad_prompt, tokens_identical, mse_max, mse_mean, mse_threshold, first,
                             skipped)


__all__ = ["ConsistencyError", "ConsistencyReport", "Mismatch", "Probe", "as_probe", "check_consistency",
           "probes_from_episodes", "resolve_callable"]
