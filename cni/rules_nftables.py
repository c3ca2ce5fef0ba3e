"""In-pod redirection rules, native nftables backend (``docs/enrollment.md``).

The same policy as :mod:`cni.rules_iptables`, written as ``nft -f`` transactions in
three ``inet`` tables (``istio-ambient-nat``, ``-mangle``, ``-raw``). IPv4 and IPv6
share the tables: family-neutral rules appear once, address rules get an ``ip``
and (IPv6 on) an ``ip6`` variant, as upstream does.

Each table is written as ``add table; flush table; add chain...; add rule...`` so a
re-run replaces instead of duplicating, all tables in one ``nft -f -`` call (one
atomic kernel transaction). Delete is ``add table`` then ``delete table`` per table,
which can't fail on an absent table. The builder is a pure function (upstream had
"concurrent map writes" crashes from a shared builder).

Where upstream's text has a double space (``mark and 0xfff  != 0x539``) we emit one:
nft parses both, and our goldens are our own output for the upstream scenarios.
"""

from __future__ import annotations

import subprocess

from cni import rules_common as rc
from cni.rules_common import RuleOptions, RulesError

NAT, MANGLE, RAW = "istio-ambient-nat", "istio-ambient-mangle", "istio-ambient-raw"
PRERT, OUTPUT = "istio-prerouting", "istio-output"
TOOL_TIMEOUT = 60.0

_BASE_CHAINS = {
    NAT: [("prerouting", "nat", "prerouting", -100), ("output", "nat", "output", -100)],
    MANGLE: [("prerouting", "filter", "prerouting", -150), ("output", "route", "output", -150)],
    RAW: [("prerouting", "filter", "prerouting", -300), ("output", "filter", "output", -300)],
}


def build_tables(opts: RuleOptions) -> dict[str, list[str]]:
    """``{table: [rule text after "add rule inet <table> "]}`` in upstream order
    (the iptables rules mapped to nft). Tables without rules are omitted."""
    fams = [("ip", "127.0.0.1/32", opts.probe_snat_ipv4)]
    if opts.ipv6:
        fams.append(("ip6", "::1/128", opts.probe_snat_ipv6))
    ztunnel = f"mark and {rc.INPOD_MASK:#x} != {rc.INPOD_MARK:#x}"
    nat = [f"output jump {OUTPUT}", f"prerouting jump {PRERT}"]
    mangle = [f"prerouting jump {PRERT}", f"output jump {OUTPUT}"]
    raw: list[str] = []
    for ifname in opts.virtual_interfaces:
        nat += [f"{PRERT} iifname {ifname} meta l4proto tcp counter redirect to "
                f":{rc.ZTUNNEL_OUTBOUND_PORT}",
                f"{PRERT} iifname {ifname} meta l4proto tcp counter return"]
    if not opts.ingress_mode:
        nat += [f"{PRERT} meta l4proto tcp {f} saddr {probe} counter accept"
                for f, _, probe in fams]
    # ztunnel's packets connmarked, ingress mode included (see rules_iptables_text.build_rules)
    mangle.append(f"{PRERT} meta mark & {rc.INPOD_MASK:#x} == {rc.INPOD_MARK:#x} counter "
                  f"ct mark set ct mark & 0xfffff000 | {rc.INPOD_TPROXY_MARK:#x}")
    nat += [f"{OUTPUT} meta l4proto tcp {f} daddr {probe} counter accept" for f, _, probe in fams]
    if not opts.ingress_mode:
        nat += [f"{PRERT} {f} daddr != {lo} tcp dport != {rc.ZTUNNEL_INBOUND_HBONE_PORT} "
                f"{ztunnel} counter redirect to :{rc.ZTUNNEL_INBOUND_PLAINTEXT_PORT}"
                for f, lo, _ in fams]
    mangle.append(f"{OUTPUT} ct mark and {rc.INPOD_TPROXY_MASK:#x} == {rc.INPOD_TPROXY_MARK:#x} "
                  "counter meta mark set ct mark")
    if opts.dns_capture:
        nat.append(f"{OUTPUT} oifname != lo {ztunnel} udp dport 53 counter redirect to "
                   f":{rc.ZTUNNEL_DNS_PORT}")
        nat += [f"{OUTPUT} {f} daddr != {lo} tcp dport 53 {ztunnel} counter redirect to "
                f":{rc.ZTUNNEL_DNS_PORT}" for f, lo, _ in fams]
        raw = [f"prerouting jump {PRERT}", f"output jump {OUTPUT}",
               f"{OUTPUT} udp dport 53 meta mark and {rc.INPOD_MASK:#x} == {rc.INPOD_MARK:#x} "
               "counter ct zone set 1",
               f"{PRERT} udp sport 53 meta {ztunnel} counter ct zone set 1"]
    nat.append(f"{OUTPUT} meta l4proto tcp mark and {rc.INPOD_TPROXY_MASK:#x} == "
               f"{rc.INPOD_TPROXY_MARK:#x} counter accept")
    nat += [f"{OUTPUT} oifname lo {f} daddr != {lo} counter accept" for f, lo, _ in fams]
    nat += [f"{OUTPUT} meta l4proto tcp {f} daddr != {lo} {ztunnel} counter redirect to "
            f":{rc.ZTUNNEL_OUTBOUND_PORT}" for f, lo, _ in fams]
    tables = {NAT: nat, MANGLE: mangle}
    if raw:
        tables[RAW] = raw
    return tables


def render_transaction(opts: RuleOptions) -> str:
    """The ``nft -f`` text installing the ruleset; newline-terminated."""
    lines: list[str] = []
    for table, rules in build_tables(opts).items():
        lines += [f"add table inet {table}", f"flush table inet {table}"]
        for name, kind, hook, prio in _BASE_CHAINS[table]:
            lines.append(f"add chain inet {table} {name} {{ type {kind} hook {hook} "
                         f"priority {prio} ; }}")
        lines += [f"add chain inet {table} {PRERT}", f"add chain inet {table} {OUTPUT}"]
        lines += [f"add rule inet {table} {r}" for r in rules]
    return "\n".join(lines) + "\n"


def render_delete() -> str:
    """``nft -f`` text removing all three tables; succeeds when they are absent."""
    return "".join(f"add table inet {t}\ndelete table inet {t}\n" for t in (NAT, MANGLE, RAW))


def run_nft(text: str, what: str) -> None:
    """``nft -f -`` in the calling thread's netns. Raises :class:`RulesError` with stderr."""
    try:
        p = subprocess.run(["nft", "-f", "-"], input=text, capture_output=True, text=True,
                           timeout=TOOL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RulesError(f"nft failed to run: {e}") from None
    if p.returncode != 0:
        raise RulesError(f"nft -f ({what}) failed: {p.stderr.strip()}")


def list_tables() -> list[str]:
    """Names of the inet tables in the calling thread's netns."""
    p = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                       timeout=TOOL_TIMEOUT)
    if p.returncode != 0:
        raise RulesError(f"nft list tables failed: {p.stderr.strip()}")
    return [line.split()[-1] for line in p.stdout.splitlines() if line.startswith("table inet ")]


class NftablesBackend:
    """Applies/removes the in-pod ruleset with ``nft``. Same interface and threading
    contract as :class:`cni.rules_iptables.IptablesBackend` (blocking, current netns)."""

    name = "nftables"

    def apply(self, opts: RuleOptions) -> str:
        """Routing first, then one transaction. Returns ``"applied"`` or
        ``"replaced"``. Raises :class:`RulesError`."""
        existed = NAT in list_tables()
        rc.add_routing(opts.ipv6)
        run_nft(render_transaction(opts), "apply")
        return "replaced" if existed else "applied"

    def delete(self, ipv6: bool, routing: bool = True) -> None:
        """Drop our tables, then the routing (unless ``routing`` is False). Idempotent."""
        run_nft(render_delete(), "delete")
        if routing:
            rc.delete_routing(ipv6)

    def present(self, ipv6: bool) -> bool:
        return NAT in list_tables()
