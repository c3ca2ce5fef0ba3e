"""Pod IP addresses as the node agent keeps them: canonical text, IPv4 never mapped.

Some CNI plugins (and some runtimes' ``status.podIPs``) report an IPv4 pod address in its
IPv4-mapped IPv6 form, ``::ffff:10.0.0.19``. To the kernel that pod is an IPv4 pod: its
probe set entry belongs in the IPv4 set, its netns holds ``10.0.0.19``. Upstream's node
agent unmaps every address where it enters (``netip.Addr.Unmap()`` in
``cni/pkg/nodeagent/cni-watcher.go`` for the plugin's ``prevResult`` IPs, in
``cni/pkg/ipset/ipset.go`` and ``cni/pkg/nftables/host_sets.go`` before touching a set,
in ``cni/pkg/nodeagent/podcgroupns_linux.go`` when matching netns addresses). We do the
same once, where an address enters the agent: the plugin event
(:class:`cni.events.CniPodEvent`), a Pod object's ``status.podIPs``/``status.podIP``
(:func:`pod_status_ips`), and a persisted pod record.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any, Iterable

log = logging.getLogger(__name__)


def normalize_ip(text: Any, field: str = "ip") -> str:
    """The canonical text of one address: IPv4-mapped IPv6 becomes IPv4
    (``"::ffff:10.0.0.19"`` -> ``"10.0.0.19"``), IPv6 is compressed
    (``"FD00:0::1"`` -> ``"fd00::1"``). Raises ValueError naming ``field`` and the value
    when ``text`` is not a string holding one IP address (no prefix length)."""
    if not isinstance(text, str):
        raise ValueError(f"field {field!r} must be an IP address string, got {text!r}")
    try:
        addr = ipaddress.ip_address(text.strip())
    except ValueError:
        raise ValueError(f"field {field!r} is not an IP address: {text!r}") from None
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(mapped or addr)


def normalize_ips(values: Iterable[Any], field: str = "ips") -> list[str]:
    """:func:`normalize_ip` of each value (``field[i]`` in errors), duplicates dropped
    (``10.0.0.19`` and ``::ffff:10.0.0.19`` are one address), order kept."""
    out: list[str] = []
    for i, value in enumerate(values):
        ip = normalize_ip(value, f"{field}[{i}]")
        if ip not in out:
            out.append(ip)
    return out


def usable_ips(values: Iterable[Any], field: str, owner: str) -> list[str]:
    """Like :func:`normalize_ips` for addresses the agent did not just receive from a
    caller (a Pod object, a persisted record): a value that is not an address is logged
    (``owner``, its field and value) and skipped instead of failing the whole pod.
    ``field`` names the values; ``{i}`` in it is replaced by the index."""
    out: list[str] = []
    for i, value in enumerate(values):
        if not value:
            continue
        try:
            ip = normalize_ip(value, field.replace("{i}", str(i)))
        except ValueError as e:
            log.warning("%s: %s; ignored", owner, e)
            continue
        if ip not in out:
            out.append(ip)
    return out


def pod_status_ips(pod: dict | None) -> list[str]:
    """A Pod object's addresses, as upstream's ``GetPodIPsIfPresent``
    (``cni/pkg/util/podutil.go``): ``status.podIPs[].ip`` when that list is non-empty,
    else ``status.podIP``; normalized. An entry that is not an address is logged with
    its field and skipped (a bad object must not stop the others); ``[]`` when the pod
    has no IP yet."""
    status = (pod or {}).get("status") or {}
    if not isinstance(status, dict):
        return []
    meta = (pod or {}).get("metadata") or {}
    owner = f"pod {meta.get('namespace', '')}/{meta.get('name', '')}"
    listed = status.get("podIPs")
    if isinstance(listed, list) and listed:
        return usable_ips([e.get("ip") if isinstance(e, dict) else e for e in listed],
                          "status.podIPs[{i}].ip", owner)
    if status.get("podIP"):
        return usable_ips([status.get("podIP")], "status.podIP", owner)
    return []
