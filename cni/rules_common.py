"""What both in-pod rule backends share: constants, per-pod options, and the routing.

Constants are Istio's (``docs/enrollment.md``, ``istio/istio:cni/pkg/config/config.go``):
ztunnel marks its own packets with 0x539 (ztunnel's ``PACKET_MARK``), connections it
accepts are connmarked 0x111 and packets carrying that mark are routed locally via
table 100. Pod overrides come from annotations.

The routing helpers block and act on the *calling thread's* netns: call them from a
thread that already entered the pod's netns (``agent.core.netns.entered``).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
from typing import TYPE_CHECKING, Mapping

# pyroute2 is imported where it is used: importing it costs ~150-250 ms of CPU, and the
# modules that build the enrollment are imported before the agent's first xDS push
# (issue 28; tests/agent/test_start_order.py checks that nothing there loads it)
if TYPE_CHECKING:
    from pyroute2.netlink import nlmsg

INPOD_MARK = 0x539
INPOD_MASK = 0xFFF
INPOD_TPROXY_MARK = 0x111
INPOD_TPROXY_MASK = 0xFFF
INPOD_RESTORE_MASK = 0xFFFFFFFF
ROUTE_TABLE_INBOUND = 100
RULE_PRIORITY = 32764
ZTUNNEL_OUTBOUND_PORT = 15001
ZTUNNEL_INBOUND_PLAINTEXT_PORT = 15006
ZTUNNEL_INBOUND_HBONE_PORT = 15008
ZTUNNEL_DNS_PORT = 15053

ANNOTATION_BYPASS_INBOUND = "ambient.istio.io/bypass-inbound-capture"
ANNOTATION_DNS_CAPTURE = "ambient.istio.io/dns-capture"
ANNOTATION_VIRTUAL_INTERFACES = "istio.io/reroute-virtual-interfaces"

_RTN_LOCAL = 2
_RTPROT_STATIC = 4  # what pyroute2 sets (`ip route` says "proto static")
_NETLINK_TIMEOUT = 10.0  # seconds for the kernel's ACKs (they come at once)


class RulesError(RuntimeError):
    """Applying or removing in-pod or host rules failed.

    ``str()`` says which step failed and includes the tool's stderr when a tool ran.
    """


def loaded_xtables(ipv6: bool) -> list[str] | None:
    """The legacy xtables tables loaded in the calling thread's netns (``nat``,
    ``mangle``...), from ``/proc/thread-self/net/ip{,6}_tables_names`` (not
    ``/proc/net``: that follows the process's first thread, not a thread that entered
    another netns); None when the kernel has no x_tables for the family.

    Look here before running ``iptables-legacy-save``/``-S``: reading a table through the
    legacy tools loads it, so a mere look would leave an empty legacy ``nat`` table
    behind (and every later ``iptables-save`` warns "iptables-legacy tables present")."""
    try:
        with open(f"/proc/thread-self/net/ip{'6' if ipv6 else ''}_tables_names") as f:
            return f.read().split()
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class RuleOptions:
    """Everything that shapes one pod's redirection ruleset.

    ``probe_snat_ipv4``/``probe_snat_ipv6``: kubelet probe source addresses accepted
    unredirected; ``ipv6``: also build/apply the IPv6 ruleset;
    ``dns_capture``: redirect port 53 to 15053 (global setting unless the pod overrides
    it); ``ingress_mode``: no inbound capture (``bypass-inbound-capture``);
    ``virtual_interfaces``: interfaces whose inbound TCP is treated as outbound.
    """

    probe_snat_ipv4: str = "169.254.7.127"
    probe_snat_ipv6: str = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
    ipv6: bool = True
    dns_capture: bool = True
    ingress_mode: bool = False
    virtual_interfaces: tuple[str, ...] = ()


def _parse_bool(text: str) -> bool | None:
    value = text.strip().lower()
    if value in ("1", "t", "true"):
        return True
    if value in ("0", "f", "false"):
        return False
    return None  # Go's strconv.ParseBool failure: treated as "unset" upstream


def pod_options(base: RuleOptions, annotations: Mapping[str, str] | None) -> RuleOptions:
    """Apply a pod's annotation overrides to the global options.

    ``dns-capture: "true"/"false"`` forces DNS capture (unparsable = unset);
    ``bypass-inbound-capture: "true"`` selects ingress mode;
    ``reroute-virtual-interfaces: "a, b,"`` gives ``("a", "b")``.
    """
    annotations = annotations or {}
    changes: dict = {}
    dns = _parse_bool(str(annotations.get(ANNOTATION_DNS_CAPTURE, "")))
    if dns is not None:
        changes["dns_capture"] = dns
    if _parse_bool(str(annotations.get(ANNOTATION_BYPASS_INBOUND, ""))):
        changes["ingress_mode"] = True
    vifs = str(annotations.get(ANNOTATION_VIRTUAL_INTERFACES, ""))
    names = tuple(p.strip() for p in vifs.split(",") if p.strip())
    if names:
        changes["virtual_interfaces"] = names
    return dataclasses.replace(base, **changes) if changes else base


def _families(ipv6: bool) -> list[int]:
    return [socket.AF_INET, socket.AF_INET6] if ipv6 else [socket.AF_INET]


def _ipv6_lo_disabled() -> bool:
    # Read in the current netns (procfs net/ entries follow the reader's netns).
    try:
        with open("/proc/sys/net/ipv6/conf/lo/disable_ipv6") as f:
            return f.read().strip() == "1"
    except OSError:
        return False  # upstream: read errors -> still try


def _loopback_index() -> int | None:
    """ifindex of ``lo`` in the calling thread's netns (an ioctl on a socket made there,
    not a netlink link dump); None when there is none."""
    try:
        return socket.if_nametoindex("lo")
    except OSError:
        return None


def add_routing(ipv6: bool) -> bool:
    """In the current netns: ``ip rule fwmark 0x111/0xfff lookup 100 pref 32764`` (EEXIST
    ignored) and ``ip route replace local <any> dev lo table 100`` per family.

    Returns True when our ip rule was already there (for some family): the pod holds, or
    held, our rules (every backend adds this routing with them; :mod:`cni.rules_detect`
    uses it to decide whether the netns needs looking at). Raises :class:`RulesError`
    naming the failed netlink call.

    Every request goes in one ``sendmsg`` on one NETLINK_ROUTE socket and the kernel's
    ACKs are read back by sequence number (:func:`_netlink_batch`): this runs on every
    pod's CNI ADD, and pyroute2's ``IPRoute`` (its own event loop per socket, ~1 ms of
    Python per request) cost ~6 ms of the agent's CPU here, where its message classes
    alone encode the same requests in well under 1 ms.
    """
    from pyroute2.netlink import NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE
    from pyroute2.netlink.rtnl import RTM_NEWROUTE, RTM_NEWRULE
    from pyroute2.netlink.rtnl.fibmsg import FR_ACT_TO_TBL, fibmsg
    from pyroute2.netlink.rtnl.rtmsg import rtmsg

    lo = _loopback_index()
    if lo is None:
        raise RulesError("no loopback interface in the pod netns")
    requests: list[tuple[str, int, int, nlmsg]] = []
    for family in _families(ipv6):
        rule = fibmsg()
        rule["family"], rule["action"] = family, FR_ACT_TO_TBL
        rule["table"] = ROUTE_TABLE_INBOUND
        rule["attrs"] = [("FRA_TABLE", ROUTE_TABLE_INBOUND), ("FRA_PRIORITY", RULE_PRIORITY),
                         ("FRA_FWMARK", INPOD_TPROXY_MARK), ("FRA_FWMASK", INPOD_TPROXY_MASK)]
        requests.append((f"ip rule add (family {family})", RTM_NEWRULE,
                         NLM_F_CREATE | NLM_F_EXCL, rule))
        if family == socket.AF_INET6 and _ipv6_lo_disabled():
            continue
        dst = "0.0.0.0/0" if family == socket.AF_INET else "::/0"
        route = rtmsg()
        route["family"], route["table"], route["type"] = family, ROUTE_TABLE_INBOUND, _RTN_LOCAL
        route["scope"], route["proto"] = 254, _RTPROT_STATIC
        route["attrs"] = [("RTA_TABLE", ROUTE_TABLE_INBOUND), ("RTA_OIF", lo)]
        requests.append((f"ip route replace local {dst} table 100", RTM_NEWROUTE,
                         NLM_F_CREATE | NLM_F_REPLACE, route))
    existed = False
    for (what, kind, _, _), code in zip(requests, _netlink_batch(
            [(kind, flags, msg) for _, kind, flags, msg in requests])):
        if code == 0:
            continue
        if kind == RTM_NEWRULE and code == errno.EEXIST:
            existed = True
            continue
        raise RulesError(f"{what}: {os.strerror(code)} (errno {code})")
    return existed


def _netlink_batch(requests: list[tuple[int, int, nlmsg]]) -> list[int]:
    """Send pyroute2 messages ``(type, extra flags, message)`` to NETLINK_ROUTE in the
    calling thread's netns in one datagram, each with ``NLM_F_REQUEST | NLM_F_ACK``;
    returns each one's errno (0 = done), in order. The kernel handles them one after the
    other and ACKs each. Raises :class:`RulesError` when the socket fails or an answer
    is missing."""
    from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST, NLMSG_ERROR, nlmsgerr

    pending: dict[int, int] = {}
    payload = bytearray()
    for seq, (kind, flags, msg) in enumerate(requests, start=1):
        msg["header"]["type"] = kind
        msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
        msg["header"]["sequence_number"] = seq
        msg.encode()
        payload += msg.data
        pending[seq] = -1
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                           socket.NETLINK_ROUTE) as sock:
            sock.settimeout(_NETLINK_TIMEOUT)
            sock.bind((0, 0))
            sock.send(bytes(payload))
            while any(code < 0 for code in pending.values()):
                data = sock.recv(65536)
                offset = 0
                while offset + 16 <= len(data):
                    ack = nlmsgerr(data[offset:])
                    ack.decode()
                    length = ack["header"]["length"]
                    seq = ack["header"]["sequence_number"]
                    if ack["header"]["type"] == NLMSG_ERROR and seq in pending:
                        pending[seq] = -ack["error"] if ack["error"] else 0
                    offset += max(length, 16)
    except OSError as e:
        raise RulesError(f"netlink (routing): {e}") from None
    return [pending[seq] for seq in sorted(pending)]


def delete_routing(ipv6: bool) -> None:
    """Remove what :func:`add_routing` added; missing entries are fine (idempotent)."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    lo = _loopback_index()
    with IPRoute() as ipr:
        for family in _families(ipv6):
            while True:  # remove duplicates too, should an older agent have left any
                try:
                    ipr.rule("del", family=family, table=ROUTE_TABLE_INBOUND,
                             priority=RULE_PRIORITY, fwmark=INPOD_TPROXY_MARK,
                             fwmask=INPOD_TPROXY_MASK)
                except NetlinkError:
                    break
            dst = "0.0.0.0/0" if family == socket.AF_INET else "::/0"
            if lo is not None:
                try:
                    ipr.route("del", family=family, dst=dst, type=_RTN_LOCAL, oif=lo, scope=254,
                              table=ROUTE_TABLE_INBOUND)
                except NetlinkError as e:
                    if e.code not in (errno.ESRCH, errno.ENOENT):
                        raise RulesError(f"ip route del local {dst} table 100: {e}") from None
