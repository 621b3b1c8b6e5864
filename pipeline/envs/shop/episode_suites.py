"""Great Expectations suites for episode data: "trajectories" (rollouts, with tokens) and "evaluation" (evaluation
episodes); :func:`pipeline.envs.shop.suites.register_suites` registers them with the generic registry.

Both check these rules row by row, each as an ordinary GX expectation on a column derived from the
record (the ``validation`` module's convention), so a failure names its row and, through the derived column's value,
what is wrong:

- **reward within range**: ``return`` lies in [-(β + γ), α + δ] for the environment's reward weights, and each
  component in its documented range (correctness {0, 1}, efficiency and safety [-1, 0], user experience [0, 1]);
  ``success`` agrees with ``correctness == 1``;
- **masks consistent with tokens** (``token_problem``): ``token_ids``, ``action_mask`` and ``logprobs`` have one
  entry per token, the mask holds only 0 and 1 and at least one 1, token ids are non-negative integers, the
  log-probabilities of sampled tokens are finite and at most 0, and segment starts are increasing offsets from 0.
  Records without token fields (expert or evaluation episodes) are not checked here, unless the suite is asked to
  ``require_tokens``;
- **tool-call JSON valid** (``call_problem``): one call record per step; every call whose outcome is not
  ``invalid_action`` names a real tool, carries parameters that are a JSON object (strict JSON: no NaN), and its
  step's action text parses (the protocol's own parser) to exactly that tool and those parameters (compared after the
  environment's printable-ASCII sanitising, which the echoed action text went through);
- **no empty answers where an answer was given** (``answer_problem``): an episode whose answer call succeeded records
  a non-blank ``answer`` equal to that call's value; an episode without one records no answer. The environment
  refuses a blank answer (the `answer` tool's schema), so a row that breaks this rule is a recording defect, not a
  policy that answered with nothing.

Deliberately left out: the demonstrations' schema (suite "demos" in pipeline.envs.shop.suites) and cross-record rules.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from pipeline.core.validation import BOOL_TYPES, FLOAT_TYPES, INT_TYPES, NON_BLANK, STR_TYPES
from pipeline.envs.config import LEVELS, EnvConfig, RewardWeights
from pipeline.envs.protocol import InvalidAction, parse_action, sanitize
from pipeline.envs.shop.tasks import ALL_FAMILIES
from pipeline.envs.context_actions import CONTEXT_TOOLS
from pipeline.envs.shop.tools import TOOL_NAMES as SHOP_TOOLS

TOOL_NAMES = SHOP_TOOLS + CONTEXT_TOOLS  # the context actions (env.context_actions) are the pipeline's tools
from pipeline.envs.verifier import ANSWER, INVALID_ACTION, OUTCOMES

OK = "ok"  # value of a derived *_problem column for a record without the problem
COMPONENT_RANGES = {"correctness": (0.0, 1.0), "efficiency": (-1.0, 0.0), "safety": (-1.0, 0.0),
                    "user_experience": (0.0, 1.0)}
LOGPROB_TOLERANCE = 1e-4  # sampled tokens' log-probabilities must be <= this (0 up to float rounding)


def reward_bounds(w: RewardWeights) -> tuple[float, float]:
    """The range of R = α·correctness + β·efficiency + γ·safety + δ·user_experience, given each component's range.

    >>> reward_bounds(RewardWeights(correctness=1, efficiency=0.5, safety=1, user_experience=0.1))
    (-1.5, 1.1)
    """
    return -(w.efficiency + w.safety), w.correctness + w.user_experience


# ---------------------------------------------------------------------------------------------------- derived rules
def _params_key(params: dict) -> str:
    return sanitize(json.dumps(params, ensure_ascii=False, sort_keys=True))


def call_problem(steps: Any, calls: Any) -> str | None:
    """None without a call log, "ok", or the first problem of the call log (see the module docstring)."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"calls is a {type(calls).__name__}, not a list"
    if not isinstance(steps, list) or len(calls) != len(steps):
        return f"{len(calls)} call records but {len(steps) if isinstance(steps, list) else 'no'} steps"
    for k, (step, call) in enumerate(zip(steps, calls)):
        if not isinstance(call, dict) or call.get("outcome") not in OUTCOMES:
            got = call.get("outcome") if isinstance(call, dict) else call
            return f"step {k}: outcome {got!r} is not one of {list(OUTCOMES)}"
        tool, params, outcome = call.get("tool"), call.get("params"), call["outcome"]
        if outcome == INVALID_ACTION:
            if tool is not None:
                return f"step {k}: an invalid action records tool {tool!r}"
            continue
        if tool not in TOOL_NAMES:
            return f"step {k}: tool {tool!r} is not one of {list(TOOL_NAMES)}"
        if not isinstance(params, dict):
            return f"step {k}: {tool} parameters are a {type(params).__name__}, not a JSON object"
        try:
            json.dumps(params, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return f"step {k}: {tool} parameters are not valid JSON ({exc})"
        action = step.get("action") if isinstance(step, dict) else None
        parsed = parse_action(action, TOOL_NAMES, max_chars=1 << 20)
        if isinstance(parsed, InvalidAction):
            return f"step {k}: outcome {outcome!r} but the action text is not a valid call: {parsed.reason}"
        if parsed.name != tool or _params_key(parsed.params) != _params_key(params):
            return (f"step {k}: the action text calls {parsed.name} {parsed.params_text} but the call log records "
                    f"{tool} {json.dumps(params)}")
    return OK


def answer_problem(answer: Any, calls: Any) -> str | None:
    """None without a call log, "ok", or what is wrong with the recorded answer (see the module docstring)."""
    if not isinstance(calls, list):
        return None
    answered = [c for c in calls if isinstance(c, dict) and c.get("outcome") == ANSWER]
    if not answered:
        return OK if answer is None else f"answer {answer!r} recorded but no answer call succeeded"
    params = answered[-1].get("params")
    value = str(params.get("value")) if isinstance(params, dict) else None
    if not isinstance(answer, str) or not answer.strip():
        return f"the answer call succeeded but the recorded answer is empty ({answer!r})"
    if answer != value:
        return f"answer {answer!r} differs from the answer call's value {value!r}"
    return OK


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def token_problem(record: dict) -> str | None:
    """None without token fields, "ok", or the first inconsistency of ids, mask, log-probabilities and segments."""
    ids, mask, lp, seg = (record.get(k) for k in ("token_ids", "action_mask", "logprobs", "segments"))
    if ids is None and mask is None and lp is None:
        return None
    if not isinstance(ids, list) or not isinstance(mask, list):
        return "token_ids and action_mask must both be lists"
    if len(mask) != len(ids):
        return f"len(action_mask)={len(mask)} != len(token_ids)={len(ids)}"
    if lp is not None and (not isinstance(lp, list) or len(lp) != len(ids)):
        return f"len(logprobs)={len(lp) if isinstance(lp, list) else type(lp).__name__} != len(token_ids)={len(ids)}"
    if not ids:
        return "no tokens"
    if not all(map(_is_int, ids)) or min(ids) < 0:
        return "token_ids must be non-negative integers"
    values = set(mask)
    if not values <= {0, 1} or not all(map(_is_int, mask)):
        return f"action_mask holds values other than 0 and 1: {sorted(map(repr, values - {0, 1}))[:3] or 'booleans'}"
    if 1 not in values:
        return "action_mask has no 1: the episode has no sampled token"
    if lp is not None:
        for t, (m, v) in enumerate(zip(mask, lp)):
            if m == 1 and not (isinstance(v, (int, float)) and math.isfinite(v) and v <= LOGPROB_TOLERANCE):
                return f"logprobs[{t}]={v!r} of a sampled token is not a finite value <= 0"
    if seg is not None:
        if not isinstance(seg, list) or not seg or seg[0] != 0 or any(
                not _is_int(b) or b <= a for a, b in zip(seg, seg[1:])) or seg[-1] >= len(ids):
            return f"segments {seg!r} must be increasing token offsets starting at 0"
    return OK


def _column(df: pd.DataFrame, name: str) -> list:
    if name not in df.columns:
        return [None] * len(df)
    return [None if isinstance(v, float) and math.isnan(v) else v for v in df[name].tolist()]


def derive_episodes(df: pd.DataFrame) -> dict[str, list]:
    """The derived columns both episode suites check (one list per column, one value per record)."""
    steps, calls, comps, answers, success = (_column(df, c) for c in ("steps", "calls", "components", "answer",
                                                                      "success"))
    records = df.to_dict("records") if len(df) else []

    def comp(c: dict | None, name: str) -> float | None:
        v = c.get(name) if isinstance(c, dict) else None
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    out = {
        "n_steps": [len(s) if isinstance(s, list) else -1 for s in steps],
        "steps_well_formed": [isinstance(s, list) and all(
            isinstance(x, dict) and isinstance(x.get("action"), str) and isinstance(x.get("observation"), str)
            for x in s) for s in steps],
        "call_problem": [call_problem(s, c) for s, c in zip(steps, calls)],
        "answer_problem": [answer_problem(a, c) for a, c in zip(answers, calls)],
        "components_well_formed": [isinstance(c, dict) and set(c) == set(COMPONENT_RANGES)
                                   and all(comp(c, k) is not None for k in COMPONENT_RANGES) for c in comps],
        "token_problem": [token_problem({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                         for k, v in r.items()}) for r in records],
        "has_tokens": [isinstance(r.get("token_ids"), list) for r in records],
    }
    for name in COMPONENT_RANGES:
        out[f"reward_{name}"] = [comp(c, name) for c in comps]
    out["success_consistent"] = [None if not isinstance(s, bool) or corr is None else s == (corr == 1.0)
                                 for s, corr in zip(success, out["reward_correctness"])]
    return out


# ------------------------------------------------------------------------------------------------------ the suites
def _episode_expectations(gxe, env_cfg: EnvConfig | None) -> list:
    env_cfg = env_cfg or EnvConfig()
    lo, hi = reward_bounds(env_cfg.reward)

    def present(col: str, types: list[str]) -> list:
        return [gxe.ExpectColumnValuesToNotBeNull(column=col), gxe.ExpectColumnValuesToBeInTypeList(column=col,
                                                                                                     type_list=types)]

    def is_ok(col: str) -> list:
        return [gxe.ExpectColumnValuesToNotBeNull(column=col), gxe.ExpectColumnValuesToBeInSet(column=col,
                                                                                               value_set=[OK])]

    return [
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        *present("task_id", STR_TYPES),
        gxe.ExpectColumnValuesToMatchRegex(column="task_id", regex=NON_BLANK),
        *present("level", INT_TYPES),
        gxe.ExpectColumnValuesToBeInSet(column="level", value_set=list(LEVELS)),
        *present("family", STR_TYPES),
        gxe.ExpectColumnValuesToBeInSet(column="family", value_set=list(ALL_FAMILIES)),
        *present("success", BOOL_TYPES),
        *present("return", FLOAT_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="return", min_value=lo, max_value=hi),
        gxe.ExpectColumnValuesToBeInSet(column="components_well_formed", value_set=[True]),
        *[gxe.ExpectColumnValuesToBeBetween(column=f"reward_{c}", min_value=a, max_value=b)
          for c, (a, b) in COMPONENT_RANGES.items()],
        gxe.ExpectColumnValuesToBeInSet(column="success_consistent", value_set=[True]),
        *present("n_calls", INT_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="n_calls", min_value=1, max_value=env_cfg.max_steps),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="n_calls", column_B="n_steps"),
        gxe.ExpectColumnValuesToBeInSet(column="steps_well_formed", value_set=[True]),
        *is_ok("call_problem"),
        *is_ok("answer_problem"),
    ]


def trajectories_suite(env_cfg: EnvConfig | None = None, require_tokens: bool = False) -> list:
    """Episode records of rollouts (pipeline.policy.rollout) or of run_episode; `env_cfg` (default EnvConfig())
    gives the reward weights and the step budget; `require_tokens` makes token_ids/action_mask mandatory."""
    import great_expectations.expectations as gxe

    out = [*_episode_expectations(gxe, env_cfg),
           gxe.ExpectColumnValuesToBeInSet(column="token_problem", value_set=[OK])]
    if require_tokens:
        out.append(gxe.ExpectColumnValuesToBeInSet(column="has_tokens", value_set=[True]))
    return out


def evaluation_suite(env_cfg: EnvConfig | None = None) -> list:
    """Per-episode evaluation outputs (the records of pipeline.policy.episodes.run_episode / evaluate); `env_cfg` (default
    EnvConfig()) gives the reward weights and the step budget."""
    import great_expectations.expectations as gxe

    def present(col: str, types: list[str]) -> list:
        return [gxe.ExpectColumnValuesToNotBeNull(column=col), gxe.ExpectColumnValuesToBeInTypeList(column=col,
                                                                                                     type_list=types)]

    return [
        *_episode_expectations(gxe, env_cfg),
        *present("truncated", BOOL_TYPES),
        *present("template_seen", BOOL_TYPES),
        *present("ground_truth", STR_TYPES),
        gxe.ExpectColumnValuesToMatchRegex(column="ground_truth", regex=NON_BLANK),
        *present("n_violations", INT_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="n_violations", min_value=0),
        *present("n_failed", INT_TYPES),
        gxe.ExpectColumnValuesToBeBetween(column="n_failed", min_value=0),
        gxe.ExpectColumnValuesToBeInSet(column="token_problem", value_set=[OK]),
        # the environment's name and the policy's answer: strings (the answer is null when none was given)
        gxe.ExpectColumnValuesToBeInTypeList(column="env", type_list=STR_TYPES),
        gxe.ExpectColumnValuesToBeInTypeList(column="answer", type_list=STR_TYPES),
    ]
