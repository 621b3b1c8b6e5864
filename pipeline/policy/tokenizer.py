"""The policy's tokenizer: byte-level BPE trained locally on the environment's training text.

Decisions (the prototype's pitfalls):

- **Byte-level BPE** over the full byte alphabet, so *any* text encodes (hostile unicode, control characters, emoji
  go through their UTF-8 bytes); no unknown token exists. Lone surrogates, which UTF-8 cannot represent, are replaced
  by '?' in :func:`encodable` (the encode helpers below apply it).
- **Digits one per token** (`Digits(individual_digits=True)` before the byte-level split): numbers are what the policy
  copies from tool results into its next call, and per-digit tokens make copying a digit-by-digit skill.
- **Special tokens, one id each**: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2) and the protocol markers ``<call>``,
  ``</call>``, ``<obs>``, ``</obs>`` (3-6; imported from :mod:`pipeline.envs.protocol`). The rollout engine detects the
  end of an action by the ``</call>`` *id*, never by decoding text. Because the markers are split off before BPE, a
  context encodes to the concatenation of its pieces: ``encode(before + action + observation) == encode(before) +
  encode(action) + encode(observation)`` whenever the pieces start and end at markers or newlines, which is what the
  prompt format guarantees (:mod:`pipeline.envs.prompt`). That is what lets the engine keep its KV cache across turns.
- **Every space is a token of its own** (``Split(" ", "isolated")`` before everything else), so a word has the same
  ids wherever it stands: ``height`` in "the height of" (after a space) and in ``"field": "height"`` (after a quote),
  or ``Cedar`` in ``of "Cedar Tower"`` and in ``"query": "Cedar Tower main hall"``. The policy's core skill is
  copying words from the question and from tool results into calls; with GPT-2's space-prefixed words a copy had to
  map `` height`` to ``height``, a per-word mapping that does not transfer to words seen in one position only. Measured
  with space-prefixed words on the default: the adapted policy never learned which field a level-1 question asks for
  (teacher-forced probability of the right field 0.34 on *training* demonstrations, about one in three), and it wrote
  a training entity's name into every level-4 search query. Cost: 34 % more tokens per demonstration (125 to 167
  on the default) and 25 % more action tokens, paid in SFT and rollout time.
- **No normaliser** and ``clean_up_tokenization_spaces=False``: ``decode(encode(text)) == text`` for every valid
  string, so the engine can compare the decoded action with the environment's echo of it.
- ``<bos>`` is prepended by the post-processor when ``add_special_tokens=True`` (the default) -- a context starts with
  it -- and is absent for continuations (``add_special_tokens=False``). Use :func:`encode_context` /
  :func:`encode_continuation` so training and rollout tokenize identically.
- ``padding_side="left"``: generation batches are left-padded.

Measured on the default data (build_env defaults): training takes under a second and saturates at 884 tokens with
``vocab_size=1024`` (merges run out); a demonstration is ~164 tokens (prompt ~93, an action ~18).

Deliberately left out: a chat template (the environment's context *is* the prompt, docs/design.md §3.3) and any text normalisation.

A foreign tokenizer (``model.base`` a Hugging Face folder) goes through the same four functions: with a chat template
they delegate to :mod:`pipeline.policy.chat` (the context rendered as a conversation, actions and observations as
token deltas), without one they encode the text as above. Actions and observations are encoded by
:func:`encode_action` and :func:`encode_observation`, which for this tokenizer are :func:`encode_continuation` (ids
unchanged). :func:`marker_ids` maps ``<pad>``/``<bos>``/``<eos>`` to a foreign tokenizer's own pad/bos/eos tokens
(``<bos>`` to None when it has none).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pipeline.envs.prompt import render_header
from pipeline.envs.protocol import CALL_CLOSE, CALL_OPEN, OBS_CLOSE, OBS_OPEN
from pipeline.core.errors import AgentRLError
from pipeline.core.jsonl import iter_jsonl
from pipeline.policy.chat import chat_format

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
MARKERS = (CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE)
SPECIAL_TOKENS = (PAD, BOS, EOS, *MARKERS)
DEFAULT_VOCAB_SIZE = 1024


def _backend(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    return tok, trainer


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a backend tokenizer holding :data:`SPECIAL_TOKENS` as the transformers tokenizer the policy uses."""
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=list(MARKERS), padding_side="left", clean_up_tokenization_spaces=False,
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer described in the module docstring on `texts`.

    `vocab_size` counts the 256 byte symbols and the 7 special tokens; the rest are merges (training stops earlier
    when no pair occurs twice). Deterministic for the same texts in the same order.
    """
    n_base = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_base:
        raise AgentRLError(f"vocab_size={vocab_size} leaves no room for merges: the byte alphabet and special tokens "
                           f"alone take {n_base} ids")
    tok, trainer = _backend(vocab_size)
    tok.train_from_iterator(texts, trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))), ids  # fixed ids: pad 0, bos 1, eos 2, markers 3-6
    return wrap(tok)


ROLES = {PAD: "pad_token", BOS: "bos_token", EOS: "eos_token"}


def marker_ids(tokenizer) -> dict[str, int | None]:
    """Ids of the special tokens by name; raises AgentRLError if the tokenizer lacks one as a single token. For a
    tokenizer whose pad/bos/eos tokens are others (a foreign model's), those ids (``<bos>``: None without one)."""
    out = {}
    for t in SPECIAL_TOKENS:
        role = ROLES.get(t)
        own = getattr(tokenizer, role, None) if role else None
        if role and own != t:  # a foreign tokenizer: its own pad/bos/eos stand for ours
            if own is None and t == BOS:
                out[t] = None
                continue
            if own is None:
                raise AgentRLError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no {role}; the policy "
                                   f"needs one (pad: batching; eos: the end of an action)")
            out[t] = tokenizer.convert_tokens_to_ids(own)
            continue
        ids = tokenizer.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise AgentRLError(f"tokenizer does not hold {t!r} as a single token (got ids {ids}); the policy's "
                               f"tokenizer must contain the protocol markers {list(MARKERS)} as special tokens")
        out[t] = ids[0]
    return out


def encodable(text: str) -> str:
    """`text` with anything UTF-8 cannot represent (lone surrogates) replaced by '?'; every other string is returned
    unchanged. The Rust tokenizer refuses such strings, so every encode in the policy goes through this."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def encode_context(tokenizer, text: str) -> list[int]:
    """Token ids of a context (the start of a policy input): ``<bos>`` + the text; with a chat template, an
    environment context rendered as a conversation (:mod:`pipeline.policy.chat`)."""
    fmt = chat_format(tokenizer)
    if fmt is not None:
        ids = fmt.context_ids(encodable(text))
        if ids is not None:
            return ids
    return tokenizer.encode(encodable(text), add_special_tokens=True)


def encode_continuation(tokenizer, text: str) -> list[int]:
    """Token ids of plain text appended to a context: no ``<bos>``. (Actions and observations of an episode:
    :func:`encode_action`, :func:`encode_observation`.)"""
    return tokenizer.encode(encodable(text), add_special_tokens=False)


def encode_action(tokenizer, text: str) -> list[int]:
    """Token ids of an action appended to a context (the tokens the policy writes)."""
    fmt = chat_format(tokenizer)
    return encode_continuation(tokenizer, text) if fmt is None else fmt.action_ids(encodable(text))


def encode_observation(tokenizer, text: str) -> list[int]:
    """Token ids of an observation appended after an action; with a chat template, the tool turn's delta (the end of
    the assistant turn, the tool turn and the next generation prompt)."""
    fmt = chat_format(tokenizer)
    return encode_continuation(tokenizer, text) if fmt is None else fmt.observation_ids(encodable(text))


def encode_turns(tokenizer, context: str, steps: Iterable[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Ids and action mask of a context followed by (action_text, observation_text) pairs, as the rollout engine lays
    them out (mask 1 on action tokens, 0 on the context and observations). For SFT on demonstrations; it does not fold
    history (an episode longer than `history_window` would be re-based by the engine, see pipeline.policy.rollout)."""
    ids = encode_context(tokenizer, context)
    mask = [0] * len(ids)
    for action, obs in steps:
        a, o = encode_action(tokenizer, action), encode_observation(tokenizer, obs)
        ids += a + o
        mask += [1] * len(a) + [0] * len(o)
    return ids, mask


def corpus_texts(data_dir: str | Path, signatures: list[str], documents: Sequence[str] = ()) -> Iterator[str]:
    """The tokenizer's training text, from training data only: the world's documents (``env/corpus.jsonl``, and
    `documents`: the environment's ``corpus()`` where it offers capability HasCorpus),
    the prompt header of every training question (``tasks/train.jsonl``; the header is in every policy input, so its
    words deserve merges) and the demonstrations' actions and
    observations (``demos/train.jsonl``). Validation and test files are never read."""
    data_dir = Path(data_dir)
    hint = "run `agentrl build-env` first"
    corpus = data_dir / "env" / "corpus.jsonl"  # the world's documents, where its environment writes them
    for doc in iter_jsonl(corpus, "document corpus", hint=hint) if corpus.is_file() else ():
        yield f"{doc.get('title', '')}\n{doc.get('text', '')}"
    yield from (d for d in documents if isinstance(d, str))
    for task in iter_jsonl(data_dir / "tasks" / "train.jsonl", "training tasks", hint=hint):
        yield render_header(task["question"], signatures)
    for demo in iter_jsonl(data_dir / "demos" / "train.jsonl", "demonstrations", hint=hint):
        for step in demo["steps"]:
            yield step["action"] + step["observation"]
