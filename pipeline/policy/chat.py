"""Chat-template prompts for a tokenizer that has one: the environment's context as a conversation, and the token
deltas that actions and tool results append to it.

The built-in tokenizer has no chat template: its policy reads the environment's context text as it is
(:mod:`pipeline.policy.tokenizer`), and nothing here runs for it. A Hugging Face model brought in through
``model.base`` usually was trained on its own chat template, so for a tokenizer with a ``chat_template``:

- **The prompt goes through the template.** The environment's context has a fixed layout: a system line ("You are
  an agent that can use tools. Available tools: ..."), then ``Task: <question>`` (and, once old turns are folded, a
  ``State: ...`` line), then action/observation pairs (``<call>tool {json}</call>`` and ``<obs>result</obs>\\n``).
  :func:`context_messages` reads it as ``system``, ``user``, then ``assistant`` (the action text) and ``tool`` (the
  observation without its final newline) messages; :meth:`ChatFormat.context_ids` renders that with
  ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``. When tool specs are bound (OpenAI
  function shape, :func:`openai_tools`), the template renders them into the system turn and the system line loses
  its own "Available tools: ..." list; without them the system line stays whole. Text that is not laid out like a
  context (continued pre-training's documents and drills) is encoded plainly.
- **Actions and tool results are token deltas.** An action is its text's tokens (what the policy samples, ending
  at ``</call>``); a tool result is what the template adds after an assistant turn's content for a tool turn plus
  the next generation prompt (for Qwen: ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
  <|im_end|>\\n<|im_start|>assistant\\n``), measured by rendering a fixed two-message conversation with and
  without the tool turn. A context is its first prompt plus these deltas, so ``context_ids(c + a + o) ==
  context_ids(c) + action_ids(a) + observation_ids(o)``: the rollout engine keeps its KV cache across turns, and
  training (SFT on demonstrations, RL's recomputed log-probabilities) sees exactly the tokens rollouts produced.
- **Start-up check** (:meth:`ChatFormat.check`, run when a format is made, i.e. when a model's tokenizer is loaded
  or built): a probe conversation of two tool-using turns built from deltas must equal the template's own rendering
  of the whole conversation, token for token, after every turn. A template that changes earlier tokens once a turn
  is appended (one that renders the message count, drops or rewrites earlier assistant content, or reasoning blocks
  of earlier turns) would make the training stream differ from what inference renders -- the train/inference
  token-stream mismatch known from other RL frameworks -- and is refused with an :class:`AgentRLError` naming the
  tokenizer and the first differing tokens.

The format is kept on the tokenizer object (``tokenizer.agentrl_chat``): :func:`bind_tools` sets it,
:func:`chat_format` makes a tool-less one on first use. :func:`pipeline.policy.model.save_policy` stores the bound
tools in ``policy.json`` and :func:`~pipeline.policy.model.load_policy` binds them again, so every phase renders the
same prompt. Left out: the template's native ``tool_calls`` field (the action stays the protocol's text, which the
environment parses) and reasoning templates.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from pipeline.core.errors import AgentRLError

CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE = "<call>", "</call>", "<obs>", "</obs>"  # as pipeline.env.protocol
TASK_PREFIX, STATE_PREFIX = "Task: ", "State: "
TOOLS_MARK = " Available tools:"  # where the system line's own tool list starts
ATTR = "agentrl_chat"

# the start-up check's probe conversation (two tool-using turns, as the environment writes them)
PROBE_SYSTEM = "You are an agent that can use tools."
PROBE_USER = "Task: What is the height of 'Cedar Tower'?"
PROBE_TURNS = (('<call>search {"query": "Cedar Tower"}</call>', '<obs>[{"id": 12, "height": 19.5}]</obs>\n'),
               ('<call>answer {"value": "19.5"}</call>', "<obs>ok</obs>\n"))
DELTA_BASE = ({"role": "system", "content": "s"}, {"role": "user", "content": "u"})
DELTA_ACTION = "<call>a {}</call>"


def openai_tools(tools: Iterable) -> list[dict]:
    """Tool specs in OpenAI function shape (``{"type": "function", "function": {name, description, parameters}}``)
    from objects or dicts with ``name``, ``description`` and ``parameters`` (a JSON schema); specs already in that
    shape pass through. Copies, so the caller's objects are never shared."""
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function" and "function" in t:
            out.append(json.loads(json.dumps(t)))
            continue
        get = t.get if isinstance(t, dict) else (lambda k, t=t: getattr(t, k, None))
        if not get("name"):
            raise AgentRLError(f"tool spec {t!r} has no name; give name, description and parameters")
        out.append({"type": "function", "function": {
            "name": get("name"), "description": get("description") or "",
            "parameters": json.loads(json.dumps(get("parameters") or {"type": "object", "properties": {}}))}})
    return out


def context_messages(text: str, with_tools: bool) -> tuple[list[dict], list[tuple[str, str]]] | None:
    """The environment's context as ``([system, user], [(action, observation), ...])``, or None for text that is not
    laid out like a context (see the module docstring). With `with_tools` the system line loses its tool list.
    History that does not parse into pairs stays in the user message (the stream still only grows by deltas)."""
    first, sep, rest = text.partition("\n")
    if not sep or not rest.startswith(TASK_PREFIX):
        return None
    system = first.split(TOOLS_MARK)[0] if with_tools else first
    end = rest.find("\n") + 1 or len(rest)
    if rest.startswith(STATE_PREFIX, end):
        end = rest.find("\n", end) + 1 or len(rest)
    user, history, pairs, pos = rest[:end], rest[end:], [], 0
    while pos < len(history):
        i = history.find(OBS_OPEN, pos)
        j = history.find(OBS_CLOSE + "\n", i) if i >= 0 else -1
        if j < 0:
            return [_msg("system", system), _msg("user", _chomp(rest))], []
        pairs.append((history[pos:i], history[i:j + len(OBS_CLOSE) + 1]))
        pos = j + len(OBS_CLOSE) + 1
    return [_msg("system", system), _msg("user", _chomp(user))], pairs


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _chomp(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text


def _name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


class ChatFormat:
    """How one tokenizer with a chat template encodes contexts, actions and observations (module docstring).
    Made by :func:`bind_tools` / :func:`chat_format`; runs :meth:`check` on construction."""

    def __init__(self, tokenizer, tools: Sequence[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = openai_tools(tools) if tools else None
        self.name = _name(tokenizer)
        self._base_ids = None
        self._base_ids = self.render_ids(list(DELTA_BASE), generation=True, tools=False)
        self.check()

    # ---------------------------------------------------------------------------------------------------- encoding
    def render_ids(self, messages: list[dict], generation: bool, tools: bool = True) -> list[int]:
        """Token ids of the template's rendering of `messages` (with the bound tools unless `tools` is False)."""
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(messages, tools=self.tools if tools else None,
                                                      add_generation_prompt=generation, tokenize=False)
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise AgentRLError(f"tokenizer {self.name!r}: its chat template does not render a tool-using "
                               f"conversation ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(text, str):
            raise AgentRLError(f"tokenizer {self.name!r}: apply_chat_template returned {type(text).__name__}, not text")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def action_ids(self, text: str) -> list[int]:
        """An action's tokens: its text, as the policy samples it (no template tokens)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observation_ids(self, text: str) -> list[int]:
        """What the template appends after an assistant turn's content for a tool turn holding `text` (without its
        final newline), plus the next generation prompt."""
        head = self._base_ids + self.action_ids(DELTA_ACTION)
        full = self.render_ids([*DELTA_BASE, _msg("assistant", DELTA_ACTION), _msg("tool", _chomp(text))],
                               generation=True, tools=False)
        if full[:len(head)] != head:
            raise AgentRLError(self._mismatch("a tool turn changes the tokens before it", head, full))
        return full[len(head):]

    def context_ids(self, text: str) -> list[int] | None:
        """Token ids of an environment context (first prompt plus deltas); None for text not laid out like one."""
        parsed = context_messages(text, self.tools is not None)
        if parsed is None:
            return None
        messages, pairs = parsed
        ids = self.render_ids(messages, generation=True)
        for action, obs in pairs:
            ids += self.action_ids(action) + self.observation_ids(obs)
        return ids

    # ---------------------------------------------------------------------------------------------- start-up check
    def check(self) -> None:
        """Refuse a template under which appending an assistant turn and a tool turn changes earlier tokens (module
        docstring): the delta-built probe must equal the template's rendering after every turn."""
        messages = [_msg("system", PROBE_SYSTEM), _msg("user", PROBE_USER)]
        built = self.render_ids(messages, generation=True)
        first = list(built)
        for k, (action, obs) in enumerate(PROBE_TURNS, 1):
            a = self.action_ids(action)
            messages.append(_msg("assistant", action))
            rendered = self.render_ids(messages, generation=False)
            if rendered[:len(built) + len(a)] != built + a:
                raise AgentRLError(self._mismatch(f"appending assistant turn {k} changes earlier tokens or the "
                                                  "action's own text", built + a, rendered))
            built = built + a + self.observation_ids(obs)
            messages.append(_msg("tool", _chomp(obs)))
            rendered = self.render_ids(messages, generation=True)
            if rendered != built:
                raise AgentRLError(self._mismatch(f"after tool turn {k} the template's rendering of the whole "
                                                  "conversation differs from the prompt plus the turns' deltas",
                                                  built, rendered))
        if self.tools:  # bound tools replace the system line's own list: a template that drops them hides the tools
            shown = self.tokenizer.decode(first)
            missing = [t["function"]["name"] for t in self.tools if t["function"]["name"] not in shown]
            if missing:
                raise AgentRLError(f"tokenizer {self.name!r}: its chat template does not render the tools passed to "
                                   f"it (missing from the prompt: {', '.join(missing)}); the policy would never see "
                                   f"them. Use a template that renders `tools`, or remove the chat template")

    def _mismatch(self, what: str, built: list[int], rendered: list[int]) -> str:
        i = next((i for i, (x, y) in enumerate(zip(built, rendered)) if x != y), min(len(built), len(rendered)))
        dec = self.tokenizer.decode
        return (f"tokenizer {self.name!r}: chat template is not append-only: {what} (first difference at token "
                f"{i}: the token stream has {dec(built[i:i + 16])!r}, the template renders "
                f"{dec(rendered[i:i + 16])!r}); training and inference would see different tokens. Use a template "
                f"whose rendering of earlier turns does not depend on later ones")


def chat_format(tokenizer) -> ChatFormat | None:
    """The tokenizer's :class:`ChatFormat` (made without tools on first use), or None when it has no chat template
    (the built-in tokenizer)."""
    fmt = getattr(tokenizer, ATTR, None)
    if fmt is not None:
        return fmt
    if not getattr(tokenizer, "chat_template", None):
        return None
    return bind_tools(tokenizer, None)


def bind_tools(tokenizer, tools: Iterable | None) -> ChatFormat | None:
    """Make (and check) the tokenizer's :class:`ChatFormat` with `tools` (any shape :func:`openai_tools` takes; None
    or empty: no tools) and keep it on the tokenizer; None for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    fmt = ChatFormat(tokenizer, list(tools) if tools else None)
    setattr(tokenizer, ATTR, fmt)
    return fmt


def bound_tools(tokenizer) -> list[dict] | None:
    """The tool specs bound to the tokenizer's format (None: none bound or no template)."""
    fmt = getattr(tokenizer, ATTR, None)
    return None if fmt is None else fmt.tools
