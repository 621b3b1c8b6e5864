"""The `build_env` phase's config: the data that phase generates (task counts, level mix, demonstrations, and the
environment's own options such as the world's size). Mirrors the `build_env` section of params.yaml key for key."""

from __future__ import annotations

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig
from pipeline.envs.config import SPLITS


class DemoConfig(PhaseConfig):
    """Imperfect demonstrations made from the environment's scripted expert (one flaw at most each)."""

    level_coverage: dict[int, float] = Field(
        default_factory=lambda: {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.03},
        description="Share of training tasks of each level that get a demonstration. Level 4 is scarce on purpose: its steps are all taught on level 2, so SFT solves it now and then and RL has room above.",
    )
    family_coverage: dict[str, float] = Field(
        default_factory=dict,
        description="Share of training tasks of a task family that get a demonstration, in place of its level's `level_coverage` (e.g. {update: 0.1}); an empty mapping builds the same data as level coverage alone.",
    )
    min_per_family: int = Field(
        25, ge=0,
        description="Fewest demonstrations a task family gets: a family that level_coverage leaves below it gets more of its training tasks demonstrated (never more than it has); a family that family_coverage names gets exactly its share. A family whose call shapes no other family shows is not learnt from a handful of examples. The default world's families all have more, so its data are unchanged. 0 turns it off.",
    )
    redundant_call_prob: float = Field(0.1, ge=0, le=1, description="Chance that a demonstration repeats one of its calls.")
    wrong_order_prob: float = Field(0.1, ge=0, le=1, description="Chance that a demonstration first tries a step out of order (a failing call), then recovers.")
    wrong_value_prob: float = Field(0.0, ge=0, le=1, description="Chance that a demonstration makes the planned calls, then answers a wrong value.")

    @model_validator(mode="after")
    def _check_levels(self) -> "DemoConfig":
        bad = [lv for lv in self.level_coverage if lv < 1]
        if bad:
            raise ValueError(f"level_coverage has invalid levels {bad}; levels are integers from 1")
        out = {lv: v for lv, v in self.level_coverage.items() if not 0 <= v <= 1}
        if out:
            raise ValueError(f"level_coverage values must lie in [0, 1], got {out}")
        out = {f: v for f, v in self.family_coverage.items() if not 0 <= v <= 1}
        if out:
            raise ValueError(f"family_coverage values must lie in [0, 1], got {out}")
        flaws = self.wrong_value_prob + self.wrong_order_prob + self.redundant_call_prob
        if flaws > 1 + 1e-9:  # one flaw per demonstration at most: the chances share one draw
            raise ValueError(f"wrong_value_prob + wrong_order_prob + redundant_call_prob must be at most 1 (a "
                             f"demonstration gets one flaw at most), got {flaws:g}")
        return self


def option_owners(keys: list[str]) -> dict[str, list[str]]:
    """{built-in environment: those of `keys` its Options model declares}, for a message about misplaced options."""
    from pipeline.envs.registry import BUILTIN, environment_class

    out: dict[str, list[str]] = {}
    for name in BUILTIN:
        try:
            fields = environment_class(name).Options.model_fields
        except Exception:  # noqa: BLE001 -- a built-in that does not load names no owner
            continue
        mine = [k for k in keys if k in fields]
        if mine:
            out[name] = mine
    return out


class ProbesConfig(PhaseConfig):
    """Reward-hacking probes (:mod:`pipeline.envs.probes`): degenerate policies played with the configured reward on
    a sample of the training tasks; one that earns more than `floor` × the expert's mean return stops the build."""

    enabled: bool = Field(True, description="Play the probes on every build (a winning probe stops the phase before anything is published).")
    tasks: int = Field(100, ge=1, le=4000, description="Training tasks each probe and the expert play (the first of every level and family, then evenly spaced ones).")
    floor: float = Field(0.5, gt=0, le=1, description="A probe fails the build when its mean return exceeds floor × the expert's mean return (when the expert's is not positive: when it reaches it).")


class BuildEnvConfig(PhaseConfig):
    """What the `build_env` phase generates: the world, the task splits and the demonstrations."""

    seed: int = Field(0, description="Seed of every random draw in the phase; the same seed gives byte-identical data.")
    tasks_per_split: dict[str, int] = Field(
        default_factory=lambda: {"train": 4000, "validation": 400, "test": 400},
        description="Number of tasks in each split (train, validation, test).",
    )
    level_mix: dict[int, float] = Field(
        default_factory=lambda: {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25},
        description="Relative weight of each difficulty level in every split.",
    )
    options: dict = Field(
        default_factory=dict,
        description="The environment's own build options, checked by its Options model (`agentrl envs` and "
                    "docs/environments.md list each built-in environment's); {} takes the environment's defaults.",
    )
    demos: DemoConfig = Field(default_factory=DemoConfig, description="Demonstration generation.")
    probes: ProbesConfig = Field(default_factory=ProbesConfig, description="Reward-hacking probes run before anything is published.")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        """A key of a built-in environment's own options written at the top of the section (params files from before
        the environment contract) is named as moved, with the environment it belongs to, rather than as merely
        unknown."""
        if isinstance(data, dict):
            owners = option_owners(sorted(k for k in data if k not in cls.model_fields))
            if owners:
                moved = sorted({k for ks in owners.values() for k in ks})
                whose = "; ".join(f"{', '.join(ks)}: options of environment {n!r}" for n, ks in owners.items())
                raise ValueError(f"{', '.join(moved)}: moved under build_env.options (the environment's own build "
                                 f"options; {whose}), e.g. options: {{{moved[0]}: ...}}")
        return data

    @model_validator(mode="after")
    def _check(self) -> "BuildEnvConfig":
        if set(self.tasks_per_split) != set(SPLITS):
            raise ValueError(f"tasks_per_split must name exactly {list(SPLITS)}, got {sorted(self.tasks_per_split)}")
        small = {k: v for k, v in self.tasks_per_split.items() if v < 1}
        if small:
            raise ValueError(f"tasks_per_split needs at least one task per split, got {small}")
        bad = [lv for lv in self.level_mix if lv < 1]
        if bad:
            raise ValueError(f"level_mix has invalid levels {bad}; levels are integers from 1 (the environment "
                             f"says which it has)")
        if any(w < 0 for w in self.level_mix.values()) or sum(self.level_mix.values()) <= 0:
            raise ValueError(f"level_mix weights must be ≥ 0 and not all zero, got {self.level_mix}")
        return self
