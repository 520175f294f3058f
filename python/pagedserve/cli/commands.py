"""Subcommand dispatch shared by ``pagedserve`` and ``pagedserve bench``: a
table of commands, each imported only when it runs (the server and the
benchmarks pull in torch, uvicorn, transformers)."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand.

    Attributes:
        summary: one line for the parent's --help.
        target: "module:function" of its ``main(argv, prog)``, which parses argv
            itself (so ``pagedserve CMD --help`` is the command's own help).
    """

    summary: str
    target: str

    def run(self, argv: list[str], prog: str) -> None:
        """Imports the target and calls it with argv and prog (the name --help shows)."""
        module, function = self.target.split(":")
        getattr(importlib.import_module(module), function)(argv, prog=prog)


def run_subcommand(prog: str, description: str, commands: dict[str, Command], argv: list[str],
                   version: str | None = None) -> None:
    """Runs ``prog COMMAND [ARGS...]``: argv[0] names the command, the rest goes
    to it untouched. Anything else (no command, an unknown one, --help, --version
    when version is given) is answered by this level's parser, which lists the
    commands, and exits."""
    if argv and argv[0] in commands:
        commands[argv[0]].run(argv[1:], prog=f"{prog} {argv[0]}")
        return
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if version is not None:
        parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, command in commands.items():
        sub.add_parser(name, help=command.summary, add_help=False)
    parser.parse_args(argv)  # exits: help, version, or a usage error naming what is wrong
    parser.error(f"the command must come first, one of: {', '.join(commands)}")  # e.g. `-- serve`
