"""The chat's turns against a running OpenAI-compatible server: POST
/v1/chat/completions with ``stream: true``, the answer read as Server-Sent
Events as it arrives (standard library http.client: no client dependency)."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator

from .chat import ChatError

TIMEOUT_S = 600.0  # a connect or one read (the wait for the next event) may take this long


class ServerChat:
    """Chat completions from a server, streamed.

    Args:
        url: the server's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted).
        api_key: sent as ``Authorization: Bearer <key>`` when not None.
        model: the requests' "model" (None: left out, the server answers with its own).
        temperature: sampling temperature (0 = greedy).
        max_tokens: output tokens per answer at most (None: what the context leaves).
    Raises:
        ValueError for a URL that is not http(s)://host[:port][/path].
    """

    def __init__(self, url: str, api_key: str | None, model: str | None, temperature: float,
                 max_tokens: int | None) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http(s)://host[:port], got '{url}'")
        self._parts = parts
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._body = {"stream": True, "temperature": temperature}
        if model is not None:
            self._body["model"] = model
        if max_tokens is not None:
            self._body["max_tokens"] = max_tokens

    def describe(self) -> str:
        """'<model> at <url>' from GET /v1/models. Raises ChatError when the server
        cannot be reached or refuses (e.g. a wrong API key)."""
        conn = self._connect()
        try:
            resp = self._send(conn, "GET", "/v1/models")
            models = [m["id"] for m in json.loads(resp.read()).get("data", [])]
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            raise ChatError(f"cannot reach {self.url}: {e}") from e
        finally:
            conn.close()
        return f"{', '.join(models) or 'no model'} at {self.url}"

    def stream(self, messages: list[dict]) -> Iterator[str]:
        """Yields the answer's text pieces to `messages` as the server sends them.
        Closing the generator (or an exception in it) closes the connection, which
        makes the server abort the request. Raises ChatError for an HTTP error, an
        error event or a lost connection."""
        conn = self._connect()
        try:
            resp = self._send(conn, "POST", "/v1/chat/completions", {**self._body, "messages": messages})
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, other SSE fields
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ChatError(_message(event))
                for choice in event.get("choices", []):
                    if text := (choice.get("delta") or {}).get("content"):
                        yield text
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise ChatError(f"{self.url}: {e}") from e
        finally:
            conn.close()

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        return cls(self._parts.hostname, self._parts.port, timeout=TIMEOUT_S)

    def _send(self, conn: http.client.HTTPConnection, method: str, path: str,
              body: dict | None = None) -> http.client.HTTPResponse:
        """Sends one request; returns the response when its status is 200, else
        raises ChatError with the server's error message."""
        conn.request(method, self._parts.path + path, body=None if body is None else json.dumps(body),
                     headers=self._headers)
        resp = conn.getresponse()
        if resp.status != 200:
            text = resp.read().decode("utf-8", "replace")
            try:
                text = _message(json.loads(text))
            except (ValueError, KeyError, TypeError, AttributeError):
                pass  # not an OpenAI-style error body: show it as it came
            raise ChatError(f"HTTP {resp.status}: {text}")
        return resp


def _message(body: dict) -> str:
    """The message of an OpenAI-style error body {"error": {"message": ...}} (or {"error": "..."})."""
    error = body["error"]
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)
