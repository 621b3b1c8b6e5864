"""The deployable policy: a solver that answers tasks with the tools, and the MLflow pyfunc model that wraps it.

What a registered model holds (``mlflow.pyfunc`` flavour, saved by :func:`save_pyfunc`):

- ``artifacts/policy/``: the Hugging Face folder of the policy (fp32 weights, tokenizer, ``policy.json``);
- ``artifacts/world/``: the world the tools act on, every file of the folder the environment built (the shop's
  ``world.sqlite``, ``corpus.jsonl``, ``entities.json``; any environment's own): a model solves tasks against the
  world it was trained and tested with, so it is packaged with it;
- ``artifacts/serving.json``: the environment and rollout settings and the serving precision.

Loading needs the installed ``agentrl-pipeline`` package (``pip_requirements`` names it): the environment, the tools
and the rollout engine are its code. Nothing else of this repository is read: no ``params.yaml``, no ``data/``.
The precision is applied at load (:func:`pipeline.deploy.quantize.make_variant` from the fp32 weights), so one
artefact serves fp32, bf16 or int8.

``predict`` takes tasks -- a question string, a mapping with ``question`` (and optionally ``task_id``,
``allowed_writes``, ``answer`` as ground truth, or every task field), a list of those, or a pandas DataFrame with a
``question`` column -- and returns one record per task: ``answer``, ``trajectory`` (each step's action and
observation), ``calls`` (tool, params, outcome), ``n_calls``, ``n_violations``, ``truncated``, and ``success``,
``return`` and ``step_rewards`` (the reward the environment paid at each step; all three None unless a ground-truth
answer came with the task: the reward scores the answer against it). Episodes are greedy; a task without
``allowed_writes`` may not write (an ``update`` call is refused as a safety violation), and every episode writes only to
its private in-memory copy of the database.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlflow.pyfunc

from pipeline.core.errors import AgentRLError

SERVING_JSON = "serving.json"


class RequestError(ValueError):
    """A task request that cannot be served; the message says why (the HTTP server answers 422 with it)."""


# ------------------------------------------------------------------------------------------------------- requests
def parse_task(obj: Any, max_question_chars: int, world):
    """The task of one request for the served environment `world` (its :meth:`request_task`): a string is a
    question; :class:`RequestError` names what is wrong."""
    if isinstance(obj, str):
        obj = {"question": obj}
    if not isinstance(obj, dict):
        raise RequestError(f"a task must be a JSON object with a 'question' (or a string), got {type(obj).__name__}")
    try:
        task = world.request_task(obj)
    except (ValueError, TypeError, KeyError) as exc:
        raise RequestError(str(exc)) from None
    if len(task.question) > max_question_chars:
        raise RequestError(f"'question' has {len(task.question)} characters, more than the {max_question_chars} "
                           f"allowed")
    if not task.question.strip():
        raise RequestError("'question' must be a non-empty string")
    return task


def _has_truth(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("answer") is not None


def normalize_inputs(model_input: Any) -> list:
    """A list of task requests from what ``predict`` receives (string, mapping, list, or DataFrame)."""
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas is a dependency of mlflow
        pd = None
    if pd is not None and isinstance(model_input, pd.DataFrame):
        return [{k: v for k, v in row.items() if not (isinstance(v, float) and v != v)}  # drop NaN (missing)
                for row in model_input.to_dict(orient="records")]
    if hasattr(model_input, "tolist") and not isinstance(model_input, (str, dict)):  # numpy arrays
        model_input = model_input.tolist()
    if isinstance(model_input, dict):
        cols = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in model_input.items()}
        lengths = {len(v) for v in cols.values() if isinstance(v, list)}
        if "question" in cols and isinstance(cols["question"], list) and len(lengths) == 1 and \
                all(isinstance(v, list) for v in cols.values()):
            # columnar input, as MLflow's scoring server passes {"inputs": {"question": [...]}} or records
            return [{k: v[i] for k, v in cols.items()} for i in range(lengths.pop())]
        return [model_input]
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, list):
        # MLflow's scoring server turns every value of {"inputs": [{...}]} into a numpy array (0-d for a scalar)
        return [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in r.items()} if isinstance(r, dict) else r
                for r in model_input]
    raise RequestError(f"expected a task, a list of tasks or a DataFrame, got {type(model_input).__name__}")


# --------------------------------------------------------------------------------------------------------- solver
class PolicySolver:
    """Loads a packaged policy and answers batches of tasks with the batched rollout engine.

    Args:
        policy_dir: Hugging Face folder (save_policy); world_dir: the world's files; settings: the serving.json
        content (``env``, ``rollout``, ``precision``, ``quantization``, ``seed``).
    """

    def __init__(self, policy_dir: str | Path, world_dir: str | Path, settings: dict):
        from pipeline.deploy.config import QuantizationConfig
        from pipeline.deploy.quantize import make_variant
        from pipeline.envs.config import EnvConfig
        from pipeline.envs.registry import open_environment
        from pipeline.policy.config import RolloutConfig
        from pipeline.policy.model import load_policy
        from pipeline.policy.rollout import RolloutEngine

        self.settings = settings
        self.precision = settings.get("precision", "fp32")
        model, self.tokenizer, self.meta = load_policy(policy_dir)
        self.model = make_variant(model, self.precision, QuantizationConfig(**settings.get("quantization", {})))
        del model
        self.env_cfg = EnvConfig(**settings.get("env", {}))
        try:
            self.runtime = open_environment(self.env_cfg.name, world_dir)
        except AgentRLError as exc:
            raise AgentRLError(f"packaged world: {exc}") from None
        rollout = RolloutConfig(**settings.get("rollout", {}))
        self.rollout_cfg = rollout.model_copy(update={"dtype": "fp32"})  # the variant's own dtype (see quantize.py)
        self.seed = int(settings.get("seed", 0))
        self.engine = RolloutEngine(self.model, self.tokenizer, self.runtime, self.env_cfg, self.rollout_cfg)

    def solve_tasks(self, tasks: list, seeds: list[int] | None = None, truth: list[bool] | None = None) -> list[dict]:
        """Greedy episodes for parsed tasks (one engine batch); `truth[i]` False hides success (no ground truth)."""
        if not tasks:
            return []
        seeds = seeds if seeds is not None else [self.seed] * len(tasks)
        records = self.engine.run(tasks, seeds, greedy=True)
        truth = truth if truth is not None else [True] * len(tasks)
        return [response(r, t) for r, t in zip(records, truth)]

    def predict(self, model_input: Any, max_question_chars: int = 1000) -> list[dict]:
        reqs = normalize_inputs(model_input)
        tasks = [parse_task(r, max_question_chars, self.runtime) for r in reqs]
        seeds = [int(r["seed"]) if isinstance(r, dict) and r.get("seed") is not None else self.seed for r in reqs]
        truth = [(isinstance(r, dict) and set(r) >= {"plan", "answer"}) or _has_truth(r) for r in reqs]
        return self.solve_tasks(tasks, seeds, truth)

    def close(self) -> None:
        self.runtime.close()


def response(rec: dict, has_truth: bool = True) -> dict:
    """The public part of an episode record."""
    return {"task_id": rec["task_id"], "answer": rec["answer"],
            "success": rec["success"] if has_truth else None,
            "return": rec["return"] if has_truth else None,
            "step_rewards": rec["step_rewards"] if has_truth else None,
            "trajectory": rec["steps"], "calls": rec["calls"], "n_calls": rec["n_calls"],
            "n_violations": rec["n_violations"], "truncated": rec["truncated"]}


# ----------------------------------------------------------------------------------------------------- the pyfunc
class AgentPolicyModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: ``predict(tasks) -> [{answer, trajectory, ...}]`` (see the module docstring)."""

    # MLflow wraps a PythonModel's `predict` for validation against its type hints and, without hints, warns when
    # the class is defined; the warning stood beside the one `error:` line of `agentrl serve` and `agentrl promote`.
    # The requests are checked by PolicySolver.predict itself (each bad field with its own 4xx), so MLflow's own
    # switch for models that do their own checking turns the wrapper, and the warning, off.
    _skip_type_hint_validation = True

    def load_context(self, context):
        settings = json.loads(Path(context.artifacts["serving"]).read_text())
        self.solver = PolicySolver(context.artifacts["policy"], context.artifacts["world"], settings)

    def predict(self, context, model_input, params=None):
        try:
            return self.solver.predict(model_input)
        except RequestError as exc:
            raise AgentRLError(f"bad request: {exc}") from None


def serving_settings(env_cfg, rollout_cfg, precision: str, quantization, seed: int) -> dict:
    return {"env": env_cfg.model_dump(), "rollout": rollout_cfg.model_dump(), "precision": precision,
            "quantization": quantization.model_dump(), "seed": seed}


def save_pyfunc(path: str | Path, policy_dir: str | Path, world_dir: str | Path, settings: dict) -> Path:
    """Write the pyfunc model folder at `path` (MLmodel, the pickled wrapper, the artefacts above)."""
    policy_dir, world_dir, path = Path(policy_dir), Path(world_dir), Path(path)
    if not world_dir.is_dir() or not any(world_dir.iterdir()):
        raise AgentRLError(f"cannot package the world: {world_dir} is missing or empty (run build-env first)")
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp)
        shutil.copytree(policy_dir, staged / "policy")
        shutil.copytree(world_dir, staged / "world")
        (staged / SERVING_JSON).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        mlflow.pyfunc.save_model(
            path=str(path), python_model=str(Path(__file__).with_name("pyfunc_entry.py")),
            artifacts={"policy": str(staged / "policy"), "world": str(staged / "world"),
                       "serving": str(staged / SERVING_JSON)},
            pip_requirements=pip_requirements(),  # given: inferring them spawns a subprocess (5-7 s)
        )
    return path


def pip_requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    reqs = []
    for name in ("agentrl-pipeline", "torch", "transformers", "mlflow"):
        try:
            reqs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            reqs.append(name)
    return reqs


def load_solver(model_uri: str):
    """Load a registered (or any) pyfunc model URI and return its :class:`PolicySolver`; a URI that does not resolve
    or is not an agentrl policy is an :class:`AgentRLError`."""
    from mlflow.exceptions import MlflowException

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        loaded = mlflow.pyfunc.load_model(model_uri)
    except (MlflowException, OSError) as exc:
        raise AgentRLError(f"cannot load model {model_uri!r}: {str(exc).splitlines()[0][:300]}") from None
    inner = loaded.unwrap_python_model()
    solver = getattr(inner, "solver", None)
    if not isinstance(solver, PolicySolver):
        raise AgentRLError(f"{model_uri!r} is not an agentrl policy model (its pyfunc has no PolicySolver)")
    return solver


__all__ = ["PolicySolver", "RequestError", "load_solver", "normalize_inputs", "parse_task", "response",
           "save_pyfunc", "serving_settings"]
