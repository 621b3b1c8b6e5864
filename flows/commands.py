"""What the `agentrl` command table (:data:`flows.cli.COMMANDS`) is made of: an argument, a group of arguments of
which one at most may be given, a command, and the runner of a command that names its library function as
``module:function`` (imported only when the command runs, so `agentrl --help` stays fast)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.core.config import DEFAULT_PARAMS


class Arg:
    """One command-line argument: the flags and keyword options of one `ArgumentParser.add_argument` call."""

    def __init__(self, *flags: str, **options) -> None:
        self.flags, self.options = flags, options

    def add_to(self, parser) -> None:
        parser.add_argument(*self.flags, **self.options)


class OneOf:
    """Arguments of which at most one may be given (an argparse mutually exclusive group)."""

    def __init__(self, *args: Arg) -> None:
        self.args = args

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_mutually_exclusive_group()
        for arg in self.args:
            arg.add_to(group)


PARAMS = Arg("--params", default=str(DEFAULT_PARAMS), metavar="FILE", help="params file to read (default: %(default)s)")


def never(args: argparse.Namespace) -> bool:
    return False


def always(args: argparse.Namespace) -> bool:
    return True


@dataclass(frozen=True)
class Command:
    """One `agentrl` command, as :data:`flows.cli.COMMANDS` declares it.

    `run` is either ``"module:function"``, called with the parsed arguments named in `passes`, in that order (the
    module is imported only when the command runs), or a handler that takes the parsed arguments and returns the exit
    status. `locks` says, given the parsed arguments, whether the command holds the repository lock while it runs
    (pipeline.core.lock: commands that write the project's outputs or move registry aliases; a second one is refused at
    once, exit 2). A `project` command reads and writes a project's own folders (data/, models/, metrics/,
    checkpoints/, its MLflow store) and acts on the project its params file belongs to
    (:func:`flows.cli.enter_project`); a project command and one that locks take :data:`PARAMS` (the lock and the
    project are the params file's folder).
    """

    name: str
    help: str
    description: str
    run: str | Callable[[argparse.Namespace], int]
    arguments: tuple[Arg | OneOf, ...] = (PARAMS,)
    passes: tuple[str, ...] = ("params",)
    verdict: bool = False  # `run` returns whether it passed: exit 1 when it did not (a rejected promotion)
    project: bool = False
    locks: Callable[[argparse.Namespace], bool] = never
    only_known: bool = True  # the params file may hold only the known sections (check_params)

    def add_to(self, sub) -> None:
        parser = sub.add_parser(self.name, help=self.help, description=self.description)
        for arg in self.arguments:
            arg.add_to(parser)

    def __call__(self, args: argparse.Namespace) -> int:
        if callable(self.run):
            return self.run(args)
        return run_phase(self.run, [getattr(args, name) for name in self.passes], self.verdict)


def run_phase(target: str, values: Sequence, verdict: bool = False) -> int:
    """Import ``module:function``, call it with `values`; exit status 0, or 1 for a `verdict` that did not pass."""
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(*values)
    return (0 if result else 1) if verdict else 0
