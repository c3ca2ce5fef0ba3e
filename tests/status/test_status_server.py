"""The status server end to end on loopback: readiness, the node-agent health port,
quit/drain, /debug, the merged metrics (with real local aiohttp apps as metrics
targets and a fake Envoy admin serving canned stats: where noted, the real Envoy is in
tests/peers/test_status_envoy.py). The ``ambient-agent status`` CLI: test_status_cli.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import os

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from agent.core.config import ConfigError
from agent.status import metrics_merge
from tests.status.conftest import FakeComponent, free_port, running_status, serve_app

OM_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


async def request(method: str, url: str, raw: bool = False, unix: str | None = None,
                  **kw) -> tuple[int, dict, bytes]:
    """One request; ``raw`` keeps a compressed body compressed; ``unix``: over that
    Unix socket (``url`` is then ``http://localhost/<path>``)."""
    connector = aiohttp.UnixConnector(unix) if unix else None
    async with aiohttp.ClientSession(auto_decompress=not raw, connector=connector) as c:
        async with c.request(method, url, **kw) as r:
            return r.status, dict(r.headers), await r.read()


def admin(server, method: str, path: str, **kw):
    """A request on the server's admin socket."""
    return request(method, "http://localhost" + path, unix=server.admin_socket, **kw)


async def test_readiness_follows_components_and_shutdown(tmp_path):
    zds = FakeComponent("zds", ok=False, why="no ztunnel connected")
    async with running_status(tmp_path, [zds]) as (ctx, server):
        url = f"http://127.0.0.1:{server.port}/healthz/ready"
        status, _, body = await request("GET", url)
        assert (status, body) == (503, b"zds: no ztunnel connected\n")
        health = f"http://127.0.0.1:{server.health_port}"
        assert (await request("GET", health + "/healthz"))[0] == 200
        status, _, body = await request("GET", health + "/readyz")
        assert status == 503 and body.startswith(b"Service Unavailable")
        zds.ok = True
        assert (await request("GET", url))[:1] == (200,)
        assert (await request("GET", health + "/readyz"))[0] == 200
        zds.ok = False  # not latched: flips back
        assert (await request("GET", health + "/readyz"))[0] == 503
        zds.ok = True
        ctx.draining = True
        assert (await request("GET", url))[2] == b"drain: the agent is draining (POST /drain)\n"
        ctx.draining = False
        ctx.request_shutdown("test")
        status, _, body = await request("GET", url)
        assert status == 503 and body.startswith(b"agent: server is terminated")


async def test_quit_and_drain_only_on_the_admin_socket(tmp_path):
    """Loopback TCP is every local user and every host-network pod: it gets 403 and a
    pointer; the 0600 admin socket does it."""
    async with running_status(tmp_path) as (ctx, server):
        assert oct(os.stat(server.admin_socket).st_mode & 0o777) == "0o600"
        assert server.admin_socket == str(tmp_path / "state" / "admin.sock")
        base = f"http://127.0.0.1:{server.port}"
        for path in ("/quitquitquit", "/drain"):
            status, _, body = await request("POST", base + path)
            assert status == 403 and body.decode() == (
                f"{path} is served only on the agent's admin socket {server.admin_socket} "
                f"(root only), e.g. curl --unix-socket {server.admin_socket} -X POST "
                f"http://localhost{path}\n")
        assert not ctx.shutdown.is_set() and not ctx.draining
        assert (await admin(server, "GET", "/quitquitquit"))[0] == 405
        assert (await admin(server, "GET", "/drain"))[0] == 405
        status, _, body = await admin(server, "POST", "/drain")
        assert (status, body) == (200, b"OK") and ctx.draining
        status, _, body = await admin(server, "POST", "/quitquitquit")
        assert (status, body) == (200, b"OK")
        await asyncio.wait_for(ctx.shutdown.wait(), 2)
        assert server.shutdown_cause == "/quitquitquit called"
    assert not os.path.exists(tmp_path / "state" / "admin.sock")  # unlinked at stop


async def test_ipv6_loopback_cannot_quit(tmp_path):
    async with running_status(tmp_path, status_address="::1") as (ctx, server):
        status, _, _ = await request("POST", f"http://[::1]:{server.port}/quitquitquit")
        assert status == 403
        await asyncio.sleep(0.1)
        assert not ctx.shutdown.is_set()


async def test_debug_endpoints(tmp_path):
    pods = FakeComponent("enrollment", {"pods": [{"uid": "u1", "name": "p", "status": "enrolled"}]})
    broken = FakeComponent("sds", RuntimeError("boom"))
    async with running_status(tmp_path, [pods, broken]) as (ctx, server):
        for path in ("/debug", "/debug/config", "/debug/all"):
            status, _, body = await request("GET", f"http://127.0.0.1:{server.port}{path}")
            assert status == 403 and server.admin_socket in body.decode()

        status, headers, body = await admin(server, "GET", "/debug")
        index = json.loads(body)
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        assert "/debug/pods" in index["endpoints"] and index["components"] == [
            "enrollment", "sds", "status"]
        assert body.startswith(b"{\n  ")  # pretty
        config = json.loads((await admin(server, "GET", "/debug/config"))[2])
        assert config["status_port"] == {"value": 0, "source": "env STATUS_PORT"}
        comps = json.loads((await admin(server, "GET", "/debug/components"))[2])
        assert comps["status"]["ready"] is True
        assert json.loads((await admin(server, "GET", "/debug/pods"))[2])["pods"][0]["uid"] == "u1"
        status, _, body = await admin(server, "GET", "/debug/sds")
        assert status == 500 and "boom" in json.loads(body)["error"]
        status, _, body = await admin(server, "GET", "/debug/xds")
        assert status == 404 and "'xds' is not running" in json.loads(body)["error"]
        status, _, body = await admin(server, "GET", "/debug/component/status")
        assert status == 200 and json.loads(body)["port"] == server.port
        assert (await admin(server, "GET", "/debug/nothing"))[0] == 404
        doc = json.loads((await admin(server, "GET", "/debug/all"))[2])
        assert doc["sds"]["error"] == "RuntimeError: boom" and doc["xds"]["missing"]
        # the server survived the failing component
        assert (await admin(server, "GET", "/debug/pods"))[0] == 200


# --- merged metrics ---------------------------------------------------------------------

ENVOY_TEXT = (b"# TYPE envoy_cluster_upstream_cx_total counter\n"
              b"envoy_cluster_upstream_cx_total{envoy_cluster_name=\"x\"} 3\n"
              b"# TYPE envoy_server_live gauge\nenvoy_server_live 1")  # no final newline
APP_TEXT = (b"# HELP app_requests_total Requests.\n# TYPE app_requests_total counter\n"
            b"app_requests_total 7\n")
APP_OM = (b"# HELP app_jobs Jobs.\n# TYPE app_jobs counter\napp_jobs_total 1.0\n# EOF\n")
APP_OM2 = (b"# HELP app_jobs Jobs.\n# TYPE app_jobs counter\napp_jobs_total{k=\"b\"} 2.0\n"
           b"# TYPE app_temp gauge\napp_temp 21.5\n# EOF\n")


def metrics_app(routes: dict[str, tuple[int, bytes, str]], seen: list) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        seen.append(dict(request.headers) | {"path_qs": request.path_qs})
        status, body, ctype = routes[request.path]
        return web.Response(status=status, body=body, headers={"Content-Type": ctype})

    app = web.Application()
    for path in routes:
        app.router.add_get(path, handle)
    return app


TEXT_CT = "text/plain; version=0.0.4; charset=utf-8"
OM_CT = "application/openmetrics-text; version=1.0.0; charset=utf-8"


async def scrape(server, accept: str | None = None, query: str = "", raw: bool = False,
                 **headers):
    if accept is not None:
        headers["Accept"] = accept
    return await request("GET", f"http://127.0.0.1:{server.port}/stats/prometheus{query}",
                         raw=raw, headers=headers)


async def test_metrics_envoy_then_app_text(tmp_path):
    seen: list = []
    routes = {"/stats/prometheus": (200, ENVOY_TEXT, TEXT_CT), "/metrics": (200, APP_TEXT, TEXT_CT)}
    async with serve_app(metrics_app(routes, seen)) as port:
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"scrape": "true", "port": str(port)})}
        async with running_status(tmp_path, env=env, envoy_admin_port=port) as (_, server):
            status, headers, body = await scrape(
                server, "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily",
                "?usedonly", **{"User-Agent": "Prometheus/2.42",
                                "X-Prometheus-Scrape-Timeout-Seconds": "5"})
    assert status == 200 and headers["Content-Type"] == TEXT_CT
    text = body.decode()
    assert text.index("istio_agent_scrapes_total") < text.index("envoy_server_live") \
        < text.index("app_requests_total")
    assert "envoy_server_live 1\n" in text  # final newline repaired
    names = {f.name for f in text_parse(text)}
    assert {"istio_agent_scrapes", "envoy_cluster_upstream_cx", "app_requests"} <= names
    envoy_req, app_req = seen
    assert envoy_req["path_qs"] == "/stats/prometheus?usedonly"  # query passed to Envoy only
    assert app_req["path_qs"] == "/metrics"
    for req in seen:  # protobuf never forwarded
        assert req["Accept"] == "text/plain;version=0.0.4"
        assert req["User-Agent"] == "Prometheus/2.42"
        assert req["X-Prometheus-Scrape-Timeout-Seconds"] == "5"


async def test_metrics_failing_sources_counted_not_fatal(tmp_path):
    seen: list = []
    routes = {"/stats/prometheus": (500, b"oops", "text/plain"), "/metrics": (200, APP_TEXT, TEXT_CT)}
    async with serve_app(metrics_app(routes, seen)) as port:
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"targets": [
            {"port": str(port)}, {"port": str(free_port())}]})}
        async with running_status(tmp_path, env=env, envoy_admin_port=port) as (ctx, server):
            status, _, body = await scrape(server)
            failures = {kind: ctx.registry.get_sample_value(
                "istio_agent_scrape_failures_total", {"type": kind})
                for kind in ("envoy", "application")}
    assert status == 200
    assert failures == {"envoy": 1.0, "application": 1.0}
    families = {f.name: f for f in text_parse(body.decode())}
    assert "app_requests" in families and b"oops" not in body


async def test_metrics_openmetrics_two_targets_one_eof(tmp_path):
    seen: list = []
    routes = {"/stats/prometheus": (200, ENVOY_TEXT, TEXT_CT), "/a": (200, APP_OM, OM_CT),
              "/b": (200, APP_OM2, OM_CT), "/t": (200, APP_TEXT, TEXT_CT)}
    async with serve_app(metrics_app(routes, seen)) as port:
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"targets": [
            {"port": str(port), "path": "/a"}, {"port": str(port), "path": "/b"}]})}
        async with running_status(tmp_path, env=env, envoy_admin_port=port) as (_, server):
            status, headers, body = await scrape(server, "application/openmetrics-text;"
                                                 "version=1.0.0,text/plain;version=0.0.4;q=0.5")
            again = (await scrape(server))[2].decode()
    assert status == 200 and headers["Content-Type"] == OM_CT
    text = body.decode()
    assert text.count("# EOF") == 1 and text.endswith("# EOF\n")
    assert text.count("# TYPE app_jobs counter") == 1 and text.count("# HELP app_jobs") == 1
    fams = {f.name: f for f in om_parse(text)}  # the whole body is valid OpenMetrics
    # first source wins: /b's app_jobs is dropped whole (counted), its app_temp kept
    assert [s.labels for s in fams["app_jobs"].samples] == [{}]
    assert "app_temp" in fams and "envoy_server_live" in fams
    assert 'ambient_agent_metrics_merge_dropped_families_total{source="application"} 1.0' \
        in again
    assert seen[1]["Accept"].startswith("application/openmetrics-text;version=1.0.0;q=0.2")
    assert seen[0]["Accept"] == "text/plain;version=0.0.4;q=0.1"  # Envoy: text only


async def test_metrics_mixed_formats_fall_back_to_text(tmp_path):
    routes = {"/a": (200, APP_OM, OM_CT), "/t": (200, APP_TEXT, TEXT_CT)}
    async with serve_app(metrics_app(routes, [])) as port:
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"targets": [
            {"port": str(port), "path": "/a"}, {"port": str(port), "path": "/t"}]})}
        async with running_status(tmp_path, env=env) as (_, server):
            status, headers, body = await scrape(server, "application/*")
    assert headers["Content-Type"] == TEXT_CT and b"# EOF" not in body


async def test_metrics_body_cap_drops_target(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_merge, "APP_BODY_CAP", 100)
    body100 = b"# TYPE a gauge\n" + b"a " + b"1" * 82 + b"\n"
    assert len(body100) == 100
    routes = {"/ok": (200, body100, TEXT_CT), "/big": (200, body100 + b"\n", TEXT_CT)}
    async with serve_app(metrics_app(routes, [])) as port:
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"targets": [
            {"port": str(port), "path": "/ok"}, {"port": str(port), "path": "/big"}]})}
        async with running_status(tmp_path, env=env) as (_, server):
            _, _, body = await scrape(server)
    text = body.decode()
    assert text.count("# TYPE a gauge") == 1
    assert 'istio_agent_scrape_failures_total{type="application"} 1.0' in text


async def test_metrics_gzip_and_localhost_only(tmp_path):
    async with running_status(tmp_path, metrics_localhost_only=True) as (_, server):
        status, headers, body = await scrape(server, raw=True, **{"Accept-Encoding": "gzip"})
        assert status == 200 and headers.get("Content-Encoding") == "gzip"
        assert b"istio_agent_scrapes_total" in gzip.decompress(body)


async def test_large_buffered_bodies_compressed_probe_is_not(tmp_path):
    """Compression is per handler: a ≥ 1 KiB debug body is gzipped when asked, the
    bodiless readiness probe never carries a Content-Encoding."""
    many = FakeComponent("enrollment", {"pods": [{"uid": f"u{i}", "name": f"pod-{i}"}
                                                 for i in range(100)]})
    async with running_status(tmp_path, [many]) as (_, server):
        base = f"http://127.0.0.1:{server.port}"
        status, headers, body = await admin(server, "GET", "/debug/all", raw=True,
                                            headers={"Accept-Encoding": "gzip"})
        assert status == 200 and headers.get("Content-Encoding") == "gzip"
        assert b"pod-99" in gzip.decompress(body)
        status, headers, body = await admin(server, "GET", "/debug/all", raw=True,
                                            headers={"Accept-Encoding": "identity"})
        assert status == 200 and "Content-Encoding" not in headers and b"pod-99" in body
        status, headers, body = await request("GET", base + "/healthz/ready", raw=True,
                                              headers={"Accept-Encoding": "gzip"})
        assert (status, body) == (200, b"") and "Content-Encoding" not in headers


@pytest.mark.parametrize("value", ['{"targets":[{"port":"015020"}]}', '{"port":"15090"}'])
async def test_bad_annotations_stop_start_up(tmp_path, value):
    with pytest.raises(ConfigError, match="prometheus_annotations"):
        async with running_status(tmp_path, env={"ISTIO_PROMETHEUS_ANNOTATIONS": value}):
            pass


async def test_listen_failure_is_one_line_config_error(tmp_path):
    async with running_status(tmp_path) as (_, first):
        with pytest.raises(ConfigError, match="status_port.*cannot listen"):
            async with running_status(tmp_path, status_port=first.port):
                pass


async def test_large_envoy_body_streams_byte_exact(tmp_path):
    """A multi-megabyte Envoy body arrives in many socket-sized chunks split mid-line; the
    streamed copy must equal the source; the family declared a second time at the very
    end keeps its sample, its repeated TYPE line cut (its line had no final newline)."""
    from benchmarks.bench_status import envoy_like_body

    big = envoy_like_body(3 * 1024 * 1024)
    source = big + b"# TYPE envoy_cluster_m0_total counter\nenvoy_cluster_m0_total{x=\"y\"} 1"
    routes = {"/stats/prometheus": (200, source, TEXT_CT)}
    async with serve_app(metrics_app(routes, [])) as port:
        async with running_status(tmp_path, envoy_admin_port=port) as (_, server):
            _, _, body = await scrape(server)
    envoy_part = body[body.index(b"# TYPE envoy_cluster_m0_total"):]
    assert envoy_part == big + b"envoy_cluster_m0_total{x=\"y\"} 1\n"


async def test_abandoned_scrape_releases_envoy_connection(tmp_path):
    """A scrape whose client leaves while an application target is still answering must
    not keep Envoy's response checked out: the admin connection (body unread) is closed.
    The Envoy admin is a fake streaming a body it never finishes."""
    envoy_closed = asyncio.Event()

    async def envoy_stats(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": TEXT_CT})
        await resp.prepare(request)
        await resp.write(b"# TYPE envoy_server_live gauge\n")
        for _ in range(100):  # up to 5 s for the agent to let go of this connection
            if request.transport is None or request.transport.is_closing():
                envoy_closed.set()
                break
            await asyncio.sleep(0.05)
        return resp

    async def slow_app(request: web.Request) -> web.Response:
        await asyncio.sleep(1.5)  # longer than the agent's 0.8 s scrape timeout
        return web.Response(body=APP_TEXT)

    app = web.Application()
    app.router.add_get("/stats/prometheus", envoy_stats)
    app.router.add_get("/metrics", slow_app)
    async with serve_app(app) as port:
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"port": str(port)})}
        async with running_status(tmp_path, env=env, envoy_admin_port=port) as (_, server):
            with pytest.raises(asyncio.TimeoutError):
                await request("GET", f"http://127.0.0.1:{server.port}/stats/prometheus",
                              timeout=aiohttp.ClientTimeout(total=0.3),
                              headers={"X-Prometheus-Scrape-Timeout-Seconds": "0.8"})
            await asyncio.wait_for(envoy_closed.wait(), 4)
