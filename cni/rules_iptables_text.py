"""The in-pod iptables ruleset as text: the rules as data (:class:`Rule`,
:func:`build_rules`), the ``iptables-restore`` input exactly as upstream renders it
(:func:`render_restore`; the default IPv4 output equals upstream's default golden line for
line, ``tests/enrollment/test_rules_golden.py``), and what an ``iptables-save`` text says
about our rules (:func:`istio_residue`, :func:`empty_without_istio`). Pure functions, no
tools run; :mod:`cni.rules_iptables` applies the text inside a pod's netns.

Upstream: ``tools/istio-iptables/pkg/builder/iptables_builder_impl.go`` (rendering) and
``cni/pkg/iptables/iptables.go`` (the in-pod rules).
"""

from __future__ import annotations

import dataclasses
import re

from cni import rules_common as rc
from cni.rules_common import RuleOptions

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
PRERT, OUTPUT = "ISTIO_PRERT", "ISTIO_OUTPUT"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One iptables rule: ``op`` is ``-A`` or ``-I <pos>``; ``args`` excludes the chain."""

    table: str
    chain: str
    args: str
    op: str = "-A"


def _mark(value: int, mask: int = rc.INPOD_MASK) -> str:
    return f"{value:#x}/{mask:#x}"


def build_rules(opts: RuleOptions, ipv6: bool = False) -> list[Rule]:
    """The ordered in-pod ruleset for one family (IPv6 as upstream's ``ip6tables`` variant).

    Order matters: it is the upstream insertion order, which fixes both the rendered
    text and the evaluation order inside each chain.
    """
    lo_net = "::1/128" if ipv6 else "127.0.0.1/32"
    probe = opts.probe_snat_ipv6 if ipv6 else opts.probe_snat_ipv4
    ztunnel = _mark(rc.INPOD_MARK)
    accepted = _mark(rc.INPOD_TPROXY_MARK)
    rules = [Rule("mangle", "PREROUTING", f"-j {PRERT}"),
             Rule("mangle", "OUTPUT", f"-j {OUTPUT}"),
             Rule("nat", "OUTPUT", f"-j {OUTPUT}")]
    if opts.dns_capture:
        rules += [Rule("raw", "PREROUTING", f"-j {PRERT}"), Rule("raw", "OUTPUT", f"-j {OUTPUT}")]
    rules.append(Rule("nat", "PREROUTING", f"-j {PRERT}"))
    for ifname in opts.virtual_interfaces:
        rules += [Rule("nat", PRERT, f"-i {ifname} -p tcp -j REDIRECT --to-ports "
                                     f"{rc.ZTUNNEL_OUTBOUND_PORT}"),
                  Rule("nat", PRERT, f"-i {ifname} -p tcp -j RETURN")]
    # ztunnel's own packets (mark 0x539) connmark 0x111 so replies route back to it
    # (table 100); kept in ingress mode too: without it inbound HBONE to the pod hangs
    rules.append(Rule("mangle", PRERT, f"-m mark --mark {ztunnel} -j CONNMARK --set-xmark "
                                       f"{accepted}"))
    if not opts.ingress_mode:
        rules.append(Rule("nat", PRERT, f"-s {probe} -p tcp -m tcp -j ACCEPT"))
    rules.append(Rule("nat", OUTPUT, f"-d {probe} -p tcp -m tcp -j ACCEPT"))
    if not opts.ingress_mode:
        rules.append(Rule("nat", PRERT, f"! -d {lo_net} -p tcp ! --dport "
                                        f"{rc.ZTUNNEL_INBOUND_HBONE_PORT} -m mark ! --mark "
                                        f"{ztunnel} -j REDIRECT --to-ports "
                                        f"{rc.ZTUNNEL_INBOUND_PLAINTEXT_PORT}"))
    rules.append(Rule("mangle", OUTPUT, f"-m connmark --mark {accepted} -j CONNMARK "
                                        f"--restore-mark --nfmask {rc.INPOD_RESTORE_MASK:#x} "
                                        f"--ctmask {rc.INPOD_RESTORE_MASK:#x}"))
    if opts.dns_capture:
        rules += [
            Rule("nat", OUTPUT, f"! -o lo -p udp -m mark ! --mark {ztunnel} -m udp --dport 53 "
                                f"-j REDIRECT --to-port {rc.ZTUNNEL_DNS_PORT}"),
            Rule("nat", OUTPUT, f"! -d {lo_net} -p tcp --dport 53 -m mark ! --mark {ztunnel} "
                                f"-j REDIRECT --to-ports {rc.ZTUNNEL_DNS_PORT}"),
            # separate conntrack zone for ztunnel<->upstream DNS (istio#33469)
            Rule("raw", OUTPUT, f"-p udp -m mark --mark {ztunnel} -m udp --dport 53 "
                                f"-j CT --zone 1"),
            Rule("raw", PRERT, f"-p udp -m mark ! --mark {ztunnel} -m udp --sport 53 "
                               f"-j CT --zone 1"),
        ]
    rules += [
        Rule("nat", OUTPUT, f"-p tcp -m mark --mark {accepted} -j ACCEPT"),
        Rule("nat", OUTPUT, f"! -d {lo_net} -o lo -j ACCEPT"),
        Rule("nat", OUTPUT, f"! -d {lo_net} -p tcp -m mark ! --mark {ztunnel} -j REDIRECT "
                            f"--to-ports {rc.ZTUNNEL_OUTBOUND_PORT}"),
    ]
    return rules


def jump_target(rule: Rule) -> str | None:
    m = re.search(r"(?:^|\s)-j (\S+)", rule.args)
    target = m.group(1) if m else None
    return target if target and target.startswith("ISTIO_") else None


def render_restore(rules: list[Rule]) -> str:
    """``iptables-restore`` input: tables sorted by name; per table ``-N`` for
    custom chains in order of first use as a rule's chain, then ``-N`` for jump targets
    not yet declared, then the rules in insertion order, then ``COMMIT``. Ends with a
    newline (the goldens strip it)."""
    lines: list[str] = []
    for table in sorted({r.table for r in rules}):
        in_table = [r for r in rules if r.table == table]
        chains: list[str] = []
        for r in in_table:
            if r.chain not in BUILTIN_CHAINS and r.chain not in chains:
                chains.append(r.chain)
        for r in in_table:
            target = jump_target(r)
            if target and target not in chains:
                chains.append(target)
        lines.append(f"* {table}")
        lines += [f"-N {c}" for c in chains]
        lines += [f"{r.op} {r.chain} {r.args}" for r in in_table]
        lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def golden_record(opts: RuleOptions, restore_v4: str | None = None,
                  restore_v6: str | None = None) -> str:
    """What upstream's test stub records for one apply: the two state probes,
    then the v4 restore lines, then (IPv6 on) the v6 lines, joined by newlines."""
    v4 = restore_v4 if restore_v4 is not None else render_restore(build_rules(opts))
    parts = ["iptables-save", "ip6tables-save", v4.rstrip("\n")]
    if opts.ipv6:
        v6 = restore_v6 if restore_v6 is not None else render_restore(build_rules(opts, True))
        parts.append(v6.rstrip("\n"))
    return "\n".join(parts)


def istio_residue(save_text: str) -> dict[str, dict[str, list[str]]]:
    """From ``iptables-save`` text: ``{table: {"chains": [...], "jumps": [...]}}`` for our
    ``ISTIO_*`` chains and the built-in-chain rules jumping to them."""
    result: dict[str, dict[str, list[str]]] = {}
    table = ""
    for line in save_text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
        elif line.startswith(":ISTIO_"):
            result.setdefault(table, {"chains": [], "jumps": []})["chains"].append(
                line[1:].split()[0])
        elif line.startswith("-A ") and re.search(r"-j ISTIO_\S+$", line):
            chain = line.split()[1]
            if not chain.startswith("ISTIO_"):
                result.setdefault(table, {"chains": [], "jumps": []})["jumps"].append(line)
    return result


def chain_exists_error(stderr: str, text: str) -> bool:
    """True when iptables-restore failed on one of our ``-N`` lines: nf_tables says
    "Chain already exists", legacy only "line N failed" (so look at line N)."""
    if "already exists" in stderr:
        return True
    m = re.search(r"line:? (\d+)", stderr)
    lines = text.splitlines()
    return m is not None and 0 < int(m.group(1)) <= len(lines) and (
        lines[int(m.group(1)) - 1].startswith("-N "))


def delete_text(residue: dict[str, dict[str, list[str]]]) -> str:
    """``iptables-restore --noflush`` input removing our jumps and chains, one
    transaction per table."""
    lines: list[str] = []
    for table, have in sorted(residue.items()):
        lines.append(f"*{table}")
        lines += ["-D" + j[2:] for j in have["jumps"]]
        lines += [f"-F {c}" for c in have["chains"]]
        lines += [f"-X {c}" for c in have["chains"]]
        lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def empty_without_istio(save_text: str) -> set[str]:
    """Tables of an ``iptables-save`` text that hold nothing but ours: only ISTIO_*
    chains, built-in chains with policy ACCEPT, and rules that are either in an ISTIO_*
    chain or jump to one. Without our rules such a table has no effect, and iptables-nft
    never removes the tables it creates, so deleting it is what leaves the netns as it
    was before enrollment (iptables-nft recreates a table on demand)."""
    empty: set[str] = set()
    table, ok = "", False
    for line in save_text.splitlines():
        if line.startswith("*"):
            table, ok = line[1:].strip(), True
        elif line == "COMMIT":
            if table and ok:
                empty.add(table)
            table, ok = "", False
        elif line.startswith(":"):
            name, policy = (line[1:].split() + ["", ""])[:2]
            ok = ok and (name.startswith("ISTIO_")
                         or (name in BUILTIN_CHAINS and policy == "ACCEPT"))
        elif line.startswith("-A "):
            chain = line.split()[1]
            ok = ok and (chain.startswith("ISTIO_") or bool(re.search(r"-j ISTIO_\S+$", line)))
        elif line.strip() and not line.startswith("#"):
            ok = False
    return empty
