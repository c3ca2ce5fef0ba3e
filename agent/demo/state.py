"""What one demo run holds (:class:`DemoState`): its names, paths, the agent and the
peers it started, the pods, the undo steps and the rows of the table; and how it finds
a pod's workload in the ztunnel's view.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from agent.demo.model import Check, DemoError, DemoPod, Progress, ZtunnelWorkload, resolve_runtime

if TYPE_CHECKING:
    from agent.core.config import Config
    from agent.daemon import Agent
    from agent.demo.cni_runtime import CniRuntime
    from agent.demo.envoy import EnvoyProcess
    from agent.demo.fake_ztunnel import FakeZtunnel
    from agent.demo.pod_listeners import Accepted
    from agent.demo.podman import Podman
    from agent.demo.ztunnel import ZtunnelProcess
    from ambient.xds.client import DeltaXdsClient


class DemoState:
    """The state of one run. The attributes declared here without a value are set by
    the bring-up step that starts them (:class:`agent.demo.driver.Demo`) and only used
    after it: ``config`` and ``agent`` (start_agent), ``runtime`` (start_agent, netns
    pods), ``podman`` (prepare_podman, podman pods), ``zds_client`` and ``xds_client``
    (the reference ztunnel, without ``--ztunnel``)."""

    config: Config
    agent: Agent
    runtime: CniRuntime
    podman: Podman
    zds_client: FakeZtunnel
    xds_client: DeltaXdsClient

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
        self.zds_task: asyncio.Task | None = None
        self.seen: list[Accepted] = []  # traffic that landed on the reference ztunnel's listeners
        self.ztunnel_bin: str = getattr(args, "ztunnel", "") or ""
        self.ztunnel: ZtunnelProcess | None = None  # with --ztunnel
        self.xds_tls_port = 0
        self.envoy: EnvoyProcess | None = None
        self.envoy_port = 0
        self.app_listener: socket.socket | None = None
        self.runtime_kind = resolve_runtime(getattr(args, "runtime", "auto"))
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

    @property
    def tokens_file(self) -> Path:
        return self.root / "tokens.yaml"

    @property
    def ztunnel_token_file(self) -> Path:
        return self.root / "ztunnel-token"

    def on_cleanup(self, what: str, fn: Callable[[], Any]) -> None:
        """Register an undo step; teardown runs them in reverse, each even if others fail."""
        self._cleanups.append((what, fn))

    def agent_port(self, name: str) -> int:
        component = self.agent.ctx.components.get(name)
        port = getattr(component, "port", None)
        return int(port or getattr(self.config, f"{name}_port"))

    async def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.05)

    def add(self, subject: str, what: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(subject, what, bool(ok), detail))

    def component(self, name: str) -> Any:
        """The agent's component ``name`` (its debug state, store, backend are read as
        duck-typed objects here); DemoError if the agent has none by that name."""
        found = self.agent.ctx.components.get(name)
        if found is None:
            raise DemoError(f"the agent has no component {name!r}")
        return found

    @property
    def real_ztunnel(self) -> ZtunnelProcess:
        """The ztunnel binary's process (only with ``--ztunnel``, once started)."""
        if self.ztunnel is None:
            raise DemoError("no ztunnel binary is running (--ztunnel)")
        return self.ztunnel

    def workload_for(self, pod: DemoPod) -> Any:
        """The Workload the ztunnel holds for ``pod`` (by name and IP), or None: a
        ``workload_pb2.Workload`` from the reference client, or with a real ztunnel a
        :class:`ZtunnelWorkload` read from its ``/config_dump``."""
        if self.ztunnel is not None:
            return self._ztunnel_workload(pod)
        address: Any
        for address in self.xds_client.resources().values():
            if address.WhichOneof("type") != "workload":
                continue
            w = address.workload
            if (w.name, w.namespace) == (pod.name, pod.namespace):
                ips = [str(ipaddress.ip_address(a)) for a in w.addresses]
                if pod.ip in ips:
                    return w
        return None

    def _ztunnel_workload(self, pod: DemoPod) -> ZtunnelWorkload | None:
        try:
            dump = self.real_ztunnel.config_dump()
        except Exception:  # noqa: BLE001 - not there yet: keep waiting
            return None
        for w in dump.get("workloads") or []:
            if (w.get("name"), w.get("namespace")) == (pod.name, pod.namespace) \
                    and pod.ip in (w.get("workloadIps") or []):
                return ZtunnelWorkload(w.get("name", ""), w.get("serviceAccount", ""),
                                       w.get("protocol", ""))
        return None
