"""The real pod netns operations (:class:`cni.enrollment.api.NetnsOps`): setns(2), the
in-pod rules, the ``/proc`` scan. Everything here needs root (``tests/netns``); the
reconciler above it is tested without root against a fake.

Upstream: ``cni/pkg/nodeagent/netns_linux.go`` (open and enter a netns),
``podcgroupns.go`` (find a pod's netns from ``/proc``), ``net_linux.go`` (apply the
in-pod ruleset inside the netns).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import logging
import os
import socket
import struct
from typing import Callable, Mapping

from agent.core import netns as netns_mod
from cni import podnetns
from cni import rules_detect
from cni.enrollment.api import HostNetnsRefused, NetnsGone
from cni.rules_common import RuleOptions
from cni.rules_detect import Backend as RulesBackend

log = logging.getLogger(__name__)

IFF_UP, SIOCGIFFLAGS = 0x1, 0x8913  # <linux/if.h>, <linux/sockios.h>


class LoopbackDown(Exception):
    """The pod netns's ``lo`` is down (or missing): checked before any rule is applied,
    since the in-pod routes (``local 0.0.0.0/0 dev lo``) need it up. The runtime brings
    ``lo`` up before it runs chained plugins, so this means a broken sandbox."""


class KernelNetns:
    """:class:`cni.enrollment.api.NetnsOps` on the running kernel. ``host_netns`` is
    taken at construction."""

    def __init__(self) -> None:
        self._host_netns = podnetns.host_netns_id()

    @property
    def host_netns(self) -> tuple[int, int]:
        return self._host_netns

    def open(self, path: str) -> int:
        """The netns at ``path``, refused (:class:`HostNetnsRefused`, fd closed) when it is
        the agent's own netns (taken at construction) or pid 1's, compared by
        ``(st_ino, st_dev)``: a bind mount, ``/proc/<pid>/ns/net`` of any host process
        or a symlink all name the same namespace."""
        fd = netns_mod.open_netns(path)
        try:
            st = os.fstat(fd)
            if (st.st_ino, st.st_dev) in self._node_netns():
                raise HostNetnsRefused(path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _node_netns(self) -> set[tuple[int, int]]:
        ids = {self._host_netns}
        try:  # pid 1's: the host's when the agent runs in a container without hostNetwork
            st = os.stat("/proc/1/ns/net")
            ids.add((st.st_ino, st.st_dev))
        except OSError:
            pass
        return ids

    def close(self, fd: int) -> None:
        os.close(fd)

    def inode(self, fd: int) -> int:
        return os.fstat(fd).st_ino

    def holds(self, path: str, inode: int) -> bool:
        try:
            return os.stat(path).st_ino == inode
        except OSError:
            return False

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def apply_rules(self, fd: int, backend: RulesBackend, opts: RuleOptions, label: str,
                    known: bool) -> str:
        """In the pod netns (worker thread): check ``lo`` is up, then apply the ruleset in
        the stack the netns already holds our rules in, if any (:func:`rules_detect.apply`:
        a pod never gets a second copy in another stack, e.g. after the recorded iptables
        flavor was lost), else with ``backend``. ``known``: the agent has a record of the
        pod (always looked at; else only when our routing is there)."""
        with netns_mod.entered(fd):
            label = label or f"fd {fd}"
            require_loopback_up(label)
            outcome, used, strays = rules_detect.apply(backend, opts, known)
            if used is not backend:
                log.warning("pod netns %s holds our rules in %s, not in the agent's %s: "
                            "reconciled them there", label, rules_detect.stack_of(used),
                            rules_detect.stack_of(backend))
            for stray in strays:
                log.warning("pod netns %s also held our rules in %s: removed", label,
                            rules_detect.stack_of(stray))
            return outcome

    def delete_rules(self, target: int | str, backend: RulesBackend, ipv6: bool,
                     during: Callable[[], None] | None = None) -> None:
        """In the pod netns: our rules out of every stack holding them, then the routing
        (``during``: see :func:`rules_detect.delete_everywhere`)."""
        try:
            with netns_mod.entered(target):
                rules_detect.delete_everywhere(backend, ipv6, during)
        except netns_mod.NetnsError as e:
            if isinstance(target, str):  # vanished between the check and the entry
                raise NetnsGone(e.errno, str(e)) from None
            raise

    def find(self, wanted: Mapping[str, tuple[str, list[str]]], proc_dir: str
             ) -> dict[str, str]:
        paths: dict[str, str] = {}
        recorded = [(uid, netns, ips) for uid, (netns, ips) in wanted.items()
                    if netns and os.path.exists(netns)]
        # each check enters the netns (on this private pool's thread, which is back
        # in the agent's netns after) and lists its addresses: a few syscalls, run
        # side by side since restart recovery waits for them
        with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(4, len(recorded) or 1),
                thread_name_prefix="netns-check") as pool:
            held = pool.map(lambda item: podnetns.netns_holds_ip(
                item[1], item[2], own_thread=False), recorded)
            for (uid, netns, _), ok in zip(recorded, held):
                if ok:
                    paths[uid] = netns
        missing = {u: ips for u, (_, ips) in wanted.items() if u not in paths}
        if missing:
            for uid, hit in podnetns.scan(proc_dir, missing, self._host_netns).items():
                os.close(hit.fd)
                paths[uid] = hit.path
        return paths


def require_loopback_up(netns_label: str) -> None:
    """Raise :class:`LoopbackDown` unless ``lo`` of the calling thread's netns is up.
    ``SIOCGIFFLAGS`` on a socket made here (a socket belongs to the netns it was created
    in): ~10 µs, where a netlink dump costs ~1 ms."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            ifreq = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags, state = struct.unpack("16sH14x", ifreq)[1], "down"
    except OSError as e:
        flags, state = 0, f"unusable ({e.strerror})"
    if not flags & IFF_UP:
        raise LoopbackDown(f"loopback interface 'lo' in the pod netns {netns_label} is {state} "
                           "(the runtime brings it up before running chained plugins: the "
                           "sandbox is broken or something set lo down)")


def ipset_exists(name: str, netns: str | None) -> bool:
    """Whether ipset ``name`` exists in the node netns (``netns`` path, None = ours)."""
    from pyroute2 import IPSet
    from pyroute2.netlink.exceptions import NetlinkError

    def probe() -> bool:
        try:
            with IPSet() as ipset:
                list(ipset.list(name))  # a generator: errors surface only when consumed
            return True
        except (NetlinkError, OSError):
            return False
    return netns_mod.run_in_netns(netns, probe) if netns else probe()
