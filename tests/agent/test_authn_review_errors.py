"""The TokenReview authenticator fails closed on any failure of the review call, not only
on HTTP errors and unreachable servers: an API server whose reply is cut short mid-body
(``aiohttp.ClientPayloadError``, not an ``OSError``) refuses the caller with a reason.
A real kube-apiserver never cuts its replies short, so a raw TCP server plays it here."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client as kclient

from agent.tlsport.authn import AuthenticationError, TokenReviewAuthenticator


async def _truncating_server():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"kind\": \"TokenRev")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_a_reply_cut_short_refuses_the_caller():
    server = await _truncating_server()
    port = server.sockets[0].getsockname()[1]
    conf = kclient.Configuration(host=f"http://127.0.0.1:{port}")
    api = kclient.ApiClient(conf)
    try:
        reviewer = TokenReviewAuthenticator(api, ["istio-ca"], "cluster.local", "Kubernetes",
                                            timeout=5)
        with pytest.raises(AuthenticationError, match="TokenReview call failed"):
            await reviewer.authenticate("some-token")
        # not cached: the next call reviews again
        with pytest.raises(AuthenticationError):
            await reviewer.authenticate("some-token")
        assert reviewer.reviews == 2
    finally:
        await api.close()
        server.close()
        await server.wait_closed()
