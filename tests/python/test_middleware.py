"""APIKeyMiddleware and BodySizeLimitMiddleware, driven in-process through httpx."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from pagedserve.server.middleware import APIKeyMiddleware, BodySizeLimitMiddleware

KEY = "sk-test-123"
LIMIT = 1000


def make_app(api_key: str | None = KEY, max_body_bytes: int = LIMIT) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/x")
    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        return {"n": len(body), "body": body.decode()}

    @app.get("/v1/x")
    @app.get("/health")
    async def ok():
        return {"ok": True}

    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kwargs)
    return asyncio.run(go())


def assert_error(r: httpx.Response, status: int, type_: str) -> dict:
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and err["message"] and err["param"] is None
    return err


def test_missing_and_wrong_key_are_401():
    app = make_app()
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = call(app, "GET", "/v1/x", headers=headers)
        err = assert_error(r, 401, "authentication_error")
        assert err["code"] == "invalid_api_key"
    # a body-carrying request is refused too, before the endpoint runs
    assert call(app, "POST", "/v1/x", content=b"hi").status_code == 401


def test_right_key_passes():
    app = make_app()
    r = call(app, "POST", "/v1/x", content=b"hello", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json() == {"n": 5, "body": "hello"}
    assert call(app, "GET", "/v1/x", headers={"authorization": f"bearer {KEY}"}).status_code == 200


def test_open_paths_need_no_key():
    app = make_app()
    assert call(app, "GET", "/health").json() == {"ok": True}
    assert call(app, "POST", "/echo", content=b"x").status_code == 200
    assert call(app, "GET", "/v1x").status_code == 404  # only /v1 and /v1/... are protected


@pytest.mark.parametrize("key", [None, ""])
def test_no_api_key_is_a_no_op(key):
    app = make_app(api_key=key)  # "" too: PAGEDSERVE_API_KEY= set but empty
    assert call(app, "GET", "/v1/x").json() == {"ok": True}


def test_content_length_over_limit_is_413():
    r = call(make_app(api_key=None), "POST", "/echo", content=b"a" * (LIMIT + 1))
    err = assert_error(r, 413, "invalid_request_error")
    assert str(LIMIT) in err["message"]


def test_chunked_body_over_limit_is_413():
    async def chunks():
        for _ in range(5):
            yield b"b" * 300

    r = call(make_app(api_key=None), "POST", "/echo", content=chunks())
    err = assert_error(r, 413, "invalid_request_error")
    assert str(LIMIT) in err["message"]


def test_body_under_limit_passes_intact():
    app = make_app(api_key=None)
    data = bytes(range(97, 123)) * 38  # 988 bytes
    r = call(app, "POST", "/echo", content=data)
    assert r.status_code == 200 and r.json() == {"n": len(data), "body": data.decode()}

    async def chunks():
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    r = call(app, "POST", "/echo", content=chunks())
    assert r.status_code == 200 and r.json() == {"n": len(data), "body": data.decode()}
    assert call(app, "POST", "/echo", content=b"a" * LIMIT).status_code == 200  # exactly at the limit
