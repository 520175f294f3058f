"""``pagedserve serve --replicas N``: PagedServe replicas behind one OpenAI
endpoint, as a Ray Serve application (docs/scale-out.md).

Two deployments:

- ``EngineReplica`` (N replicas, ``--replica-cpus`` CPUs each): one engine
  (LLMEngine + AsyncLLMEngine, its own KV store) and PagedServe's own app
  (server/api.py create_app) in process. ``forward`` runs a request the ingress
  hands it through that app (asgi_forward.forward_request) and streams the
  response back, so every route behaves as on a single server: streaming, chat
  templates, tools, structured outputs, errors, the API key.
  ``record_routing_stats`` is its ReplicaReport (load and cached block hashes)
  for the router; ``metrics`` its Prometheus text.
- ``Ingress`` (one replica, Ray Serve's HTTP entry): tokenizes the request
  (chat template applied) and computes its block hashes with the engine's hash
  (router.prompt_block_hashes), then calls ``forward`` through a handle whose
  request router (ray_router.py, ``--routing``) picks the replica. ``/metrics``
  is every replica's, each sample labelled ``replica="<id>"``. A replica that
  dies mid-stream ends the stream with an error event; before the response
  starts, the client gets 503.

Ray opens connections to a cloud-metadata address when it starts; on a machine
that must stay offline run this inside a loopback-only network namespace
(docs/scale-out.md). Ray is the optional extra ``pagedserve[ray]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..server.chat_render import ChatRenderer
from ..server.errors import error_response
from ..server.middleware import body_too_large
from ..server.protocol import ChatCompletionRequest

from .asgi_forward import ResponseStart, forward_request
from .ray_router import pack_hash_prefixes
from .router import ROUTING_POLICIES, PrefixAffinityRouter, prompt_block_hashes

logger = logging.getLogger(__name__)

ROUTING_STATS_PERIOD_S = 0.5  # how often the Serve controller asks each replica for its report
METRICS_TIMEOUT_S = 10.0
# A replica takes what Ray sends it (its own scheduler queues and batches); Ray's
# default of 5 would queue requests in the ingress, hidden from the load signal.
MAX_ONGOING_REQUESTS = 1024


class EngineReplica:
    """One PagedServe engine and its OpenAI app (the module docstring).

    Runs floor(args.replica_cpus) (at least 1) kernel threads.

    Args:
        args: the parsed `pagedserve serve` flags (server/__main__.build_parser).
    Raises:
        what LLMEngine raises for a model or flag it cannot serve.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        from ..config import EngineArgs
        from ..engine.async_engine import AsyncLLMEngine
        from ..engine.llm_engine import LLMEngine
        from ..server.api import create_app

        import torch

        logging.basicConfig(level=args.log_level.upper())
        torch.set_num_threads(max(1, int(args.replica_cpus)))  # the kernels' threads: the CPUs Ray reserved
        context = serve.get_replica_context()
        self._kv_events_rank = None  # the rank whose ports this replica's KV events are bound at
        if getattr(args, "kv_events_endpoint", None):  # one publisher per replica: the endpoint offset by its rank
            self._kv_events_rank = context.rank.rank
            args = replica_kv_events_args(args, self._kv_events_rank)
        self.engine = AsyncLLMEngine(LLMEngine(EngineArgs.from_cli_args(args)))
        self.app = create_app(self.engine, api_key=args.api_key, max_body_bytes=args.max_request_body_size)
        self._report_seq = 0
        self._last_report = None
        self.replica_id = context.replica_id.unique_id

    def reconfigure(self, user_config, rank) -> None:
        """Ray Serve's hook, called at start and when Serve renumbers its
        replicas (rank: ray.serve.schema.ReplicaRank; user_config unused). The
        KV-event sockets stay where they were bound: a new rank is logged as a
        warning naming both (Serve renumbers only after a replica that was still
        stopping when its replacement started; a replacement normally takes the
        dead replica's rank)."""
        if self._kv_events_rank is not None and rank.rank != self._kv_events_rank:
            logger.warning("replica %s is now rank %d; its KV events stay at rank %d's ports (%s)", self.replica_id,
                           rank.rank, self._kv_events_rank, self.engine.engine.kv_events.endpoint)

    async def forward(self, method: str, path: str, query_string: bytes, headers: list[tuple[str, str]],
                      body: bytes, block_hashes: list[bytes] = ()) -> AsyncIterator[ResponseStart | bytes]:
        """Serves one HTTP request through this replica's app: a ResponseStart,
        then the body's chunks. block_hashes is for the request router
        (ray_router.py), unused here. The response carries this replica's id
        in an X-PagedServe-Replica header."""
        async with contextlib.aclosing(forward_request(self.app, method, path, query_string, headers,
                                                       body)) as items:
            async for item in items:
                if isinstance(item, ResponseStart):
                    item.headers.append(("x-pagedserve-replica", self.replica_id))
                yield item

    async def record_routing_stats(self) -> dict:
        """This replica's ReplicaReport as Ray Serve routing stats: num_running,
        num_waiting, num_free_blocks, block_hash_prefixes (ray_router.pack_hash_prefixes),
        and report_seq, which moves only when the rest changed (the controller
        passes on only stats that changed; the router takes each report once)."""
        report = await self.engine.call(self.engine.engine.replica_report)
        content = (report.num_running, report.num_waiting, report.num_free_blocks,
                   pack_hash_prefixes(report.block_hashes))
        if content != self._last_report:
            self._last_report = content
            self._report_seq += 1
        return {"report_seq": self._report_seq, "num_running": content[0], "num_waiting": content[1],
                "num_free_blocks": content[2], "block_hash_prefixes": content[3]}

    async def metrics(self) -> tuple[str, str]:
        """(this replica's id, its /metrics as Prometheus text)."""
        return self.replica_id, self.engine.engine.metrics.render()[0].decode()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def label_replicas(texts: dict[str, str]) -> bytes:
    """One Prometheus text exposition of several replicas' (replica id -> its
    /metrics text): each family once, each sample with a replica label added
    (prometheus_client's parser and exposition)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)

    class _Collected:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected())
    return generate_latest(registry)


def _error_event(path: str, message: str) -> bytes:
    """The event that ends a stream whose replica failed, in the API's shape."""
    if path.startswith("/v1/messages"):
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    if path.startswith("/v1/responses"):
        data = {"type": "error", "code": "server_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    data = {"error": {"message": message, "type": "server_error", "param": None, "code": 503}}
    return f"data: {json.dumps(data)}\n\ndata: [DONE]\n\n".encode()


class Ingress:
    """The HTTP entry (the module docstring).

    Args:
        engine: DeploymentHandle of the EngineReplica deployment.
        args: the parsed `pagedserve serve` flags (the model, for its
            tokenizer; block_size; skip_tokenizer_init).
    """

    def __init__(self, engine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.block_size = args.block_size
        self.max_body_bytes = args.max_request_body_size
        self.tokenizer = self.renderer = None
        if not args.skip_tokenizer_init:
            from transformers import AutoTokenizer

            from ..model.source import resolve_source

            self.tokenizer = AutoTokenizer.from_pretrained(resolve_source(args.model).config_path())
            self.renderer = ChatRenderer.for_server(self.tokenizer, args)[0]

    def block_hashes(self, path: str, body: bytes) -> list[bytes]:
        """The request's prompt block hashes as the replica's prefix cache will
        compute them: a completion's (first) prompt, a chat's messages rendered
        as the replica's server renders them (the same ChatRenderer: template
        fields, the tools its ToolPlan shows; truncate_prompt_tokens is not
        applied); [] for other routes or what cannot be read (a miss for the
        router, never an error: the replica answers the request)."""
        try:
            req = json.loads(body)
            salt = req.get("cache_salt") or ""
            if path == "/v1/completions":
                prompt = req.get("prompt")
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        return []
                    prompt = self.tokenizer(prompt, add_special_tokens=req.get("add_special_tokens") is not False
                                            ).input_ids
                ids = prompt
            elif path == "/v1/chat/completions" and self.renderer is not None:
                chat = ChatCompletionRequest.model_validate(req)
                ids = self.renderer.render(chat.messages, chat, chat.add_special_tokens,
                                           self.renderer.plan(chat).tools)
            else:
                return []
            return prompt_block_hashes([int(t) for t in ids], self.block_size, salt)
        except Exception:  # noqa: BLE001 - the replica reports what is wrong with the request
            return []

    async def metrics(self) -> Response:
        """Every running replica's /metrics (Ray Serve's broadcast), labelled by
        replica; a replica that does not answer within METRICS_TIMEOUT_S (one
        that just died) is left out."""
        results = await self.engine.broadcast("metrics").results_async(timeout_s=METRICS_TIMEOUT_S,
                                                                         return_exceptions=True)
        texts = {}
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("a replica gave no metrics: %s", result)
            else:
                texts[result[0]] = result[1]
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(label_replicas(texts), media_type=CONTENT_TYPE_LATEST)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return await self.metrics()
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:  # refused unread, as a replica would
            return body_too_large(self.max_body_bytes, path)
        body = await request.body()
        if len(body) > self.max_body_bytes:
            return body_too_large(self.max_body_bytes, path)
        hashes = await run_in_threadpool(self.block_hashes, path, body) if request.method == "POST" else []
        stream = self.engine.options(stream=True).forward.remote(
            request.method, path, request.url.query.encode("latin-1"), list(request.headers.items()), body,
            block_hashes=hashes)
        try:
            start = await stream.__anext__()
        except asyncio.CancelledError:  # the client went away before the answer started
            stream.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the replica died before answering
            stream.cancel()
            logger.warning("replica failed before answering %s: %s", path, e)
            return error_response(503, f"the replica serving this request failed: {type(e).__name__}",
                                  "server_error", path=path)
        event_stream = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                           for k, v in start.headers)

        async def body_chunks():
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as e:  # noqa: BLE001 - a replica that died mid-answer
                logger.warning("replica failed while answering %s: %s", path, e)
                if not event_stream:
                    raise  # the connection is cut: a half JSON body must not look complete
                yield _error_event(path, f"the replica serving this request failed: {type(e).__name__}")
            finally:
                # a client gone: the replica's app sees the disconnect and aborts. (A request cancelled
                # before this generator starts is cancelled at the replica by Ray Serve, which
                # cancels the handle calls a cancelled request made.)
                stream.cancel()

        response = StreamingResponse(body_chunks(), status_code=start.status)
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in start.headers
                                if k.lower() not in ("content-length", "x-request-id")]  # Ray's proxy sets x-request-id
        return response


def replica_kv_events_args(args: argparse.Namespace, rank: int) -> argparse.Namespace:
    """A copy of args whose --kv-events-endpoint (and --kv-events-replay-endpoint)
    are replica `rank`'s: each offset by the rank (kv_events.offset_endpoint), so
    replica i of N publishes on PORT+i (a replacement Serve starts for a dead
    replica normally takes its rank, so its ports: EngineReplica.reconfigure).
    Raises ValueError as offset_endpoint."""
    from ..engine.kv_events import offset_endpoint

    replay = getattr(args, "kv_events_replay_endpoint", None)
    return argparse.Namespace(**{**vars(args), "kv_events_endpoint": offset_endpoint(args.kv_events_endpoint, rank),
                                 "kv_events_replay_endpoint": replay and offset_endpoint(replay, rank)})


def _bound_address(endpoint: str) -> str:
    """What two endpoints on one machine must not share: a TCP endpoint's port
    (tcp://*:5557 and tcp://127.0.0.1:5557 collide), any other endpoint whole."""
    transport, _, address = endpoint.partition("://")
    return "tcp port " + address.rpartition(":")[2] if transport == "tcp" else endpoint


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError (TypeError) for flags `serve --replicas` cannot serve:
    engine flags EngineArgs refuses (each replica would otherwise fail the same
    way after Ray started, its retries behind a deployment error), replicas < 1,
    a routing policy outside ROUTING_POLICIES, load-guard thresholds out of
    range, a --kv-events-endpoint (or replay endpoint) that cannot be offset
    for every replica's rank (replica_kv_events_args), or whose replicas' ports
    would overlap the replay endpoint's."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if getattr(args, "kv_events_replay_endpoint", None) and not getattr(args, "kv_events_endpoint", None):
        raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint (the events it replays)")
    if getattr(args, "kv_events_endpoint", None):
        ranks = [replica_kv_events_args(args, rank) for rank in range(args.replicas)]  # raises ValueError
        bound = [_bound_address(a.kv_events_endpoint) for a in ranks] + [
            _bound_address(a.kv_events_replay_endpoint) for a in ranks if a.kv_events_replay_endpoint is not None]
        if len(set(bound)) < len(bound):
            raise ValueError(f"--kv-events-endpoint {args.kv_events_endpoint} and --kv-events-replay-endpoint "
                             f"{args.kv_events_replay_endpoint}: with --replicas {args.replicas} replica i binds each "
                             f"at its port + i, and these overlap; leave at least {args.replicas} ports between them")
    if args.routing not in ROUTING_POLICIES:
        raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {args.routing!r}")
    if args.routing == "prefix":
        PrefixAffinityRouter(args.balance_abs_threshold, args.balance_rel_threshold)  # raises ValueError
    from ..config import EngineArgs

    EngineArgs.from_cli_args(args)  # raises ValueError / TypeError, as each replica's engine would


def build_app(args: argparse.Namespace):
    """The Ray Serve application of `pagedserve serve --replicas N`: the Ingress
    over args.replicas EngineReplicas routed by args.routing. Raises ValueError
    as check_args."""
    check_args(args)
    if args.routing == "ray-default":  # Ray Serve's own router (power of two choices on queue lengths)
        router_config = RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    else:
        router_kwargs = {"policy": args.routing}
        if args.routing == "prefix":
            router_kwargs.update(balance_abs_threshold=args.balance_abs_threshold,
                                 balance_rel_threshold=args.balance_rel_threshold)
        router_config = RequestRouterConfig(
            request_router_class="pagedserve.scaleout.ray_router:PagedServeRequestRouter",
            request_router_kwargs=router_kwargs, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    replica = serve.deployment(EngineReplica, name="EngineReplica", num_replicas=args.replicas,
                               max_ongoing_requests=MAX_ONGOING_REQUESTS,
                               ray_actor_options={"num_cpus": args.replica_cpus},
                               request_router_config=router_config)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(args), args)


def serve_replicas(args: argparse.Namespace) -> None:
    """Starts Ray (a local instance on loopback, or joins --ray-address), runs
    build_app(args) with Serve's HTTP entry on args.host:args.port, and blocks
    until SIGINT/SIGTERM; then shuts Serve (and a Ray it started) down."""
    import os
    import signal
    import threading

    import ray

    check_args(args)  # before Ray starts
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level=args.log_level.upper())
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas * args.replica_cpus), include_dashboard=False,
                 _node_ip_address="127.0.0.1", logging_level=args.log_level.upper())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args), name="pagedserve", route_prefix="/")
        logger.info("serving %d replicas (routing: %s) at http://%s:%d", args.replicas, args.routing,
                    args.host, args.port)
        stop.wait()
    finally:
        if args.ray_address:
            serve.delete("pagedserve")  # a cluster we joined keeps its other applications and Serve
        else:
            serve.shutdown()
        ray.shutdown()
