"""Optional capabilities of the RL loop, one module each, all following :class:`base.Extension`.

A run's extensions are the built-in ones its config turns on (:data:`BUILTIN`, in this order: each reads its own
`train.*` keys and is off by default) followed by the ones `train.extensions` names (a mapping from each to its options), the way an
environment is named: ``module:Class`` or the name of an entry point in the group :data:`GROUP`. ``docs/rl-options.md`` shows how to
write one.

Order matters where two extensions touch the same records: adversarial sampling reports the weights of the tasks the
sampler drew before generated tasks are mixed into the plan, the learned reward pays an episode before replay stores
it, and the reward weighting recomputes returns inside the scoring that replay wraps.
"""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import entry_points
from typing import Any

from pipeline.core.errors import AgentRLError
from pipeline.train.extensions.base import Extension, Stage

GROUP = "agentrl.extensions"
BUILTIN = (
    "pipeline.train.extensions.tool_noise:ToolNoise",  # train.exploration
    "pipeline.train.extensions.adversarial:AdversarialSampling",  # train.sampling.adversarial
    "pipeline.train.extensions.task_generation:TaskGenerator",  # train.task_generation
    "pipeline.train.extensions.learned_reward:LearnedRewardTerm",  # train.learned_reward
    "pipeline.train.extensions.reward_weighting:ReturnWeighting",  # train.reward.weighting
    "pipeline.train.extensions.event_credit:EventCredit",  # train.reward.credit: event
    "pipeline.train.extensions.replay:Replay",  # train.sampling.replay
    "pipeline.train.extensions.slicing:Slicing",  # train.sampling.slice_turns
    "pipeline.train.extensions.population:Population",  # train.population (trains the stage, not a loop hook)
    "pipeline.train.extensions.time_budget:TimeBudget",  # train.time_budget_s
)

__all__ = ["BUILTIN", "GROUP", "Extension", "Stage", "curve_keys", "extension_class", "extension_classes",
           "make_extensions", "train_stage"]


def extension_class(spec: str) -> type[Extension]:
    """The class `spec` names (an entry point of :data:`GROUP`, or ``module:Class``), checked to be an Extension."""
    installed = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    target = installed.get(spec) or (spec if ":" in spec else None)
    if target is None:
        raise AgentRLError(f"train.extensions: unknown extension {spec!r}: not an installed entry point of {GROUP!r} "
                           f"and not module:Class; installed: {', '.join(sorted(installed)) or 'none'}")
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the extension's own import error, reported rather than raised through
        raise AgentRLError(f"train.extensions: cannot import {module_name} for {spec!r} "
                           f"({type(exc).__name__}: {str(exc)[:200]})") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise AgentRLError(f"train.extensions: {module_name} has no attribute {attr!r} ({spec!r})")
    if not inspect.isclass(obj) or not issubclass(obj, Extension):
        raise AgentRLError(f"train.extensions: {spec!r} is not a subclass of "
                           f"pipeline.train.extensions.base.Extension")
    return obj


def make_extensions(cfg, env_cfg, runtime) -> list[Extension]:
    """The run's extensions: the built-in ones `cfg` turns on, then those of `train.extensions`, in order."""
    out: list[Extension] = []
    for spec, options in (*((s, None) for s in BUILTIN), *cfg.extensions.items()):
        ext = extension_class(spec).create(cfg, env_cfg, runtime, options or {})
        if ext is None:
            continue
        if any(e.name == ext.name for e in out):
            raise AgentRLError(f"train.extensions: two extensions are named {ext.name!r} (from {spec!r}); each needs "
                               f"its own name (the key of its checkpointed state)")
        out.append(ext)
    return out


def curve_keys(cfg) -> tuple[str, ...]:
    """The learning-curve columns the run's possible extensions declare (:attr:`Extension.curve_keys`), built-in
    ones first, in order; each becomes a column only when some update reported it."""
    keys: dict[str, None] = {}
    for cls in extension_classes(cfg):
        keys.update(dict.fromkeys(cls.curve_keys))
    return tuple(keys)


def extension_classes(cfg) -> list[type[Extension]]:
    """The classes of every extension a run of `cfg` may have: the built-in ones, then those of `train.extensions`."""
    return [extension_class(spec) for spec in (*BUILTIN, *cfg.extensions)]


def train_stage(cfg, stage: Stage) -> dict:
    """The stage's result: the first extension's :meth:`Extension.train_stage` that gives one, else one run."""
    for cls in extension_classes(cfg):
        result = cls.train_stage(cfg, stage)
        if result is not None:
            return result
    return stage.train_one(cfg, stage.out_dir, stage.ckpt_dir_of(cfg), stage.run)
