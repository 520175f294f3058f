"""AsyncLLMEngine: runs an LLMEngine's step loop on one background thread and
streams each request's outputs to the asyncio task that waits for it.

Every call that touches the engine (add, abort, step) happens on the engine
thread, in the order the inbox received them, with one exception: an abort of
a request the forward pass in flight does not compute takes effect at once, on
the caller's thread (LLMEngine.abort_unscheduled, under the engine's lock); a
request in that step is aborted right after it, so a disconnected client's
blocks are freed within one step, and a queued one's at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine
from .outputs import PoolingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    """Server-side wrapper of an LLMEngine.

    Args:
        engine: the LLMEngine; from now on only the engine thread touches it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop ---------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | PoolingParams, request_id: str,
                       cache_salt: str | None = None, priority: int = 0, timeline: bool = False
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Submits a request and yields its RequestOutputs until the finished one
        (PoolingParams: an embedding request, one PoolingRequestOutput).
        cache_salt, priority and timeline: as LLMEngine.add_request.

        Raises:
            ValueError (RequestRejectedError among them) if the engine refuses
            the request. Closing or cancelling the iterator early aborts the
            request and frees its blocks.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, cache_salt, priority, timeline))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def call(self, fn):
        """Runs fn() on the engine thread between two steps (where the engine's
        state is consistent and nothing else touches it) and returns its result
        (or raises its exception)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(ok: bool, value) -> None:
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        self._send(("call", fn, loop, deliver))
        return await future

    def abort(self, request_id: str) -> None:
        """Aborts a request (no-op if it already ended): at once where the
        forward pass now running does not compute it (a queued request of a
        client that left goes whatever that step costs), else by the engine
        thread right after that step. The message is queued in both cases: it
        also ends a request whose "add" is still in the inbox."""
        self.engine.abort_unscheduled(request_id)
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        """Asks the engine thread to abort every request; each waiter gets its final
        output (finish_reason "abort"), so streams end cleanly (graceful shutdown)."""
        self._send(("abort_all", None))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the engine thread (waiting streams get a RuntimeError) and
        closes the KV-event sockets (--kv-events-endpoint)."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)
        if self.engine.kv_events is not None and not self._thread.is_alive():
            self.engine.kv_events.close()

    def _send(self, msg) -> None:
        self._inbox.put(msg)
        self._wakeup.set()

    # ---- the engine thread ------------------------------------------------
    def _drain_inbox(self) -> None:
        """Applies every queued add/abort, then republishes the scheduler metrics
        (under the engine's lock: another thread may abort meanwhile)."""
        with self.engine.lock:
            self._drain_inbox_locked()

    def _drain_inbox_locked(self) -> None:
        drained = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                if drained:
                    self.engine.observe_scheduler()
                return
            drained = True
            request_id = msg[1]
            try:
                if msg[0] == "add":
                    self.engine.add_request(msg[2], msg[3], request_id, msg[4], msg[5], msg[6])
                elif msg[0] == "call":
                    _, fn, loop, deliver = msg
                    try:
                        result, ok = fn(), True
                    except Exception as e:  # handed to the caller
                        result, ok = e, False
                    loop.call_soon_threadsafe(deliver, ok, result)
                    continue
                elif msg[0] == "abort_all":
                    for out in self.engine.abort_all():
                        self._deliver(out.request_id, out)
                else:
                    self.engine.abort_request(request_id)
            except Exception as e:  # rejected: hand the error to its waiter
                self._deliver(request_id, e)

    def _deliver(self, request_id: str, item) -> None:
        """Hands an output or an error to the request's waiter, if it still waits."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.put(item)
        except RuntimeError:  # its event loop is closed: nobody is waiting any more
            self._streams.pop(request_id, None)

    def _fail_all(self, err: Exception) -> None:
        """Aborts every request and tells every waiter (also those whose request
        finished inside the failed step, or never reached the engine)."""
        with self.engine.lock:
            self.engine.abort_all()
        for request_id in list(self._streams):
            self._deliver(request_id, err)

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails its requests, not the server
                logger.exception("engine step failed")
                self._fail_all(RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            outputs = out = None  # an idle engine thread pins nothing of the last step
        self._drain_inbox()
        self._fail_all(RuntimeError("engine shut down"))
