"""The ``pagedserve`` command (console script, or ``python -m pagedserve.cli``):

    pagedserve serve [MODEL] [flags]     the OpenAI-compatible server (python -m pagedserve.server)
    pagedserve chat [--url URL] [flags]  a terminal chat, against a server or a model loaded in-process
    pagedserve bench NAME [flags]        a benchmark (throughput, attention, prefix-cache)
    pagedserve replay TRACE [flags]      re-run a --trace-steps file through the scheduler, check each decision
    pagedserve --version
"""

from __future__ import annotations

import sys

from .. import __version__
from .bench import BENCHMARKS
from .commands import Command, run_subcommand

COMMANDS = {
    "serve": Command("serve a model over the OpenAI API (the flags of python -m pagedserve.server)",
                     "pagedserve.server.__main__:main"),
    "chat": Command("chat in the terminal, with a running server (--url) or a model loaded in-process",
                    "pagedserve.cli.chat:main"),
    "bench": Command(f"run a benchmark: {', '.join(BENCHMARKS)}", "pagedserve.cli.bench:main"),
    "replay": Command("re-run a step trace (--trace-steps) through the scheduler without the model and check "
                      "every decision", "pagedserve.experiments.replay:main"),
}


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``pagedserve``: runs the subcommand named by argv[0] (argv default: sys.argv[1:])."""
    run_subcommand("pagedserve", "PagedServe: serve, chat with and benchmark an LLM on a paged KV cache.",
                   COMMANDS, sys.argv[1:] if argv is None else argv, version=__version__)
