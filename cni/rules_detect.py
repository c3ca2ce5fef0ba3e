"""Which rule stack a pod's netns already holds our rules in, so a pod is never given two.

The in-pod rules exist in one of three kernel stacks: iptables-nft (``ISTIO_*`` chains in
``ip``/``ip6`` nf_tables tables), iptables-legacy (``ISTIO_*`` chains in xtables) or
native nftables (our ``inet istio-ambient-*`` tables). The agent's backend is chosen
at start (``<state_dir>/iptables-flavor``, the host's ``iptables``, ``native_nftables``).
If that choice changes while pods keep their rules (the flavor file lost, the host's
``iptables`` alternative switched, nftables turned on), applying with the new backend
would succeed next to the old rules: two copies, both redirecting. Upstream matches the
tools to "where rules are actually defined in the netns we're operating in"
(``tools/istio-iptables/pkg/dependencies/implementation.go``, ``DetectIptablesVersion``:
legacy when legacy rules exist there, else nft). We do the same per pod netns, for all
three stacks: :func:`held_stacks` looks, :func:`pick` chooses.

Cost (every apply and delete): one nf_tables netlink dump of every family's chains
(pyroute2, ~0.4 ms on a quiet machine, a few ms on a loaded one) and a read of
``/proc/thread-self/net/ip{,6}_tables_names`` (µs); only when legacy xtables tables are
loaded in the netns does ``iptables-legacy-save`` run. :func:`apply` skips the look for
a pod that can't hold our rules (no record, and our ip rule was not there: see there)
and otherwise hides it behind the tools' start-up: the agent's ``iptables-restore`` is
started first, waiting for its input, and is fed, or killed unfed (nothing applied)
when the netns holds our rules in another stack. :func:`delete_everywhere`'s look also
tells whether iptables-nft tables hold anything but ours, which spares the usual pod an
``iptables-save``.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # imported where used: pyroute2 is slow to import (cni.rules_common)
    from pyroute2.netlink import nlmsg
    from pyroute2.nftables.main import NFTables

from cni import rules_common as rc
from cni.rules_common import RuleOptions, RulesError
from cni.rules_iptables import IptablesBackend
from cni.rules_nftables import MANGLE, NAT, RAW, NftablesBackend

log = logging.getLogger(__name__)

IPTABLES_NFT, IPTABLES_LEGACY, NFTABLES = "iptables-nft", "iptables-legacy", "nftables"
STACKS = (IPTABLES_NFT, IPTABLES_LEGACY, NFTABLES)  # the order ties are broken in
_NFPROTO_INET, _NFPROTO_IPV4, _NFPROTO_IPV6 = 1, 2, 10
TOOL_TIMEOUT = 60.0
Backend = IptablesBackend | NftablesBackend  # a rules backend object


def stack_of(backend: Backend) -> str:
    """The stack name of a backend object (:class:`IptablesBackend` or
    :class:`NftablesBackend`)."""
    if isinstance(backend, NftablesBackend):
        return NFTABLES
    return IPTABLES_LEGACY if backend.flavor == "legacy" else IPTABLES_NFT


def backend_for(stack: str) -> Backend:
    """A backend object writing to ``stack``. Raises ValueError for an unknown name."""
    if stack == NFTABLES:
        return NftablesBackend()
    if stack in (IPTABLES_NFT, IPTABLES_LEGACY):
        return IptablesBackend(stack.split("-", 1)[1])
    raise ValueError(f"unknown rule stack {stack!r}; expected one of {', '.join(STACKS)}")


@dataclasses.dataclass
class Holdings:
    """What the calling thread's netns holds of ours (:func:`look`).

    ``stacks``: :data:`STACKS` names holding our rules. ``nft_tables`` (only when asked
    for): ``(family, table) -> ours only`` for every ``ip``/``ip6`` nf_tables table
    holding an ``ISTIO_*`` chain (the iptables-nft stack; family ``"ip"``/``"ip6"``);
    True when the table holds nothing but ours: only ``ISTIO_*`` chains and built-in base
    chains with policy accept, every rule outside ``ISTIO_*`` chains ends in a jump or
    goto to one, and no set or other object (the table's use count is its chains). Such
    a table has no effect without our rules, so dropping it whole is the delete."""

    stacks: set[str]
    nft_tables: dict[tuple[str, str], bool] = dataclasses.field(default_factory=dict)


_FAMILY_NAMES = {_NFPROTO_IPV4: "ip", _NFPROTO_IPV6: "ip6"}
_BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
_NF_ACCEPT = 1


def _jumps_to_ours(rule: nlmsg) -> bool:
    """True when an nf_tables rule's last expression is a jump/goto to an ``ISTIO_*``
    chain (what iptables-nft makes of ``-A <chain> ... -j ISTIO_*``)."""
    exprs = rule.get_attr("NFTA_RULE_EXPRESSIONS") or []
    if not exprs or exprs[-1].get_attr("NFTA_EXPR_NAME") != "immediate":
        return False
    data: Any = (exprs[-1].get_attr("NFTA_EXPR_DATA") or {})
    try:
        verdict = (data.get_attr("NFTA_IMMEDIATE_DATA").get_attr("NFTA_DATA_VERDICT"))
        code, chain = verdict.get_attr("NFTA_VERDICT_CODE"), verdict.get_attr("NFTA_VERDICT_CHAIN")
    except AttributeError:  # not a verdict (a data register)
        return False
    return code in ("NFT_JUMP", "NFT_GOTO") and bool(chain) and chain.startswith("ISTIO_")


def _nf_tables_look(tables: bool) -> Holdings:
    """iptables-nft and/or nftables, from one nf_tables dump of the calling thread's
    netns (chains; with ``tables`` also the tables and rules of the ``ip``/``ip6``
    tables holding ``ISTIO_*`` chains). Raises RulesError when the dump fails."""
    from pyroute2.netlink.exceptions import NetlinkError
    from pyroute2.nftables.main import NFTables

    held: set[str] = set()
    chains: dict[tuple[str, str], list] = {}
    try:
        # one dump of every family's chains: our inet tables always hold chains
        with NFTables(nfgen_family=0) as nft:
            for chain in nft.get_chains():
                stack = _stack_of(chain)
                if stack:
                    held.add(stack)
                if tables and chain["nfgen_family"] in _FAMILY_NAMES:
                    key = (_FAMILY_NAMES[chain["nfgen_family"]], chain.get_attr("NFTA_CHAIN_TABLE"))
                    chains.setdefault(key, []).append(chain)
            if not tables or IPTABLES_NFT not in held:
                return Holdings(held)
            verdict = {key: _chains_only_ours(in_table) for key, in_table in chains.items()
                       if any(_name(c).startswith("ISTIO_") for c in in_table)}
            _unless_other_objects(nft, verdict, chains)
            if any(verdict.values()):
                _unless_foreign_rules(nft, verdict)
    except (NetlinkError, OSError) as e:
        raise RulesError(f"listing nf_tables tables and chains in this netns (a pod's, or the "
                         f"host's for the host rules): {e}") from None
    return Holdings(held, verdict)


def _name(chain: nlmsg) -> str:
    return chain.get_attr("NFTA_CHAIN_NAME") or ""


def _stack_of(chain: nlmsg) -> str:
    """The stack a chain says is present: any chain of our ``inet`` tables is
    nftables'; an ``ISTIO_*`` chain of an ``ip``/``ip6`` table is iptables-nft's."""
    family = chain["nfgen_family"]
    if family == _NFPROTO_INET and chain.get_attr("NFTA_CHAIN_TABLE") in (NAT, MANGLE, RAW):
        return NFTABLES
    if family in _FAMILY_NAMES and _name(chain).startswith("ISTIO_"):
        return IPTABLES_NFT
    return ""


def _chains_only_ours(in_table: list) -> bool:
    """Every chain of a table is an ``ISTIO_*`` one or a built-in base chain with
    policy accept (what iptables-nft creates for a table it loads)."""
    return all(_name(c).startswith("ISTIO_") or (
        _name(c) in _BUILTIN_CHAINS and c.get_attr("NFTA_CHAIN_HOOK") is not None
        and c.get_attr("NFTA_CHAIN_POLICY") == _NF_ACCEPT) for c in in_table)


def _unless_other_objects(nft: NFTables, verdict: dict[tuple[str, str], bool],
                          chains: dict[tuple[str, str], list[nlmsg]]) -> None:
    """A table whose use count exceeds its chains holds sets, flowtables or objects
    besides them: not ours only."""
    for table in nft.get_tables():
        key = (_FAMILY_NAMES.get(table["nfgen_family"], ""), table.get_attr("NFTA_TABLE_NAME"))
        if verdict.get(key) and table.get_attr("NFTA_TABLE_USE") != len(chains[key]):
            verdict[key] = False


def _unless_foreign_rules(nft: NFTables, verdict: dict[tuple[str, str], bool]) -> None:
    """A rule outside the ``ISTIO_*`` chains that does not jump to one of them makes
    its table not ours only."""
    for rule in nft.get_rules():
        key = (_FAMILY_NAMES.get(rule["nfgen_family"], ""), rule.get_attr("NFTA_RULE_TABLE"))
        if not verdict.get(key):
            continue
        chain = rule.get_attr("NFTA_RULE_CHAIN") or ""
        if not chain.startswith("ISTIO_") and not _jumps_to_ours(rule):
            verdict[key] = False


def _legacy_holds(ipv6: bool) -> bool:
    """True when legacy xtables in the calling thread's netns hold an ``ISTIO_*`` chain.
    ``/proc/thread-self/net`` (not ``/proc/net``, which follows the process's first
    thread) lists the tables loaded in this netns; none loaded means none of ours."""
    for v6 in ([False, True] if ipv6 else [False]):
        loaded = rc.loaded_xtables(v6)
        if not loaded:  # none loaded (or no x_tables in this kernel): nothing of ours
            continue
        tool = f"{'ip6tables' if v6 else 'iptables'}-legacy-save"
        if not shutil.which(tool):
            log.warning("legacy xtables tables %s are loaded in the pod netns but %s is not "
                        "installed; cannot tell whether they hold our rules", loaded, tool)
            continue
        try:
            p = subprocess.run([tool], capture_output=True, text=True, timeout=TOOL_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RulesError(f"{tool} failed to run: {e}") from None
        if p.returncode != 0:
            raise RulesError(f"{tool} failed: {p.stderr.strip()}")
        if any(line.startswith(":ISTIO_") for line in p.stdout.splitlines()):
            return True
    return False


def look(ipv6: bool, tables: bool = False) -> Holdings:
    """What the calling thread's netns holds of ours (see :class:`Holdings`; ``tables``:
    also judge the iptables-nft tables). Raises RulesError when the netns can't be read."""
    held = _nf_tables_look(tables)
    if _legacy_holds(ipv6):
        held.stacks.add(IPTABLES_LEGACY)
    return held


def held_stacks(ipv6: bool) -> set[str]:
    """The stacks (:data:`STACKS` names) holding our in-pod rules in the calling thread's
    netns; empty for a fresh pod. Raises RulesError when the netns can't be read."""
    return look(ipv6).stacks


def pick(default: Backend, ipv6: bool) -> tuple[Backend, list[Backend]]:
    """``(backend to apply with, backends holding extra copies to delete)`` for the
    calling thread's netns, ``default`` being the agent's backend. A pod already holding
    our rules keeps them in that stack (reconciled there, never copied into another);
    a pod holding copies in several stacks (an older agent's mistake) keeps the one in
    the agent's stack if any, else the first of :data:`STACKS`, and loses the rest."""
    held = held_stacks(ipv6)
    mine = stack_of(default)
    if not held or held == {mine}:
        return default, []
    keep = mine if mine in held else next(s for s in STACKS if s in held)
    chosen = default if keep == mine else backend_for(keep)
    return chosen, [backend_for(s) for s in STACKS if s in held and s != keep]


def apply(default: Backend, opts: RuleOptions, known: bool = True
          ) -> tuple[str, Backend, list[Backend]]:
    """Apply the in-pod ruleset in the calling thread's netns where :func:`pick` says:
    ``(outcome, backend used, stray backends whose copies were removed)``. Raises
    RulesError (and whatever the backend raises).

    When ``default`` can start its tools ahead (``start_apply``: the iptables backend),
    they start first, unfed; the routing is added while they start, and the netns is
    looked at only when the pod might hold our rules: ``known`` (the agent has a record
    of it: a repeated ADD, a retry, restart recovery) or our ip rule was already there
    (every backend, ours and upstream's, adds it with the rules, so a netns without it
    holds none). A fresh pod at its first ADD pays no look. The restores are fed only if
    ``default`` is the pick, else killed unfed (nothing applied)."""
    pending = default.start_apply(opts) if hasattr(default, "start_apply") else None
    if pending is None:
        backend, strays = pick(default, opts.ipv6)
        outcome = backend.apply(opts)
    else:
        try:
            had_routing = rc.add_routing(opts.ipv6)
            backend, strays = (pick(default, opts.ipv6) if known or had_routing
                               else (default, []))
        except BaseException:
            pending.abandon()
            raise
        if backend is default:
            outcome = pending.finish(routing=False)
        else:
            pending.abandon()
            outcome = backend.apply(opts)
    for stray in strays:  # copies an earlier agent left in a second stack
        stray.delete(opts.ipv6, routing=False)
    return outcome, backend, strays


def delete_everywhere(default: Backend, ipv6: bool,
                      during: Callable[[], None] | None = None) -> list[str]:
    """Remove our in-pod rules from every stack holding them in the calling thread's netns:
    copies in stacks other than the agent's first (routing kept), then the agent's own
    (idempotent), which also removes the routing. Returns the other stacks that held
    rules. Raises RulesError.

    With iptables-nft as the agent's stack, the one netns look also judges its tables
    (:class:`Holdings`): when every table holding our chains holds nothing else (the
    usual pod), they are dropped in one ``nft -f`` transaction
    (:meth:`IptablesBackend.drop_tables`) without running ``iptables-save``; otherwise
    the backend's own delete reads the tables first. ``during()`` (must not raise) is
    called while the agent's stack's deleting transaction waits for the kernel, or after
    the deletion when the backend has no such wait."""
    mine = stack_of(default)
    fast = mine == IPTABLES_NFT and isinstance(default, IptablesBackend)
    held = look(ipv6, tables=fast)
    others = [s for s in STACKS if s != mine and s in held.stacks]
    for stack in others:
        backend_for(stack).delete(ipv6, routing=False)
    mine_tables = {k: v for k, v in held.nft_tables.items() if k[0] == "ip" or ipv6}
    if fast and all(mine_tables.values()) and isinstance(default, IptablesBackend):
        default.drop_tables(ipv6, sorted(mine_tables), during=during)
    elif isinstance(default, IptablesBackend):
        default.delete(ipv6, during=during)
    else:
        default.delete(ipv6)
        if during is not None:
            during()
    return others
