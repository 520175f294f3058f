"""One HTTP request run against an ASGI application in this process, its
response streamed back piece by piece: how an engine replica serves a request
the ingress forwarded (scaleout/ray_app.py) through PagedServe's own routes,
unchanged (create_app), without a socket.

The ASGI protocol (asgiref's HTTP connection scope): the app receives one
``http.request`` with the whole body, then ``http.disconnect`` once the caller
stops reading (closes the iterator): so a client that goes away at the ingress
aborts its request at the replica as it would on a single server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class ResponseStart:
    """The first item forward_request yields: the status code and the response
    headers (latin-1 decoded (name, value) pairs, as ASGI sends them)."""

    status: int
    headers: list[tuple[str, str]]


async def forward_request(app, method: str, path: str, query_string: bytes, headers: list[tuple[str, str]],
                          body: bytes) -> AsyncIterator[ResponseStart | bytes]:
    """Runs one request through an ASGI app and yields a ResponseStart, then the
    body's chunks (bytes, as the app sends them; a streamed answer's server-sent
    events arrive as they are written).

    Args:
        app: an ASGI 3 application (a FastAPI app).
        method, path, query_string: the request line (path without the query).
        headers: (name, value) pairs of the client's request.
        body: the whole request body.
    Raises:
        whatever the app raises before it starts its response (after that, an
        error ends the body early). Closing the iterator before the end tells
        the app the client disconnected and cancels it.
    """
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query_string, "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)  # the app returned (or failed)

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                task.result()  # re-raises what the app raised
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                        for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)  # the app sees the disconnect and aborts
            except Exception:  # noqa: BLE001 - a timeout, or its error, which has nobody to go to now
                task.cancel()
