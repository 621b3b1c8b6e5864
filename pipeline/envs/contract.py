"""The environment contract: what every phase needs from an environment, and nothing more.

An environment is a Python class that subclasses :class:`Environment`. The pipeline finds it by ``module:Class`` or by
name in the entry-point group ``agentrl.environments`` (:mod:`pipeline.envs.registry`) and chooses it with
``env.name`` in params.yaml. The built-in ones are ``shop`` (:mod:`pipeline.envs.shop`) and ``sql`` (the read-only
SQL environment, :mod:`pipeline.envs.sql`).

Who does what:

- **The environment** owns its world and its tasks: it builds its data (:meth:`Environment.build`, which the
  `build_env` phase calls into a staging folder that DVC versions), loads it back (:meth:`Environment.load`), declares
  its tools with a JSON Schema each (:class:`ToolSpec`, the OpenAI function shape), turns a task record into a task
  (:meth:`Environment.task_from_dict`), and opens one episode per task (:meth:`Environment.open_episode`), in which it
  executes tool calls (:meth:`Episode.call`) and judges the answer (:meth:`Episode.correct`). It enforces its own
  safety rules by raising :class:`SafetyViolation`. That is the core. Everything else is an opt-in capability
  (:mod:`pipeline.envs.capabilities`: an expert, data suites, drift sources, corpus text, reference calls, ...): the
  methods below marked optional are the capabilities' hooks with their no-op defaults, and a phase asks
  :func:`pipeline.envs.capabilities.has_capability` whether an environment really offers one.
- **The pipeline** owns everything between the model and the environment (:mod:`pipeline.envs.runner`): the text
  protocol and its parser, the prompt, the check of every call's parameters against the tool's schema before the
  environment sees it, the penalties for invalid calls, budgets and truncation, fault injection, the composite reward
  and the rule verifier, token masks and chat templates.

A task is any object with the attributes of :class:`TaskFields` (:class:`Task` is a ready-made one; the shop has its
own with more fields). `task_id` is stable across builds with the same seed and unique across splits; `answer` is
the ground truth the environment's :meth:`Episode.correct` compares with; `min_calls` (the answer included) is what
the efficiency component measures against; `level` (1, 2, ...) and `family` group the metrics; `template_seen`
says whether the question's wording occurs in training (False marks the held-out wordings of the test split).

The checks the pipeline runs on any environment before it trusts it (:mod:`pipeline.envs.checks`): the class has
every required method; every tool schema is a valid JSON Schema of an object; tool names are unique and ``answer`` is
one of them; no task id is shared between splits; the expert, replayed through the pipeline's runner, reaches the top
score on every task it is checked on; a tool that raises becomes an error observation, never a crash.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

ANSWER_TOOL = "answer"  # every environment has it: its one parameter `value` (a string) ends the episode


class ToolError(Exception):
    """A tool call that failed in a way the policy can see and recover from (its message becomes the observation)."""


class SafetyViolation(ToolError):
    """A call the environment's safety rules refuse (never executed); scored as a safety violation."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, what it does, and a JSON Schema of its parameters (an object), as in OpenAI's function
    calling. `writes` marks a tool that can change the world (shown to nobody; used by safety probes and docs)."""

    name: str
    description: str
    parameters: dict
    writes: bool = False

    def signature(self) -> str:
        """The compact form the prompt lists, e.g. ``lookup(name, field)``: the schema's properties in order."""
        return f"{self.name}({', '.join(self.parameters.get('properties', {}))})"


# A blank answer is no answer: `"value": ""` (or only whitespace) breaks the schema, so the call is an invalid-parameters
# error that costs a step and the episode goes on.
ANSWER_SPEC = ToolSpec(ANSWER_TOOL, "give the final answer and end the episode",
                       {"type": "object", "properties": {"value": {"type": ["string", "number"], "pattern": "\\S"}},
                        "required": ["value"], "additionalProperties": False})


@runtime_checkable
class TaskFields(Protocol):
    """What the pipeline reads of a task (see the module docstring)."""

    task_id: str
    split: str
    level: int
    family: str
    question: str
    answer: str
    min_calls: int
    template_seen: bool

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class Task:
    """A ready-made task for environments that need nothing else: their own fields go into `data`."""

    task_id: str
    split: str
    level: int
    question: str
    answer: str
    family: str = ""
    min_calls: int = 2
    template_seen: bool = True
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> "Task":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class BuildOptions(BaseModel):
    """Base of an environment's build options (`build_env.options` in params.yaml); unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class BuildRequest:
    """What `build_env` asks an environment to generate."""

    seed: int
    tasks_per_split: dict[str, int]  # {"train": n, "validation": n, "test": n}
    level_mix: dict[int, float]  # relative weight of each level in every split
    options: BuildOptions  # the environment's own options, validated by its `Options` model


@dataclass
class BuildResult:
    """What :meth:`Environment.build` returns: the tasks per split (the pipeline writes and validates them) and counts
    of the world it wrote (reported in `metrics/build_env.json`)."""

    tasks: dict[str, list]
    counts: dict[str, int] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)  # world files to checksum in the metrics


class ScriptedPolicy(Protocol):
    """A policy that writes action text from what the pipeline shows it (the expert, a random baseline)."""

    def reset(self, task: Any) -> None: ...

    def act(self, obs: dict, info: dict) -> str: ...


class Episode(ABC):
    """One episode of one task: a private copy of the world that no other episode sees."""

    #: the ground truth of this episode (the task's `answer` unless the episode redraws values)
    truth: str

    @abstractmethod
    def call(self, tool: str, args: dict) -> str:
        """Execute a tool other than ``answer``; `args` already satisfy the tool's schema. Returns the result text.
        Raise :class:`ToolError` for a failure the policy should see, :class:`SafetyViolation` for a refused call;
        any other exception is reported to the policy as the tool failing (the episode goes on)."""

    def correct(self, answer: str) -> bool:
        """Whether `answer` is right; by default an exact match after stripping whitespace."""
        return answer.strip() == str(self.truth).strip()

    def close(self) -> None:
        """Release the episode's resources."""


class Environment(ABC):
    """A loaded world that serves episodes (see the module docstring for the contract)."""

    #: registry name, written into every task and metric of a mixed run
    name: ClassVar[str]
    #: one line for `agentrl envs`
    description: ClassVar[str] = ""
    #: the build options model (`build_env.options`)
    Options: ClassVar[type[BuildOptions]] = BuildOptions
    #: the levels its tasks use
    levels: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)
    #: the demonstration flaws its expert can inject (besides "none"); see build_env.demos
    flaws: ClassVar[tuple[str, ...]] = ()

    # ----------------------------------------------------------------------------------------------------- data
    @classmethod
    @abstractmethod
    def build(cls, out_dir: Path, request: BuildRequest) -> BuildResult:
        """Generate the world into `out_dir` (which exists and is empty) and the tasks of every split."""

    @classmethod
    @abstractmethod
    def load(cls, world_dir: Path) -> "Environment":
        """Load a world written by :meth:`build`. Raise ValueError or FileNotFoundError naming what is wrong."""

    @classmethod
    def default(cls) -> "Environment":
        """A small world for tests and `check_env`: built in a temporary folder from the default options."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            cls.build(Path(tmp), BuildRequest(0, {"train": 8, "validation": 4, "test": 4}, {lv: 1.0 for lv in cls.levels},
                                              cls.Options()))
            return cls.load(Path(tmp))

    @abstractmethod
    def tools(self) -> list[ToolSpec]:
        """Every tool, ``answer`` included (use :data:`ANSWER_SPEC`)."""

    @abstractmethod
    def task_from_dict(self, row: dict) -> Any:
        """A task from one task-file record (already checked to be a JSON object with the :class:`TaskFields` keys)."""

    @abstractmethod
    def open_episode(self, task: Any, rng, randomize_values: bool = False) -> Episode:
        """A new episode of `task`; `rng` (a numpy Generator) is the episode's only source of randomness. With
        `randomize_values` (params `env.randomize_values`) the environment may redraw the values the task's answer
        depends on in this episode's private copy and set the episode's `truth` accordingly (or ignore it)."""

    def tools_for(self, task: Any) -> list[ToolSpec]:
        """The tools offered in `task`'s episodes (a mixed environment offers each task only its own environment's)."""
        return self.tools()

    def required_tools(self, task: Any) -> list[str]:
        """Tools a correct process must call successfully, in this order (the rule verifier checks it); [] checks
        only that the answer comes last."""
        return []

    def close(self) -> None:
        """Release the world."""

    # ------------------------------------------------- optional: hooks of the capabilities (pipeline.envs.capabilities)
    def expert(self, flaw: str = "none", rng=None) -> ScriptedPolicy | None:
        """A scripted expert that solves every task in `min_calls` calls (with `flaw`, one imperfection); None if the
        environment has none (then `build_env` writes no demonstrations and adaptation needs data of its own)."""
        return None

    def random_policy(self, rng) -> ScriptedPolicy | None:
        """A random baseline (well-formed calls with random arguments), or None."""
        return None

    def validate(self, world_dir: Path, tasks: dict[str, list[dict]], demos: list[dict] | None) -> list:
        """Great Expectations reports (:class:`pipeline.core.validation.ValidationReport`) on the data `build_env`
        wrote: the world files, the task records of every split and the demonstrations, as read back from disk. The
        pipeline runs its own checks (task keys, ids unique across splits) besides these."""
        return []

    def check_task_records(self, records: list[dict], dataset: str):
        """A Great Expectations report on task records read from a file at a phase's boundary, or None (only the
        pipeline's own checks of the keys)."""
        return None

    def request_task(self, request: dict) -> Any:
        """The task of one serving request (a JSON object: at least a "question"); raise ValueError naming what is
        wrong. The default accepts complete task records only."""
        missing = [k for k in TaskFields.__annotations__ if k not in request]
        if missing:
            raise ValueError(f"environment {self.name!r} serves complete task records; missing {missing}")
        return self.task_from_dict(request)

    def check_episodes(self, records: list[dict], kind: str, dataset: str, env_cfg, require_tokens: bool = False):
        """A Great Expectations report on episode records (`kind`: "trajectories" for training rollouts,
        "evaluation" for evaluation episodes; `require_tokens`: rollout records must carry token ids), or None (not
        checked beyond the pipeline's own)."""
        return None

    def reference_calls(self, task: Any) -> list[tuple[str, dict]] | None:
        """The calls of a correct process for `task` with their true parameters, ``answer`` last (what adaptation's
        tool-selection and parameter metrics compare with), or None (those metrics are then not reported)."""
        return None

    def same_answer(self, given: str, truth: str) -> bool:
        """Whether two answers are the same (what :meth:`Episode.correct` uses by default)."""
        return str(given).strip() == str(truth).strip()

    def leaks_heldout(self, task: Any) -> bool:
        """Whether a task from outside (``data/incoming``) names what validation and test hold out of training."""
        return False

    def heldout_slices(self, task: Any) -> list[str]:
        """Names of what validation and test hold out of training that `task` exercises (an unseen name, value or id
        of some kind); `evaluate` reports success per slice (`per_slice`), beside the held-out wordings that
        `template_seen` marks. [] by default."""
        return []

    def verify_task(self, task: Any) -> bool:
        """Whether the world gives a task from outside its stated answer (False drops it from training)."""
        return True

    def generate_tasks(self, weakness: dict, n: int, seed: int, options: BuildOptions | None = None) -> list | None:
        """Up to `n` fresh training tasks of the slice `weakness` ({"family", "level", "template_id"}, any subset),
        drawn with `seed` (same seed, same tasks), naming only training entities and never a test-only wording
        (adversarial task generation, `train.task_generation`); None when the environment cannot generate."""
        return None

    # drift checks (pipeline.check_drift): each optional; a check the environment cannot feed is skipped, saying so
    def sample_tasks(self, split: str, n: int, level_mix: dict[int, float], seed: int, options: BuildOptions) -> list:
        """`n` fresh tasks of `split` drawn as :meth:`build` draws them, with another `seed` (the drift checks'
        reference sample and their false-alarm calibration), or None when the environment cannot draw more."""
        return None

    def value_shifted(self, seed: int) -> "Environment | None":
        """A copy of the world whose values have shifted (the drift checks' planted `value_shift`), or None."""
        return None

    def entity_table(self):
        """A pandas DataFrame of the world's entities indexed by the names tasks carry in `entities`; each numeric
        column is one of the task drift check's per-entity features (``entity_<column>``), or None."""
        return None

    def entity_names(self) -> set[str] | None:
        """Every entity name of the world (tasks naming others are reported as unknown), or None."""
        return None

    def drift_features(self, record: dict) -> dict[str, float]:
        """Numeric features of one episode record that its drift checks should watch, beyond the pipeline's own."""
        return {}

    def vocabulary(self) -> list[str]:
        """Words the policy must copy exactly from questions into calls (field names, units), drilled in continued
        pre-training's word drills. (A world folder may also hold `corpus.jsonl`, documents {"text": ...} that the
        built-in tokenizer reads, and `entities.json`, {kind: {name: split}} for the drills and name augmentation:
        :mod:`pipeline.adapt.entity_source`.)"""
        return []

