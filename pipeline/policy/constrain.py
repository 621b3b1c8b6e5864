"""Decoding constrained by the tools' JSON Schemas (``rollout.constrain: schema``).

The pipeline knows every tool's parameter schema, so it knows, at each token of an action, which tokens can still
continue a valid call: ``<call>``, one of the episode's tool names, a space, a JSON object that its tool's schema
accepts (its properties in the schema's order, enums, patterns, types, bounds), ``</call>``. With the constraint on,
the rollout engine sets every other token's logit to -inf before it samples, so an action can no longer be
unparsable or break its tool's schema; what the policy still chooses is the tool and the values.

How:

- **llguidance** (the grammar engine behind constrained decoding in vLLM, SGLang and llama.cpp) compiles a Lark
  grammar whose tool rules embed each schema (``%json {...}``), over the policy's own tokenizer, and computes each
  step's token mask (a bitmask of the vocabulary) incrementally from the tokens the action has so far. One
  :class:`CallConstraint` per engine: the tokenizer is converted once, a grammar is compiled once per tool set, and
  each live action holds one matcher.
- **The JSON is written as the demonstrations write it**: ``json.dumps``' separators (``", "`` and ``": "``), no
  other whitespace, properties in the order the schema lists them (the order :func:`pipeline.envs.protocol.format_action`
  and every built-in expert use). :func:`violations` lists the demonstration actions the grammar would refuse, so a
  test (and a user) can check that the constraint never forbids what the expert does.
- **Log-probabilities**: a sampled token's recorded log-probability is that of the distribution it was drawn from, the
  masked and renormalised one (greedy decoding picks the most probable allowed token and records the model's own
  log-probability of it, for diagnostics, as it does without the constraint). RL's learner already treats recorded
  log-probabilities as the behaviour policy μ and corrects with the truncated importance weight ``min(c, π/μ)`` (as
  for the tool-choice noise), so training corrects for the constraint as for any other behaviour policy: the weight of
  an action is the mass, multiplied over its tokens, the unconstrained policy put on allowed tokens, at most 1.
- **Where it stops**: an action cut at ``rollout.max_new_tokens`` ends where it is cut (the limit is derived from the
  demonstrations with a margin); a forced token the grammar refuses (the tool-choice noise writes a name another way)
  drops the constraint for the rest of that action, counted in ``stats["dropped"]``. A one-action "episode"
  (:meth:`~pipeline.policy.rollout.RolloutEngine.complete`, which knows no tools) is never constrained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from pipeline.core.errors import AgentRLError

# the separators of json.dumps' default, which pipeline.envs.protocol.format_action (and so every demonstration) uses
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def action_grammar(specs: Sequence, open_id: int, close_id: int) -> str:
    """The Lark grammar (llguidance's dialect) of one action over the tools `specs` (ToolSpec-like: ``name``,
    ``parameters``): the ``<call>`` token, a tool's name, a space, its parameters as JSON its schema accepts, the
    ``</call>`` token; `open_id` / `close_id` are those tokens' ids."""
    lines = [f"start: <[{open_id}]> call <[{close_id}]>",
             "call: " + " | ".join(f"tool_{i}" for i in range(len(specs)))]
    for i, spec in enumerate(specs):
        schema = {**spec.parameters, "x-guidance": JSON_STYLE}
        lines.append(f"tool_{i}: {_lark_string(spec.name + ' ')} params_{i}")
        lines.append(f"params_{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def _specs_key(specs: Sequence) -> tuple:
    return tuple((s.name, json.dumps(s.parameters, sort_keys=True)) for s in specs)


class CallConstraint:
    """Per engine: masks the logits of rows writing an action so that only valid calls can be written.

    `tokenizer` is the policy's (a fast Hugging Face tokenizer); `vocab` the width of the model's logits (at least the
    tokenizer's size; ids past the tokenizer are never allowed); `open_id` / `close_id` the ``<call>`` / ``</call>``
    token ids. Rows are identified by any hashable key (the engine uses the episode's index)."""

    def __init__(self, tokenizer, vocab: int, open_id: int, close_id: int):
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        self.n_tok, self.vocab = self.lltok.vocab_size, int(vocab)
        self.open_id, self.close_id = int(open_id), int(close_id)
        self.words = (self.n_tok + 31) // 32
        self._protos: dict[tuple, object] = {}
        self._matchers: dict = {}
        self._bits = torch.arange(32, dtype=torch.int32)
        self.stats = {"actions": 0, "masked_tokens": 0, "dropped": 0}

    def _prototype(self, specs: Sequence):
        """The matcher at the start of an action over `specs`, compiled once per tool set (about 3.5 ms); every
        action then starts from a copy of it (about 1 µs)."""
        key = _specs_key(specs)
        if key not in self._protos:
            text = self._ll.grammar_from("lark", action_grammar(specs, self.open_id, self.close_id))
            proto = self._ll.LLMatcher(self.lltok, text, log_level=0)
            if proto.is_error():  # e.g. a `pattern` with look-around, which JSON Schema allows and llguidance does not
                names = ", ".join(s.name for s in specs)
                raise AgentRLError(f"rollout.constrain: schema: the parameter schemas of the tools {names} cannot be "
                                   f"decoded under: {' '.join(proto.get_error().split())}; simplify the schema or set "
                                   f"rollout.constrain: none")
            self._protos[key] = proto
        return self._protos[key]

    def matcher(self, specs: Sequence):
        """A fresh matcher at the start of an action over `specs`."""
        return self._prototype(specs).deep_copy()

    def mask_(self, logits: torch.Tensor, rows: Sequence[tuple[object, Sequence | None, bool]],
              keep: torch.Tensor | None = None) -> torch.Tensor:
        """Mask `logits` (n, vocab) in place. `rows[i]` = (key, the row's tool specs or None for no constraint,
        whether the row starts a new action). A row whose matcher failed is left as it is.

        `keep` (n,) token ids, for greedy decoding: a row whose token the grammar allows is left unmasked, since the
        most probable allowed token is then that token anyway; only the other rows pay for a mask (a trained policy
        writes almost every token validly)."""
        idx, ms = [], []
        for i, (key, specs, starts) in enumerate(rows):
            if starts:
                self._matchers.pop(key, None)
                if specs:
                    self._matchers[key] = self.matcher(specs)
                    self.stats["actions"] += 1
            m = self._matchers.get(key)
            if m is not None and not m.is_error():
                if keep is not None and m.validate_tokens([int(keep[i])]) == 1:
                    continue
                idx.append(i)
                ms.append(m)
        if not idx:
            return logits
        bitmask = torch.empty((len(idx), self.words), dtype=torch.int32)
        for j, m in enumerate(ms):
            m.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), self.words * 4)
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).reshape(len(idx), -1)[:, :self.n_tok].bool()
        full = torch.zeros((len(idx), logits.shape[-1]), dtype=torch.bool)
        full[:, :self.n_tok] = allowed
        sub = logits[idx]
        self.stats["masked_tokens"] += len(idx)
        logits[idx] = sub.masked_fill(~full, float("-inf"))
        return logits

    def consume(self, key, token: int) -> None:
        """The row `key` wrote `token`; a token its grammar refuses ends the constraint for this action."""
        m = self._matchers.get(key)
        if m is not None and not m.consume_token(int(token)):
            self.stats["dropped"] += 1
            del self._matchers[key]

    def end(self, key) -> None:
        """The row's action ended (``</call>``, end of text or the token limit)."""
        self._matchers.pop(key, None)


def violations(constraint: CallConstraint, specs: Sequence, action_ids: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the actions (token ids, ``<call>`` … ``</call>``) that the grammar over `specs` refuses."""
    bad = []
    for i, ids in enumerate(action_ids):
        m = constraint.matcher(specs)
        if not (m.consume_tokens([int(t) for t in ids]) and m.is_accepting()):
            bad.append(i)
    return bad


def check_demonstrations(tokenizer, vocab: int, demos: Sequence[dict], specs_of) -> int:
    """Refuse demonstrations that decoding under the schemas could never write; returns the number of actions checked.

    A model fine-tuned on actions the grammar refuses learns to write what constrained decoding will not let it
    (the usual cause: an expert that writes a call's parameters in another order than its tool's schema lists them,
    or a value outside an enum). `specs_of(task_id)` gives the tool specs of a demonstration's task, the same the
    rollout engine constrains to. The error names how many actions were refused, the first one and its task."""
    from pipeline.policy.tokenizer import CALL_CLOSE, CALL_OPEN, encode_action, marker_ids

    ids = marker_ids(tokenizer)
    constraint = CallConstraint(tokenizer, vocab, ids[CALL_OPEN], ids[CALL_CLOSE])
    n, refused = 0, []
    for d in demos:
        actions = [s["action"] for s in d["steps"]]
        bad = violations(constraint, specs_of(d["task_id"]), [encode_action(tokenizer, a) for a in actions])
        refused += [(d["task_id"], actions[i]) for i in bad]
        n += len(actions)
    if refused:
        task_id, action = refused[0]
        raise AgentRLError(f"rollout.constrain: schema refuses {len(refused)} of the {n} demonstrated actions, e.g. "
                           f"task {task_id!r}: {action[:200]!r}; the expert must write each call as its tool's "
                           "schema says (parameters in the schema's order, values it allows), or set "
                           "rollout.constrain: none")
    return n
