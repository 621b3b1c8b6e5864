"""The `agentrl` command line: one command per phase, `run` for the whole pipeline, `stages` for the phase graph.

Every command imports its phase only when it runs, so `agentrl --help` stays fast and the library never imports an
orchestrator: Prefect is imported by `agentrl run` alone, after its state directory has been pointed into the repo.

Errors the user can fix (a bad `params.yaml`, a corrupt task file, a missing phase output: `ConfigError` and every
`AgentRLError`) are printed as ``error: <message>`` and exit with status 2, without a traceback; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipeline.config import DEFAULT_PARAMS, ConfigError
from pipeline.errors import AgentRLError

USER_ERROR = 2


def _cmd_build_env(args: argparse.Namespace) -> int:
    from pipeline.phases import build_env

    build_env.main(args.params)
    return 0


def _cmd_adapt(args: argparse.Namespace) -> int:
    from pipeline.phases import adapt

    adapt.main(args.params)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from pipeline.phases import train

    train.main(args.params)
    return 0


def _cmd_check_drift(args: argparse.Namespace) -> int:
    from pipeline.phases import check_drift

    check_drift.main(args.params)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from pipeline import evaluation

    evaluation.main(args.policy, args.tasks, args.out, args.params, args.seed)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import flows

    params = flows.project_params(args.params)  # bad input fails here, before Prefect starts a server
    flows.use_project_prefect_home(params.parent)  # must happen before the first `import prefect`
    from flows.pipeline_flow import StageFailed, pipeline_flow

    try:
        pipeline_flow(params_path=str(params), stages=args.stage)
    except StageFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_stages(args: argparse.Namespace) -> int:
    from pipeline.graph import load_stages

    for i, stage in enumerate(load_stages(args.dvc_yaml), 1):
        deps = ", ".join(stage.deps) or "-"
        outs = ", ".join(stage.outs) or "-"
        print(f"{i}. {stage.name}: {stage.cmd}\n   deps: {deps}\n   outs: {outs}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentrl",
        description="Train tool-using agents with RL: one command per phase, `run` for the whole pipeline.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def params_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--params", default=str(DEFAULT_PARAMS), metavar="FILE", help="params file to read (default: %(default)s)"
        )

    p = sub.add_parser(
        "build-env",
        help="build the environment's data: database, documents, task splits, demonstrations",
        description="Generate the SQLite world, the document corpus, the train/validation/test task splits and the "
        "demonstrations under data/, validate them, and write metrics/build_env.json. "
        "Reads the `env` and `build_env` sections of the params file.",
    )
    params_option(p)
    p.set_defaults(func=_cmd_build_env)

    p = sub.add_parser(
        "adapt",
        help="adapt the base model: tokenizer, optional continued pre-training, adapter fine-tuning, capability gate",
        description="Build (or load) the base model, optionally continue pre-training on the environment's corpus, "
        "fine-tune it on the demonstrations with adapters, evaluate its capabilities on the validation split, apply "
        "the capability gate, and save models/adapted and metrics/adapt.json. Reads `env`, `model`, `rollout`, `adapt`.",
    )
    params_option(p)
    p.set_defaults(func=_cmd_adapt)

    p = sub.add_parser(
        "train",
        help="RL training from the adapted model with DeepSpeed (train.num_ranks processes)",
        description="Train the adapted policy with RL (PPO or a group baseline) inside DeepSpeed engines launched with "
        "the deepspeed launcher; write the best policy to models/policy, metrics/train.json and "
        "metrics/train_curve.csv. Resumes from checkpoints/train when present. Reads `env`, `rollout`, `train`.",
    )
    params_option(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "check-drift",
        help="drift and state-representation checks (train/serve consistency, data and behaviour drift)",
        description="Compare the current data (data/incoming/ or the validation split) and the policy's behaviour "
        "with the reference it was trained on, check that training and serving preprocess observations identically, "
        "and write metrics/drift.json with a verdict per check. Reads `check_drift`, `env`, `rollout`.",
    )
    params_option(p)
    p.set_defaults(func=_cmd_check_drift)

    p = sub.add_parser(
        "eval",
        help="evaluate a policy on a task file",
        description="Run a policy on every task of a task file (JSON Lines, the schema build-env writes) and write "
        "success rate, mean return, mean reward components, mean tool calls and safety violations, overall and per "
        "level, as JSON. A task file that breaks the schema is refused before anything runs.",
    )
    p.add_argument("--policy", required=True, metavar="POLICY",
                   help="'expert', 'random', or a model directory (e.g. models/adapted, models/policy)")
    p.add_argument("--tasks", required=True, metavar="FILE", help="task file (JSON Lines), e.g. data/tasks/test.jsonl")
    p.add_argument("--out", required=True, metavar="FILE.json", help="where to write the results")
    params_option(p)
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the policy and episodes (default: %(default)s)")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser(
        "run",
        help="run the whole pipeline (Prefect flow over the dvc.yaml stages)",
        description="Run every stage of dvc.yaml in graph order as a Prefect flow on an embedded local server (state "
        "under .prefect/), each through `dvc repro --single-item`, so up-to-date stages are skipped. The stages read "
        "the params.yaml next to dvc.yaml; to try other values, edit it or use `dvc exp run -S key=value`.",
    )
    params_option(p)
    p.add_argument(
        "--stage",
        action="append",
        metavar="NAME",
        help="run only this stage (repeatable; run in graph order); default: every stage",
    )
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "stages",
        help="print the phase graph in run order",
        description="Print the stages of dvc.yaml in the order the pipeline runs them, with their deps and outputs.",
    )
    p.add_argument("--dvc-yaml", default="dvc.yaml", metavar="FILE", help="dvc.yaml to read (default: %(default)s)")
    p.set_defaults(func=_cmd_stages)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, AgentRLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
