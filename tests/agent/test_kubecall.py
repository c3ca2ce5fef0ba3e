"""agent/core/kubecall.py over real HTTP (an aiohttp server on loopback standing where
the API server would, for the answers a test API server does not give on demand: a 429
with ``Retry-After``, a non-Status error body, an empty 2xx body) and the mapping of a
watch's ERROR event. The API server's own answers are in tests/kube/test_kubecall.py."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from kubernetes_asyncio import client as kclient

from agent.core import kubecall
from agent.core.kubecall import KubeError

STATUS_429 = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
              "message": "Too many requests, please try again later.",
              "reason": "TooManyRequests", "details": {"retryAfterSeconds": 3}, "code": 429}


@pytest.fixture
async def api():
    seen: list[dict[str, str]] = []

    async def too_many(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response(STATUS_429, status=429, headers={"Retry-After": "3"})

    async def bad_retry_after(_: web.Request) -> web.Response:
        return web.json_response(STATUS_429, status=429, headers={"Retry-After": "soon"})

    async def proxy_error(_: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>bad gateway</html>")

    async def empty(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/429", too_many)
    app.router.add_get("/429-bad", bad_retry_after)
    app.router.add_get("/502", proxy_error)
    app.router.add_patch("/empty", empty)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    cfg = kclient.Configuration(host=f"http://127.0.0.1:{port}")
    client = kclient.ApiClient(cfg)
    client.seen = seen
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


async def test_429_carries_retry_after(api):
    with pytest.raises(KubeError) as err:
        await kubecall.call(api, "GET", "/429", timeout=5)
    e = err.value
    assert e.too_many_requests and not (e.not_found or e.forbidden or e.conflict or e.gone)
    assert e.retry_after == 3.0 and e.status_reason == "TooManyRequests"
    assert e.phrase == "Too Many Requests" and e.reason == STATUS_429["message"]
    assert api.seen[0]["Accept"] == "application/json"
    with pytest.raises(KubeError) as bad:
        await kubecall.call(api, "GET", "/429-bad", timeout=5)
    assert bad.value.retry_after == 0.0  # not delta-seconds: no floor


async def test_an_error_body_that_is_no_status_keeps_the_phrase(api):
    with pytest.raises(KubeError) as err:
        await kubecall.read(api, "GET", "/502", timeout=5)
    e = err.value
    assert (e.status, e.phrase, e.message, e.status_reason) == (502, "Bad Gateway", "", "")
    assert e.reason == "Bad Gateway" and str(e) == "HTTP 502: Bad Gateway"
    assert e.body == b"<html>bad gateway</html>" and e.retry_after == 0.0


async def test_an_empty_2xx_body_is_none_and_the_content_type_is_sent(api):
    assert await kubecall.call(api, "PATCH", "/empty", timeout=5, body={"a": 1},
                               content_type=kubecall.MERGE_PATCH) is None
    assert api.seen[-1]["Content-Type"] == kubecall.MERGE_PATCH


def test_a_watch_error_event_maps_like_an_answer():
    e = KubeError.from_status({"kind": "Status", "status": "Failure", "code": 410,
                               "reason": "Expired",
                               "message": "too old resource version: 5 (9)"})
    assert e.gone and e.status == 410 and e.status_reason == "Expired"
    assert e.reason == e.message == "too old resource version: 5 (9)"
    assert json.loads(e.body)["code"] == 410 and e.headers is None and e.retry_after == 0.0
    bare = KubeError.from_status({"reason": "InternalError"})  # no code, no message
    assert bare.status == 500 and bare.reason == "InternalError"
    assert KubeError.from_status(None).status == 500
    with pytest.raises(ValueError):
        KubeError.from_status({"code": "x"})
