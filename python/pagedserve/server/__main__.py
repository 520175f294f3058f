"""``python -m pagedserve.server``: serve a model over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import uvicorn

from ..config import EngineArgs, parse_bytes


def build_parser() -> argparse.ArgumentParser:
    """The server's flags: its own (host, port, API key, ...) and one per EngineArgs field."""
    p = argparse.ArgumentParser(prog="python -m pagedserve.server", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: env PAGEDSERVE_API_KEY)")
    p.add_argument("--max-request-body-size", type=parse_bytes, default=16 * 2**20,
                   help="larger request bodies get 413 (16MiB)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=20.0,
                   help="on SIGTERM/SIGINT: seconds running requests get to finish before they are aborted")
    p.add_argument("--log-level", default="info", help="uvicorn and pagedserve log level")
    return EngineArgs.add_cli_args(p)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose shutdown (SIGTERM/SIGINT) stops accepting connections,
    lets running requests finish, and shortly before uvicorn's
    timeout_graceful_shutdown aborts the ones still running: their clients get a
    final finish_reason "abort" and a well-formed end instead of a cut connection.

    Args:
        engine: the AsyncLLMEngine the app serves.
        config: uvicorn.Config of the app.
    """

    def __init__(self, engine, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None):
        grace = self.config.timeout_graceful_shutdown
        handle = None
        if grace is not None:
            handle = asyncio.get_running_loop().call_later(max(0.0, grace - 0.5), self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.llm_engine import LLMEngine
    from .api import create_app

    from ..errors import PagedServeError

    try:
        core = LLMEngine(EngineArgs.from_cli_args(args))
    except (PagedServeError, ValueError, TypeError, OSError) as e:  # a reason, not a traceback: flag, model, machine
        raise SystemExit(f"pagedserve: cannot start: {e}") from e
    engine = AsyncLLMEngine(core)
    app = create_app(engine, api_key=args.api_key, max_body_bytes=args.max_request_body_size)
    server = GracefulServer(engine, uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                   timeout_graceful_shutdown=args.timeout_graceful_shutdown))
    # uvicorn handles SIGTERM/SIGINT itself (see GracefulServer), then re-raises the
    # signal to the handler installed before it: ours only logs, so main() returns
    # and the process exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: logging.getLogger(__name__).info("stopped by signal %d", signum))
    try:
        server.run()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
