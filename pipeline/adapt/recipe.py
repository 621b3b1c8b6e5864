"""adapt's part of the default recipe (:mod:`pipeline.core.recipe`): the token limit, once the tokenizer exists, and
the capability gate's minimums, from build_env's baselines and the demonstrations' coverage of each level.

Both are resolved before the first rollout of the phase (checkpoint selection plays episodes), so every episode of
adapt, and of every later phase (through policy.json's ``recipe``), uses the same values."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.core import recipe as recipes
from pipeline.core.recipe import AUTO, TOKEN_KEY, RecipeError

GATE_KEY = "adapt.gate.min"


def token_recipe(rollout_cfg: Any, tokenizer, demos: Sequence[Mapping]) -> tuple[Any, dict]:
    """(the rollout config with ``max_new_tokens`` resolved, its recipe entry): derived from every demonstrated
    action in `tokenizer`'s tokens (as the policy writes them) where the key is ``auto``, else the hand-set value."""
    from pipeline.policy.tokenizer import encode_action

    lengths = [len(encode_action(tokenizer, s["action"])) for d in demos for s in d["steps"]]
    configured = rollout_cfg.max_new_tokens
    if configured != AUTO and not lengths:
        return rollout_cfg, {TOKEN_KEY: recipes.entry(configured, "set")}
    chosen = recipes.pick(TOKEN_KEY, configured, recipes.derive_max_new_tokens(lengths))
    return rollout_cfg.model_copy(update={"max_new_tokens": chosen["value"]}), {TOKEN_KEY: chosen}


def level_coverage(demos: Sequence[Mapping], train_levels: Sequence[int]) -> dict[int, float]:
    """Share of each level's training tasks that have a demonstration (the data's own coverage, whatever
    build_env.demos asked for)."""
    tasks = Counter(train_levels)
    demonstrated = Counter(int(d["level"]) for d in demos)
    return {lv: demonstrated.get(lv, 0) / n for lv, n in sorted(tasks.items())}


def gate_recipe(gate_cfg: Any, demos: Sequence[Mapping], train_levels: Sequence[int], baselines: dict | None,
                n_tools: int, split: str) -> dict:
    """The gate's recipe entry (value: the minimums the gate applies): derived where ``adapt.gate.min`` is
    ``auto``, else the hand-set mapping. `baselines` is build_env's expert and random success on the gate's `split`
    (:func:`pipeline.adapt.main.baselines`)."""
    if gate_cfg.min != AUTO:
        return recipes.entry(dict(gate_cfg.min), "set")
    try:
        return _derive_gate(gate_cfg, demos, train_levels, baselines, n_tools, split)
    except RecipeError as exc:
        if gate_cfg.enabled:
            raise
        return recipes.entry({}, "derived", {"skipped": str(exc)})  # an unused gate does not stop the phase


def _derive_gate(gate_cfg, demos, train_levels, baselines, n_tools, split) -> dict:
    expert = (baselines or {}).get("expert")
    if not expert:
        raise RecipeError(f"{GATE_KEY}: auto needs the expert's success on the {split} split (metrics/build_env.json "
                          f"baselines, written by `agentrl build-env`), and there is none; set {GATE_KEY} by hand")
    random = (baselines or {}).get("random") or {"per_level_success": {}}
    per = lambda b: {int(lv): v for lv, v in b["per_level_success"].items() if v is not None}  # noqa: E731
    return recipes.derive_gate(level_coverage(demos, train_levels), per(expert), per(random), n_tools,
                               gate_cfg.fraction)
