"""The differential harness: one kube-apiserver, one istiod, one agent, one ztunnel-like client
per control plane, and the comparison of what the two serve.

- **Cluster**: a private kube-apiserver + etcd (scripts/kube-test-apiserver.sh), with Istio's
  own CRDs and the Gateway API CRDs of the pinned istio module installed by
  scripts/istiod-test.sh (not deploy/kubernetes/crds.yaml: istiod must find every kind it
  watches), deploy/kubernetes/rbac.yaml applied, Nodes registered, GatewayClasses created.
- **istiod**: scripts/istiod-test.sh start (ambient on, private ports); read on its plaintext
  gRPC port (15010 in a cluster).
- **agent**: ``ambient-agent run --config-source kubernetes`` as a process with a token of
  its DaemonSet ServiceAccount (deploy/kubernetes/rbac.yaml); read on its plaintext xDS port.
- **client**: :class:`tests.ztunnel_exact.xds.ZtunnelXdsClient` (written from ztunnel's
  source) with the same node (``ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local`` and
  ztunnel's metadata) for both servers; the only change is the transport: plaintext gRPC
  (:class:`PlainTarget`), because both servers are read on their plaintext ports, where
  istiod asks for no credential.

Convergence (:meth:`Oracle.converge`): after a step the harness bumps a marker Service's
port; once both clients hold the marker at the new port (both servers have seen the step's
events that precede it in their watches), it waits until both streams are quiet and the two
snapshots agree, or until both have been quiet for ``SETTLE`` seconds (then they differ for
good and the test reports how).

Normalisation (:func:`normalise`) is listed there with the reason for each rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import aiohttp
from google.protobuf import json_format

from agent.demo.envoy import free_port
from tests.kube import cluster as kc
from tests.ztunnel_exact import xds as zx

ROOT = kc.ROOT
ISTIOD_SCRIPT = os.path.join(ROOT, "scripts", "istiod-test.sh")
NODE = "oracle-node"
NODE_ZONED = "oracle-node-zoned"
MARKER_NS, MARKER_SVC = "oracle-marker", "marker"
QUIET, SETTLE, CONVERGE_TIMEOUT = 0.6, 4.0, 90.0


def require_istiod() -> bool:
    return os.environ.get("AMBIENT_REQUIRE_ISTIOD") == "1"


def go_binary() -> str | None:
    return shutil.which("go") or ("/usr/local/go/bin/go"
                                  if os.access("/usr/local/go/bin/go", os.X_OK) else None)


def why_not() -> str | None:
    """Why the differential suite cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root: the agent's host rules go into a scratch netns (as CI runs it)"
    if go_binary() is None:
        return "needs Go (go on PATH or /usr/local/go/bin/go) to build istiod"
    return None


def script_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    go = go_binary()
    if go and not shutil.which("go"):
        env["PATH"] = f"{os.path.dirname(go)}:{env.get('PATH', '')}"
    return env


class PlainTarget:
    """Stands in for :class:`tests.ztunnel_exact.tls.ControlPlaneTunnel` where the server is
    read on a plaintext port: same interface (``start``, ``close``, ``target``)."""

    def __init__(self, address: str):
        self.target = address

    async def start(self) -> "PlainTarget":
        return self

    async def close(self) -> None:
        return None


class OracleClient(zx.ZtunnelXdsClient):
    """ztunnel's delta xDS client over plaintext gRPC; records when the last response came."""

    def __init__(self, address: str, env: zx.ZtunnelEnv):
        super().__init__(env)
        self.tunnel = PlainTarget(address)  # type: ignore[assignment]
        self.last_response = time.monotonic()

    def _handle(self, resp, outbox) -> None:  # noqa: ANN001 - as the parent
        self.last_response = time.monotonic()
        super()._handle(resp, outbox)

    def quiet_for(self) -> float:
        return time.monotonic() - self.last_response


def ztunnel_env(address: str) -> zx.ZtunnelEnv:
    """What a ztunnel pod on ``NODE`` sends (no token: the plaintext port needs none).
    ``xds_address`` keeps ztunnel's https form; :class:`OracleClient` dials plaintext."""
    return zx.ZtunnelEnv(xds_address=f"https://{address}", xds_root_ca=b"", token=None,
                         cluster_id="Kubernetes", instance_ip="10.250.0.2",
                         pod_name="ztunnel-oracle", pod_namespace="istio-system",
                         node_name=NODE, proxy_metadata={"CLUSTER_ID": "Kubernetes"})


# --------------------------------------------------------------------------- normalising

def _ip(b: Any) -> str:
    raw = b if isinstance(b, bytes) else bytes(b)
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        return raw.hex()


def _walk_bytes(msg) -> Any:
    """MessageToDict, but IP bytes fields become text (both sides equally) for readable diffs."""
    d = json_format.MessageToDict(msg, preserving_proto_field_name=True)

    def fix(node: Any, m) -> Any:
        if isinstance(node, dict) and m is not None:
            for field, value in list(node.items()):
                fd = m.DESCRIPTOR.fields_by_name.get(field)
                if fd is None:
                    continue
                sub = getattr(m, field)
                if fd.type == fd.TYPE_BYTES:
                    node[field] = ([_ip(x) for x in sub] if fd.is_repeated
                                   else _ip(sub))
                elif fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                    continue  # maps here hold no bytes (Workload.services: ports)
                elif fd.message_type is not None:
                    if fd.is_repeated:
                        for item, subm in zip(value, sub):
                            fix(item, subm)
                    else:
                        fix(value, sub)
        return node
    return fix(d, msg)


def normalise(msg) -> dict:
    """One Address or Authorization as a plain dict, with these and only these rules:

    - bytes holding IPs are shown as text (presentation only);
    - ``Workload.authorization_policies`` is sorted: ztunnel keeps a workload's policies as a
      set of names it looks up (``state/policy.rs`` gathers them into a set); the order
      istiod emits is that of its krt collection, not a meaning;
    - ``Service.addresses`` and ``Workload.addresses`` keep their order (a pod's primary IP
      is first in both), no rule;
    - ``Authorization.groups`` and each group's ``rules`` are sorted: ztunnel (``rbac.rs``
      ``Authorization::matches``) takes a policy as matching when ANY group matches and a
      group as matching when ALL its rules match, so neither order can change a decision
      (istiod emits a port-level PeerAuthentication's rules in map order);
    - nothing else is touched: the matches inside a rule keep the upstream order.
    """
    d = _walk_bytes(msg)
    wl = d.get("workload")
    if wl and "authorization_policies" in wl:
        wl["authorization_policies"] = sorted(wl["authorization_policies"])
    if "groups" in d:
        for g in d["groups"]:
            if "rules" in g:
                g["rules"] = sorted(g["rules"], key=lambda r: json.dumps(r, sort_keys=True))
        d["groups"] = sorted(d["groups"], key=lambda g: json.dumps(g, sort_keys=True))
    return d


def diff(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Field-by-field differences between two normalised dicts: (path, istiod, agent)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += diff(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [(path, a, b)]


# --------------------------------------------------------------------------- event loop

class LoopThread:
    """An asyncio loop in a thread for module-long async objects; tests call :meth:`run`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="oracle-loop")
        self.thread.start()

    def run(self, coro, timeout: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --------------------------------------------------------------------------- the harness

class Oracle:
    """See the module docstring. ``start``/``stop`` are synchronous; the rest is async on
    :attr:`loop`."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.kube_dir = os.path.join(workdir, "kube")
        self.istiod_dir = os.path.join(workdir, "istiod")
        self.agent_dir = tempfile.mkdtemp(prefix="orc-")  # short: Unix socket paths
        self.loop = LoopThread()
        self.cluster: kc.KubeCluster | None = None
        self.api = None
        self.istiod_env: dict[str, str] = {}
        self.agent: subprocess.Popen | None = None
        self.agent_log = os.path.join(workdir, "agent.log")
        self.netns = "orc" + os.urandom(3).hex()
        self.clients: dict[str, OracleClient] = {}
        self.marker_seq = 0
        self.timings: dict[str, float] = {}

    # ---- processes
    def start(self) -> None:
        t0 = time.monotonic()
        env = script_env(KUBE_TEST_OWNER_PID=str(os.getpid()))
        proc = subprocess.run(["bash", kc.SCRIPT, "start", self.kube_dir], capture_output=True,
                              text=True, env=env, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"kube-test-apiserver.sh start failed: {proc.stderr[-2000:]}")
        self.cluster = kc.KubeCluster(self.kube_dir)
        self.timings["apiserver"] = time.monotonic() - t0
        t0 = time.monotonic()
        env = script_env(ISTIOD_TEST_OWNER_PID=str(os.getpid()),
                         ISTIOD_TEST_KUBECONFIG=self.cluster.kubeconfig)
        proc = subprocess.run(["bash", ISTIOD_SCRIPT, "start", self.istiod_dir],
                              capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"istiod-test.sh start failed: {proc.stderr[-3000:]}")
        self.istiod_env = kc.read_env(self.istiod_dir)
        self.timings["istiod"] = time.monotonic() - t0
        t0 = time.monotonic()
        from pyroute2 import netns
        netns.create(self.netns)
        self.loop.run(self._prepare())
        self._start_agent()
        self.loop.run(self._connect())
        self.timings["agent+clients"] = time.monotonic() - t0

    async def _prepare(self) -> None:
        assert self.cluster is not None
        self.api = await self.cluster.admin_client()
        api = self.api
        await kc.create_namespace(api, kc.AGENT_NAMESPACE)
        await kc.apply_manifest(api, "rbac.yaml")
        await kc.create_node(api, NODE, ip="10.250.0.2")
        await kc.create_node(api, NODE_ZONED, ip="10.250.0.3", labels={
            "topology.kubernetes.io/region": "region-a", "topology.kubernetes.io/zone": "zone-b",
            "topology.istio.io/subzone": "sub-c"})
        for name, controller in (("istio-waypoint", "istio.io/mesh-controller"),
                                 ("istio-remote", "istio.io/unmanaged-gateway"),
                                 ("istio-east-west", "istio.io/eastwest-controller")):
            await kc.apply(api, {"apiVersion": "gateway.networking.k8s.io/v1",
                                 "kind": "GatewayClass", "metadata": {"name": name},
                                 "spec": {"controllerName": controller}})
        await kc.create_namespace(api, MARKER_NS)
        await kc.apply(api, self._marker(0))

    def _marker(self, seq: int) -> dict:
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": MARKER_SVC, "namespace": MARKER_NS},
                "spec": {"ports": [{"name": "tcp", "port": 20000 + seq}]}}

    def _start_agent(self) -> None:
        assert self.cluster is not None
        kubeconfig = self.loop.run(kc.agent_kubeconfig(
            self.cluster, self.api, os.path.join(self.agent_dir, "agent.kubeconfig")))
        state = os.path.join(self.agent_dir, "state")
        self.agent_xds = free_port()
        self.agent_health = free_port()
        argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", state,
                "--config-source", "kubernetes", "--kubeconfig", kubeconfig,
                "--node-name", NODE, "--xds-port", str(self.agent_xds), "--xds-tls-port", "0",
                "--xds-debounce", "0.05",
                "--status-port", str(free_port()), "--health-port", str(self.agent_health),
                "--monitoring-port", str(free_port()),  # 15014 may be another agent's
                "--host-rules-netns", f"/var/run/netns/{self.netns}", "--log-level", "info",
                # the tests write Gateway status themselves (istiod's writer is off too)
                "--waypoint-status-write", "false"]
        env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=os.path.join(state, "ztunnel", "zt.sock"))
        env.pop("KUBECONFIG", None)
        with open(self.agent_log, "w") as log:
            self.agent = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=ROOT)

    async def _connect(self) -> None:
        deadline = time.monotonic() + 90
        async with aiohttp.ClientSession() as http:
            while True:
                assert self.agent is not None
                if self.agent.poll() is not None:
                    raise RuntimeError(f"agent exited: {self.tail(self.agent_log)}")
                try:
                    async with http.get(f"http://127.0.0.1:{self.agent_health}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"agent not ready: {self.tail(self.agent_log)}")
                await asyncio.sleep(0.2)
        for side, addr in (("istiod", self.istiod_env["ISTIOD_XDS_ADDR"]),
                           ("agent", f"127.0.0.1:{self.agent_xds}")):
            client = OracleClient(addr, ztunnel_env(addr))
            self.clients[side] = await client.start()
        for client in self.clients.values():
            await client.wait_ready(timeout=60)

    @staticmethod
    def tail(path: str, n: int = 40) -> str:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError as e:
            return str(e)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run(self._close(), timeout=30)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        subprocess.run(["bash", ISTIOD_SCRIPT, "stop", self.istiod_dir], capture_output=True,
                       timeout=60)
        subprocess.run(["bash", kc.SCRIPT, "stop", self.kube_dir], capture_output=True,
                       timeout=60)
        with contextlib.suppress(Exception):
            from pyroute2 import netns
            netns.remove(self.netns)
        shutil.rmtree(self.agent_dir, ignore_errors=True)
        self.loop.close()

    async def _close(self) -> None:
        for c in self.clients.values():
            await c.close()
        if self.api is not None:
            await self.api.close()

    # ---- views
    def snapshot(self, side: str) -> dict[str, dict[str, dict]]:
        """type short name ('Address'/'Authorization') -> resource name -> normalised dict."""
        c = self.clients[side]
        return {"Address": {n: normalise(m) for n, m in c.resources[zx.ADDRESS_TYPE].items()},
                "Authorization": {n: normalise(m)
                                  for n, m in c.resources[zx.AUTHORIZATION_TYPE].items()}}

    def _marker_seen(self, side: str, port: int) -> bool:
        name = f"{MARKER_NS}/{MARKER_SVC}.{MARKER_NS}.svc.cluster.local"
        res = self.clients[side].resources[zx.ADDRESS_TYPE].get(name)
        return res is not None and any(p.service_port == port for p in res.service.ports)

    async def converge(self) -> float:
        """Bump the marker, then wait as the module docstring says; returns seconds taken."""
        t0 = time.monotonic()
        self.marker_seq += 1
        port = 20000 + self.marker_seq
        await kc.apply(self.api, self._marker(self.marker_seq))
        deadline = t0 + CONVERGE_TIMEOUT
        while not all(self._marker_seen(s, port) for s in self.clients):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"marker port {port} not served by "
                                   f"{[s for s in self.clients if not self._marker_seen(s, port)]}")
            await asyncio.sleep(0.05)
        while time.monotonic() < deadline:
            quiet = min(c.quiet_for() for c in self.clients.values())
            if quiet >= SETTLE:
                break
            snaps = [self.snapshot(side) for side in self.clients]
            if quiet >= QUIET and all(x == snaps[0] for x in snaps):
                break
            await asyncio.sleep(0.1)
        return time.monotonic() - t0

    def _check_alive(self) -> None:
        if self.agent is not None and self.agent.poll() is not None:
            raise RuntimeError(f"agent exited: {self.tail(self.agent_log)}")
        pid = self.istiod_env.get("ISTIOD_PID")
        if pid and not os.path.exists(f"/proc/{pid}"):
            raise RuntimeError(f"istiod exited: "
                               f"{self.tail(os.path.join(self.istiod_dir, 'istiod.log'))}")

    def differences(self, scope: tuple[str, ...] | None) -> list[tuple[str, str, str, Any, Any]]:
        """(type, name, field path, istiod value, agent value) for every resource whose
        name is in ``scope`` (namespaces; None = all). A resource only one side has is one
        entry with path ``""``."""
        a, b = self.snapshot("istiod"), self.snapshot("agent")
        out = []
        for typ in ("Address", "Authorization"):
            for name in sorted(set(a[typ]) | set(b[typ])):
                if scope is not None and not in_scope(name, scope):
                    continue
                x, y = a[typ].get(name), b[typ].get(name)
                if x is None or y is None:
                    out.append((typ, name, "", x, y))
                    continue
                out += [(typ, name, p, u, v) for p, u, v in diff(x, y)]
        return out


def in_scope(name: str, namespaces: tuple[str, ...]) -> bool:
    """Whether a resource name belongs to one of ``namespaces``: names are
    ``<cluster>/<group>/<Kind>/<ns>/<name>[/...]`` (workloads), ``<ns>/<hostname>``
    (services) or ``<ns>/<name>`` (policies)."""
    parts = name.split("/")
    return any(parts[0] == ns or (len(parts) > 3 and parts[3] == ns) for ns in namespaces)


# --------------------------------------------------------------------------- operations

async def run_op(api, op: tuple, created: list[tuple[str, str, str, str]]) -> None:
    """Carry out one operation of tests/oracle/states.py; objects applied outside the
    case's own namespaces are appended to ``created`` (apiVersion, kind, ns, name) so the
    case can delete them."""
    kind = op[0]
    if kind == "apply":
        obj = op[1]
        await kc.apply(api, obj)
        meta = obj["metadata"]
        created.append((obj["apiVersion"], obj["kind"], meta.get("namespace", ""),
                        meta["name"]))
    elif kind == "pod":
        manifest, ips, ready, phase = op[1:]
        meta = manifest["metadata"]
        await kc.request(api, "POST", f"/api/v1/namespaces/{meta['namespace']}/pods",
                         body=manifest)
        await kc.set_pod_status(api, meta["namespace"], meta["name"], ips=ips, ready=ready,
                                phase=phase)
        created.append(("v1", "Pod", meta["namespace"], meta["name"]))
    elif kind == "podstatus":
        namespace, name, ips, ready, phase = op[1:]
        await kc.set_pod_status(api, namespace, name, ips=ips, ready=ready, phase=phase)
    elif kind == "gwstatus":
        namespace, name, addresses = op[1:]
        await kc.request(api, "PATCH", f"/apis/gateway.networking.k8s.io/v1/namespaces/"
                         f"{namespace}/gateways/{name}/status",
                         content_type="application/merge-patch+json",
                         body={"status": {"addresses": [{"type": t, "value": v}
                                                        for t, v in addresses]}})
    elif kind == "lbstatus":
        namespace, name, ips = op[1:]
        await kc.request(api, "PATCH", f"/api/v1/namespaces/{namespace}/services/{name}/status",
                         content_type="application/merge-patch+json",
                         body={"status": {"loadBalancer": {"ingress": [{"ip": i}
                                                                       for i in ips]}}})
    elif kind == "delete":
        api_version, k, namespace, name = op[1:]
        if k == "Pod":
            await kc.delete_pod(api, namespace, name)
            return
        path = await kc.object_path(api, api_version, k, name, namespace)
        try:
            await kc.request(api, "DELETE", path)
        except kc.ApiException as e:
            if e.status != 404:
                raise
    elif kind == "terminate":
        namespace, name = op[1:]
        await kc.request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")
    else:
        raise ValueError(f"unknown operation {kind!r}")


async def remove(api, namespaces: tuple[str, ...],
                 created: list[tuple[str, str, str, str]]) -> None:
    """Delete what a case made: the objects it put outside its namespaces, then its
    namespaces (as the namespace controller would, tests/kube/cluster.py)."""
    for api_version, kind, namespace, name in reversed(created):
        if namespace in namespaces or kind == "Namespace":
            continue
        path = await kc.object_path(api, api_version, kind, name, namespace)
        try:
            await kc.request(api, "DELETE", path)
        except kc.ApiException as e:
            if e.status != 404:
                raise
    for namespace in namespaces:
        await kc.delete_namespace(api, namespace)
