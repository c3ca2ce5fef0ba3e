"""Test toolkit: "pods" as real network namespaces on a real Linux bridge.

A :class:`Bridge` is a bridge device in the host netns with a gateway address; a
:class:`Pod` is a named netns (``/var/run/netns/<name>``) joined to the bridge by a
veth pair, with an IPv4 (and optionally IPv6) address, loopback up and a default
route via the bridge. Names carry a per-run random suffix so parallel runs and
leftovers from a killed run can't collide.

Everything created is torn down by ``close()``, which the pytest fixtures in
``tests/conftest.py`` always call, also when the test fails. Needs root.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import subprocess
from dataclasses import dataclass, field

from pyroute2 import IPRoute, NetNS, netns

from agent.core.netns import run_in_netns_thread

NETNS_DIR = "/var/run/netns"


def unique(prefix: str) -> str:
    """``prefix`` plus 6 random hex chars; keep prefix ≤ 8 chars so names fit IFNAMSIZ (15)."""
    return f"{prefix}{secrets.token_hex(3)}"


def is_root() -> bool:
    return os.geteuid() == 0


@dataclass
class Pod:
    """A netns "pod". ``ip``/``ip6`` are its addresses, ``netns_path`` its netns file."""

    name: str
    ip: str
    ip6: str | None
    host_veth: str
    pod_veth: str = "eth0"
    uid: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def netns_path(self) -> str:
        return os.path.join(NETNS_DIR, self.name)

    def run(self, fn, *args, **kwargs):
        """Call ``fn`` on a thread inside this pod's netns; returns its result."""
        return run_in_netns_thread(self.netns_path, fn, *args, **kwargs)

    def exec(self, *argv: str, input: str | None = None, check: bool = True,
             timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a command inside the pod (``ip netns exec``); text output captured."""
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], input=input,
                              capture_output=True, text=True, check=check, timeout=timeout)

    def connect(self, host: str, port: int, timeout: float = 2.0) -> socket.socket:
        """Open a TCP connection from inside the pod; caller closes the socket."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        def dial():
            s = socket.socket(family, socket.SOCK_STREAM)
            s.settimeout(timeout)
            try:
                s.connect((host, port))
            except BaseException:
                s.close()
                raise
            return s
        return self.run(dial)

    def listen(self, port: int, host: str = "", family: int | None = None) -> socket.socket:
        """A listening TCP socket inside the pod (it stays in the pod's netns)."""
        family = family or (socket.AF_INET6 if ":" in host else socket.AF_INET)
        def bind():
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(64)
            return s
        return self.run(bind)


class Bridge:
    """A host bridge with gateway ``<subnet>.1`` and pods attached on demand.

    ``subnet`` is an IPv4 /24 (default: a random one in 10.200.0.0/16); ``subnet6`` an
    optional IPv6 /64 (default: a random ULA) used when ``ipv6=True``.
    """

    def __init__(self, prefix: str = "tb", subnet: str | None = None, ipv6: bool = False):
        self.name = unique(prefix + "br")
        self.subnet = ipaddress.ip_network(subnet or f"10.200.{secrets.randbelow(250) + 1}.0/24")
        self.subnet6 = (ipaddress.ip_network(f"fd00:{secrets.token_hex(2)}:{secrets.token_hex(2)}::/64")
                        if ipv6 else None)
        self.gateway = str(self.subnet.network_address + 1)
        self.gateway6 = str(self.subnet6.network_address + 1) if self.subnet6 else None
        self.pods: list[Pod] = []
        self._next = 2
        self._ipr = IPRoute()
        self._ipr.link("add", ifname=self.name, kind="bridge")
        idx = self._ipr.link_lookup(ifname=self.name)[0]
        self._ipr.addr("add", index=idx, address=self.gateway, prefixlen=self.subnet.prefixlen)
        if self.subnet6:
            self._ipr.addr("add", index=idx, address=self.gateway6,
                           prefixlen=self.subnet6.prefixlen, flags=0x02)  # IFA_F_NODAD
        self._ipr.link("set", index=idx, state="up")

    def add_pod(self, name_prefix: str = "tp") -> Pod:
        """Create a netns pod on this bridge with the next free address."""
        host_num = self._next
        self._next += 1
        name = unique(name_prefix)
        ip = str(self.subnet.network_address + host_num)
        ip6 = str(self.subnet6.network_address + host_num) if self.subnet6 else None
        pod = Pod(name=name, ip=ip, ip6=ip6, host_veth=unique("tv"))
        netns.create(name)
        self.pods.append(pod)  # registered before configuring so close() cleans partial pods
        self._ipr.link("add", ifname=pod.host_veth, kind="veth",
                       peer={"ifname": pod.pod_veth, "net_ns_fd": name})
        host_idx = self._ipr.link_lookup(ifname=pod.host_veth)[0]
        self._ipr.link("set", index=host_idx, master=self._ipr.link_lookup(ifname=self.name)[0],
                       state="up")
        with NetNS(name) as ns:
            lo = ns.link_lookup(ifname="lo")[0]
            ns.link("set", index=lo, state="up")
            idx = ns.link_lookup(ifname=pod.pod_veth)[0]
            ns.addr("add", index=idx, address=ip, prefixlen=self.subnet.prefixlen)
            if ip6:
                ns.addr("add", index=idx, address=ip6, prefixlen=64, flags=0x02)
            ns.link("set", index=idx, state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=self.gateway)
            if ip6:
                ns.route("add", dst="::/0", gateway=self.gateway6, family=socket.AF_INET6)
        return pod

    def remove_pod(self, pod: Pod) -> None:
        """Delete the pod's netns (its veth goes with it) and host veth if still there."""
        try:
            netns.remove(pod.name)
        except OSError:
            pass
        for idx in self._ipr.link_lookup(ifname=pod.host_veth):
            try:
                self._ipr.link("del", index=idx)
            except Exception:  # noqa: BLE001 - already gone with the netns
                pass
        if pod in self.pods:
            self.pods.remove(pod)

    def close(self) -> None:
        """Remove every pod and the bridge. Safe to call twice."""
        for pod in list(self.pods):
            self.remove_pod(pod)
        for idx in self._ipr.link_lookup(ifname=self.name):
            self._ipr.link("del", index=idx)
        self._ipr.close()

    def __enter__(self) -> "Bridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
