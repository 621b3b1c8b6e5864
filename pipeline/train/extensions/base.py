"""The one protocol every optional capability of the RL loop follows (``docs/rl-options.md``).

The kernel (:mod:`pipeline.train.loop`, :mod:`pipeline.train.learner`, :mod:`pipeline.train.advantages`) knows the
algorithm alone: PPO / GRPO / RLOO, the stabilisers that are on by default, the curriculum and asynchronous rollouts.
Everything else joins a run as an :class:`Extension`: the loop holds a list of them and calls each hook in that
order at fixed points of an update; a hook an extension does not define is this class's, which changes nothing. So a
run without extensions is the kernel exactly (bit for bit), and the kernel has no branch on any extension.

Points of an update ``u`` (0-based), in order:

1. :meth:`Extension.begin_update` before its rollouts; :meth:`Extension.plan` and :meth:`Extension.task_weights`
   while its tasks are drawn (in asynchronous mode the next update's plan is drawn during this one).
2. :meth:`Extension.observe` with this rank's own episodes, before the batch is learned or dropped as too stale.
3. :meth:`Extension.before_learn`: the records the learner will see (expert-guided groups included) may be changed
   or extended (an extra reward, replayed episodes); returns them and metrics.
4. Inside the learner: :meth:`Extension.reweight` (returns from the reward components), :meth:`Extension.score`
   (wraps the scoring of episodes), :meth:`Extension.turn_discounts` (per-turn discounts of per-turn credit),
   :meth:`Extension.row_weights` (loss weight of each row) and :meth:`Extension.after_advantages`. The learner
   also reads an extension's :attr:`Extension.slice_turns`, how many turns a row of the batch holds at most.
5. :meth:`Extension.after_learn`: metrics of the update (also when the batch was dropped).
6. :meth:`Extension.should_stop` after the update's figures joined the history: a reason stops the run the way early
   stopping does (the best validated policy is the output).
7. :meth:`Extension.state_dict` / :meth:`Extension.load_state_dict`: the extension's state in every checkpoint, so a
   resumed run continues as if it had not stopped.

One point lies above the loop: :meth:`Extension.train_stage` (a class method, asked before any run starts) may train
the stage otherwise than as one run, e.g. several runs with the best one kept (a population); the first extension
that returns a result decides, and none: the stage is one run. The curve columns an extension logs are its
:attr:`Extension.curve_keys`.

All ranks hold the same extensions and call the same hooks, so an extension may use the rank collectives
(``loop.dist.all_gather``) in any hook that runs on every rank.

An extension is built by :meth:`Extension.create` from the run's :class:`pipeline.train.config.TrainConfig`; it
returns None when the config leaves it off, so an extension that is off costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the types hooks receive; importing them here would make this module depend on the loop
    import numpy as np
    import torch

    from pipeline.train.config import TrainConfig


@dataclass
class Stage:
    """What :meth:`Extension.train_stage` may use to train the stage: one run of the loop with the stage's inputs
    bound, ``train_one(cfg, out_dir, ckpt_dir, run) -> result``, and what else the stage holds."""

    train_one: Callable[..., dict]
    ckpt_dir_of: Callable[[Any], Path]  # a run config's checkpoint folder (its config is in the folder's key)
    out_dir: Path  # where the stage's policy goes (models/policy)
    run: Any  # the stage's tracking run
    dist: Any  # pipeline.train.distributed.Dist
    runtime: Any  # the opened environment
    val_tasks: list
    env_cfg: Any
    rollout_cfg: Any


class Extension:
    """Base class of an optional capability: every hook is a no-op (see the module docstring for when each runs).
    `loop` is the run's :class:`pipeline.train.loop.Loop`, `lr` its :class:`pipeline.train.learner.Learner`."""

    name: str = "extension"  # the key of its state in a checkpoint; unique within a run
    slice_turns: int = 0  # > 0: the learner's rows hold at most this many turns (trajectory slicing)
    curve_keys: tuple[str, ...] = ()  # metrics it logs that are columns of metrics/train_curve.csv when reported

    @classmethod
    def create(cls, cfg: "TrainConfig", env_cfg: Any, runtime: Any, options: dict | None = None) -> "Extension | None":
        """This run's instance, or None when `cfg` leaves the capability off. `env_cfg` is the run's
        :class:`pipeline.envs.config.EnvConfig`, `runtime` its opened environment, `options` the mapping
        ``train.extensions`` gives it (built-in extensions read their own `train.*` keys instead)."""
        return cls()

    # ---- the stage (pipeline.train.worker)
    @classmethod
    def train_stage(cls, cfg: "TrainConfig", stage: Stage) -> dict | None:
        """The stage's result (a loop result; its ``extension_summary`` mapping joins ``metrics/train.json``) when
        the extension trains the stage otherwise than as one run of the loop, else None."""
        return None

    # ---- the loop
    def attach(self, loop) -> None:
        """Once, when the run is set up (before a checkpoint is restored)."""

    def begin_update(self, loop, u: int) -> None:
        """Before update `u`'s rollouts are played (synchronous mode)."""

    def plan(self, loop, tasks: list) -> list:
        """The tasks of an update (the same on every rank); return them, changed or not."""
        return tasks

    def task_weights(self, loop, task_ids: list[str]) -> "np.ndarray | None":
        """Weights of the tasks of one level, multiplied into the goal sampler's; None leaves them."""
        return None

    def observe(self, loop, u: int, records: list[dict]) -> dict:
        """This rank's episodes of update `u`, before they are learned or dropped; metrics."""
        return {}

    def before_learn(self, loop, u: int, records: list[dict], own: list[dict]) -> tuple[list[dict], dict]:
        """The records the learner trains on (`own`: this rank's episodes of the update, by identity); metrics."""
        return records, {}

    def after_learn(self, loop, u: int, records: list[dict]) -> dict:
        """After update `u` learned (or dropped its batch); metrics of the update."""
        return {}

    def should_stop(self, loop, u: int, metrics: dict) -> str | None:
        """After update `u`'s figures joined ``loop.history`` (figures may be added to `metrics` and to
        ``loop.history[-1]``); a reason stops the run."""
        return None

    # ---- the learner (pipeline.train.learner, pipeline.train.advantages)
    def reweight(self, records: list[dict], gather: Callable | None) -> tuple[list[dict], "np.ndarray | None", dict]:
        """Records with another ``return`` (copies), R' − R per episode (None: unchanged) and metrics; `gather`
        collects a value from every rank (``Dist.all_gather``; None: this process only)."""
        return records, None, {}

    def score(self, records: list[dict], score: Callable) -> Any:
        """The :class:`pipeline.train.advantages.Scores` of `records`; `score(records)` is the kernel's (or the
        previous extension's) scoring."""
        return score(records)

    def turn_discounts(self, records: list[dict], turn_mask: "torch.Tensor") -> tuple["torch.Tensor | None", dict]:
        """(episodes, turns) discount after each turn of per-turn credit, `train.gamma` included (None: `train.gamma`
        after every turn); the first extension that gives discounts sets them. Metrics."""
        return None, {}

    def row_weights(self, loss_mask: "torch.Tensor", records: list[dict], batch) -> "torch.Tensor":
        """The (rows, T) policy-loss weights of the batch (:class:`pipeline.train.batch.Batch`)."""
        return loss_mask

    def after_advantages(self, u: int, records: list[dict], scores, batch, adv: "torch.Tensor", dist) -> dict:
        """Once update `u`'s (rows, T) advantages are known, before its optimizer steps; metrics."""
        return {}

    # ---- checkpoints
    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of the extension (None: nothing)."""
        return None

    def load_state_dict(self, state: dict, loop) -> None:
        """Restore :meth:`state_dict`'s result."""
