"""The `build_env` phase's config: the data that phase generates (world size, task counts, level mix, demonstration
flaws). Mirrors the `build_env` section of params.yaml key for key."""

from __future__ import annotations

from pydantic import Field, model_validator

from pipeline.core.config import PhaseConfig
from pipeline.env.config import LEVELS, SPLITS


class DemoConfig(PhaseConfig):
    """Imperfect demonstrations made from the scripted expert (see `pipeline.env.expert`)."""

    level_coverage: dict[int, float] = Field(
        default_factory=lambda: {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.03},
        description="Share of training tasks of each level that get a demonstration. Level 4 is scarce on purpose: its steps are all taught on level 2, so SFT solves it now and then and RL has room above.",
    )
    family_coverage: dict[str, float] = Field(
        default_factory=dict,
        description="Share of training tasks of a task family that get a demonstration, in place of its level's `level_coverage` (e.g. {update: 0.1}); an empty mapping builds the same data as level coverage alone.",
    )
    redundant_call_prob: float = Field(0.1, ge=0, le=1, description="Chance that a demonstration repeats one of its calls.")
    wrong_order_prob: float = Field(0.1, ge=0, le=1, description="Chance that a demonstration first tries a step out of order (a failing call), then recovers.")
    wrong_value_prob: float = Field(0.0, ge=0, le=1, description="Chance that a demonstration makes the planned calls, then answers a wrong value.")

    @model_validator(mode="after")
    def _check_levels(self) -> "DemoConfig":
        bad = [lv for lv in self.level_coverage if lv not in LEVELS]
        if bad:
            raise ValueError(f"level_coverage has unknown levels {bad}; levels are {list(LEVELS)}")
        out = {lv: v for lv, v in self.level_coverage.items() if not 0 <= v <= 1}
        if out:
            raise ValueError(f"level_coverage values must lie in [0, 1], got {out}")
        from pipeline.env.tasks import FAMILIES  # noqa: PLC0415 (tasks imports the world, not this module)

        bad_families = sorted(f for f in self.family_coverage if f not in FAMILIES)
        if bad_families:
            raise ValueError(f"family_coverage has unknown task families {bad_families}; families are "
                             f"{list(FAMILIES)}")
        out = {f: v for f, v in self.family_coverage.items() if not 0 <= v <= 1}
        if out:
            raise ValueError(f"family_coverage values must lie in [0, 1], got {out}")
        flaws = self.wrong_value_prob + self.wrong_order_prob + self.redundant_call_prob
        if flaws > 1 + 1e-9:  # one flaw per demonstration at most: the chances share one draw
            raise ValueError(f"wrong_value_prob + wrong_order_prob + redundant_call_prob must be at most 1 (a "
                             f"demonstration gets one flaw at most), got {flaws:g}")
        return self


class BuildEnvConfig(PhaseConfig):
    """What the `build_env` phase generates: the world, the task splits and the demonstrations."""

    seed: int = Field(0, description="Seed of every random draw in the phase; the same seed gives byte-identical data.")
    n_products: int = Field(400, ge=30, le=100_000, description="Products in the SQLite world.")
    n_suppliers: int = Field(80, ge=10, le=10_000, description="Suppliers (each with a flagship product, described in the document corpus).")
    heldout_entity_fraction: float = Field(0.3, gt=0, lt=0.9, description="Share of products and suppliers held out of training; validation and test each get half.")
    tasks_per_split: dict[str, int] = Field(
        default_factory=lambda: {"train": 4000, "validation": 400, "test": 400},
        description="Number of tasks in each split (train, validation, test).",
    )
    level_mix: dict[int, float] = Field(
        default_factory=lambda: {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25},
        description="Relative weight of each difficulty level in every split.",
    )
    train_wordings: int = Field(
        4, ge=1, le=8,
        description="Question wordings per family that train and validation draw from (the original four, then four "
                    "more); the held-out fifth wording stays test-only, and test draws from the original five, so the "
                    "test split does not depend on this.",
    )
    demos: DemoConfig = Field(default_factory=DemoConfig, description="Demonstration generation.")

    @model_validator(mode="after")
    def _check(self) -> "BuildEnvConfig":
        if set(self.tasks_per_split) != set(SPLITS):
            raise ValueError(f"tasks_per_split must name exactly {list(SPLITS)}, got {sorted(self.tasks_per_split)}")
        small = {k: v for k, v in self.tasks_per_split.items() if v < 1}
        if small:
            raise ValueError(f"tasks_per_split needs at least one task per split, got {small}")
        bad = [lv for lv in self.level_mix if lv not in LEVELS]
        if bad:
            raise ValueError(f"level_mix has unknown levels {bad}; levels are {list(LEVELS)}")
        if any(w < 0 for w in self.level_mix.values()) or sum(self.level_mix.values()) <= 0:
            raise ValueError(f"level_mix weights must be ≥ 0 and not all zero, got {self.level_mix}")
        return self
