"""The `agentrl` command line: one command per phase, `run` for the whole pipeline, `schedule` for the retraining
deployment, `stages` for the phase graph.

It lives in `flows/`, next to the Prefect flows it starts: the layer above the library, which imports neither
(tests/test_layering.py). Every command imports its phase only when it runs, so `agentrl --help` stays fast; Prefect
is imported by `agentrl run` and `agentrl schedule` alone, after its state directory has been pointed into the repo.

The commands are declared once, in :data:`COMMANDS` (name, help, arguments, what runs, whether it holds the repository
lock and acts in its project's folder; the parts are in flows/commands.py); the parser and the dispatch are built from
that table.

Errors the user can fix (a bad `params.yaml`, a corrupt task file, a missing phase output: `ConfigError` and every
`AgentRLError`) are printed as ``error: <message>`` and exit with status 2, without a traceback, and so is a tracking
server that stopped answering (:func:`pipeline.core.tracking.store_failure`); anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from flows.commands import PARAMS, Arg, Command, OneOf, always
from flows.stop_signals import interrupt_on_stop, restore
from pipeline.core.config import ConfigError
from pipeline.core.errors import AgentRLError
from pipeline.core.tracking import require_tracking, tracking_enabled

USER_ERROR = 2
# When set (the Prefect flow sets it for each stage it launches), every `agentrl` command appends one JSON line
# {"command", "seconds", "rc", "peak_rss_mib"} to this file: the stage's own time, which the flow subtracts from its
# wall time to report the orchestration overhead (DVC, Prefect and MLflow bookkeeping), and the peak resident memory
# of the command: its own process with the parts it ran in child processes (pipeline.core.isolation), or its largest other
# child (a DeepSpeed rank), whichever is larger.
STAGE_TIMES_ENV = "AGENTRL_STAGE_TIMES"


def enter_project(args: argparse.Namespace) -> None:
    """Act on the project that `--params` belongs to, whatever the working directory.

    A project is a folder with its own dvc.yaml and params.yaml (the repository root, each folder under `projects/`):
    its phases read and write data/, models/, metrics/ and checkpoints/ relative to that folder, as `agentrl run` runs
    them. When the params file lies in such a folder and it is not the working directory, the command moves there
    (and says so on stderr) instead of writing one project's outputs into another's. A params file in a folder
    without dvc.yaml (a file of overrides a test or a script wrote) keeps the working directory as the project.
    """
    params = Path(args.params)
    folder = params.resolve().parent
    if not (folder / "dvc.yaml").is_file() or folder == Path.cwd().resolve():
        return
    args.params = str(params.resolve())
    os.chdir(folder)
    print(f"agentrl {args.command}: acting on the project in {folder} (the folder of {params})", file=sys.stderr)


def _cmd_run(args: argparse.Namespace) -> int:
    started = time.time()  # the reported wall time includes Prefect's start-up
    import flows

    params = flows.project_params(args.params)  # bad input fails here, before Prefect starts a server
    require_tracking("agentrl run (its MLflow parent run and the registry's promotion gate)")
    flows.use_project_prefect_home(params.parent)  # must happen before the first `import prefect`
    from flows.pipeline_flow import StageFailed, pipeline_flow

    try:
        pipeline_flow(params_path=str(params), stages=args.stage, push=args.push, started_at=started)
    except StageFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    import flows

    params = flows.project_params(args.params)
    require_tracking("agentrl schedule (the champion's data version and the promotion gate)")
    root = params.parent
    flows.use_project_prefect_home(root)  # must happen before the first `import prefect`
    if args.once:
        from flows.pipeline_flow import StageFailed
        from flows.retrain_flow import retrain_flow

        try:
            retrain_flow(project=str(root), incoming=args.incoming, force=args.force)
        except StageFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.force:
        raise AgentRLError("--force applies to --once; a served run is forced with "
                           "`prefect deployment run agentrl-retrain/<name> --param force=true`")
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:  # PREFECT_API_URL, from the environment or a Prefect profile
        raise AgentRLError(
            "agentrl schedule serves the retraining deployment on a Prefect server, so that the schedule and "
            "`prefect deployment run` reach it: start one (`prefect server start --host 127.0.0.1 --port 4200`) and "
            "`export PREFECT_API_URL=http://127.0.0.1:4200/api`; or run one retraining now with `agentrl schedule --once`"
        )
    from flows.retrain_flow import serve_retraining

    serve_retraining(root, name=args.name, cron=args.cron)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from flows.report import write_report

    print(f"wrote {write_report(Path(args.params).resolve().parent, args.out, args.run_id)}")
    return 0


def _cmd_stages(args: argparse.Namespace) -> int:
    from pipeline.core.graph import load_stages

    for i, stage in enumerate(load_stages(args.dvc_yaml), 1):
        deps = ", ".join(stage.deps) or "-"
        outs = ", ".join(stage.outs) or "-"
        print(f"{i}. {stage.name}: {stage.cmd}\n   deps: {deps}\n   outs: {outs}")
    return 0


def _cmd_envs(args: argparse.Namespace) -> int:
    """`agentrl envs`: every environment one can name in `env.name`, where it comes from, and whether it loads."""
    from pipeline.envs.registry import list_environments

    rows = list_environments()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "ok " if r["ok"] else "BAD"
        print(f"{r['name']:<{width}}  {mark} {r['source']:<11}  {r['target']}\n{'':<{width}}      {r['description']}")
    print("name one in params.yaml `env.name`, or give module:Class (docs/environments.md)")
    return 0 if all(r["ok"] for r in rows) else 1


def _with_repair(args: argparse.Namespace) -> bool:
    return args.repair  # a listing writes nothing; a repair moves aliases


def _with_once(args: argparse.Namespace) -> bool:
    return args.once  # served, `schedule` would hold the lock for good; its flow runs' stages take it each


# Every `agentrl` command, in the order `agentrl --help` lists them. Adding a command is one entry here (its parts are
# in flows/commands.py):
#   Command("name", help="one line for `agentrl --help`", description="the paragraph of `agentrl name --help`",
#           run="pipeline.<phase>.main:main",  # called with the parsed arguments `passes` names, in that order
#           arguments=(PARAMS, Arg("--out", metavar="FILE", help="...")),  # Arg takes what add_argument takes
#           passes=("params", "out"),  # default: arguments (PARAMS,), passes ("params",)
#           project=True,  # acts on the project its params file belongs to (enter_project)
#           locks=always),  # writes the project's outputs or moves registry aliases: holds the repository lock
# A command whose work is more than one library call names a handler instead: a function of the parsed arguments
# that returns the exit status (as `run` and `schedule` below). The parser, the repository lock and the project
# folder all follow from the entry; place a new one beside the commands of its kind.
COMMANDS: dict[str, Command] = {command.name: command for command in (
    Command(
        "envs",
        help="list the environments: built-in and installed (entry-point group agentrl.environments)",
        description="List every environment that `env.name` can name: the built-in ones and those installed packages "
        "register in the entry-point group agentrl.environments, with whether each loads and keeps the contract.",
        run=_cmd_envs, arguments=(),
    ),
    Command(
        "build-env",
        help="build the environment's data: database, documents, task splits, demonstrations",
        description="Generate the SQLite world, the document corpus, the train/validation/test task splits and the "
        "demonstrations under data/, validate them, and write metrics/build_env.json. "
        "Reads the `env` and `build_env` sections of the params file.",
        run="pipeline.build_env.main:main", project=True, locks=always,
    ),
    Command(
        "adapt",
        help="adapt the base model: tokenizer, optional continued pre-training, adapter fine-tuning, capability gate",
        description="Build (or load) the base model, optionally continue pre-training on the environment's corpus, "
        "fine-tune it on the demonstrations with adapters, evaluate its capabilities on the validation split, apply "
        "the capability gate, and save models/adapted and metrics/adapt.json. Reads `env`, `model`, `rollout`, `adapt`.",
        run="pipeline.adapt.main:main", project=True, locks=always,
    ),
    Command(
        "reward-model",
        help="train the learned verifier (success and process soundness) on demonstrations and the policy's rollouts",
        description="Replay the demonstrations and sample rollouts of the adapted policy on training tasks, label them "
        "with the rule verifier and reward, fit the learned verifier, and save models/reward_model and "
        "metrics/reward_model.json (held-out AUC, accuracy, calibration). Reads `reward_model`, `env`, `rollout`.",
        run="pipeline.reward_model.main:main", project=True, locks=always,
    ),
    Command(
        "train",
        help="RL training from the adapted model with DeepSpeed (train.num_ranks processes)",
        description="Train the adapted policy with RL (PPO or a group baseline) inside DeepSpeed engines launched with "
        "the deepspeed launcher; write the best policy to models/policy, metrics/train.json and "
        "metrics/train_curve.csv. Resumes from checkpoints/train when present. Reads `env`, `rollout`, `train`.",
        run="pipeline.train.main:main", project=True, locks=always,
    ),
    Command(
        "check-drift",
        help="drift and state-representation checks (train/serve consistency, data and behaviour drift)",
        description="Compare the current data (data/incoming/ or the validation split) and the policy's behaviour "
        "with the reference it was trained on, check that training and serving preprocess observations identically, "
        "and write metrics/drift.json with a verdict per check. Reads `check_drift`, `env`, `rollout`.",
        run="pipeline.check_drift.main:main", project=True, locks=always,
    ),
    Command(
        "deploy",
        help="quantise the policy, check parity, register it as challenger, run the promotion gate",
        description="Measure fp32, bf16 and int8 variants of models/policy on the test split (success, latency per "
        "action, throughput, size), check quantisation parity, log the policy to MLflow as a pyfunc with its world, "
        "register it as a new version with alias `challenger`, and (deploy.promote) run the promotion gate. Writes "
        "metrics/deploy.json. Reads `deploy`, `env`, `rollout`.",
        run="pipeline.deploy.main:main", project=True, locks=always,
    ),
    Command(
        "promote",
        help="run the promotion gate on a model version by hand (challenger -> champion)",
        description="Judge a registered version (default: the one with alias `challenger`) with the promotion gate: "
        "capability, safety, drift and consistency verdicts, quantisation parity, and a paired test against the "
        "champion on the same test tasks. Every check is tagged on the version; on a pass `champion` moves to it. "
        "Exits 0 when promoted, 1 when rejected. Reads `deploy`, `env`, `rollout`.",
        run="pipeline.deploy.main:promote_main", project=True, locks=always, verdict=True,
        passes=("params", "version", "alias", "dry_run", "require_live"),
        arguments=(
            PARAMS,
            OneOf(Arg("--version", type=int, metavar="N", help="model version to judge"),
                  Arg("--alias", metavar="A", help="alias of the version to judge (default: challenger)")),
            Arg("--dry-run", action="store_true", help="show the decision and its reasons; write nothing"),
            Arg("--require-live", action="store_true",
                help="require the live check: the version served as a shadow or canary challenger and not worse "
                     "than the champion on live traffic (tag gate.live pass; also deploy.gate.require_live)"),
        ),
    ),
    Command(
        "rollback",
        help="point the `champion` alias back to the previous champion",
        description="Move the registered model's `champion` alias to the version that was champion before the "
        "current one (the history is the registered-model tag agentrl.champion_history). Reads `deploy`.",
        run="pipeline.deploy.main:rollback_main", project=True, locks=always,
    ),
    Command(
        "registry",
        help="check the registered model for half-finished alias moves and orphan versions (--repair fixes them)",
        description="List what stopped commands or writers that skip the registry lease leave in the registered "
        "model: a champion that did not pass its gate or is missing from the history, a challenger whose passed "
        "promotion never moved the champion, versions whose gate.decision says passed or promoted but that never "
        "became champion, gate tags written part-way, stale lease tickets. With --repair, fix them under the lease "
        "(never promoting a version the gate did not pass, never deleting a version). Exits 0 when nothing is left "
        "to report, 1 otherwise. Reads `deploy`.",
        run="pipeline.deploy.registry_check:main", passes=("params", "repair", "min_age"), verdict=True,
        project=True, locks=_with_repair,
        arguments=(
            Arg("action", nargs="?", default="check", choices=["check"],
                help="what to do (check, the default: list, and with --repair fix)"),
            PARAMS,
            Arg("--repair", action="store_true", help="repair what is listed, under the registry lease"),
            Arg("--min-age", type=float, default=900.0, metavar="S",
                help="leave versions younger than S seconds alone: a deploy may still be publishing them "
                     "(default: %(default)s)"),
        ),
    ),
    Command(
        "serve",
        help="serve a registered policy over HTTP (dynamic batching, cache, limits)",
        description="Load models:/<deploy.model_name>@champion (or --model-uri) and serve POST /solve (a task in, "
        "the answer and trajectory out), GET /health, /ready and /stats. Concurrent requests are batched; identical "
        "requests are answered from a cache; request size and rate are limited (deploy.serve). Binding a "
        "non-loopback address requires an API key in $AGENTRL_SERVE_API_KEY (deploy.serve.api_key_env); with a key "
        "set, requests need 'Authorization: Bearer <key>'. Reads `deploy`.",
        run="pipeline.deploy.main:serve_main", project=True, passes=("params", "model_uri", "host", "port"),
        arguments=(
            PARAMS,
            Arg("--model-uri", metavar="URI", help="any MLflow model URI (default: models:/NAME@champion)"),
            Arg("--host", metavar="HOST", help="interface to listen on (default: deploy.serve.host; a "
                "non-loopback one needs the API key)"),
            Arg("--port", type=int, metavar="PORT", help="port (default: deploy.serve.port)"),
        ),
    ),
    Command(
        "snapshot",
        help="snapshot captured traffic into data/production/snapshot (validated, DVC-tracked)",
        description="Read the sealed segments of the capture folder, join people's feedback, turn the requests the "
        "environment can verify into tasks, check the drift against the training data (the alarm the scheduled "
        "retraining reads), write data/production/snapshot whole and `dvc add` it. Reads `deploy`, `env`.",
        run="flows.snapshot:run_snapshot", project=True, locks=always, passes=("params", "capture"),
        arguments=(PARAMS, Arg("--capture", default=None, metavar="DIR",
                               help="capture folder to read (default: deploy.serve.capture.dir)")),
    ),
    Command(
        "evaluate",
        help="evaluate the SFT and RL policies on every split: metrics with intervals, overfitting flags",
        description="Evaluate the SFT policy (models/adapted) and the RL policy (models/policy) on a subset of the "
        "train split and on the validation and test splits: success, return and reward components, tool calls and "
        "safety violations, overall and per level, with bootstrap confidence intervals. Flag overfitting (train/"
        "validation gap), failure on unseen question templates and rigid behaviour (low behaviour diversity and few "
        "distinct solutions across seeds). Write metrics/evaluate.json and metrics/evaluate_success.csv, and log a "
        "report to MLflow. Reads `evaluate`, `env`, `rollout`.",
        run="pipeline.evaluate.main:main", project=True, locks=always,
    ),
    Command(
        "report",
        help="write a markdown report card of the last run (default: metrics/report.md)",
        description="Each phase's headline figures, the gate's decision, times, memory, the MLflow run and the plots "
        "of the project's last run, from metrics/*.json and its MLflow run (flows/report.py).",
        run=_cmd_report,
        arguments=(
            PARAMS,
            Arg("--out", default=None, metavar="FILE", help="where to write it (default: metrics/report.md)"),
            Arg("--run-id", default=None, metavar="ID", help="the MLflow parent run (default: the last run's)"),
        ),
    ),
    Command(
        "eval",  # takes its own paths for the policy, tasks and output: not a project command
        help="evaluate a policy on a task file",
        description="Run a policy on every task of a task file (JSON Lines, the schema build-env writes) and write "
        "success rate, mean return, mean reward components, mean tool calls and safety violations, overall and per "
        "level, as JSON. A task file that breaks the schema is refused before anything runs.",
        run="pipeline.policy.episodes:main", passes=("policy", "tasks", "out", "params", "seed"),
        arguments=(
            Arg("--policy", required=True, metavar="POLICY",
                help="'expert', 'random', or a model directory (e.g. models/adapted, models/policy)"),
            Arg("--tasks", required=True, metavar="FILE", help="task file (JSON Lines), e.g. data/tasks/test.jsonl"),
            Arg("--out", required=True, metavar="FILE.json", help="where to write the results"),
            PARAMS,
            Arg("--seed", type=int, default=0, metavar="N",
                help="seed of the policy and episodes (default: %(default)s)"),
        ),
    ),
    Command(
        "run",  # DVC runs every stage in the folder of dvc.yaml; the stages it launches run inside its lock
        help="run the whole pipeline (Prefect flow over the dvc.yaml stages)",
        description="Run every stage of dvc.yaml in graph order as a Prefect flow on an embedded local server (state "
        "under .prefect/), each through `dvc repro --single-item`, so up-to-date stages are skipped. The stages read "
        "the params.yaml next to dvc.yaml; to try other values, edit it or use `dvc exp run -S key=value`.",
        run=_cmd_run, locks=always, only_known=False,
        arguments=(
            PARAMS,
            Arg("--stage", action="append", metavar="NAME",
                help="run only this stage (repeatable; run in graph order); default: every stage"),
            Arg("--push", action="store_true",
                help="`dvc push` data and models to the default DVC remote at the end (retried when it fails)"),
        ),
    ),
    Command(
        "schedule",
        help="serve the scheduled retraining deployment of prefect.yaml (or run one retraining now: --once)",
        description="Serve the retraining deployment defined in prefect.yaml (its cron schedule and parameters) from "
        "this process with Prefect's flow.serve, against the Prefect server in PREFECT_API_URL, until interrupted. "
        "Each run checks data/incoming/*.jsonl for drift against the data the champion was trained on, retrains and "
        "re-gates (the pipeline stages from the first that reads the new data on) when drift is found or when forced, and otherwise records that "
        "nothing was needed. Trigger a run by hand with `prefect deployment run agentrl-retrain/<name>`.",
        run=_cmd_schedule, locks=_with_once,
        arguments=(
            PARAMS,
            Arg("--name", metavar="NAME", help="deployment of prefect.yaml to serve (default: the retraining one)"),
            Arg("--cron", metavar="EXPR", help="override the deployment's cron schedule, e.g. '*/30 * * * *'"),
            Arg("--once", action="store_true", help="run one retraining decision now, without a server, and exit"),
            Arg("--force", action="store_true", help="with --once: retrain and re-gate even without drift"),
            Arg("--incoming", default="data/incoming", metavar="DIR",
                help="with --once: folder of incoming task files (default: %(default)s)"),
        ),
    ),
    Command(
        "stages",
        help="print the phase graph in run order",
        description="Print the stages of dvc.yaml in the order the pipeline runs them, with their deps and outputs.",
        run=_cmd_stages,
        arguments=(Arg("--dvc-yaml", default="dvc.yaml", metavar="FILE",
                       help="dvc.yaml to read (default: %(default)s)"),),
    ),
)}
# Read from the table: the commands that hold the repository lock whatever their arguments, and those that act on the
# project their params file belongs to.
LOCKED = frozenset(name for name, command in COMMANDS.items() if command.locks is always)
PROJECT_COMMANDS = frozenset(name for name, command in COMMANDS.items() if command.project)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl",
        description="Train tool-using agents with RL: one command per phase, `run` for the whole pipeline, "
                    "`schedule` for scheduled retraining.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_to(sub)
    return parser


def _record_time(command: str, seconds: float, rc: int | str) -> None:
    path = os.environ.get(STAGE_TIMES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"command": command, "seconds": seconds, "rc": rc, "peak_rss_mib": _peak_rss_mib()})
                    + "\n")


def _peak_rss_mib() -> float:
    """The stage's peak: this process with the parts it ran in child processes (their resident sizes added to this
    process's while they ran; pipeline.core.isolation), or its largest other child (the DeepSpeed ranks), if larger."""
    from pipeline.core.isolation import children_peak_mib, tree_peak_mib

    return round(max(tree_peak_mib(), children_peak_mib()), 1)


def section_models() -> dict:
    """Each `params.yaml` section and the config model that validates it (a new phase adds its section here;
    scripts/params_table.py documents the same models)."""
    from pipeline.adapt.config import AdaptConfig
    from pipeline.build_env.config import BuildEnvConfig
    from pipeline.check_drift.config import DriftConfig
    from pipeline.deploy.config import DeployConfig
    from pipeline.envs.config import EnvConfig
    from pipeline.evaluate.config import EvaluateConfig
    from pipeline.policy.config import ModelConfig, RolloutConfig
    from pipeline.reward_model.config import RewardModelConfig
    from pipeline.train.config import TrainConfig

    return {"env": EnvConfig, "build_env": BuildEnvConfig, "model": ModelConfig, "rollout": RolloutConfig,
            "adapt": AdaptConfig, "reward_model": RewardModelConfig, "train": TrainConfig,
            "check_drift": DriftConfig, "evaluate": EvaluateConfig, "deploy": DeployConfig}


def check_params(path: str, only_known: bool = True) -> None:
    """Validate every section of the params file a command that writes will read, before it takes the repository lock:
    a bad file is refused before anything is written (the lock file included). A ConfigError names file and key.
    `only_known` as in :func:`pipeline.core.config.read_params` (False for `agentrl run`)."""
    from pipeline.core.config import parse_section, read_params

    data = read_params(path, only_known=only_known)
    for section, model in section_models().items():
        if section in data:
            parse_section(model, data[section], f"{path}:{section}")


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    signals = interrupt_on_stop(stage=bool(os.environ.get(STAGE_TIMES_ENV)))
    command = COMMANDS[args.command]
    rc: int | str = "exception"
    try:
        tracking_enabled()  # a mistyped AGENTRL_TRACKING stops every command here, before it does anything
        if command.project:
            enter_project(args)
        if command.locks(args):
            from pipeline.core.lock import repo_lock

            check_params(args.params, only_known=command.only_known)
            with repo_lock(Path(args.params).resolve().parent, " ".join(sys.argv[1:] if argv is None else argv)):
                rc = command(args)
        else:
            rc = command(args)
        return rc
    except (ConfigError, AgentRLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        rc = USER_ERROR
        return rc
    except Exception as exc:  # a tracking server that stopped answering in the middle: one line, not a traceback
        from pipeline.core.tracking import store_failure

        why = store_failure(exc)
        if why is None:
            raise
        print(f"error: {args.command}: {why}; it stopped there: its outputs are as they were or whole, and its MLflow "
              f"run, if one was open, stays RUNNING with what it logged before", file=sys.stderr)
        rc = USER_ERROR
        return rc
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        rc = 130
        return rc
    finally:
        _record_time(args.command, time.perf_counter() - started, rc)
        restore(signals)


if __name__ == "__main__":
    sys.exit(main())
