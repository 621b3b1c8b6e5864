"""Learnability report: why a policy does not solve an environment's tasks, read off episodes a phase already played.

:func:`learnability_report` is a pure function of episode records (what :class:`pipeline.policy.rollout.RolloutEngine`
records: ``steps``, ``calls``, ``actions``, ``level``, ``family``, ``success``), the evaluated tasks, the tool specs,
the demonstrations (``data/demos/train.jsonl`` records) and, for the copy figures, reference calls. It works for any
environment: it reads only the pipeline's own record fields, the tool names and the outcome names of
:mod:`pipeline.envs.verifier`. :func:`report_for` gathers those inputs from a loaded environment (the one place that
calls into it); :mod:`pipeline.policy.learnability_render` renders the table and the flat tracking metrics.

What the report holds (``docs/environments.md``, "When your environment does not learn", tells what to do about each):

- ``tools``: per tool, ``calls`` (every action that names it, parsed or not), ``invalid`` (actions naming it that the
  protocol rejects: broken JSON, missing ``</call>``, too long, ...), ``schema_errors`` (parsed calls whose parameters
  break the tool's JSON Schema, outcome ``invalid_params``), ``tool_errors`` (outcomes ``tool_error`` and ``timeout``:
  with ``env.tool_failure_rate`` > 0 these include the injected failures) and ``safety_violations``, each count with
  its rate over ``calls``. An invalid action is attributed to the tool its text starts with (after ``<call>``) when
  that is a known tool name.
- ``actions``: every action falls in exactly one class, checked in this order: ``token_limit`` (the engine cut it at
  ``rollout.max_new_tokens``, the record's ``actions[i]["token_limit"]``), ``char_limit`` (longer than
  ``env.max_action_chars``), ``unknown_tool``, ``parse_failure`` (any other text the protocol rejects), or parsed.
  Shares are over all actions. Records without ``actions`` (scripted policies) count as never cut.
- ``copy``: how exactly the policy copies strings it was given. With reference calls for the task
  (:meth:`~pipeline.envs.contract.Environment.reference_calls`), every scalar parameter value of the reference process
  whose text (at least ``min_copy_chars`` characters) occurs verbatim in the question or in an observation of the
  policy's episode is a *copyable value*; it is *attempted* when the policy made a call of the same tool with the same
  parameter after the value had appeared, and *copied* when one of those calls carries exactly that text (strings
  compared after stripping, numbers by value). ``copy_rate`` = copied / attempted, so a wrong tool choice does not
  count as a copying error (``reached`` = attempted / copyable says how often the policy got that far). Without
  reference calls, the demonstrations of the same family and level (else the same family) say which parameters are
  copies: a (tool, parameter) whose demonstrated values occur verbatim in the demonstration's question or an earlier
  observation at least half of the time; each such call of the policy is then attempted, and copied when its value
  occurs verbatim in the question or an earlier observation. A miss whose closest candidate is at least
  ``near_miss_similarity`` alike (difflib ratio) is a *near miss*; the closest misses are kept as examples.
- ``families`` and ``levels``: evaluated episodes, success rate, and demonstrations (all, and successful ones).
- ``findings``: plain-language sentences computed from the figures, each with the threshold that triggered it
  (:data:`THRESHOLDS`; a rate needs at least ``min_calls`` calls or ``min_copy_values`` values behind it).

Decisions: values nested in lists or objects are not copy candidates (their exact form depends on the JSON writer);
an observation counts once it was returned, even if the context later folded it into the summary line; families and
levels are the tasks' own labels, compared as strings.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from pipeline.envs.protocol import CALL_OPEN, InvalidAction, parse_action
from pipeline.envs.verifier import INVALID_ACTION, INVALID_PARAMS, SAFETY_VIOLATION, TIMEOUT, TOOL_ERROR

THRESHOLDS = {
    "tool_invalid_rate": 0.2,       # a tool's actions the protocol rejects
    "tool_schema_error_rate": 0.2,  # a tool's calls that break its schema
    "tool_error_rate": 0.2,         # a tool's calls that end in a tool error or timeout
    "safety_violations": 1,         # any refused call
    "min_calls": 5,                 # calls a tool needs before its rates are judged
    "token_limit_share": 0.05,      # actions cut at rollout.max_new_tokens
    "char_limit_share": 0.05,       # actions longer than env.max_action_chars
    "unknown_tool_share": 0.05,     # actions naming no tool of the task
    "parse_failure_share": 0.1,     # other unparsable action text
    "copy_rate": 0.8,               # exact copies among attempted copyable values (overall and per parameter)
    "min_copy_values": 5,           # attempted values behind a copy rate before it is judged
    "min_demos": 20,                # demonstrations a family or level should have ...
    "demo_success": 0.5,            # ... when its success is below this
    "low_success": 0.1,             # success at or below this despite enough demonstrations
    "min_episodes": 5,              # episodes a family or level needs before its success is judged
}
MIN_COPY_CHARS = 3         # shorter values occur verbatim by chance
NEAR_MISS_SIMILARITY = 0.6
MAX_EXAMPLES = 5
_HEAD = re.compile(r"\s*(?:" + re.escape(CALL_OPEN) + r")?\s*([A-Za-z_][A-Za-z0-9_]{0,31})")


def _text(value) -> str | None:
    """The comparable text of a scalar parameter value (None for anything else)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (int, float)):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    return None


def _written(value) -> str:
    """What the policy wrote for a parameter, as text (a non-scalar as its JSON)."""
    t = _text(value)
    return t if t is not None else json.dumps(value, sort_keys=True)


def _rate(n: int, d: int) -> float | None:
    return n / d if d else None


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _closest_window(value: str, text: str) -> tuple[str, float]:
    """The substring of `text` of `value`'s length, starting at a word start, most like `value`."""
    n, best = len(value), ("", 0.0)
    for m in re.finditer(r"(?<![A-Za-z0-9])[A-Za-z0-9]", text):
        cand = text[m.start():m.start() + n]
        r = _similarity(value, cand)
        if r > best[1]:
            best = (cand, r)
    return best


# ----------------------------------------------------------------------------------------------- tools and actions


def _attributed_tool(action_text: str, names: set[str]) -> str | None:
    m = _HEAD.match(action_text or "")
    return m.group(1) if m and m.group(1) in names else None


def action_class(action: Mapping | None, max_action_chars: int) -> str | None:
    """``token_limit``, ``char_limit``, ``unknown_tool``, ``parse_failure`` or None (parsed): the module docstring."""
    action = action or {}
    if action.get("token_limit"):
        return "token_limit"
    reason = action.get("error")
    if reason is None:
        return None
    if reason.startswith(f"action longer than {max_action_chars}"):
        return "char_limit"
    if reason.startswith("unknown tool"):
        return "unknown_tool"
    return "parse_failure"


def tool_figures(records: Sequence[dict], tool_names: Sequence[str], max_action_chars: int) -> tuple[dict, dict]:
    """(per-tool figures, action classes) of the records (see the module docstring)."""
    names = set(tool_names)
    counts: dict[str, Counter] = {t: Counter() for t in tool_names}
    classes: Counter = Counter()
    for r in records:
        actions = r.get("actions") or [None] * len(r["calls"])
        for step, call, action in zip(r["steps"], r["calls"], actions):
            if action is None and call["outcome"] == INVALID_ACTION:  # no parse record: re-read the text
                parsed = parse_action(step["action"], tuple(tool_names), max_action_chars)
                action = {"error": parsed.reason} if isinstance(parsed, InvalidAction) else {}
            cls = action_class(action, max_action_chars)
            classes[cls or "parsed"] += 1
            tool = call["tool"] or _attributed_tool(step["action"], names)
            if tool is None:
                continue
            c = counts.setdefault(tool, Counter())
            c["calls"] += 1
            c["invalid"] += call["outcome"] == INVALID_ACTION
            c["schema_errors"] += call["outcome"] == INVALID_PARAMS
            c["tool_errors"] += call["outcome"] in (TOOL_ERROR, TIMEOUT)
            c["safety_violations"] += call["outcome"] == SAFETY_VIOLATION
    tools = {}
    for t, c in counts.items():
        n = c["calls"]
        tools[t] = {"calls": n, **{k: c[k] for k in ("invalid", "schema_errors", "tool_errors", "safety_violations")},
                    "invalid_rate": _rate(c["invalid"], n), "schema_error_rate": _rate(c["schema_errors"], n),
                    "tool_error_rate": _rate(c["tool_errors"], n)}
    total = sum(classes.values())
    actions = {"n": total, **{k: classes[k] for k in ("token_limit", "char_limit", "unknown_tool", "parse_failure")}}
    actions.update({f"{k}_share": _rate(classes[k], total)
                    for k in ("token_limit", "char_limit", "unknown_tool", "parse_failure")})
    return tools, actions


# -------------------------------------------------------------------------------------------------------- copying


def _visible(question: str, steps: Sequence[dict]) -> list[str]:
    """visible[j]: the text the policy had been given before its action j (question and observations 0..j-1)."""
    out, text = [], question
    for s in steps:
        out.append(text)
        text += "\n" + s["observation"]
    out.append(text)
    return out


def _scalar_params(params) -> Iterable[tuple[str, str]]:
    for k, v in (params or {}).items() if isinstance(params, Mapping) else ():
        t = _text(v)
        if t is not None and len(t) >= MIN_COPY_CHARS:
            yield k, t


class _CopyTally:
    def __init__(self):
        self.by_param: dict[str, Counter] = defaultdict(Counter)
        self.misses: list[dict] = []

    def add(self, param: str, copied: bool | None, task_id: str, wanted: str, wrote: str | None, similarity: float):
        c = self.by_param[param]
        c["copyable"] += 1
        if copied is None:
            return
        c["attempted"] += 1
        c["copied"] += copied
        if not copied:
            near = similarity >= NEAR_MISS_SIMILARITY
            c["near_misses"] += near
            self.misses.append({"param": param, "task_id": task_id, "wanted": wanted, "wrote": wrote,
                                "similarity": round(similarity, 3), "near": near})


def _reference_slots(record: dict, reference: Sequence, question: str, tally: _CopyTally) -> None:
    visible = _visible(question, record["steps"])
    given = visible[max(0, len(record["steps"]) - 1)]  # all the policy was shown before its last action
    for tool, params in reference:
        for key, want in _scalar_params(params):
            if want not in given:
                continue  # never given in this episode: nothing to copy
            wrote = [(_written(c["params"][key]), visible[j]) for j, c in enumerate(record["calls"])
                     if c["tool"] == tool and isinstance(c["params"], Mapping) and key in c["params"]]
            tries = [w for w, seen in wrote if want in seen]
            if not tries:
                tally.add(f"{tool}.{key}", None, record["task_id"], want, None, 0.0)
                continue
            best = max(tries, key=lambda w: (w == want, _similarity(want, w)))
            tally.add(f"{tool}.{key}", best == want, record["task_id"], want, best, _similarity(want, best))


def demo_copy_slots(demos: Sequence[dict], questions: Mapping[str, str], tool_names: Sequence[str],
                    max_action_chars: int) -> dict[tuple, set[tuple[str, str]]]:
    """(family, level) and (family,) -> the (tool, parameter) pairs whose demonstrated values are copies of the
    demonstration's question or an earlier observation at least half of the time."""
    seen: dict[tuple, Counter] = defaultdict(Counter)
    copied: dict[tuple, Counter] = defaultdict(Counter)
    for d in demos:
        question = questions.get(d["task_id"])
        if question is None:
            continue
        visible = _visible(question, d["steps"])
        for j, s in enumerate(d["steps"]):
            parsed = parse_action(s["action"], tuple(tool_names), max_action_chars)
            if isinstance(parsed, InvalidAction):
                continue
            for key, value in _scalar_params(parsed.params):
                for group in ((d["family"], int(d["level"])), (d["family"],)):
                    seen[group][(parsed.name, key)] += 1
                    copied[group][(parsed.name, key)] += value in visible[j]
    return {g: {slot for slot, n in c.items() if 2 * copied[g][slot] >= n} for g, c in seen.items()}


def _demo_slots(record: dict, slots: set, question: str, tally: _CopyTally) -> None:
    visible = _visible(question, record["steps"])
    for j, c in enumerate(record["calls"]):
        for key, wrote in _scalar_params(c["params"] if c["tool"] else None):
            if (c["tool"], key) not in slots:
                continue
            ok = wrote in visible[j]
            near, sim = ("", 0.0) if ok else _closest_window(wrote, visible[j])
            tally.add(f"{c['tool']}.{key}", ok, record["task_id"], near if not ok else wrote, wrote,
                      1.0 if ok else sim)


def copy_figures(records: Sequence[dict], questions: Mapping[str, str], references: Mapping[str, Sequence | None],
                 demo_slots: Mapping[tuple, set]) -> dict:
    """The ``copy`` section (see the module docstring)."""
    tally, sources = _CopyTally(), Counter()
    for r in records:
        question = questions.get(r["task_id"], "")
        ref = references.get(r["task_id"])
        if ref:
            sources["reference_calls"] += 1
            _reference_slots(r, ref, question, tally)
            continue
        slots = demo_slots.get((r["family"], int(r["level"]))) or demo_slots.get((r["family"],))
        if slots:
            sources["demonstrations"] += 1
            _demo_slots(r, slots, question, tally)
        else:
            sources["none"] += 1
    total = Counter()
    for c in tally.by_param.values():
        total.update(c)
    by_param = {p: {"copyable": c["copyable"], "attempted": c["attempted"], "copied": c["copied"],
                    "near_misses": c["near_misses"], "copy_rate": _rate(c["copied"], c["attempted"])}
                for p, c in sorted(tally.by_param.items())}
    examples = sorted(tally.misses, key=lambda m: -m["similarity"])[:MAX_EXAMPLES]
    return {"source": dict(sorted(sources.items())), "copyable": total["copyable"], "attempted": total["attempted"],
            "copied": total["copied"], "near_misses": total["near_misses"],
            "copy_rate": _rate(total["copied"], total["attempted"]),
            "reached": _rate(total["attempted"], total["copyable"]), "by_param": by_param,
            "near_miss_examples": examples}


# ------------------------------------------------------------------------------------------- families and levels


def group_figures(records: Sequence[dict], demos: Sequence[dict], key: str) -> dict:
    """Per family (`key` "family") or level ("level"): episodes, success rate, demonstrations (all, successful)."""
    groups: dict[str, dict] = {}
    for r in records:
        g = groups.setdefault(str(r[key]), {"episodes": 0, "successes": 0, "demos": 0, "demos_successful": 0})
        g["episodes"] += 1
        g["successes"] += bool(r["success"])
    for d in demos:
        g = groups.setdefault(str(d[key]), {"episodes": 0, "successes": 0, "demos": 0, "demos_successful": 0})
        g["demos"] += 1
        g["demos_successful"] += bool(d.get("success", True))
    return {k: {**g, "success": _rate(g["successes"], g["episodes"])} for k, g in sorted(groups.items())}


# ----------------------------------------------------------------------------------------------------- findings


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def findings(report: Mapping, thresholds: Mapping[str, float] = THRESHOLDS) -> list[dict]:
    """Plain-language findings of a report's figures, each ``{"code", "subject", "value", "threshold", "text"}``."""
    th, out = thresholds, []

    def add(code: str, subject: str, value: float, threshold: float, text: str) -> None:
        out.append({"code": code, "subject": subject, "value": value, "threshold": threshold, "text": text})

    a, lim = report["actions"], report["limits"]
    if a["n"]:
        if a["token_limit_share"] >= th["token_limit_share"]:
            add("token_limit", "actions", a["token_limit_share"], th["token_limit_share"],
                f"{_pct(a['token_limit_share'])} of actions hit the {lim['max_new_tokens']}-token limit: raise "
                f"rollout.max_new_tokens")
        if a["char_limit_share"] >= th["char_limit_share"]:
            add("char_limit", "actions", a["char_limit_share"], th["char_limit_share"],
                f"{_pct(a['char_limit_share'])} of actions are longer than {lim['max_action_chars']} characters: raise "
                f"env.max_action_chars or shorten the tools' parameters")
        if a["unknown_tool_share"] >= th["unknown_tool_share"]:
            add("unknown_tool", "actions", a["unknown_tool_share"], th["unknown_tool_share"],
                f"{_pct(a['unknown_tool_share'])} of actions name no tool of the task: demonstrate every tool")
        if a["parse_failure_share"] >= th["parse_failure_share"]:
            add("parse_failure", "actions", a["parse_failure_share"], th["parse_failure_share"],
                f"{_pct(a['parse_failure_share'])} of actions cannot be parsed: the model has not learnt the call "
                f"format (more SFT steps or demonstrations)")
    for tool, t in report["tools"].items():
        if t["safety_violations"] >= th["safety_violations"]:
            add("safety", tool, t["safety_violations"], th["safety_violations"],
                f"tool {tool}: {t['safety_violations']} of {t['calls']} calls refused as safety violations")
        if t["calls"] < th["min_calls"]:
            continue
        for code, rate, what in (("invalid", "invalid_rate", "are unparsable actions"),
                                 ("schema", "schema_error_rate", "break its schema"),
                                 ("tool_error", "tool_error_rate", "end in a tool error")):
            limit = th["tool_" + rate.removeprefix("tool_")]
            if t[rate] >= limit:
                add(code, tool, t[rate], limit, f"tool {tool}: {_pct(t[rate])} of {t['calls']} calls {what}")
    c = report["copy"]
    if c["attempted"] >= th["min_copy_values"] and c["copy_rate"] < th["copy_rate"]:
        add("copy", "all", c["copy_rate"], th["copy_rate"],
            f"the model copies {_pct(c['copy_rate'])} of given strings exactly ({c['copied']} of {c['attempted']}; "
            f"{c['near_misses']} near misses)")
    for param, p in c["by_param"].items():
        if p["attempted"] >= th["min_copy_values"] and p["copy_rate"] < th["copy_rate"]:
            add("copy_param", param, p["copy_rate"], th["copy_rate"],
                f"{param}: {_pct(p['copy_rate'])} of {p['attempted']} values copied exactly")
    for kind in ("family", "level"):
        for name, g in report[f"{kind}_figures"].items():
            if not g["episodes"]:
                continue
            if g["demos"] < th["min_demos"] and g["success"] < th["demo_success"]:
                add("few_demos", f"{kind} {name}", g["demos"], th["min_demos"],
                    f"{kind} {name} has {g['demos']} demonstrations (success {_pct(g['success'])}): add "
                    f"demonstrations")
            elif g["episodes"] >= th["min_episodes"] and g["success"] <= th["low_success"]:
                add("low_success", f"{kind} {name}", g["success"], th["low_success"],
                    f"{kind} {name}: {_pct(g['success'])} success despite {g['demos']} demonstrations: check its "
                    f"tasks, tools and answers")
    return out


# --------------------------------------------------------------------------------------------------------- report


def learnability_report(records: Sequence[dict], questions: Mapping[str, str], tool_names: Sequence[str],
                        demos: Sequence[dict], *, max_new_tokens: int, max_action_chars: int,
                        references: Mapping[str, Sequence | None] | None = None,
                        demo_questions: Mapping[str, str] | None = None,
                        thresholds: Mapping[str, float] = THRESHOLDS) -> dict:
    """The report of `records` (see the module docstring). `questions`: task_id -> question of the evaluated tasks;
    `references`: task_id -> reference calls (or None); `demo_questions`: task_id -> question of the demonstrated
    (training) tasks, for the copy figures of tasks without reference calls."""
    tools, actions = tool_figures(records, tool_names, max_action_chars)
    slots = demo_copy_slots(demos, demo_questions or {}, tool_names, max_action_chars)
    report = {
        "episodes": len(records),
        "success": _rate(sum(bool(r["success"]) for r in records), len(records)),
        "limits": {"max_new_tokens": max_new_tokens, "max_action_chars": max_action_chars},
        "actions": actions,
        "tools": tools,
        "copy": copy_figures(records, questions, references or {}, slots),
        "family_figures": group_figures(records, demos, "family"),
        "level_figures": group_figures(records, demos, "level"),
        "thresholds": dict(thresholds),
    }
    report["findings"] = findings(report, thresholds)
    return report


def report_for(runtime, records: Sequence[dict], tasks: Sequence, demos: Sequence[dict], train_tasks: Sequence,
               env_cfg, rollout_cfg) -> dict:
    """:func:`learnability_report` of `records` played on `tasks` in the loaded environment `runtime` (its tools and
    reference calls), with the demonstrations `demos` of `train_tasks`."""
    by_id = {t.task_id: t for t in tasks}
    names: list[str] = []
    for t in tasks:
        names += [s.name for s in runtime.tools_for(t) if s.name not in names]
    return learnability_report(
        records, {k: t.question for k, t in by_id.items()}, names, demos,
        max_new_tokens=rollout_cfg.max_new_tokens, max_action_chars=env_cfg.max_action_chars,
        references={k: runtime.reference_calls(t) for k, t in by_id.items()},
        demo_questions={t.task_id: t.question for t in train_tasks})
