"""The learnability report on hand-built episode records with known answers: per-tool figures, action limits, exact
copies (from reference calls and, without them, from the demonstrations), families and levels, findings; its
rendering and flat metrics. The report of a real adapt run is checked in tests/test_adapt.py."""

from __future__ import annotations

import json

import pytest

from pipeline.policy.learnability import THRESHOLDS, action_class, learnability_report
from pipeline.policy.learnability_render import flat_metrics, render

TOOLS = ["search", "read", "answer"]
MAX_CHARS = 64


def call(tool, params, outcome):
    return {"tool": tool, "params": params, "outcome": outcome}


def step(action, observation):
    return {"action": action, "observation": f"<obs>{observation}</obs>\n"}


def act(tool=None, params=None, error=None, token_limit=False):
    return ({"tool": None, "params": None, "error": error, "token_limit": token_limit} if error
            else {"tool": tool, "params": params, "token_limit": token_limit})


def ok(tool, params, obs, outcome="ok"):
    """(step, call, action) of a well-formed call."""
    text = f"<call>{tool} {json.dumps(params)}</call>"
    return step(text, obs), call(tool, params, outcome), act(tool, params)


def bad(text, obs, error, token_limit=False):
    """(step, call, action) of an action the protocol rejects."""
    return step(text, obs), call(None, None, "invalid_action"), act(error=error, token_limit=token_limit)


def episode(task_id, family, level, success, parts):
    steps, calls, actions = zip(*parts)
    return {"task_id": task_id, "family": family, "level": level, "success": success, "steps": list(steps),
            "calls": list(calls), "actions": list(actions)}


QUESTIONS = {
    "t1": "Find the code of 'Kestrel Nine'.",
    "t2": "What is stored under 'Osprey Delta'?",
    "t3": "Open record 'mv-5550' and report its label.",
    "t4": "Report the label of 'Wren Atlas'.",
}
REFERENCES = {
    "t1": [("search", {"query": "Kestrel Nine"}), ("read", {"id": "xk-4471"}), ("answer", {"value": "42"})],
    "t2": [("search", {"query": "Osprey Delta"}), ("read", {"id": "zq-9012"}), ("answer", {"value": "blue"})],
    "t3": [("read", {"id": "mv-5550"}), ("answer", {"value": "Heron"})],
    "t4": None,  # no reference process: the demonstrations of (delta, 2) say what is copied
}
RECORDS = [
    episode("t1", "alpha", 1, True, [
        ok("search", {"query": "Kestrel Nine"}, '[{"id": "xk-4471"}]'),
        ok("read", {"id": "xk-4471"}, "42"),
        ok("answer", {"value": "42"}, "42", "answer")]),
    episode("t2", "alpha", 2, False, [
        ok("search", {"query": "Osprey Delt"}, "[]"),                        # a near miss of 'Osprey Delta'
        ok("read", {"id": 12}, "error: invalid parameters for read: id", "invalid_params"),
        bad('<call>read {"id": "zq-9012"', "error: invalid action: missing </call>", "missing </call>",
            token_limit=True),                                                # cut at the token limit
        bad('<call>lookup {"x": 1}</call>', "error: invalid action: unknown tool", "unknown tool 'lookup'")]),
    episode("t3", "beta", 1, False, [
        ok("read", {"id": "mv-5505"}, "error: no record mv-5505", "tool_error"),  # a miscopied id
        bad('<call>read {"id": "mv-5550", "pad": "' + "x" * 80 + '"}</call>', "error: invalid action: too long",
            f"action longer than {MAX_CHARS} characters"),
        bad('<call>read {"id": mv-5550}</call>', "error: invalid action: bad JSON",
            "parameters are not valid JSON (Expecting value)"),
        ok("answer", {"value": "Heron"}, "Heron", "answer")]),
    episode("t4", "delta", 2, True, [
        ok("search", {"query": "Wren Atlas"}, '[{"id": "pp-1200"}]'),
        ok("read", {"id": "pp-1201"}, "error: refused: not allowed", "safety_violation"),
        ok("answer", {"value": "Robin"}, "Robin", "answer")]),
]
DEMO_QUESTIONS = {"d-task-1": "Find the code of 'Lark Mesa'.", "d-task-2": "Report the label of 'Finch Row'."}


def demo(demo_id, task_id, family, level, success, parts):
    return {"demo_id": demo_id, "task_id": task_id, "family": family, "level": level, "success": success,
            "steps": [p[0] for p in parts]}


DEMOS = [
    demo("d1", "d-task-1", "alpha", 1, True, [ok("search", {"query": "Lark Mesa"}, '[{"id": "qq-100"}]'),
                                              ok("answer", {"value": "qq-100"}, "qq-100", "answer")]),
    demo("d2", "d-task-2", "delta", 2, True, [ok("search", {"query": "Finch Row"}, '[{"id": "qq-200"}]'),
                                              ok("read", {"id": "qq-200"}, "7"),
                                              ok("answer", {"value": "7.50"}, "7.50", "answer")]),  # computed: no copy
    demo("d3", "d-task-2", "delta", 2, False, [ok("search", {"query": "Finch Row"}, '[{"id": "qq-200"}]')]),
]


def report(**over):
    kw = dict(max_new_tokens=48, max_action_chars=MAX_CHARS, references=REFERENCES, demo_questions=DEMO_QUESTIONS)
    kw.update(over)
    return learnability_report(RECORDS, QUESTIONS, TOOLS, DEMOS, **kw)


def test_per_tool_figures_count_invalid_actions_by_the_tool_they_name():
    tools = report()["tools"]
    assert tools["search"] == {"calls": 3, "invalid": 0, "schema_errors": 0, "tool_errors": 0, "safety_violations": 0,
                               "invalid_rate": 0.0, "schema_error_rate": 0.0, "tool_error_rate": 0.0}
    # read: 1 ok, 1 schema error, 3 rejected actions that name it (token limit, too long, bad JSON), 1 tool error,
    # 1 refusal; the unknown tool 'lookup' is nobody's
    assert tools["read"] == {"calls": 7, "invalid": 3, "schema_errors": 1, "tool_errors": 1, "safety_violations": 1,
                             "invalid_rate": 3 / 7, "schema_error_rate": 1 / 7, "tool_error_rate": 1 / 7}
    assert tools["answer"]["calls"] == 3 and set(tools) == set(TOOLS)


def test_every_action_falls_in_one_class():
    a = report()["actions"]
    assert a == {"n": 14, "token_limit": 1, "char_limit": 1, "unknown_tool": 1, "parse_failure": 1,
                 "token_limit_share": 1 / 14, "char_limit_share": 1 / 14, "unknown_tool_share": 1 / 14,
                 "parse_failure_share": 1 / 14}
    # the token limit comes first: a cut action is counted there whatever the parser said about it
    assert action_class({"error": "missing </call>", "token_limit": True}, 64) == "token_limit"
    assert action_class({"error": "action longer than 64 characters"}, 64) == "char_limit"
    assert action_class({"tool": "read", "params": {}, "token_limit": False}, 64) is None


def test_copy_figures_from_reference_calls_and_from_demonstrations():
    c = report()["copy"]
    # t1: query and id copied; t2: 'Osprey Delta' written 'Osprey Delt', its id never shown (not copyable);
    # t3: 'mv-5550' written 'mv-5505' (the later attempts do not parse); '42' is shorter than 3 characters;
    # t4 (demonstrations): the query is copied, 'pp-1201' is not in what the policy was shown
    assert c["source"] == {"demonstrations": 1, "reference_calls": 3}
    assert (c["copyable"], c["attempted"], c["copied"], c["near_misses"]) == (6, 6, 3, 3)
    assert c["copy_rate"] == 0.5 and c["reached"] == 1.0
    assert c["by_param"] == {
        "read.id": {"copyable": 3, "attempted": 3, "copied": 1, "near_misses": 2, "copy_rate": 1 / 3},
        "search.query": {"copyable": 3, "attempted": 3, "copied": 2, "near_misses": 1, "copy_rate": 2 / 3}}
    ex = [(m["param"], m["task_id"], m["wanted"], m["wrote"]) for m in c["near_miss_examples"]]
    assert ex == [("search.query", "t2", "Osprey Delta", "Osprey Delt"), ("read.id", "t3", "mv-5550", "mv-5505"),
                  ("read.id", "t4", "pp-1200", "pp-1201")]
    assert c["near_miss_examples"][0]["similarity"] == round(22 / 23, 3)


def test_a_value_given_only_after_the_last_attempt_is_copyable_but_not_reached():
    rec = episode("t1", "alpha", 1, False, [ok("read", {"id": "xk-0000"}, "no such id"),
                                            ok("search", {"query": "Kestrel Nine"}, '[{"id": "xk-4471"}]'),
                                            ok("answer", {"value": "41"}, "41", "answer")])
    c = learnability_report([rec], QUESTIONS, TOOLS, [], max_new_tokens=48, max_action_chars=MAX_CHARS,
                            references=REFERENCES)["copy"]
    assert (c["copyable"], c["attempted"], c["copied"]) == (2, 1, 1) and c["reached"] == 0.5


def test_families_and_levels_carry_success_and_demonstrations():
    r = report()
    assert r["family_figures"] == {
        "alpha": {"episodes": 2, "successes": 1, "demos": 1, "demos_successful": 1, "success": 0.5},
        "beta": {"episodes": 1, "successes": 0, "demos": 0, "demos_successful": 0, "success": 0.0},
        "delta": {"episodes": 1, "successes": 1, "demos": 2, "demos_successful": 1, "success": 1.0}}
    assert r["level_figures"] == {
        "1": {"episodes": 2, "successes": 1, "demos": 1, "demos_successful": 1, "success": 0.5},
        "2": {"episodes": 2, "successes": 1, "demos": 2, "demos_successful": 1, "success": 0.5}}
    assert r["episodes"] == 4 and r["success"] == 0.5


def test_findings_name_the_figure_and_the_threshold_that_triggered_them():
    found = [(f["code"], f["subject"], f["threshold"]) for f in report()["findings"]]
    assert found == [("token_limit", "actions", 0.05), ("char_limit", "actions", 0.05),
                     ("unknown_tool", "actions", 0.05), ("safety", "read", 1), ("invalid", "read", 0.2),
                     ("copy", "all", 0.8), ("few_demos", "family beta", 20)]
    texts = [f["text"] for f in report()["findings"]]
    assert texts[0] == "7 % of actions hit the 48-token limit: raise rollout.max_new_tokens"
    assert texts[4] == "tool read: 43 % of 7 calls are unparsable actions"
    assert texts[5] == "the model copies 50 % of given strings exactly (3 of 6; 3 near misses)"
    assert texts[6] == "family beta has 0 demonstrations (success 0 %): add demonstrations"


def test_thresholds_decide_the_findings():
    quiet = {**THRESHOLDS, "token_limit_share": 0.5, "char_limit_share": 0.5, "unknown_tool_share": 0.5,
             "safety_violations": 99, "tool_invalid_rate": 0.5, "copy_rate": 0.5, "min_demos": 0}
    assert report(thresholds=quiet)["findings"] == []
    strict = {**quiet, "tool_schema_error_rate": 0.1, "min_copy_values": 3, "copy_rate": 0.7, "low_success": 0.0,
              "min_episodes": 1}
    found = [(f["code"], f["subject"], f["value"]) for f in report(thresholds=strict)["findings"]]
    assert found == [("schema", "read", 1 / 7), ("copy", "all", 0.5), ("copy_param", "read.id", 1 / 3),
                     ("copy_param", "search.query", 2 / 3), ("low_success", "family beta", 0.0)]


def test_records_without_parse_records_are_read_from_their_text():
    rec = {k: v for k, v in RECORDS[2].items() if k != "actions"}  # a scripted policy's record, its texts cut
    rec["steps"] = [{**s, "action": s["action"][:MAX_CHARS]} for s in rec["steps"]]  # as the runner records them
    a = learnability_report([rec], QUESTIONS, TOOLS, [], max_new_tokens=48, max_action_chars=MAX_CHARS)["actions"]
    # the step text was cut to env.max_action_chars by the runner, so a too-long action reads as a parse failure
    assert (a["n"], a["token_limit"], a["parse_failure"]) == (4, 0, 2)


def test_render_and_flat_metrics():
    r = report()
    text = render(r, "learnability (test)")
    assert text.splitlines()[0] == "learnability (test): 4 episodes, success 50.0%"
    assert "  read        7    42.9%       14.3%     14.3%       1" in text.splitlines()
    assert "    read.id 33.3% (1/3 of 3); search.query 66.7% (2/3 of 3)" in text.splitlines()
    assert "    search.query: wanted 'Osprey Delta', wrote 'Osprey Delt' (t2)" in text
    assert text.splitlines()[-1] == ("  - family beta has 0 demonstrations (success 0 %): add demonstrations "
                                     "(threshold < 20)")
    flat = flat_metrics(r)
    assert flat["learnability/copy_rate"] == 0.5 and flat["learnability/token_limit_share"] == 1 / 14
    assert flat["learnability/tool/read/schema_error_rate"] == 1 / 7
    assert flat["learnability/family/beta/demos"] == 0.0 and flat["learnability/findings"] == 7.0
    assert all(isinstance(v, float) for v in flat.values())


@pytest.mark.parametrize("records", [[], RECORDS[:1]])
def test_no_episodes_or_clean_ones_give_no_findings(records):
    """No figure without episodes behind it; a solved episode of a family without demonstrations is no finding."""
    r = learnability_report(records, QUESTIONS, TOOLS, [], max_new_tokens=48, max_action_chars=MAX_CHARS,
                            references=REFERENCES)
    assert r["findings"] == []
    assert r["success"] == (None if not records else 1.0) and r["copy"]["copy_rate"] == (None if not records else 1.0)
    assert "findings: none" in render(r)
