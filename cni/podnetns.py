"""Finding running pods' network namespaces by scanning ``/proc`` (``docs/enrollment.md``).

Used at agent start for pods enrolled before a restart whose netns path we don't have
(or whose recorded path is gone), and for running pods that become ambient
(:mod:`cni.enrollment.watch`): for every process, read its cgroup path to get the pod UID (or,
for a podman container, named by its container ID, that ID), and take its ``ns/net``
if that netns really holds the pod's IP.

Upstream rules kept here, each for a reason:
- skip the host netns: a hostNetwork pod's processes live there (istio#55139). We
  compare with the agent's own netns taken at start, since ``/proc/1/ns`` is
  unreadable in some sandboxes (``docs/maintainers/testing.md``, pitfall 7);
- a process's cgroup may name pod A while it sits in pod B's netns, so the pod IP must
  be an address inside the netns, and a rejected netns is not marked "seen" (the
  rightful pod may still claim it);
- a pod may have several netns (sandbox recreated): the oldest process wins.

Everything here blocks (it reads /proc and enters netns); run it in a worker thread.
"""

from __future__ import annotations

import array
import dataclasses
import fcntl
import ipaddress
import logging
import os
import socket
import struct


from agent.core import netns as netns_mod
from agent.core.podcgroup import canonical_uid, parse_cgroup

log = logging.getLogger(__name__)

def starttime(proc_dir: str, pid: str) -> int:
    """Field 22 of ``<pid>/stat`` (clock ticks since boot), parsed after the last ``)``."""
    with open(os.path.join(proc_dir, pid, "stat")) as f:
        text = f.read()
    return int(text[text.rindex(")") + 1:].split()[19])


_SIOCGIFCONF = 0x8912
_IFREQ = 40  # sizeof(struct ifreq) on 64-bit Linux: 16-byte name + 24-byte union
_IFCONF = struct.Struct("iL")  # struct ifconf: int ifc_len; (padding) char *ifc_buf


def _ipv4_addresses() -> set[str]:
    """IPv4 interface addresses of the calling thread's netns, by ``SIOCGIFCONF`` on a
    socket made there (~20 µs; a netlink address dump through pyroute2 costs ~1 ms,
    which restart recovery would pay per pod). Raises OSError."""
    size = 64
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        while True:
            buf = array.array("B", bytes(_IFREQ * size))
            ifc = fcntl.ioctl(sock.fileno(), _SIOCGIFCONF,
                              _IFCONF.pack(len(buf), buf.buffer_info()[0]))
            used = _IFCONF.unpack(ifc)[0]
            if used < len(buf):  # everything fitted
                break
            size *= 4
    raw = buf.tobytes()
    # each ifreq: name[16], then struct sockaddr_in (family, port, 4-byte address)
    return {socket.inet_ntoa(raw[off + 20:off + 24]) for off in range(0, used, _IFREQ)}


def _ipv6_addresses() -> set[str]:
    """IPv6 interface addresses of the calling thread's netns, from
    ``/proc/thread-self/net/if_inet6`` (procfs ``net/`` entries follow the reader's
    netns; the file is missing when IPv6 is off)."""
    try:
        with open("/proc/thread-self/net/if_inet6") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return set()
    out = set()
    for line in lines:
        if len(line) >= 32:
            out.add(str(ipaddress.IPv6Address(bytes.fromhex(line[:32]))))
    return out


def netns_addresses() -> set[str]:
    """Every interface address in the calling thread's netns (v4-mapped shown unmapped):
    IPv4 by ioctl and IPv6 from procfs, each a few µs; a netlink dump when either
    fails."""
    try:
        return {_unmap(a) for a in _ipv4_addresses() | _ipv6_addresses()}
    except (OSError, ValueError) as e:
        log.debug("address listing by ioctl/procfs failed (%s); asking netlink", e)
    from pyroute2 import IPRoute  # here: slow to import (cni.rules_common)

    out: set[str] = set()
    with IPRoute() as ipr:
        for msg in ipr.get_addr():
            addr = msg.get_attr("IFA_ADDRESS")
            if addr:
                out.add(_unmap(addr))
    return out


def _unmap(ip: str) -> str:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(mapped or addr)


def netns_holds_ip(target: str | int, ips: list[str], own_thread: bool = True) -> bool:
    """True when some interface in netns ``target`` has one of ``ips``. Blocks: enters
    the netns on a short-lived thread, or (``own_thread=False``, for a caller on a
    private worker thread) on the calling thread, which is back in its netns after."""
    wanted = {_unmap(ip) for ip in ips}
    run = netns_mod.run_in_netns_thread if own_thread else netns_mod.run_in_netns
    try:
        have = run(target, netns_addresses)
    except OSError:
        return False
    return bool(wanted & have)


@dataclasses.dataclass
class FoundNetns:
    """A pod netns found by the scan: ``fd`` is open (caller closes it), ``path`` is the
    ``<proc>/<pid>/ns/net`` it came from, ``inode`` identifies the netns."""

    uid: str
    pid: int
    path: str
    fd: int
    inode: int
    starttime: int


def scan(proc_dir: str, wanted: dict[str, list[str]], host_netns: tuple[int, int]
         ) -> dict[str, FoundNetns]:
    """Find the netns of each pod in ``wanted`` (``{uid: [pod IPs]}``).

    ``host_netns`` is ``(st_ino, st_dev)`` of the node's netns (skipped). Pods without
    IPs can't be verified and are not returned. Returns ``{uid as given: FoundNetns}``;
    pods not found are absent (the caller reports them). Unreadable processes (exited
    mid-scan, permission) are skipped.
    """
    by_canon = {canonical_uid(u): u for u, ips in wanted.items() if ips}
    found: dict[str, FoundNetns] = {}
    seen_inodes: set[int] = set()
    try:
        pids = sorted((p for p in os.listdir(proc_dir) if p.isdigit()), key=int)
    except OSError as e:
        log.error("cannot list %s: %s", proc_dir, e)
        return found
    for pid in pids:
        ns_path = os.path.join(proc_dir, pid, "ns", "net")
        try:
            st = os.stat(ns_path)
            if (st.st_ino, st.st_dev) == host_netns or st.st_ino in seen_inodes:
                continue
            with open(os.path.join(proc_dir, pid, "cgroup")) as f:
                uid, cid = parse_cgroup(f.read())
            # a pod UID names the pod; without one (podman), the container ID may: a
            # pod known only by its container ID has that as its key
            key = canonical_uid(uid) if uid else canonical_uid(cid)
            if not key or key not in by_canon:
                continue
            started = starttime(proc_dir, pid)
        except (OSError, ValueError) as e:
            log.debug("skipping pid %s: %s", pid, e)
            continue
        pod_uid = by_canon[key]
        try:
            fd = netns_mod.open_netns(ns_path)
        except OSError:
            continue
        if not netns_holds_ip(fd, wanted[pod_uid]):
            os.close(fd)  # not this pod's netns; don't mark it seen
            continue
        seen_inodes.add(st.st_ino)
        current = found.get(pod_uid)
        if current is None or started < current.starttime:
            if current is not None:
                os.close(current.fd)
            found[pod_uid] = FoundNetns(pod_uid, int(pid), ns_path, fd, st.st_ino, started)
        else:
            os.close(fd)
    return found


def host_netns_id() -> tuple[int, int]:
    """``(st_ino, st_dev)`` of the agent process's netns; take it at start."""
    st = os.stat("/proc/self/ns/net")
    return st.st_ino, st.st_dev
