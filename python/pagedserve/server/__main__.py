"""``python -m pagedserve.server``: serve a model over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import uvicorn

from ..config import EngineArgs, parse_bytes
from ..scaleout.router import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, ROUTING_POLICIES


class _ServerArgumentParser(argparse.ArgumentParser):
    """ArgumentParser that folds the optional positional MODEL into ``args.model``
    (as --model), so every caller of build_parser() sees one model field; giving
    both is a usage error (exit status 2)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        positional = vars(ns).pop("model_positional", None)
        if positional is not None:
            if ns.model is not None:
                self.error(f"the model is given twice (MODEL {positional!r} and --model {ns.model!r}): give one")
            ns.model = positional
        return ns, extras


def build_parser(prog: str = "python -m pagedserve.server") -> argparse.ArgumentParser:
    """The server's flags: an optional positional MODEL (the same as --model), its
    own flags (host, port, API key, ...) and one per EngineArgs field.
    prog: the command name --help and usage errors show (``pagedserve serve`` shares this parser)."""
    p = _ServerArgumentParser(prog=prog, description=__doc__,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_positional", nargs="?", metavar="MODEL", default=None, help="the same as --model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: env PAGEDSERVE_API_KEY)")
    p.add_argument("--max-request-body-size", type=parse_bytes, default=16 * 2**20,
                   help="larger request bodies get 413 (16MiB)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=20.0,
                   help="on SIGTERM/SIGINT: seconds running requests get to finish before they are aborted")
    p.add_argument("--log-level", default="info", help="uvicorn and pagedserve log level")
    ray = p.add_argument_group("replicas (Ray Serve; pip install 'pagedserve[ray]'; docs/scale-out.md)")
    ray.add_argument("--replicas", type=int, default=0,
                     help="serve N engine replicas behind this endpoint as a Ray Serve application (0: one engine, "
                          "no Ray)")
    ray.add_argument("--routing", default="prefix", choices=ROUTING_POLICIES,
                     help="with --replicas: which replica serves a request (prefix: prefix-cache affinity under a "
                          "load guard)")
    ray.add_argument("--balance-abs-threshold", type=int, default=BALANCE_ABS_THRESHOLD,
                     help="with --routing prefix: the load guard acts when the busiest replica's load exceeds the "
                          "idlest's by more than this many requests ...")
    ray.add_argument("--balance-rel-threshold", type=float, default=BALANCE_REL_THRESHOLD,
                     help="... and is more than this factor of it (SGLang's two conditions)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: CPUs Ray reserves per replica")
    ray.add_argument("--ray-address", default=None,
                     help="with --replicas: join this Ray cluster (e.g. auto) instead of starting a local one")
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


def main(argv: list[str] | None = None, prog: str = "python -m pagedserve.server") -> None:
    """Parses argv (default sys.argv[1:]) with build_parser(prog) and serves until SIGTERM/SIGINT.
    Exits with a one-line reason when the engine cannot start."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas:
        try:
            from ..scaleout.ray_app import serve_replicas
        except ImportError as e:
            raise SystemExit(f"pagedserve: --replicas needs Ray Serve: pip install 'pagedserve[ray]' ({e})") from e
        try:
            serve_replicas(args)
        except ValueError as e:
            raise SystemExit(f"pagedserve: cannot start: {e}") from e
        return
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
