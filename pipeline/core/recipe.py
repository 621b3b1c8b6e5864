"""The default recipe: generation limits and capability-gate minimums derived from what the environment provides.

A params key set to ``auto`` takes the value the rules below derive from the environment's own data; a number (or, for
the gate, a mapping) set by hand wins and is reported as ``set``. Every derived value travels with its evidence
(``{"value", "source", "evidence"}``), goes to the phase's metrics under ``recipe``, to MLflow as ``recipe/<key>``
params, and is printed once by the phase that derives it. docs/recipe.md is the user's account.

Who derives what (each phase only what its inputs allow):

- ``build_env`` (:func:`derive_data_recipe`): from the demonstrations (``data/demos/train.jsonl``) and the tasks of
  every split, the character and step limits ``env.max_action_chars``, ``env.max_steps``, ``env.max_policy_chars``;
  written to ``data/recipe.json`` (an output of the stage);
- ``adapt`` (:func:`derive_max_new_tokens`, :func:`derive_gate`): once its tokenizer exists, the token limit
  ``rollout.max_new_tokens`` from the demonstrations' actions in that tokenizer's tokens, recorded in the adapted
  model's ``policy.json`` (``recipe``); the gate's minimums from build_env's expert and random baselines.

Every later phase loads its sections through :func:`pipeline.core.config.load_section`, which resolves ``auto``
with :func:`resolve` from those two files, so train, evaluate, check_drift, deploy and serve all see the same values.
The phases that derive a value load their section with ``resolve=False`` (an earlier run's file is never read as
this run's).

The rules (pure functions, unit-tested with known answers):

- action characters: the next power of two ≥ 2 × the longest demonstrated action (cheap to be generous: the limit only
  decides whether an action is valid; a power of two keeps the value stable while the data changes a little);
- steps: 2 × the most calls any task's plan needs (over every split: a policy gets as many calls again for retries
  and detours); from the tasks alone, since the budget enters the reward the demonstrations record;
- policy characters per episode: the next power of two ≥ 4 × the longest demonstrated episode (twice the steps,
  each twice as long, as the two rules above allow);
- tokens per action: 1.5 × the longest demonstrated action in the adapted tokenizer's tokens, rounded up to a multiple
  of 16 (tighter than characters: every runaway action decodes up to this many tokens in every rollout);
- gate: for each level the demonstrations teach (coverage ≥ :data:`TAUGHT_COVERAGE` of its training tasks),
  ``success_L<l>`` ≥ random + f·(expert − random) on the gate's split; ``tool_first_acc`` ≥ c + f·(1 − c) with c
  = 1 / number of tools (a uniform first choice); ``param_acc`` ≥ f (the expert's is 1, chance 0); f is
  ``adapt.gate.fraction``. A level the demonstrations barely cover (the shop's level 4 at 3 %) is left to RL.

Values are clamped to the config fields' ranges (:data:`BOUNDS`); a clamp is named in the evidence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.core.errors import AgentRLError

AUTO = "auto"
RECIPE_FILE = Path("data") / "recipe.json"        # build_env's derivations (relative to the run's folder)
ADAPTED_POLICY = Path("models") / "adapted"       # adapt's token limit is in its policy.json under "recipe"
TAUGHT_COVERAGE = 0.5                             # a level with demonstrations for at least this share is gated
DATA_KEYS = ("env.max_action_chars", "env.max_steps", "env.max_policy_chars")
TOKEN_KEY = "rollout.max_new_tokens"
BOUNDS = {"env.max_action_chars": (16, 4096), "env.max_steps": (1, 64), "env.max_policy_chars": (64, 1 << 20),
          TOKEN_KEY: (1, 1024)}


class RecipeError(AgentRLError):
    """An ``auto`` value that cannot be derived or resolved; the message names the key."""


def entry(value: Any, source: str, evidence: Mapping[str, Any] | None = None) -> dict:
    """One recipe entry: the value, its source (``derived`` | ``set``) and what it was derived from."""
    return {"value": value, "source": source, "evidence": dict(evidence or {})}


def pow2_at_least(x: float) -> int:
    """The smallest power of two ≥ x (1 for x ≤ 1)."""
    return 1 if x <= 1 else 1 << math.ceil(math.log2(x))


def _clamp(key: str, value: int, evidence: dict) -> dict:
    lo, hi = BOUNDS[key]
    if not lo <= value <= hi:
        evidence["clamped_from"] = value
        value = min(hi, max(lo, value))
    return entry(value, "derived", evidence)


def _nonempty(values: Sequence, what: str, key: str) -> None:
    if not values:
        raise RecipeError(f"{key}: auto needs {what}, and there are none; set {key} to a number")


def derive_action_chars(action_lengths: Sequence[int]) -> dict:
    """``env.max_action_chars`` from the demonstrated actions' lengths in characters."""
    _nonempty(action_lengths, "demonstrated actions", "env.max_action_chars")
    longest = max(action_lengths)
    return _clamp("env.max_action_chars", pow2_at_least(2 * longest),
                  {"rule": "next power of two >= 2 x longest demonstrated action", "longest_action_chars": longest,
                   "actions": len(action_lengths)})


def derive_steps(task_min_calls: Sequence[int], demo_calls: Sequence[int] = ()) -> dict:
    """``env.max_steps`` from the fewest calls each task needs (every split). It depends on the tasks alone: the
    step budget enters the reward (efficiency is −extra calls / max_steps), so the demonstrations' returns are
    recorded under it. The longest demonstration (`demo_calls`) is evidence; one reaching the budget is flagged."""
    _nonempty(task_min_calls, "tasks", "env.max_steps")
    most_needed = max(task_min_calls)
    out = _clamp("env.max_steps", 2 * most_needed, {"rule": "2 x most calls a task needs",
                                                    "most_calls_needed": most_needed, "tasks": len(task_min_calls)})
    if demo_calls:
        out["evidence"]["longest_demo_calls"] = max(demo_calls)
        if max(demo_calls) >= out["value"]:
            out["evidence"]["demos_at_budget"] = sum(c >= out["value"] for c in demo_calls)
    return out


def derive_policy_chars(episode_chars: Sequence[int]) -> dict:
    """``env.max_policy_chars`` from the characters each demonstration wrote in all its actions."""
    _nonempty(episode_chars, "demonstrations", "env.max_policy_chars")
    longest = max(episode_chars)
    return _clamp("env.max_policy_chars", pow2_at_least(4 * longest),
                  {"rule": "next power of two >= 4 x longest demonstrated episode", "longest_episode_chars": longest,
                   "demos": len(episode_chars)})


def derive_max_new_tokens(action_tokens: Sequence[int]) -> dict:
    """``rollout.max_new_tokens`` from the demonstrated actions' lengths in the adapted tokenizer's tokens."""
    _nonempty(action_tokens, "demonstrated actions", TOKEN_KEY)
    longest = max(action_tokens)
    ordered = sorted(action_tokens)
    return _clamp(TOKEN_KEY, 16 * math.ceil(1.5 * longest / 16),
                  {"rule": "1.5 x longest demonstrated action in tokens, rounded up to a multiple of 16",
                   "longest_action_tokens": longest, "p99_action_tokens": ordered[(99 * (len(ordered) - 1)) // 100],
                   "actions": len(action_tokens)})


def derive_data_recipe(demos: Iterable[Mapping], task_min_calls: Sequence[int]) -> dict[str, dict]:
    """The three data-level limits from demonstration records (``steps``: ``[{"action": ...}, ...]``) and every
    task's ``min_calls``, keyed ``env.<key>``."""
    actions, calls, episodes = [], [], []
    for d in demos:
        lengths = [len(s["action"]) for s in d["steps"]]
        actions += lengths
        calls.append(len(lengths))
        episodes.append(sum(lengths))
    return {"env.max_action_chars": derive_action_chars(actions),
            "env.max_steps": derive_steps(task_min_calls, calls),
            "env.max_policy_chars": derive_policy_chars(episodes)}


def derive_gate(coverage: Mapping[int, float], expert: Mapping[int, float], random: Mapping[int, float],
                n_tools: int, fraction: float) -> dict:
    """The gate's minimums (``adapt.gate.min``) and their evidence.

    coverage: share of each level's training tasks with a demonstration; expert / random: each level's success of the
    expert and of the random policy on the gate's split; n_tools: tools a policy chooses from; fraction: f."""
    if not 0 < fraction <= 1:
        raise RecipeError(f"adapt.gate.fraction must lie in (0, 1], got {fraction}")
    taught = sorted(lv for lv, c in coverage.items() if c >= TAUGHT_COVERAGE and lv in expert)
    if not taught:
        raise RecipeError(f"adapt.gate.min: auto gates the levels with demonstrations for at least "
                          f"{TAUGHT_COVERAGE:.0%} of their training tasks and an expert baseline, and there are none "
                          f"(coverage {dict(coverage)}); set adapt.gate.min by hand or adapt.gate.enabled: false")
    mins, per_level = {}, {}
    for lv in taught:
        lo, hi = float(random.get(lv, 0.0)), float(expert[lv])
        mins[f"eval/greedy/success_L{lv}"] = round(lo + fraction * max(0.0, hi - lo), 4)
        per_level[str(lv)] = {"coverage": round(coverage[lv], 4), "expert": hi, "random": lo}
    chance = 1.0 / max(1, n_tools)
    mins["eval/greedy/tool_first_acc"] = round(chance + fraction * (1 - chance), 4)
    mins["eval/greedy/param_acc"] = round(fraction, 4)
    return entry(mins, "derived", {
        "rule": "chance + fraction x (expert - chance) per metric; levels with demonstration coverage >= "
                f"{TAUGHT_COVERAGE}", "fraction": fraction, "levels": per_level,
        "untaught_levels": sorted(lv for lv in coverage if lv not in taught), "n_tools": n_tools})


# --------------------------------------------------------------------------------------------------- resolution


def pick(key: str, configured: Any, derived: dict) -> dict:
    """The entry a run uses: the derived one for ``auto``, else the configured value marked ``set`` (the derivation
    kept as evidence, so a report shows what the hand-set value overrides)."""
    if configured == AUTO:
        return derived
    return entry(configured, "set", {"derived": derived["value"]})


def provisional(env_cfg: Any, task_min_calls: Sequence[int]) -> Any:
    """The env config build_env's checks and demonstrations run under: an ``auto`` step budget already derived (from
    the tasks alone), each ``auto`` character limit at its upper bound until it is derived from the demonstrations.
    The derived character limits lie above every demonstration's actions and episodes, so the demonstrations are
    the same as under the derived limits."""
    update = {k.split(".", 1)[1]: BOUNDS[k][1] for k in auto_keys(env_cfg, "env")}
    if "max_steps" in update:
        update["max_steps"] = derive_steps(task_min_calls)["value"]
    return env_cfg.model_copy(update=update)


def data_recipe(env_cfg: Any, demos: Sequence[Mapping], task_min_calls: Sequence[int]) -> tuple[Any, dict]:
    """(the env config with its data keys resolved, the recipe entries of build_env): derived where the key is
    ``auto``, the hand-set value (``set``) where it is not; an environment without demonstrations can only use
    hand-set values (a RecipeError names the first ``auto`` key otherwise)."""
    auto = auto_keys(env_cfg, "env")
    if not demos and auto:
        raise RecipeError(f"{auto[0]}: auto needs the expert's demonstrations, and this environment has no expert; "
                          f"set {auto[0]} to a number")
    if not demos:
        return env_cfg, {k: entry(getattr(env_cfg, k.split('.', 1)[1]), "set") for k in DATA_KEYS}
    derived = derive_data_recipe(demos, task_min_calls)
    recipe = {k: pick(k, getattr(env_cfg, k.split(".", 1)[1]), derived[k]) for k in DATA_KEYS}
    return env_cfg.model_copy(update={k.split(".", 1)[1]: recipe[k]["value"] for k in DATA_KEYS}), recipe


def read_recipe(path: str | Path = RECIPE_FILE) -> dict[str, dict]:
    """build_env's recipe file (``{key: entry}``); a RecipeError when it is missing or unreadable."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path} not found; run `agentrl build-env` (DVC stage build_env) first") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RecipeError(f"{path}: unreadable recipe ({exc}); run `agentrl build-env` again") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping of recipe entries")
    return data


def policy_recipe(policy_dir: str | Path = ADAPTED_POLICY) -> dict[str, dict]:
    """The recipe adapt recorded in a policy's ``policy.json`` (``{}`` when it has none)."""
    path = Path(policy_dir) / "policy.json"
    try:
        return json.loads(path.read_text()).get("recipe") or {}
    except FileNotFoundError:
        raise RecipeError(f"{path} not found; run `agentrl adapt` (DVC stage adapt) first") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise RecipeError(f"{path}: unreadable ({exc})") from None


def auto_keys(cfg: Any, section: str) -> list[str]:
    """The ``section.key`` names of `cfg` still set to ``auto``."""
    keys = [k for k in (*DATA_KEYS, TOKEN_KEY) if k.startswith(section + ".")]
    return [k for k in keys if getattr(cfg, k.split(".", 1)[1], None) == AUTO]


def resolve(cfg: Any, section: str, recipe_file: str | Path = RECIPE_FILE,
            adapted: str | Path = ADAPTED_POLICY) -> Any:
    """`cfg` with every ``auto`` key of the `env` or `rollout` section replaced by the recorded value (the same
    object when none is ``auto``); a RecipeError naming the key when its record is missing."""
    keys = auto_keys(cfg, section)
    if not keys:
        return cfg
    update = {}
    for key in keys:
        try:
            recipe = policy_recipe(adapted) if key == TOKEN_KEY else read_recipe(recipe_file)
        except RecipeError as exc:
            raise RecipeError(f"{key}: auto: {exc}; or set {key} to a number") from None
        if key not in recipe:
            where = Path(adapted) / "policy.json" if key == TOKEN_KEY else recipe_file
            raise RecipeError(f"{key}: auto, but {where} records no value for it (written before the recipe "
                              f"existed); rerun the phase that derives it or set {key} to a number")
        update[key.split(".", 1)[1]] = recipe[key]["value"]
    return cfg.model_copy(update=update)


def require_resolved(cfg: Any, section: str) -> None:
    """Refuse a config whose ``auto`` keys were never resolved (built in code or parsed without
    :func:`pipeline.core.config.load_section`), before a number is needed."""
    keys = auto_keys(cfg, section)
    if keys:
        raise RecipeError(f"{keys[0]}: auto was not resolved; load the section with "
                          f"pipeline.core.config.load_section or pass pipeline.core.recipe.resolve's result")


def mlflow_params(recipe: Mapping[str, dict]) -> dict[str, Any]:
    """``recipe/<key>`` → value and ``recipe/<key>_source`` → derived | set, for Run.log_params."""
    out: dict[str, Any] = {}
    for key, e in recipe.items():
        name = key.split(".")[-1] if key != "adapt.gate.min" else "gate_min"
        value = e["value"]
        out[f"recipe/{name}"] = json.dumps(value, sort_keys=True) if isinstance(value, dict) else value
        out[f"recipe/{name}_source"] = e["source"]
    return out


def describe(recipe: Mapping[str, dict]) -> str:
    """One line for the phase's output: ``key value (source), ...``."""
    parts = []
    for key, e in recipe.items():
        value = e["value"]
        shown = ", ".join(f"{k.rsplit('/', 1)[-1]} {v:g}" for k, v in value.items()) if isinstance(value, dict) else value
        parts.append(f"{key} {shown} ({e['source']})")
    return "; ".join(parts)
