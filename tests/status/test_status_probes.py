"""App probes against real local servers (acceptance cases 26–28): real aiohttp
HTTP and HTTPS apps, a real TCP listener, a real grpc.aio server with grpc.health.v1."""

from __future__ import annotations

import asyncio
import datetime
import json
import ssl

import aiohttp
import grpc
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agent.core.config import ConfigError
from agent.status.probes import BODY_CAP
from tests.status.conftest import free_port, running_status, serve_app


def app_server(seen: list) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "headers": dict(request.headers),
                     "remote": request.remote})
        code = int(request.query.get("code", "200"))
        return web.Response(status=code, text=f"status {code}")

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    async def huge(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (BODY_CAP * 5))

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/echo", echo)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/loop", loop)
    app.router.add_get("/huge", huge)
    app.router.add_get("/slow", slow)
    return app


def probers(port: int, **extra) -> str:
    table = {
        "/app-health/web/livez": {"httpGet": {"path": "/echo", "port": port}},
        "/app-health/web/readyz": {"httpGet": {"path": "/echo?code=503", "port": port}},
        "/app-health/web/startupz": {"httpGet": {"path": "/redirect?to=/echo", "port": port}},
        "/app-health/other/livez": {"httpGet": {"path": "/redirect?to=http://example.invalid/x",
                                                "port": port}},
        "/app-health/loop/livez": {"httpGet": {"path": "/loop", "port": port}},
        "/app-health/huge/livez": {"httpGet": {"path": "/huge", "port": port}},
        "/app-health/slow/livez": {"httpGet": {"path": "/slow", "port": port},
                                   "timeoutSeconds": 0.3},
        "/app-health/gone/livez": {"httpGet": {"path": "/", "port": free_port()},
                                   "timeoutSeconds": 1},
    }
    table.update(extra)
    return json.dumps(table)


async def get(port: int, path: str, headers=None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as c:
        async with c.get(f"http://127.0.0.1:{port}{path}", headers=headers or {}) as r:
            return r.status, await r.read()


async def test_http_probes_status_mapping(tmp_path):
    seen: list = []
    async with serve_app(app_server(seen)) as app_port:
        env = {"ISTIO_KUBE_APP_PROBERS": probers(app_port)}
        async with running_status(tmp_path, env=env) as (_, server):
            p = server.port
            assert await get(p, "/app-health/web/livez") == (200, b"status 200")
            assert await get(p, "/app-health/web/readyz") == (503, b"status 503")
            assert await get(p, "/app-health/web/startupz") == (200, b"status 200")
            assert await get(p, "/app-health/other/livez") == (200, b"")  # other host: stop
            assert (await get(p, "/app-health/loop/livez"))[0] == 500     # > 10 redirects
            status, body = await get(p, "/app-health/huge/livez")
            assert status == 200 and len(body) == BODY_CAP
            assert (await get(p, "/app-health/slow/livez"))[0] == 500     # timeout
            assert (await get(p, "/app-health/gone/livez"))[0] == 500     # refused
            status, body = await get(p, "/app-health/nope/livez")
            assert status == 400 and b"app prober config does not exists" in body
            # control bytes of the path come back escaped, never raw (newuser finding)
            status, body = await get(p, "/app-health/%1b%5b31mRED%0aX-Injected:%20y%00/readyz")
            assert status == 400, body
            assert b"\x1b" not in body and b"\n" not in body[:-1] and b"\x00" not in body, body
            assert b"\\x1b[31mRED\\nX-Injected: y\\x00/readyz" in body, body
            assert (await get(p, "/bad-path"))[0] == 404


async def test_http_probe_headers_source_and_host(tmp_path):
    seen: list = []
    async with serve_app(app_server(seen)) as app_port:
        env = {"ISTIO_KUBE_APP_PROBERS": probers(app_port)}
        async with running_status(tmp_path, env=env) as (_, server):
            await get(server.port, "/app-health/web/livez",
                      {"Some-Header": "v", "User-Agent": "kube-probe/1.30",
                       "Host": f"10.0.0.5:{server.ctx.config.status_port}"})
    headers = seen[-1]["headers"]
    assert headers["Some-Header"] == "v"
    assert headers["User-Agent"] == "kube-probe/1.30"
    assert headers["Connection"] == "close"
    assert headers["Host"] == f"10.0.0.5:{app_port}"  # status port replaced by the app's
    assert seen[-1]["remote"] == "127.0.0.6"  # probe source, skipped by inbound capture


def self_signed(tmp_path) -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "app")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1)).sign(key, hashes.SHA256()))
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    return ctx


async def test_https_probe_without_verification(tmp_path):
    seen: list = []
    async with serve_app(app_server(seen), ssl_context=self_signed(tmp_path)) as app_port:
        env = {"ISTIO_KUBE_APP_PROBERS": json.dumps({
            "/app-health/tls/readyz": {"httpGet": {"path": "/echo?code=204", "port": app_port,
                                                   "scheme": "HTTPS"}},
            "/app-health/plain/readyz": {"httpGet": {"path": "/echo", "port": app_port},
                                         "timeoutSeconds": 1}})}
        async with running_status(tmp_path, env=env) as (_, server):
            assert (await get(server.port, "/app-health/tls/readyz"))[0] == 204
            # Plain HTTP to a TLS port is a transport error, not a pass.
            assert (await get(server.port, "/app-health/plain/readyz"))[0] == 500


async def test_tcp_probe(tmp_path):
    listener = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        env = {"ISTIO_KUBE_APP_PROBERS": json.dumps({
            "/app-lifecycle/db/poststartz": {"tcpSocket": {"port": port}},
            "/app-health/db/livez": {"tcpSocket": {"port": free_port()}, "timeoutSeconds": 1}})}
        async with running_status(tmp_path, env=env) as (_, server):
            assert (await get(server.port, "/app-lifecycle/db/poststartz"))[0] == 200
            assert (await get(server.port, "/app-health/db/livez"))[0] == 500
    finally:
        listener.close()
        await listener.wait_closed()


async def test_grpc_probe(tmp_path):
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await servicer.set("not-serving-svc", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        table = {"/app-health/g/livez": {"gRPC": {"port": port, "service": None}},
                 "/app-health/g/readyz": {"grpc": {"port": port, "service": "not-serving-svc"}},
                 "/app-health/g/startupz": {"grpc": {"port": port, "service": "unknown-svc"}},
                 "/app-health/h/livez": {"grpc": {"port": free_port()}}}
        env = {"ISTIO_KUBE_APP_PROBERS": json.dumps(table)}
        async with running_status(tmp_path, env=env) as (_, status):
            assert (await get(status.port, "/app-health/g/livez"))[0] == 200
            assert (await get(status.port, "/app-health/g/readyz"))[0] == 500
            assert (await get(status.port, "/app-health/g/startupz"))[0] == 500
            assert (await get(status.port, "/app-health/h/livez"))[0] == 500
    finally:
        await server.stop(0)


@pytest.mark.parametrize("value, fragment", [
    ("{oops", "ISTIO_KUBE_APP_PROBERS"),  # JSON errors surface at config load
    ('{"/app-health/a/livez": {"httpGet": {"port": "80"}}}', "/app-health/a/livez"),
    ('{"/x": {"httpGet": {"port": 80}}}', "invalid path '/x'"),
])
async def test_invalid_probers_stop_start_up(tmp_path, fragment, value):
    with pytest.raises(ConfigError) as info:
        async with running_status(tmp_path, env={"ISTIO_KUBE_APP_PROBERS": value}):
            pass
    message = str(info.value)
    assert "kube_app_probers" in message and fragment in message
    assert "\n" not in message
