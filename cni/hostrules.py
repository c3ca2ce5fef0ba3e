"""Host-side (node netns) rules for kubelet probes (``docs/enrollment.md``).

Kubelet probes come from the node and would otherwise look like any other node-sourced
traffic (kube-proxy forwarded traffic shares the node IP). Packets from a *local
socket* on the node to an enrolled pod's IP are SNATed to ``169.254.7.127`` (IPv6
``fd16:9254:7127:1337:ffff:ffff:ffff:ffff``); the in-pod rules accept that source
unredirected. The "enrolled pod IPs" are a set whose entries carry the owning pod UID
as comment, so an IP reused by a new pod is never removed by the old pod's teardown.

Two backends, chosen like the in-pod ones:

- iptables: ipsets ``istio-inpod-probes-v4``/``-v6`` (``hash:ip`` with comments,
  managed over netlink with pyroute2, no ``ipset`` binary needed) and nat chain
  ``ISTIO_POSTRT`` inserted at POSTROUTING position 1 with
  ``-m owner --socket-exists ... -m set --match-set <set> dst -j SNAT``.
- nftables: table ``inet istio-ambient-nat`` with sets of type ``ipv4_addr``/``ipv6_addr``
  and a ``postrouting`` nat chain matching ``meta skuid <kubelet UID>``. Without a
  kubelet on this host we match ``meta skuid >= 0`` instead, which, like
  ``--socket-exists``, is true exactly for packets that have a local socket.

The sets are never flushed: :meth:`HostProbeRules.setup` keeps their entries and
:meth:`HostProbeRules.sync` reconciles them in place at start, so a restart never leaves an
enrolled pod without its entry (upstream flushes at start). Entries are removed by owner.

All names are constructor arguments so tests use unique ones; defaults follow the spec.
Every method blocks; the agent calls them via ``ctx.run_blocking``. ``netns`` (a path)
makes them act on that netns instead of the caller's (tests use a scratch "node").
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import re
import shutil
import socket
import subprocess
import threading
from typing import TYPE_CHECKING, Iterable, Iterator

import psutil

from agent.core import netns as netns_mod
from cni.podips import normalize_ip
from cni.rules_common import RulesError, loaded_xtables
from cni.rules_iptables_text import Rule, render_restore
from cni.rules_nftables import list_tables, run_nft

if TYPE_CHECKING:  # imported where used: pyroute2 is slow to import (cni.rules_common)
    from pyroute2 import IPSet

log = logging.getLogger(__name__)
TOOL_TIMEOUT = 60.0
SET_COMMENT = "UUID of the pods that are part of ambient mesh"


def find_kubelet_uid() -> int | None:
    """UID of the first process that is kubelet (``comm`` kubelet, or kubelite with
    "kubelet" in an argv element, or k3s); None when there is none."""
    for p in psutil.process_iter(["name", "cmdline", "uids"]):
        name = p.info.get("name") or ""
        argv = p.info.get("cmdline") or []
        if name == "kubelet" or name == "k3s" or (
                name == "kubelite" and any("kubelet" in a for a in argv)):
            uids = p.info.get("uids")
            if uids is not None:
                return uids.real
    return None


class HostProbeRules:
    """The node's probe SNAT rules and the per-pod probe address sets.

    Args: ``backend`` ``"iptables"`` or ``"nftables"``; ``flavor`` iptables ``"nft"`` or
    ``"legacy"``; ``snat_ipv4``/``snat_ipv6`` the SNAT sources; ``ipv6`` manage the v6
    set and rule too; ``chain`` (must start with ``ISTIO_``), ``set_v4``, ``set_v6``,
    ``nft_table`` names; ``kubelet_uid`` (nftables; None = detect, else ``>= 0``).
    Errors raise :class:`cni.rules_common.RulesError` naming the step.
    """

    def __init__(self, backend: str = "iptables", flavor: str = "nft",
                 snat_ipv4: str = "169.254.7.127",
                 snat_ipv6: str = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff", ipv6: bool = True,
                 chain: str = "ISTIO_POSTRT", set_v4: str = "istio-inpod-probes-v4",
                 set_v6: str = "istio-inpod-probes-v6", nft_table: str = "istio-ambient-nat",
                 kubelet_uid: int | None = None, netns: str | None = None):
        if backend not in ("iptables", "nftables"):
            raise ValueError(f"host rules backend must be iptables or nftables, got {backend!r}")
        if not chain.startswith("ISTIO_"):
            raise ValueError(f"host chain name must start with ISTIO_, got {chain!r}")
        self.backend, self.flavor = backend, flavor
        self.snat_ipv4, self.snat_ipv6, self.ipv6 = snat_ipv4, snat_ipv6, ipv6
        self.chain, self.set_v4, self.set_v6, self.nft_table = chain, set_v4, set_v6, nft_table
        self.kubelet_uid = kubelet_uid
        self.netns = netns
        self._ipset_lock = threading.Lock()
        self._ipset_sock: IPSet | None = None
        self._ipset_loop = None  # the asyncio loop pyroute2 made for it (see _close_ipset)

    # --- rendering (pure; the goldens) ---------------------------------------------

    def render_iptables(self, v6: bool = False) -> str:
        """``iptables-restore`` input for one family."""
        set_name, snat = (self.set_v6, self.snat_ipv6) if v6 else (self.set_v4, self.snat_ipv4)
        return render_restore([
            Rule("nat", "POSTROUTING", f"1 -j {self.chain}", op="-I"),
            Rule("nat", self.chain, f"-m owner --socket-exists -p tcp -m set --match-set "
                                    f"{set_name} dst -j SNAT --to-source {snat}"),
        ])

    def render_nft(self, kubelet_uid: int | None) -> str:
        """The ``nft -f`` transaction creating table, sets and chain (flushes old state)."""
        t = f"inet {self.nft_table}"
        owner = f"skuid {kubelet_uid}" if kubelet_uid is not None else "meta skuid >= 0"
        lines = [f"add table {t}", f"flush table {t}",
                 f'add set {t} {self.set_v4} {{ type ipv4_addr ; comment "{SET_COMMENT}" ; }}']
        if self.ipv6:
            lines.append(f'add set {t} {self.set_v6} {{ type ipv6_addr ; comment '
                         f'"{SET_COMMENT}" ; }}')
        lines += [f"add chain {t} postrouting {{ type nat hook postrouting priority 100 ; }}",
                  f"add rule {t} postrouting meta l4proto tcp {owner} ip daddr "
                  f"@{self.set_v4} counter snat to {self.snat_ipv4}"]
        if self.ipv6:
            lines.append(f"add rule {t} postrouting meta l4proto tcp {owner} ip6 daddr "
                         f"@{self.set_v6} counter snat to {self.snat_ipv6}")
        return "\n".join(lines) + "\n"

    # --- lifecycle --------------------------------------------------------------------

    @contextlib.contextmanager
    def _ipset(self) -> Iterator[IPSet]:
        """One netlink socket, opened in the node netns on first use and kept (it stays
        in that netns), serialised by a lock: saves a socket setup per pod."""
        from pyroute2 import IPSet
        from pyroute2.netlink.exceptions import NetlinkError

        with self._ipset_lock:
            if self._ipset_sock is None:
                with self._in_netns():
                    try:
                        self._ipset_sock = IPSet()
                    except NetlinkError as e:
                        if e.code == errno.EPERM:  # not retried: it never starts working
                            raise PermissionError(
                                "ipset netlink socket: operation not permitted (host probe "
                                "rules need root, CAP_NET_ADMIN)") from None
                        raise RulesError(f"ipset netlink socket: {e}") from None
                # pyroute2 keeps a private event loop per *thread* and closes only the
                # calling thread's one on close(); worker threads differ between calls
                self._ipset_loop = getattr(getattr(self._ipset_sock, "asyncore", None),
                                           "event_loop", None)
            try:
                yield self._ipset_sock
            except OSError:
                self._close_ipset()
                raise

    def _close_ipset(self) -> None:
        if self._ipset_sock is not None:
            try:
                self._ipset_sock.close()
            finally:
                self._ipset_sock = None
                loop, self._ipset_loop = self._ipset_loop, None
                # not running (pyroute2 runs it per call), so closing it here is safe; an
                # unclosed one is reported at interpreter exit
                if loop is not None and not loop.is_closed() and not loop.is_running():
                    loop.close()

    def close(self) -> None:
        """Release the kept netlink socket (rules and sets stay)."""
        with self._ipset_lock:
            self._close_ipset()

    @contextlib.contextmanager
    def _in_netns(self) -> Iterator[None]:
        if self.netns:
            with netns_mod.entered(self.netns):
                yield
        else:
            yield

    def setup(self) -> None:
        """Start of day: create the sets if missing and (re)write the rules,
        each in one atomic step. Set entries are kept: a restarted agent reconciles them in
        place (:meth:`sync`), so an enrolled pod's entry is never absent (kubelet probes
        would fail in that window; upstream flushes here). Nothing is duplicated."""
        from pyroute2.netlink.exceptions import NetlinkError

        with self._in_netns():
            if self.backend == "nftables":
                uid = self.kubelet_uid if self.kubelet_uid is not None else find_kubelet_uid()
                # one transaction; "flush table" empties the chains, set elements stay
                run_nft(self.render_nft(uid), "host probe rules")
                return
            with self._ipset() as ips:
                for name, family in self._sets():
                    try:  # exclusive=False: an existing set (and its entries) is kept
                        ips.create(name, stype="hash:ip", family=family, exclusive=False,
                                   comment=True)
                    except NetlinkError as e:
                        raise RulesError(f"ipset create {name}: {e}") from None
            for v6 in self._v6s():
                jumps, has_chain = self._existing_iptables_rules(v6)
                if jumps or has_chain:
                    self._restore(v6, self._replace_iptables(v6, jumps), "replace host rules")
                else:
                    self._restore(v6, self.render_iptables(v6), "create host rules")
            # after ours are written: the probe SNAT is never absent
            self.remove_stale_flavor()

    def other_flavor(self) -> str:
        """The iptables flavor this object does not write to (``"legacy"`` for ``"nft"``)."""
        return "legacy" if self.flavor == "nft" else "nft"

    def remove_stale_flavor(self) -> list[str]:
        """Remove our chain and its POSTROUTING jumps from the *other* iptables flavor's
        nat table (iptables backend; a no-op for nftables or when that flavor's tools are
        not installed). Such a copy is what an agent that wrote to the other flavor left
        (its flavor record lost, the host's ``iptables`` alternative switched): its SNAT
        rule may carry an old address and would go on rewriting probes next to ours.
        Logs one warning per family naming the flavor, the chain and the SNAT sources
        removed. Returns the tool names of the families cleaned. Raises RulesError."""
        if self.backend != "iptables":
            return []
        other = self.other_flavor()
        cleaned = []
        with self._in_netns():
            for v6 in self._v6s():
                save_tool = self._tool(v6, "save", other)
                if not shutil.which(save_tool) or not shutil.which(
                        self._tool(v6, "restore", other)):
                    continue
                jumps, has_chain, save = self._iptables_nat(v6, other)
                if not jumps and not has_chain:
                    continue
                snat = sorted(set(re.findall(rf"-A {re.escape(self.chain)} .*--to-source (\S+)",
                                             save)))
                self._delete_flavor_rules(v6, other, jumps, has_chain)
                log.warning("host probe rules: removed a stale copy of nat chain %s from %s "
                            "(%d POSTROUTING jump(s), SNAT to %s); the rules are kept in %s",
                            self.chain, save_tool.rsplit("-", 1)[0], len(jumps),
                            ", ".join(snat) or "nothing", self._tool(v6, "save").rsplit("-", 1)[0])
                cleaned.append(save_tool.rsplit("-", 1)[0])
        return cleaned

    def _replace_iptables(self, v6: bool, jumps: list[str]) -> str:
        """One ``iptables-restore --noflush`` transaction that flushes our chain
        (``:CHAIN`` under ``--noflush``), drops every old jump to it and writes the rules
        again: the SNAT rule is never absent, and never doubled."""
        fresh = self.render_iptables(v6).splitlines()
        rules = [ln for ln in fresh if ln.startswith(("-A ", "-I "))]
        lines = ["*nat", f":{self.chain} - [0:0]"] + ["-D" + j[2:] for j in jumps] + rules
        return "\n".join(lines + ["COMMIT"]) + "\n"

    def teardown(self) -> None:
        """Remove the rules and the sets (clean shutdown). Idempotent."""
        from pyroute2.netlink.exceptions import NetlinkError

        with self._in_netns():
            if self.backend == "nftables":
                run_nft(f"add table inet {self.nft_table}\ndelete table inet {self.nft_table}\n",
                        "delete host rules")
                return
            self._delete_iptables_rules()
            self.remove_stale_flavor()
            with self._ipset() as ips:
                for name, _ in self._sets():
                    try:
                        ips.destroy(name)
                    except NetlinkError:
                        pass  # absent

    def present(self) -> list[str]:
        """What of ours exists now in the node netns, one line each (``ambient-agent
        cleanup --dry-run``): the nftables table, else the iptables chain, its jumps and
        the ipsets. Empty when nothing is there. Raises RulesError."""
        from pyroute2.netlink.exceptions import NetlinkError

        found: list[str] = []
        with self._in_netns():
            if self.backend == "nftables":
                if self.nft_table in list_tables():
                    found.append(f"nftables table inet {self.nft_table}")
                return found
            for v6 in self._v6s():
                try:
                    jumps, has_chain = self._existing_iptables_rules(v6)
                except (OSError, subprocess.TimeoutExpired):
                    continue  # that flavor's tools are not installed: nothing of it
                if has_chain or jumps:
                    found.append(f"{self._tool(v6, 'save').rsplit('-', 1)[0]} nat chain "
                                 f"{self.chain} ({len(jumps)} POSTROUTING jump(s))")
            with self._ipset() as ips:
                for name, _ in self._sets():
                    try:
                        list(ips.list(name))
                        found.append(f"ipset {name}")
                    except NetlinkError:
                        pass
        return found

    def _v6s(self) -> list[bool]:
        return [False, True] if self.ipv6 else [False]

    def _sets(self) -> list[tuple[str, int]]:
        sets: list[tuple[str, int]] = [(self.set_v4, socket.AF_INET)]
        if self.ipv6:
            sets.append((self.set_v6, socket.AF_INET6))
        return sets

    def _tool(self, v6: bool, what: str, flavor: str | None = None) -> str:
        return f"{'ip6tables' if v6 else 'iptables'}-{flavor or self.flavor}-{what}"

    def _restore(self, v6: bool, text: str, what: str, flavor: str | None = None) -> None:
        tool = self._tool(v6, "restore", flavor)
        p = subprocess.run([tool, "--noflush", "--wait=30"], input=text,
                           capture_output=True, text=True, timeout=TOOL_TIMEOUT)
        if p.returncode != 0:
            raise RulesError(f"{tool} ({what}) failed: {p.stderr.strip()}")

    def _existing_iptables_rules(self, v6: bool) -> tuple[list[str], bool]:
        """``(POSTROUTING rules jumping to our chain, whether our chain exists)``."""
        jumps, has_chain, _ = self._iptables_nat(v6, None)
        return jumps, has_chain

    def _iptables_nat(self, v6: bool, flavor: str | None) -> tuple[list[str], bool, str]:
        """``(POSTROUTING rules jumping to our chain, whether our chain exists, the nat
        table's save text)`` in ``flavor`` (None: ours). A legacy nat table that is not
        loaded in the netns holds nothing, and is not read: the legacy tools would create
        it (:func:`cni.rules_common.loaded_xtables`)."""
        if (flavor or self.flavor) == "legacy" and "nat" not in (loaded_xtables(v6) or ()):
            return [], False, ""
        p = subprocess.run([self._tool(v6, "save", flavor), "-t", "nat"], capture_output=True,
                           text=True, timeout=TOOL_TIMEOUT)
        save = p.stdout if p.returncode == 0 else ""
        jumps = [ln for ln in save.splitlines()
                 if ln.startswith("-A POSTROUTING") and ln.endswith(f"-j {self.chain}")]
        return jumps, f":{self.chain} " in save, save

    def _delete_flavor_rules(self, v6: bool, flavor: str | None, jumps: list[str],
                             has_chain: bool) -> None:
        lines = ["*nat"] + ["-D" + j[2:] for j in jumps]
        if has_chain:
            lines += [f"-F {self.chain}", f"-X {self.chain}"]
        self._restore(v6, "\n".join(lines + ["COMMIT"]) + "\n", "delete host rules", flavor)

    def _delete_iptables_rules(self) -> None:
        for v6 in self._v6s():
            jumps, has_chain = self._existing_iptables_rules(v6)
            if jumps or has_chain:
                self._delete_flavor_rules(v6, None, jumps, has_chain)

    # --- per-pod entries --------------------------------------------------------------

    def _family_set(self, ip: str) -> tuple[str, int] | None:
        """The set (and its family) for a normalized address (:func:`normalize_ip`)."""
        if ipaddress.ip_address(ip).version == 4:
            return self.set_v4, socket.AF_INET
        return (self.set_v6, socket.AF_INET6) if self.ipv6 else None

    def add_pod(self, uid: str, ips: Iterable[str]) -> None:
        """Upsert each IP with comment ``uid`` (an IP reused by a new pod changes owner).
        IPv6 addresses are skipped when IPv6 is off. Raises RulesError."""
        from pyroute2.netlink.exceptions import NetlinkError

        # unmapped first (upstream's Unmap() in ipset.AddIP): "::ffff:10.0.0.19" is an
        # IPv4 entry, and the kernel's IPv4 set only takes the dotted form
        normalized = [normalize_ip(ip) for ip in ips]
        pairs = [(ip, fs) for ip, fs in ((ip, self._family_set(ip)) for ip in normalized)
                 if fs is not None]
        if not pairs:
            return
        with self._in_netns():
            if self.backend == "nftables":
                t = f"inet {self.nft_table}"
                lines = []
                for ip, (name, _) in pairs:
                    # add (no-op if present), delete, add: an upsert that also replaces the
                    # comment, and never fails on absence, in one transaction
                    lines += [f"add element {t} {name} {{ {ip} }}",
                              f"delete element {t} {name} {{ {ip} }}",
                              f'add element {t} {name} {{ {ip} comment "{uid}" }}']
                run_nft("\n".join(lines) + "\n", f"add probe set entries for pod {uid}")
                return
            with self._ipset() as ipset:
                for ip, (name, family) in pairs:
                    try:
                        ipset.add(name, ip, etype="ip", family=family, comment=uid,
                                  exclusive=False)
                    except NetlinkError as e:
                        raise RulesError(f"ipset add {name} {ip} (pod {uid}): {e}") from None

    def remove_pod(self, uid: str, ips: Iterable[str] = ()) -> list[str]:
        """Remove every entry whose owner is ``uid``, whether or not its IPs are known
        (a DEL for a pod the agent has no record of still finds its entries by the owner
        comment, as upstream's ``ClearEntriesWithComment``). An IP of ``ips`` owned by
        another pod is kept (IP reuse) and logged. Returns the IPs removed."""
        owners = self.entries()
        removed = [ip for ip, owner in owners.items() if owner == uid]
        for ip in {normalize_ip(ip) for ip in ips}:
            if ip in owners and owners[ip] != uid:
                log.warning("probe set entry %s belongs to pod %s, not %s: kept", ip,
                            owners[ip], uid)
        if removed:
            self._delete_entries(removed)
        return removed

    def _delete_entries(self, ips: list[str]) -> None:
        from pyroute2.netlink.exceptions import NetlinkError

        with self._in_netns():
            if self.backend == "nftables":
                t = f"inet {self.nft_table}"
                lines = []
                for ip in ips:
                    name = self._family_set(ip)[0]  # type: ignore[index]
                    lines += [f"add element {t} {name} {{ {ip} }}",
                              f"delete element {t} {name} {{ {ip} }}"]
                run_nft("\n".join(lines) + "\n", "delete probe set entries")
                return
            with self._ipset() as ipset:
                for ip in ips:
                    name, family = self._family_set(ip)  # type: ignore[misc]
                    try:
                        ipset.delete(name, ip, etype="ip", family=family)
                    except NetlinkError as e:
                        raise RulesError(f"ipset del {name} {ip}: {e}") from None

    def entries(self) -> dict[str, str]:
        """``{ip: owner pod uid}`` for every entry of the probe sets; a set that does not
        exist has none. Raises RulesError when a set can't be read (a removal or prune
        must never act on a listing that silently came back empty)."""
        from pyroute2.netlink.exceptions import NetlinkError

        result: dict[str, str] = {}
        with self._in_netns():
            if self.backend == "nftables":
                for name, _ in self._sets():
                    p = subprocess.run(["nft", "-j", "list", "set", "inet", self.nft_table, name],
                                       capture_output=True, text=True, timeout=TOOL_TIMEOUT)
                    if p.returncode != 0:
                        if "No such file or directory" in p.stderr:
                            continue  # no table/set yet
                        raise RulesError(f"nft list set {self.nft_table} {name} failed: "
                                         f"{p.stderr.strip()}")
                    for item in json.loads(p.stdout).get("nftables", []):
                        for elem in item.get("set", {}).get("elem", []):
                            e = elem.get("elem", {}) if isinstance(elem, dict) else {}
                            if "val" in e:
                                result[str(e["val"])] = e.get("comment", "")
                            elif isinstance(elem, str):
                                result[elem] = ""
                return result
            with self._ipset() as ipset:
                for name, _ in self._sets():
                    try:
                        msgs = list(ipset.list(name))  # lazy generator
                    except NetlinkError as e:
                        if e.code == errno.ENOENT:
                            continue  # no such set yet
                        raise RulesError(f"ipset list {name}: {e}") from None
                    for msg in msgs:
                        adt = msg.get_attr("IPSET_ATTR_ADT")
                        if adt is None:
                            continue
                        for data in adt.get_attrs("IPSET_ATTR_DATA"):
                            ipfrom = data.get_attr("IPSET_ATTR_IP_FROM")
                            ip = (ipfrom.get_attr("IPSET_ATTR_IPADDR_IPV4")
                                  or ipfrom.get_attr("IPSET_ATTR_IPADDR_IPV6"))
                            result[str(ipaddress.ip_address(ip))] = (
                                data.get_attr("IPSET_ATTR_COMMENT") or "")
        return result

    def sync(self, pods: dict[str, list[str]]) -> list[str]:
        """Reconcile the sets in place with the pods this agent knows (``{uid: [IPs]}``;
        start of day), never flushing: each known IP is upserted with its
        owner (only where missing or owned by someone else), and an entry is removed
        only when its IP belongs to no known pod and its owner is not a known pod whose
        IPs are still unknown (a pod whose ``podIPs`` are not published yet keeps the
        entry an earlier run gave it; upstream skips pruning altogether then). Returns
        the removed IPs. Raises RulesError, ValueError (a bad IP)."""
        desired: dict[str, str] = {}
        for uid, ips in pods.items():
            for ip in ips:
                desired[normalize_ip(ip)] = uid
        ip_unknown = {uid for uid, ips in pods.items() if not ips}
        have = self.entries()
        missing: dict[str, list[str]] = {}
        for ip, uid in desired.items():
            if have.get(ip) != uid:
                missing.setdefault(uid, []).append(ip)
        for uid, ips in missing.items():
            self.add_pod(uid, ips)
        stale = [ip for ip, owner in have.items()
                 if ip not in desired and owner not in ip_unknown]
        if stale:
            self._delete_entries(stale)
        return stale
