"""HTTPRoute attached to a Service (parentRefs kind Service) through a real Envoy waypoint:
path and header matches, a request header set by a filter, an 80/20 weighted split over
200 requests, 404 when no rule matches, an unsupported filter named in one warning, and
no NACK. Two destination pods, each behind its own HBONE terminator (``tests/waypoint/hbone.py``,
written from ztunnel's inbound) in front of an app that says which pod it is."""

from __future__ import annotations

import json
import random

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.demo.envoy import EnvoyProcess, free_port
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint.bootstrap import BootstrapOptions, bootstrap
from ambient.waypoint.service import WaypointConfigs
from ambient.xds.server import XdsServer
from tests.waypoint.hbone import HboneTerminator, hbone_request
from tests.waypoint.split import check_split
from tests.waypoint.test_envoy_waypoint import (CA, CLIENT_ID, config_dump, dump_errors, nacks,
                                                objects, status_of, until)

pytestmark = pytest.mark.envoy


def _svc(name: str, cluster_ip: str, selector: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "demo"},
            "spec": {"clusterIP": cluster_ip, "selector": selector,
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}


def _pod(name: str, ip: str, version: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "demo", "uid": f"uid-{name}",
                         "labels": {"app": "web", "version": version},
                         "annotations": {"ambient.istio.io/redirection": "enabled"}},
            "spec": {"nodeName": "n1", "serviceAccountName": "server",
                     "containers": [{"name": "c", "ports": [{"containerPort": 8080}]}]},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


ROUTE = {
    "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
    "metadata": {"name": "split", "namespace": "demo"},
    "spec": {
        "parentRefs": [{"group": "", "kind": "Service", "name": "web", "port": 80}],
        "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/v2only"}}],
             "backendRefs": [{"name": "web-v2", "port": 80}]},
            {"matches": [{"headers": [{"name": "x-version", "value": "v1"}]}],
             "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                 "set": [{"name": "x-routed", "value": "by-header"}]}}],
             "backendRefs": [{"name": "web-v1", "port": 80}]},
            {"matches": [{"path": {"type": "PathPrefix", "value": "/split"}}],
             "backendRefs": [{"name": "web-v1", "port": 80, "weight": 80},
                             {"name": "web-v2", "port": 80, "weight": 20}],
             "timeouts": {"request": "5s"}, "retry": {"attempts": 2, "codes": [503]}},
            {"matches": [{"path": {"type": "Exact", "value": "/odd"}}],
             "filters": [{"type": "RequestMirror", "requestMirror": {
                 "backendRef": {"name": "web-v2", "port": 80}}}],
             "backendRefs": [{"name": "web-v1", "port": 80}]},
        ]}}


@pytest.fixture
async def routed(tmp_path):
    a, b = random.randint(10, 250), random.randint(10, 250)
    net, vip = f"127.{a}.{b}", f"10.97.{a}.{b}"
    ca = CA(tmp_path / "ca")
    base = [o for o in objects(net, vip) if o["kind"] in ("Namespace", "Gateway", "Service")]
    for o in base:
        if o["kind"] == "Gateway":
            o["metadata"]["annotations"] = {}
    store = ObjectStore(CollectorRegistry())
    v1 = _svc("web-v1", f"10.98.{a}.1", {"version": "v1"})
    v2 = _svc("web-v2", f"10.98.{a}.2", {"version": "v2"})
    store.apply([(o, "test") for o in [*base, v1, v2, _pod("p1", f"{net}.2", "v1"),
                                       _pod("p2", f"{net}.3", "v2"), ROUTE]])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    token = tmp_path / "xds-token"
    token.write_text("s3cret")
    registry = CollectorRegistry()
    server = XdsServer(index, port=0, debounce=0.02, debounce_max=0.1, registry=registry,
                       token_file=str(token), waypoints=WaypointConfigs(store, index, issuer=ca))
    await server.start()
    runners, terms = [], []
    for ip, version in ((f"{net}.2", "v1"), (f"{net}.3", "v2")):
        async def handler(request: web.Request, version=version) -> web.Response:
            return web.json_response({"pod": version, "path": request.path,
                                      "routed": request.headers.get("x-routed", "")})
        app = web.Application()
        app.router.add_get("/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, ip, 8080).start()
        runners.append(runner)
        chain, key = ca.leaf("spiffe://cluster.local/ns/demo/sa/server")
        terms.append(await HboneTerminator(ip, chain=chain, key=key, root=ca.root_pem()).start())
    boot = bootstrap(BootstrapOptions(namespace="demo", gateway="wp", xds_port=server.port,
                                      token="s3cret", admin_port=free_port(),
                                      node_ip=f"{net}.1", hbone_bind=f"{net}.1"))
    envoy = EnvoyProcess(boot, tmp_path / "envoy").start()
    client_chain, client_key = ca.leaf(CLIENT_ID)

    async def get(path: str, headers: str = "") -> tuple[int, dict]:
        req = (f"GET {path} HTTP/1.1\r\nHost: web\r\n{headers}Connection: close\r\n\r\n").encode()
        _, raw, _ = await hbone_request((f"{net}.1", 15008), f"{vip}:80", req,
                                        chain=client_chain, key=client_key, root=ca.root_pem())
        body = raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""
        try:
            parsed = json.loads(body) if body.startswith(b"{") else {}
        except ValueError:
            parsed = {}
        return status_of(raw), parsed

    try:
        yield {"get": get, "envoy": envoy, "registry": registry, "store": store}
    finally:
        envoy.stop()
        for t in terms:
            await t.stop()
        for r in runners:
            await r.cleanup()
        await server.stop(0.2)
        index.stop()


async def test_httproute_matches_weights_and_404(routed, caplog):
    env = routed
    await env["envoy"].wait_ready_async(30)

    async def up():
        try:
            return (await env["get"]("/v2only/a"))[0] == 200
        except (OSError, TimeoutError):
            return False
    await until(up, 20, "the routed waypoint")

    status, body = await env["get"]("/v2only/a")
    assert (status, body["pod"]) == (200, "v2")
    status, body = await env["get"]("/v2onlyx")  # PathPrefix matches whole path elements
    assert status == 404
    status, body = await env["get"]("/any", "x-version: v1\r\n")
    assert (status, body["pod"], body["routed"]) == (200, "v1", "by-header")
    assert (await env["get"]("/nothing-matches"))[0] == 404
    status, body = await env["get"]("/odd")
    assert (status, body["pod"]) == (200, "v1")
    assert sum("spec.rules[3].filters[0].type' 'RequestMirror'" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING") == 1

    async def draw(n: int) -> list[str]:
        pods = []
        for _ in range(n):
            status, body = await env["get"]("/split")
            assert status == 200
            pods.append(body["pod"])
        return pods
    await check_split(draw, "v1", "v2")  # 80 % +- 8 points of 200

    dump = await config_dump(env["envoy"])
    assert dump_errors(dump) == []
    assert nacks(env["registry"]) == 0
