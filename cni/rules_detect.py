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
(pyroute2, ~0.4 ms on a quiet machine) and a read of
``/proc/thread-self/net/ip{,6}_tables_names`` (µs); only when legacy xtables tables are
loaded in the netns does ``iptables-legacy-save`` run.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.nftables.main import NFTables

from cni import rules_common as rc
from cni.rules_common import RulesError
from cni.rules_iptables import IptablesBackend
from cni.rules_nftables import MANGLE, NAT, RAW, NftablesBackend

log = logging.getLogger("cni.rules")

IPTABLES_NFT, IPTABLES_LEGACY, NFTABLES = "iptables-nft", "iptables-legacy", "nftables"
STACKS = (IPTABLES_NFT, IPTABLES_LEGACY, NFTABLES)  # the order ties are broken in
_NFPROTO_INET, _NFPROTO_IPV4, _NFPROTO_IPV6 = 1, 2, 10
TOOL_TIMEOUT = 60.0


def stack_of(backend) -> str:
    """The stack name of a backend object (:class:`IptablesBackend` or
    :class:`NftablesBackend`)."""
    if isinstance(backend, NftablesBackend):
        return NFTABLES
    return IPTABLES_LEGACY if getattr(backend, "flavor", "nft") == "legacy" else IPTABLES_NFT


def backend_for(stack: str):
    """A backend object writing to ``stack``. Raises ValueError for an unknown name."""
    if stack == NFTABLES:
        return NftablesBackend()
    if stack in (IPTABLES_NFT, IPTABLES_LEGACY):
        return IptablesBackend(stack.split("-", 1)[1])
    raise ValueError(f"unknown rule stack {stack!r}; expected one of {', '.join(STACKS)}")


def _nf_tables_holdings() -> set[str]:
    """iptables-nft and/or nftables, from one nf_tables dump of the calling thread's
    netns. Raises RulesError when the dump fails."""
    ours = {NAT, MANGLE, RAW}
    held: set[str] = set()
    try:
        # one dump of every family's chains: our inet tables always hold chains
        with NFTables(nfgen_family=0) as nft:
            for chain in nft.get_chains():
                family = chain["nfgen_family"]
                if family == _NFPROTO_INET and chain.get_attr("NFTA_CHAIN_TABLE") in ours:
                    held.add(NFTABLES)
                elif (family in (_NFPROTO_IPV4, _NFPROTO_IPV6)
                      and (chain.get_attr("NFTA_CHAIN_NAME") or "").startswith("ISTIO_")):
                    held.add(IPTABLES_NFT)
    except (NetlinkError, OSError) as e:
        raise RulesError(f"listing nf_tables tables and chains in the pod netns: {e}") from None
    return held


def _legacy_holds(ipv6: bool) -> bool:
    """True when legacy xtables in the calling thread's netns hold an ``ISTIO_*`` chain.
    ``/proc/thread-self/net`` (not ``/proc/net``, which follows the process's first
    thread) lists the tables loaded in this netns; none loaded means none of ours."""
    for v6 in ([False, True] if ipv6 else [False]):
        names_file = f"/proc/thread-self/net/ip{'6' if v6 else ''}_tables_names"
        try:
            with open(names_file) as f:
                loaded = f.read().split()
        except OSError:
            continue  # x_tables not available in this kernel: nothing of ours there
        if not loaded:
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


def held_stacks(ipv6: bool) -> set[str]:
    """The stacks (:data:`STACKS` names) holding our in-pod rules in the calling thread's
    netns; empty for a fresh pod. Raises RulesError when the netns can't be read."""
    held = _nf_tables_holdings()
    if _legacy_holds(ipv6):
        held.add(IPTABLES_LEGACY)
    return held


def pick(default, ipv6: bool) -> tuple[object, list]:
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


def delete_everywhere(default, ipv6: bool) -> list[str]:
    """Remove our in-pod rules from every stack holding them in the calling thread's netns:
    copies in stacks other than the agent's first (routing kept), then ``default.delete``
    (the agent's backend, idempotent) which also removes the routing. Returns the other
    stacks that held rules. Raises RulesError."""
    mine = stack_of(default)
    others = [s for s in STACKS if s != mine and s in held_stacks(ipv6)]
    for stack in others:
        backend_for(stack).delete(ipv6, routing=False)
    default.delete(ipv6)
    return others
