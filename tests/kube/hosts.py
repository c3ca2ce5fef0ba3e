"""Two hosts without Kubernetes, each a network namespace, sharing workloads through the
real kube-apiserver (tests/kube/conftest.py) used as a store only: the harness of
``test_two_hosts.py`` and ``test_two_hosts_rotation.py`` (:func:`two_hosts`).

Layout (every name carries this run's suffix; all of it is removed at the end, also when
the test fails):

- two "host" netns, each joined to the root netns by a veth (the API server's link) and
  to each other by a third veth (the hosts' network; each host routes the other's pod
  subnet over it, so the root netns forwards nothing);
- the API server listens on 127.0.0.1 of the root netns: a TCP pass-through
  (:class:`tests.kube.proxy.TcpProxy`) on each root-side veth address forwards to it
  unchanged (TLS end to end). The hosts reach it as ``https://kubernetes:<port>``:
  ``ip netns exec`` bind-mounts ``/etc/netns/<host>/hosts`` over ``/etc/hosts``, which
  maps ``kubernetes`` (a SAN of the server's certificate) to the root-side address;
- in each host, ``ambient-agent run`` (a subprocess under ``ip netns exec``) with
  ``config_source: kubernetes``, ``workload_registration: workloadentry`` and the
  DaemonSet's ServiceAccount token under the shipped rbac.yaml + deploy/registration/rbac-registration.yaml,
  its own state dir, CNI conf/bin dirs (``cni_manage_config`` chains istio-cni into the
  host's bridge + host-local conflist), and one mesh root for both: either one shared
  root file (``ca_cert_file``) or the cluster CA Secret of a system namespace the caller
  prepared (``ca_kubernetes_secret``, docs/trust.md);
- with a real ztunnel (``AMBIENT_TEST_ZTUNNEL``) one ztunnel per host (its fixed ports are
  per netns), authenticated to its agent by a bearer token (``tokens_file``);
- one pod per host: a named netns set up by the real CNI chain (loopback, then bridge +
  host-local + istio-cni, the plugins run inside the host netns), named only by
  ``K8S_POD_NAME`` as podman names it; ambient (redirected to ztunnel) only with ztunnel;
- an echo listener (:func:`agent.demo.traffic.echo_forever`) on :data:`APP_PORT` in the
  pod of host B.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from agent.demo.traffic import close_listener, echo_forever, exchange, listen
from ambient.xds.client import DeltaXdsClient
from agent.core.netns import run_in_netns_thread
from tests.kube import cluster as kc
from tests.kube.proxy import TcpProxy

ROOT = Path(kc.ROOT)
ZTUNNEL = os.environ.get("AMBIENT_TEST_ZTUNNEL", "")
HAVE_ZTUNNEL = bool(ZTUNNEL and os.access(ZTUNNEL, os.X_OK))
CNI_PLUGIN_DIRS = ["/usr/lib/cni", "/opt/cni/bin"]
APP_PORT = 8080
ZT_ADMIN, ZT_STATS = 15100, 15101  # ztunnel's admin/stats ports inside each host netns
AGENT_BIN = str(Path(sys.executable).parent / "ambient-agent")

# Run inside a host netns (ip netns exec): the CNI calls a runtime makes for one pod.
CNI_ADD = r"""
import json, sys
from agent.demo.cni_runtime import CniRuntime
req = json.load(sys.stdin)
rt = CniRuntime(bin_dirs=req["bins"], cache_dir=req["cache"])
rt.exec_plugin("ADD", {"cniVersion": "1.0.0", "name": "lo", "type": "loopback"},
               req["cid"], req["netns"], "lo", req["args"])
print(json.dumps(rt.add(req["conflist"], req["cid"], req["netns"], "eth0", req["args"])))
"""


def sh(*argv: str, timeout: float = 60, check: bool = True,
       **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}): "
                             f"{proc.stderr.strip()[-2000:]}")
    return proc


def free_block() -> ipaddress.IPv4Network:
    """A /24 in 10.214.0.0/16 overlapping no address of the root netns."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        used = [ipaddress.ip_network(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}",
                                     strict=False)
                for a in ipr.get_addr(family=socket.AF_INET)]
    for _ in range(200):
        net = ipaddress.ip_network(f"10.214.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise AssertionError("no free /24 in 10.214.0.0/16")


class Host:
    """One host: its netns, addresses, agent, optional ztunnel and one pod."""

    def __init__(self, letter: str, suffix: str, work: Path, block: ipaddress.IPv4Network,
                 index: int):
        self.letter = letter
        self.netns = f"th{letter}-{suffix}"
        self.netns_path = f"/var/run/netns/{self.netns}"
        self.node = f"host-{letter}-{suffix}"
        self.root_if, self.host_if = f"th{letter}r{suffix}", f"th{letter}h{suffix}"
        base = int(block.network_address)
        # /30 to the root netns: .1/.2 (host a), .5/.6 (host b)
        self.root_ip = str(ipaddress.ip_address(base + 4 * index + 1))
        self.ip = str(ipaddress.ip_address(base + 4 * index + 2))
        self.peer_ip = str(ipaddress.ip_address(base + 9 + index))  # a-b link .9/.10
        self.pod_subnet = ipaddress.ip_network(f"{ipaddress.ip_address(base + 64 + 32 * index)}/27")
        self.dir = work / letter
        self.state = self.dir / "state"
        self.conf_dir, self.bin_dir = self.dir / "net.d", self.dir / "bin"
        self.pod_name = f"app-{letter}"
        self.pod_netns = f"th{letter}p-{suffix}"
        self.pod_ip = ""
        self.agent: subprocess.Popen | None = None
        self.ztunnel: subprocess.Popen | None = None
        self.xds: DeltaXdsClient | None = None
        self.proxy: TcpProxy | None = None

    def log(self, name: str) -> str:
        """The last 3000 characters of ``name`` in this host's directory (for messages)."""
        return self.full_log(name)[-3000:]

    def full_log(self, name: str) -> str:
        try:
            return (self.dir / name).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def get(self, port: int, path: str) -> tuple[int, str]:
        """HTTP GET http://127.0.0.1:port/path inside this host's netns."""
        def go():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    return r.status, r.read().decode(errors="replace")
            except urllib.error.HTTPError as e:
                return e.code, ""
            except OSError as e:
                return 0, str(e)
        return run_in_netns_thread(self.netns_path, go)


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


async def until(what: str, predicate, timeout: float, detail=lambda: "") -> None:
    """Poll ``predicate`` (sync, run off the loop) every 0.25 s; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        if await asyncio.to_thread(predicate):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}. {detail()}",
                        pytrace=False)
        await asyncio.sleep(0.25)


def build_network(a: Host, b: Host, cleanups: list) -> None:
    for h in (a, b):
        sh("ip", "netns", "add", h.netns)
        cleanups.append(lambda h=h: sh("ip", "netns", "del", h.netns, check=False))
        etc = Path("/etc/netns") / h.netns
        etc.mkdir(parents=True, exist_ok=True)
        cleanups.append(lambda etc=etc: shutil.rmtree(etc, ignore_errors=True))
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{h.root_ip} kubernetes\n")
        sh("ip", "link", "add", h.root_if, "type", "veth", "peer", "name", h.host_if)
        cleanups.append(lambda h=h: sh("ip", "link", "del", h.root_if, check=False))
        sh("ip", "link", "set", h.host_if, "netns", h.netns)
        sh("ip", "addr", "add", f"{h.root_ip}/30", "dev", h.root_if)
        sh("ip", "link", "set", h.root_if, "up")
        ns = ("ip", "-n", h.netns)
        sh(*ns, "addr", "add", f"{h.ip}/30", "dev", h.host_if)
        sh(*ns, "link", "set", h.host_if, "up")
        sh(*ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", h.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    link_a, link_b = f"tha2b{a.netns[-4:]}", f"thb2a{a.netns[-4:]}"
    sh("ip", "link", "add", link_a, "netns", a.netns, "type", "veth", "peer", "name", link_b,
       "netns", b.netns)
    for h, other, link in ((a, b, link_a), (b, a, link_b)):
        ns = ("ip", "-n", h.netns)
        sh(*ns, "addr", "add", f"{h.peer_ip}/30", "dev", link)
        sh(*ns, "link", "set", link, "up")
        sh(*ns, "route", "add", str(other.pod_subnet), "via", other.peer_ip)


def write_host_files(h: Host, namespace: str, kubeconfig: str, ca: tuple[str, str] | None,
                     ztunnel_token: str, extra_env: dict[str, str] | None = None
                     ) -> dict[str, str]:
    """The host's CNI conflist and tokens file; returns the agent's environment. ``ca``:
    (root cert, key) files, or None for the cluster CA Secret (``extra_env`` then names
    the system namespace)."""
    for d in (h.state, h.conf_dir, h.bin_dir, h.dir / "ipam", h.dir / "cni-cache"):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    conflist = {"cniVersion": "1.0.0", "name": f"net-{h.letter}", "plugins": [
        {"type": "bridge", "bridge": f"thbr{h.letter}", "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": str(h.pod_subnet)}]],
                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(h.dir / "ipam")}}]}
    (h.conf_dir / "10-net.conflist").write_text(json.dumps(conflist))
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "PYTHONPATH": str(ROOT),
        "AMBIENT_AGENT_CONFIG_FILE": os.devnull,
        "AMBIENT_AGENT_STATE_DIR": str(h.state),
        "NODE_NAME": h.node,
        "AMBIENT_AGENT_CONFIG_SOURCE": "kubernetes",
        "KUBECONFIG": kubeconfig,
        "AMBIENT_AGENT_WORKLOAD_REGISTRATION": "workloadentry",
        "AMBIENT_AGENT_REGISTRATION_RUNTIME": "none",
        "AMBIENT_AGENT_REGISTRATION_NAMESPACE": namespace,
        "AMBIENT_AGENT_REGISTRATION_GRACE": "60s",
        "MOUNTED_CNI_NET_DIR": str(h.conf_dir),
        "CNI_BIN_DIR": str(h.bin_dir),
        "AMBIENT_AGENT_CNI_MANAGE_CONFIG": "true",
        "ZTUNNEL_UDS_ADDRESS": str(h.state / "ztunnel.sock"),
        "AMBIENT_AGENT_XDS_ADDRESS": "0.0.0.0",  # the test's xDS client is in the root netns
        "EXCLUDE_NAMESPACES": "kube-system",
        "LOG_LEVEL": "info",
    }
    if ca is not None:
        env["AMBIENT_AGENT_CA_CERT_FILE"], env["AMBIENT_AGENT_CA_KEY_FILE"] = ca
    env.update(extra_env or {})
    if ztunnel_token:
        tokens = h.dir / "tokens.yaml"
        tokens.write_text(yaml.safe_dump({ztunnel_token: "istio-system/ztunnel"}))
        tokens.chmod(0o600)
        env["AMBIENT_AGENT_TOKENS_FILE"] = str(tokens)
    return env


def start_agent(h: Host, env: dict[str, str]) -> None:
    log = open(h.dir / "agent.log", "ab")
    try:
        h.agent = subprocess.Popen(["ip", "netns", "exec", h.netns, AGENT_BIN, "run"], env=env,
                                   cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


def chained(h: Host) -> dict | None:
    try:
        conflist = json.loads((h.conf_dir / "10-net.conflist").read_text())
    except (OSError, ValueError):
        return None
    return conflist if any(p.get("type") == "istio-cni" for p in conflist["plugins"]) else None


def access_lines(log: str, direction: str, src: str, dst: str) -> list[str]:
    """ztunnel's access-log lines (target ``access``, "connection complete", its
    ``src/proxy/metrics.rs``) for one connection ``direction`` ("outbound" at the source
    ztunnel, "inbound" at the destination's) between SPIFFE IDs ``src`` and ``dst``."""
    return [line for line in log.splitlines()
            if "connection complete" in line and f'direction="{direction}"' in line
            and f'src.identity="{src}"' in line and f'dst.identity="{dst}"' in line]


def start_ztunnel(h: Host, token_file: Path, extra_env: dict[str, str] | None = None) -> None:
    """ztunnel in the host's netns against its agent (``extra_env``: more of ztunnel's
    own settings, e.g. ``SECRET_TTL``)."""
    from agent.demo.ztunnel import ZtunnelSettings

    settings = ZtunnelSettings(
        binary=ZTUNNEL, xds_address="localhost:15012",
        root_cert=str(h.state / "mesh-root" / "root-cert.pem"), token_file=str(token_file),
        zds_socket=str(h.state / "ztunnel.sock"), node_name=h.node,
        admin_port=ZT_ADMIN, stats_port=ZT_STATS, extra_env=dict(extra_env or {}))
    log = open(h.dir / "ztunnel.log", "ab")
    try:
        h.ztunnel = subprocess.Popen(["ip", "netns", "exec", h.netns, ZTUNNEL, "proxy"],
                                     env=settings.env(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


def cni_add(h: Host, ambient: bool) -> str:
    conflist = chained(h)
    assert conflist, f"istio-cni not chained into {h.conf_dir}"
    for p in conflist["plugins"]:
        if p.get("type") == "istio-cni":
            # no Pod object and no runtime labels: the network's default decides
            p["ambient_default"] = ambient
    req = {"bins": [str(h.bin_dir)] + CNI_PLUGIN_DIRS, "cache": str(h.dir / "cni-cache"),
           "cid": secrets.token_hex(32), "netns": f"/var/run/netns/{h.pod_netns}",
           "args": {"K8S_POD_NAME": h.pod_name}, "conflist": conflist}
    proc = sh("ip", "netns", "exec", h.netns, sys.executable, "-c", CNI_ADD,
              input=json.dumps(req), timeout=120, cwd=str(ROOT), check=False,
              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if proc.returncode:
        raise AssertionError(f"CNI ADD of {h.pod_name} in {h.netns} failed: "
                             f"{proc.stderr.strip()[-2000:]}\nagent log: {h.log('agent.log')}")
    result = json.loads(proc.stdout)
    return result["ips"][0]["address"].split("/")[0]


def xds_workloads(h: Host, namespace: str) -> dict[str, tuple[list[str], str]]:
    """name -> (IPs, tunnel protocol) of this namespace's workloads the agent serves."""
    from ambient import workload_pb2 as wl

    out = {}
    for address in h.xds.resources().values():
        if address.WhichOneof("type") == "workload" and address.workload.namespace == namespace:
            w = address.workload
            out[w.name] = ([str(ipaddress.ip_address(x)) for x in w.addresses],
                           wl.TunnelProtocol.Name(w.tunnel_protocol))
    return out




class TwoHosts:
    """What :func:`two_hosts` set up: ``a``, ``b`` (:class:`Host`, pods running, B's echo
    listener on :data:`APP_PORT`), ``ztunnel`` (whether a real ztunnel runs on each),
    ``identity`` (the pods' SPIFFE ID: both run as ``default`` of the namespace),
    ``work`` (this run's directory)."""

    def __init__(self, a: Host, b: Host, ztunnel: bool, identity: str, work: Path):
        self.a, self.b, self.ztunnel, self.identity, self.work = a, b, ztunnel, identity, work

    def pod_path(self, h: Host) -> str:
        return f"/var/run/netns/{h.pod_netns}"

    async def first_exchange(self, timeout: float = 60) -> None:
        """Wait until pod A gets its ``ping`` echoed by pod B (through both ztunnels when
        they run: the first connection also waits for ztunnel's certificates)."""
        a, b = self.a, self.b
        reply = b""
        deadline = time.monotonic() + timeout
        while reply != b"ping\n" and time.monotonic() < deadline:
            reply = await asyncio.to_thread(run_in_netns_thread, self.pod_path(a),
                                            lambda: exchange(b.pod_ip, APP_PORT, b"ping\n"))
            if reply != b"ping\n":
                await asyncio.sleep(1)
        assert reply == b"ping\n", (
            f"pod {a.pod_ip} on {a.netns} got {reply!r} from {b.pod_ip}:{APP_PORT} on "
            f"{b.netns}" + (f"\nztunnel a: {a.log('ztunnel.log')}\nztunnel b: "
                            f"{b.log('ztunnel.log')}" if self.ztunnel else ""))


def write_root_files(work: Path) -> tuple[str, str]:
    """A new self-signed mesh root as (cert file, key file 0600) under ``work``."""
    from agent.sds.ca_embedded import create_root
    from cryptography.hazmat.primitives import serialization

    cert, key = create_root("cluster.local")
    ca = (str(work / "root.pem"), str(work / "root.key"))
    Path(ca[0]).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(ca[1]).write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    os.chmod(ca[1], 0o600)
    return ca


@contextlib.asynccontextmanager
async def two_hosts(kube_cluster, kube_admin, namespace: str, *, root_files: bool = True,
                    agent_env: dict[str, str] | None = None,
                    ztunnel_env: dict[str, str] | None = None):
    """Set up the module docstring's layout and yield a :class:`TwoHosts`; everything is
    removed on exit, also when setting up or the test fails.

    ``root_files``: one shared root file for both agents (else the cluster CA Secret,
    whose system namespace ``agent_env`` must name); ``agent_env`` / ``ztunnel_env``: more
    settings for every agent / ztunnel. Checked on the way: each agent chains istio-cni
    and serves both pods' WorkloadEntries (``<pod>-<node>``) with the other host's pod IP
    over workload xDS (to the reference client, ambient/xds/client.py), HBONE when ztunnel
    runs; each ztunnel is ready."""
    await kc.apply_manifest(kube_admin, kc.REGISTRATION_RBAC)
    suffix = secrets.token_hex(2)
    block = await asyncio.to_thread(free_block)
    work = Path(f"/run/th-{suffix}")  # short: Unix socket paths live under it
    work.mkdir(mode=0o700)
    a, b = Host("a", suffix, work, block, 0), Host("b", suffix, work, block, 1)
    hosts = (a, b)
    cleanups: list = [lambda: shutil.rmtree(work, ignore_errors=True)]
    api_port = int(kube_cluster.url.rsplit(":", 1)[1])
    try:
        await asyncio.to_thread(build_network, a, b, cleanups)
        ca = await asyncio.to_thread(write_root_files, work) if root_files else None
        token = secrets.token_urlsafe(32) if HAVE_ZTUNNEL else ""
        token_file = work / "ztunnel-token"
        if token:
            token_file.write_text(token)
            token_file.chmod(0o600)
        for h in hosts:
            h.proxy = await TcpProxy(api_port, listen_host=h.root_ip).start()
            kubeconfig = await kc.agent_kubeconfig(
                kube_cluster, kube_admin, str(work / f"{h.letter}.kubeconfig"),
                server=f"https://kubernetes:{h.proxy.port}")
            env = write_host_files(h, namespace, kubeconfig, ca, token, agent_env)
            start_agent(h, env)
            cleanups.append(lambda h=h: stop_process(h.agent))
        for h in hosts:
            await until(f"the agent on {h.netns} to chain istio-cni into {h.conf_dir}",
                        lambda h=h: chained(h) is not None or h.agent.poll() is not None,
                        timeout=120, detail=lambda h=h: h.log("agent.log"))
            assert h.agent.poll() is None, f"agent on {h.netns} exited: {h.log('agent.log')}"
            h.xds = DeltaXdsClient(f"{h.ip}:15010", metadata={"NODE_NAME": h.node})
            await h.xds.connect()
            await h.xds.wait_synced(timeout=60)
        if HAVE_ZTUNNEL:
            for h in hosts:
                start_ztunnel(h, token_file, ztunnel_env)
                cleanups.append(lambda h=h: stop_process(h.ztunnel))
            for h in hosts:
                await until(f"ztunnel in {h.netns} ready (:15021/healthz/ready)",
                            lambda h=h: h.get(15021, "/healthz/ready")[0] == 200
                            or h.ztunnel.poll() is not None, timeout=90,
                            detail=lambda h=h: h.log("ztunnel.log"))
                assert h.ztunnel.poll() is None, f"ztunnel exited: {h.log('ztunnel.log')}"

        for h in hosts:
            sh("ip", "netns", "add", h.pod_netns)
            cleanups.append(lambda h=h: sh("ip", "netns", "del", h.pod_netns, check=False))
            h.pod_ip = await asyncio.to_thread(cni_add, h, HAVE_ZTUNNEL)
            assert ipaddress.ip_address(h.pod_ip) in h.pod_subnet, (h.pod_ip, h.pod_subnet)

        want = {f"{h.pod_name}-{h.node}": ([h.pod_ip], "HBONE" if HAVE_ZTUNNEL else "NONE")
                for h in hosts}
        for h in hosts:
            try:
                await h.xds.wait(lambda h=h: all(xds_workloads(h, namespace).get(n) == v
                                                 for n, v in want.items()), timeout=90)
            except (asyncio.TimeoutError, TimeoutError):
                pytest.fail(f"agent on {h.netns} serves {xds_workloads(h, namespace)}, "
                            f"want {want}. agent log: {h.log('agent.log')}", pytrace=False)

        listener = await asyncio.to_thread(run_in_netns_thread, f"/var/run/netns/{b.pod_netns}",
                                           lambda: listen(APP_PORT))
        cleanups.append(lambda: close_listener(listener))
        threading.Thread(target=echo_forever, args=(listener,), daemon=True).start()
        yield TwoHosts(a, b, HAVE_ZTUNNEL,
                       f"spiffe://cluster.local/ns/{namespace}/sa/default", work)
    finally:
        for h in hosts:
            if h.xds is not None:
                with contextlib.suppress(Exception):
                    await h.xds.close()
        for fn in reversed(cleanups):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(fn)
        for h in hosts:
            if h.proxy is not None:
                await h.proxy.stop()
