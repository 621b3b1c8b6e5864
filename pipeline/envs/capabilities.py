"""Opt-in capabilities of an environment: what a phase can use when an environment offers it, beyond the core.

The core every environment implements is in :mod:`pipeline.envs.contract` (`build`, `load`, `tools`,
`task_from_dict`, `open_episode`, and `Episode.call` / `Episode.correct`). Everything else is a capability: a
:class:`typing.Protocol` below, one per job. A phase asks :func:`has_capability` (the one place that decides) and
either uses the hooks or skips what needs them, saying so.

How a capability is detected: the environment's class defines every method of the protocol, and at least one of them
is its own rather than the no-op default that :class:`~pipeline.envs.contract.Environment` keeps for backward
compatibility (so subclassing `Environment` alone offers none of the capabilities whose defaults the base class
carries). A hook that only the capability declares (``corpus``, ``entity_kinds``, ``state_digest``) has no default:
defining it is opting in.

Which phase calls which hook (docs/environments.md, "Capabilities", lists the same):

=================  =====================================================  ==========================================
capability         hooks                                                  used by
=================  =====================================================  ==========================================
HasExpert          expert(flaw, rng), random_policy(rng), flaws            build_env (checks, demonstrations, probes,
                                                                          baselines), train (expert-guided groups)
HasDataSuites      validate, check_task_records, check_episodes            build_env, every phase reading task files,
                                                                          train/evaluate (episode records)
DriftSource        sample_tasks, value_shifted, entity_table,              check_drift
                   entity_names, drift_features
FiltersIncoming    leaks_heldout, verify_task                             train (data/incoming, generated tasks)
GeneratesTasks     generate_tasks                                         train (train.task_generation)
Servable           request_task                                           deploy (serving)
HasCorpus          corpus(), copyable_strings(task)                       adapt (tokenizer, pre-training, drills and
                                                                          name augmentation)
NamesEntities      entity_kinds()                                         adapt (drills and name augmentation)
ReferenceCalls     reference_calls, same_answer, required_tools            adapt (tool/parameter accuracy), verifier
DigestsState       Episode.state_digest()                                 build_env (finding undeclared write tools)
=================  =====================================================  ==========================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class HasExpert(Protocol):
    """A scripted expert (demonstrations, the expert check, the probes' reference, expert-guided RL groups) and a
    random baseline. `expert(flaw, rng)` returns a policy with ``reset(task)`` and ``act(obs, info)``; `flaw` is
    "none" or one of `flaws`; `random_policy(rng)` is also called with ``rng=None`` (it then seeds itself)."""

    flaws: tuple[str, ...]

    def expert(self, flaw: str = "none", rng=None) -> Any: ...

    def random_policy(self, rng) -> Any: ...


@runtime_checkable
class HasDataSuites(Protocol):
    """Great Expectations reports on the data: the world and splits `build_env` wrote (`validate`), task records read
    at a phase's boundary (`check_task_records`) and episode records (`check_episodes`)."""

    def validate(self, world_dir: Path, tasks: dict[str, list[dict]], demos: list[dict] | None) -> list: ...

    def check_task_records(self, records: list[dict], dataset: str): ...

    def check_episodes(self, records: list[dict], kind: str, dataset: str, env_cfg, require_tokens: bool = False): ...


@runtime_checkable
class DriftSource(Protocol):
    """What the drift checks compare: fresh tasks of a split, a value-shifted world, the entity table (its numeric
    columns are the per-entity features), the names of every entity, and extra features of an episode record."""

    def sample_tasks(self, split: str, n: int, level_mix: dict[int, float], seed: int, options) -> list | None: ...

    def value_shifted(self, seed: int) -> Any: ...

    def entity_table(self): ...

    def entity_names(self) -> set[str] | None: ...

    def drift_features(self, record: dict) -> dict[str, float]: ...


@runtime_checkable
class FiltersIncoming(Protocol):
    """Whether a task from outside names what the held-out splits hold out, and whether the world gives its answer."""

    def leaks_heldout(self, task: Any) -> bool: ...

    def verify_task(self, task: Any) -> bool: ...


@runtime_checkable
class GeneratesTasks(Protocol):
    """Fresh training tasks of a weak slice (adversarial task generation)."""

    def generate_tasks(self, weakness: dict, n: int, seed: int, options=None) -> list | None: ...


@runtime_checkable
class Servable(Protocol):
    """The task of one serving request (at least a "question")."""

    def request_task(self, request: dict) -> Any: ...


@runtime_checkable
class HasCorpus(Protocol):
    """Text of the world: `corpus()` documents for the built-in tokenizer and (``adapt.pretrain.include_documents:
    auto``) continued pre-training; `copyable_strings(task)` the strings an agent must copy exactly from what it reads
    (the question, tool results) into its calls, for the drills and name augmentation where the world folder has no
    ``entities.json``."""

    def corpus(self) -> list[str]: ...

    def copyable_strings(self, task: Any) -> list[str]: ...


@runtime_checkable
class NamesEntities(Protocol):
    """`entity_kinds()`: the kinds of ``entities.json`` the drills and name augmentation use, in order, each with its
    weight in the drills (the first kind also fills a drill's second name). Without it every kind of the file is
    used, in the file's order, with equal weights."""

    def entity_kinds(self) -> dict[str, float]: ...


@runtime_checkable
class ReferenceCalls(Protocol):
    """The calls of a correct process (adaptation's tool and parameter metrics), answer equality, and the tools the
    rule verifier requires in order."""

    def reference_calls(self, task: Any) -> list[tuple[str, dict]] | None: ...

    def same_answer(self, given: str, truth: str) -> bool: ...

    def required_tools(self, task: Any) -> list[str]: ...


@runtime_checkable
class DigestsState(Protocol):
    """An episode that can fingerprint its private world (any string that changes when the state changes): the
    undeclared-write check compares it before and after each call of a tool not marked ``writes``."""

    def state_digest(self) -> str: ...


CAPABILITIES = (HasExpert, HasDataSuites, DriftSource, FiltersIncoming, GeneratesTasks, Servable, HasCorpus,
                NamesEntities, ReferenceCalls)


def _hooks(cap: type) -> list[str]:
    return [n for n in getattr(cap, "__protocol_attrs__", None) or _protocol_attrs(cap) if not n.startswith("_")
            and callable(getattr(cap, n, None))]


def _protocol_attrs(cap: type) -> set[str]:
    return {n for n in vars(cap) if not n.startswith("_")}


def has_capability(env: Any, cap: type) -> bool:
    """Whether `env` (an environment, or an episode for :class:`DigestsState`) offers `cap`: it has every member of
    the protocol and overrides at least one of the hooks the base class :class:`~pipeline.envs.contract.Environment`
    gives a no-op default (see the module docstring)."""
    if not isinstance(env, cap):
        return False
    from pipeline.envs.contract import Environment

    hooks = _hooks(cap)
    defaults = [h for h in hooks if hasattr(Environment, h)]
    if not defaults or not isinstance(env, Environment):
        return True
    if len(defaults) < len(hooks):  # a hook the base class does not define was defined: opted in
        return True
    cls = type(env)
    return any(getattr(cls, h) is not getattr(Environment, h) for h in defaults)


def offered(env: Any) -> list[str]:
    """The names of the capabilities `env` offers (for `agentrl envs` and the docs' checks)."""
    return [c.__name__ for c in CAPABILITIES if has_capability(env, c)]
