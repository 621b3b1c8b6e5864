"""The one prompt: the system template of docs/design.md §3.3.2, the task, a folded summary of old results, and the recent
history.

This function renders the environment's `context` observation, and the language-model policy reads exactly that text
in training, evaluation and serving (docs/design.md §3.3.2: "You are an agent that can use tools.
Available tools: {tool_list}. Current state: {state}. Previous actions: {history}."). History is managed as the
docs/design.md §3.7 asks: the last `window` action/observation pairs stay verbatim, older pairs are folded into one `State:` line that keeps each call's
result (the short-term window plus a compact summary), so the context stays bounded however long the episode runs.

While no folding happens, the context only grows by appending each action and its observation. That is what lets the
rollout engine keep its KV cache across turns: the context after a step equals the context before it plus
`info["action_text"] + info["observation_text"]` (the environment sets `info["context_folded"]` when that stops holding).

With the context actions on (:mod:`pipeline.envs.context_actions`), their tools follow the environment's in the tool
list (measured: a separate "Context tools:" line after or before the task line costs the adapted policy more than
this), and the agent's latest ``note`` replaces the turns up to and including it by one ``Note: <text>`` line after
the header; the turns after the note are the history the window and the summary line apply to. Without a note the
text is exactly what it was before notes existed.
"""

from __future__ import annotations

from pipeline.envs.protocol import CALL_CLOSE, CALL_OPEN, OBS_CLOSE, OBS_OPEN

SYSTEM_TEMPLATE = "You are an agent that can use tools. Available tools: {tool_list}."
MAX_SUMMARY_CHARS = 600
MAX_SUMMARY_ITEM_CHARS = 90


def render_header(question: str, tool_signatures: list[str]) -> str:
    return SYSTEM_TEMPLATE.format(tool_list=" ".join(tool_signatures)) + f"\nTask: {question}\n"


def _strip(text: str, open_: str, close: str) -> str:
    text = text.strip()
    if text.startswith(open_):
        text = text[len(open_):]
    if text.endswith(close):
        text = text[: -len(close)]
    return text.strip()


def summarize(pairs: list[tuple[str, str]]) -> str:
    """One line keeping every folded call with its result, newest last; the oldest items go first if it is too long."""
    items = []
    for action, obs in pairs:
        item = f"{_strip(action, CALL_OPEN, CALL_CLOSE)} -> {_strip(obs, OBS_OPEN, OBS_CLOSE)}"
        items.append(item[:MAX_SUMMARY_ITEM_CHARS])
    line = "; ".join(items)
    while len(line) > MAX_SUMMARY_CHARS and len(items) > 1:
        items.pop(0)
        line = "...; " + "; ".join(items)
    return line[:MAX_SUMMARY_CHARS]


def render_context(question: str, tool_signatures: list[str], history: list[tuple[str, str]], window: int,
                   note: tuple[str, int] | None = None) -> str:
    """The policy's full input text for a task and its history of (action_text, observation_text) pairs; `note`
    (text, n) replaces the first n pairs by the line ``Note: text``."""
    text = render_header(question, tool_signatures)
    if note is not None:
        text += f"Note: {note[0]}\n"
        history = history[note[1]:]
    folded, recent = history[:-window] if len(history) > window else [], history[-window:]
    if folded:
        text += f"State: earlier calls and results: {summarize(folded)}\n"
    for action, obs in recent:
        text += action + obs
    return text
