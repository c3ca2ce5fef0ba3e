"""In-pod redirection rules, iptables backend (``docs/enrollment.md``).

:func:`build_rules` gives the ordered rule list of one family; :func:`render_restore`
turns it into ``iptables-restore`` input exactly as upstream renders it (the default
IPv4 output equals upstream's default golden line for line). :class:`IptablesBackend` applies
it inside a pod's netns.

Apply algorithm (ours; upstream compares with ``iptables -C`` per rule and guards the
reconcile with DROP rules). A fresh pod is the common case, so we try the plain
``iptables-restore --noflush`` first: it is atomic and fails as a whole with
"Chain already exists" when our chains are there, so nothing is ever duplicated.
Only on failure do we look (``iptables-save``): no ``ISTIO_*`` residue means a real
error (reported with stderr); residue means a pod carrying our rules, which we replace
in one atomic restore (declaring ``:CHAIN`` flushes it under ``--noflush``, stale jumps
are ``-D``'d in the same transaction). No window without rules, no guardrails needed.

Flavor (nf_tables vs legacy) is detected once from the host's ``iptables --version``
and recorded in the state dir so a restarted agent keeps using the variant the pods'
rules were written with (mixing variants inside one netns double-applies).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
from pathlib import Path

from agent.core.files import write_atomic
from cni import rules_common as rc
from cni.rules_common import RuleOptions, RulesError

log = logging.getLogger(__name__)

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
PRERT, OUTPUT = "ISTIO_PRERT", "ISTIO_OUTPUT"
WAIT_SECONDS = "30"
TOOL_TIMEOUT = 60.0


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


def _jump_target(rule: Rule) -> str | None:
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
            target = _jump_target(r)
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


# --- tool invocation -------------------------------------------------------------------

FLAVOR_FILE = "iptables-flavor"


def detect_flavor(state_dir: str | None = None) -> str:
    """``"nft"`` or ``"legacy"``: recorded value from ``<state_dir>/iptables-flavor`` if
    present, else from ``iptables --version`` in the current (host) netns, then recorded.

    Raises :class:`RulesError` when no iptables is installed.
    """
    path = Path(state_dir, FLAVOR_FILE) if state_dir else None
    if path and path.exists():
        flavor = path.read_text().strip()
        if flavor in ("nft", "legacy") and shutil.which(f"iptables-{flavor}-restore"):
            return flavor
        log.warning("ignoring recorded iptables flavor %r in %s", flavor, path)
    try:
        out = subprocess.run(["iptables", "--version"], capture_output=True, text=True,
                             timeout=TOOL_TIMEOUT).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RulesError(f"cannot run iptables --version: {e}") from None
    flavor = "legacy" if "legacy" in out else "nft"
    if not shutil.which(f"iptables-{flavor}-restore"):
        raise RulesError(f"iptables flavor {flavor!r} detected but iptables-{flavor}-restore "
                         "is not installed")
    if path:
        write_atomic(path, flavor + "\n", 0o644)
    return flavor


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    # Forked children inherit the calling thread's netns (``docs/maintainers/testing.md``).
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RulesError(f"{argv[0]} failed to run: {e}") from None


def _istio_residue(save_text: str) -> dict[str, dict[str, list[str]]]:
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


def _chain_exists_error(stderr: str, text: str) -> bool:
    """True when iptables-restore failed on one of our ``-N`` lines: nf_tables says
    "Chain already exists", legacy only "line N failed" (so look at line N)."""
    if "already exists" in stderr:
        return True
    m = re.search(r"line:? (\d+)", stderr)
    lines = text.splitlines()
    return bool(m) and 0 < int(m.group(1)) <= len(lines) and (
        lines[int(m.group(1)) - 1].startswith("-N "))


def _delete_text(residue: dict[str, dict[str, list[str]]]) -> str:
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


def _empty_without_istio(save_text: str) -> set[str]:
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


class IptablesBackend:
    """Applies/removes the in-pod ruleset with ``iptables[-nft|-legacy]-restore``.

    Every method blocks and acts on the *calling thread's* netns; the enrollment code
    runs them in a worker thread that entered the pod's netns. ``flavor`` is ``"nft"``
    or ``"legacy"`` (see :func:`detect_flavor`).
    """

    name = "iptables"

    def __init__(self, flavor: str = "nft"):
        if flavor not in ("nft", "legacy"):
            raise ValueError(f"iptables flavor must be nft or legacy, got {flavor!r}")
        self.flavor = flavor

    def _tool(self, v6: bool, what: str) -> str:
        return f"{'ip6tables' if v6 else 'iptables'}-{self.flavor}-{what}"

    def save(self, v6: bool = False) -> str:
        """``iptables-save`` of the current netns. Raises :class:`RulesError`."""
        p = _run([self._tool(v6, "save")])
        if p.returncode != 0:
            raise RulesError(f"{self._tool(v6, 'save')} failed: {p.stderr.strip()}")
        return p.stdout

    def _restore(self, v6: bool, text: str) -> subprocess.CompletedProcess:
        return _run([self._tool(v6, "restore"), "--noflush", f"--wait={WAIT_SECONDS}"], text)

    def apply(self, opts: RuleOptions) -> str:
        """Install the ruleset (both families when ``opts.ipv6``) plus routing.
        Returns ``"applied"`` or ``"replaced"`` (our rules were already there and were
        atomically rewritten). Raises :class:`RulesError` with the tool's stderr.
        Same as ``start_apply(opts).finish()``."""
        return self.start_apply(opts).finish()

    def start_apply(self, opts: RuleOptions) -> "PendingApply":
        """Start the restore processes (in the calling thread's netns) without giving
        them their input yet, so their fork/exec and start-up overlap whatever the
        caller still has to decide (:mod:`cni.rules_detect` looks at the netns meanwhile).
        Nothing is applied until :meth:`PendingApply.finish`; :meth:`PendingApply.abandon`
        kills them with nothing applied. Raises :class:`RulesError` if a tool can't run."""
        families = [False, True] if opts.ipv6 else [False]
        texts = {v6: render_restore(build_rules(opts, v6)) for v6 in families}
        procs: dict[bool, subprocess.Popen] = {}
        try:
            for v6 in families:
                procs[v6] = self._spawn([self._tool(v6, "restore"), "--noflush",
                                         f"--wait={WAIT_SECONDS}"])
        except BaseException:
            _kill_all(procs.values())
            raise
        return PendingApply(self, opts, procs, texts)

    @staticmethod
    def _spawn(argv: list[str]) -> subprocess.Popen:
        """Start ``argv`` with a pipe on its stdin, nothing written yet; RulesError if it
        can't run."""
        try:
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        except OSError as e:
            raise RulesError(f"{argv[0]} failed to run: {e}") from None

    @staticmethod
    def _feed(p: subprocess.Popen, text: str) -> None:
        """Write ``text`` to a :meth:`_spawn`'ed process's stdin and close it."""
        try:
            p.stdin.write(text)  # a few KiB: fits the pipe buffer, never blocks
            p.stdin.close()
        except OSError:
            pass  # the tool died early; its exit status and stderr say why
        p.stdin = None  # so communicate() only collects output

    @classmethod
    def _start(cls, argv: list[str], text: str) -> subprocess.Popen:
        """Start ``argv`` with ``text`` on its stdin (closed); RulesError if it can't run."""
        p = cls._spawn(argv)
        cls._feed(p, text)
        return p

    @staticmethod
    def _wait(p: subprocess.Popen, tool: str) -> tuple[str, str, int]:
        """``(stdout, stderr, exit status)``; RulesError after :data:`TOOL_TIMEOUT`."""
        try:
            out, err = p.communicate(timeout=TOOL_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise RulesError(f"{tool} timed out") from None
        return out, err, p.returncode

    def _finish(self, v6: bool, p: subprocess.Popen) -> subprocess.CompletedProcess:
        out, err, code = self._wait(p, self._tool(v6, "restore"))
        return subprocess.CompletedProcess(p.args, code, out, err)

    def _after_first(self, opts: RuleOptions, v6: bool, text: str,
                     first: subprocess.CompletedProcess) -> str:
        if first.returncode == 0:
            return "applied"
        # Only "our chain exists" sends us down the replace path; any other failure
        # (bad interface name, missing module, ...) is reported as is.
        residue = _istio_residue(self.save(v6)) if _chain_exists_error(first.stderr, text) else {}
        if not residue:
            raise RulesError(f"{self._tool(v6, 'restore')} failed: {first.stderr.strip()}")
        second = self._restore(v6, self._replace_text(build_rules(opts, v6), residue))
        if second.returncode != 0:
            raise RulesError(f"{self._tool(v6, 'restore')} (replacing existing rules) failed: "
                             f"{second.stderr.strip()}")
        return "replaced"

    @staticmethod
    def _replace_text(rules: list[Rule], residue: dict) -> str:
        """One atomic transaction per table: flush/declare our chains, drop stale jumps,
        delete ISTIO_* chains we no longer want, add the desired rules."""
        lines: list[str] = []
        tables = sorted({r.table for r in rules} | set(residue))
        for table in tables:
            wanted = [r for r in rules if r.table == table]
            have = residue.get(table, {"chains": [], "jumps": []})
            chains: list[str] = []
            for r in wanted:
                for c in (r.chain, _jump_target(r)):
                    if c and c not in BUILTIN_CHAINS and c not in chains:
                        chains.append(c)
            stale = [c for c in have["chains"] if c not in chains]
            lines.append(f"*{table}")
            lines += [f":{c} - [0:0]" for c in chains + stale]  # create or flush
            lines += ["-D" + j[2:] for j in have["jumps"]]
            lines += [f"-X {c}" for c in stale]
            lines += [f"{r.op} {r.chain} {r.args}" for r in wanted]
            lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def delete(self, ipv6: bool, routing: bool = True, during=None) -> None:
        """Remove every ISTIO_* chain and jump (both families when ``ipv6``), then the
        routing (unless ``routing`` is False: removing a stray copy of our rules from this
        stack while another stack keeps them, :mod:`cni.rules_detect`). Idempotent: a
        clean netns is fine. Raises :class:`RulesError`. ``during()``, if given, is called
        while the deleting transaction waits for the kernel (or at the end, when there is
        none); it must not raise.

        Every deleting kernel transaction costs ~12 ms here (nf_tables waits for an RCU
        grace period), far more than the tools' start-up, so we do as few as possible:
        one ``iptables-save`` per family (both at once) tells us what is there; with the
        nft flavor, tables that would be left empty (the usual pod: only our rules) are
        dropped whole, all families in one ``nft -f`` transaction. Only tables holding
        someone else's rules get an ``iptables-restore`` that deletes just ours.
        :func:`cni.rules_detect.delete_everywhere` spares the usual pod the saves when its
        netns look already showed the tables hold only ours (:meth:`drop_tables`).
        """
        families = [False, True] if ipv6 else [False]
        self._delete_from_saves(ipv6, self._save_all(families), routing, during)

    def _delete_from_saves(self, ipv6: bool, saves: dict[bool, str], routing: bool,
                           during=None) -> None:
        families = [False, True] if ipv6 else [False]
        drops: list[str] = []
        for v6 in families:
            residue = _istio_residue(saves[v6])
            if not residue:
                continue
            empty = _empty_without_istio(saves[v6]) if self.flavor == "nft" else set()
            family = "ip6" if v6 else "ip"
            drops += [f"add table {family} {t}\ndelete table {family} {t}\n"
                      for t in sorted(residue) if t in empty]
            keep = {t: have for t, have in residue.items() if t not in empty}
            if keep:
                p = self._restore(v6, _delete_text(keep))
                if p.returncode != 0:
                    raise RulesError(f"{self._tool(v6, 'restore')} (delete) failed: "
                                     f"{p.stderr.strip()}")
        self._drop("".join(drops), ipv6, routing, during)

    def drop_tables(self, ipv6: bool, tables: list[tuple[str, str]], routing: bool = True,
                    during=None) -> None:
        """Drop whole nf_tables tables ``(family, table)`` (``"ip"``/``"ip6"``) in one ``nft
        -f`` transaction, removing the routing while it runs (unless ``routing`` is
        False): the delete for tables known to hold nothing but ours
        (:func:`cni.rules_detect.look`), without reading them again. Idempotent (absent
        tables are fine). Raises :class:`RulesError`. ``during``: as for :meth:`delete`."""
        self._drop("".join(f"add table {f} {t}\ndelete table {f} {t}\n" for f, t in tables),
                   ipv6, routing, during)

    def _drop(self, text: str, ipv6: bool, routing: bool, during=None) -> None:
        if not text:
            if routing:
                rc.delete_routing(ipv6)
            if during is not None:
                during()
            return
        # the routing goes (and ``during`` runs) while nft waits out its grace period
        nft = self._start(["nft", "-f", "-"], text)
        try:
            if during is not None:
                during()
            if routing:
                rc.delete_routing(ipv6)
        finally:
            _, err, code = self._wait(nft, "nft")
        if code != 0:
            raise RulesError(f"nft -f (delete iptables-nft tables) failed: {err.strip()}")

    def _save_all(self, families: list[bool]) -> dict[bool, str]:
        """``iptables-save`` of every family in ``families``, run concurrently."""
        procs: dict[bool, subprocess.Popen] = {}
        for v6 in families:
            argv = [self._tool(v6, "save")]
            try:
                procs[v6] = subprocess.Popen(argv, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)
            except OSError as e:
                _kill_all(procs.values())
                raise RulesError(f"{argv[0]} failed to run: {e}") from None
        out: dict[bool, str] = {}
        for v6, p in procs.items():
            text, err, code = self._wait(p, self._tool(v6, "save"))
            if code != 0:
                raise RulesError(f"{self._tool(v6, 'save')} failed: {err.strip()}")
            out[v6] = text
        return out

    def present(self, ipv6: bool) -> bool:
        """True when our chains exist in the current netns (every family asked for)."""
        return all(_istio_residue(self.save(v6)) for v6 in ([False, True] if ipv6 else [False]))


class PendingApply:
    """Restore processes started by :meth:`IptablesBackend.start_apply`, waiting for
    their input. Exactly one of :meth:`finish` / :meth:`abandon` must be called, on the
    thread (netns) that started them."""

    def __init__(self, backend: IptablesBackend, opts: RuleOptions,
                 procs: dict[bool, subprocess.Popen], texts: dict[bool, str]):
        self.backend, self.opts, self.procs, self.texts = backend, opts, procs, texts

    def finish(self, routing: bool = True) -> str:
        """Give each restore its ruleset, set up the routing while they run (unless
        ``routing`` is False: the caller added it already), then handle their outcome
        (replace path on "chain exists"). Returns ``"applied"`` or ``"replaced"``;
        raises :class:`RulesError`."""
        b = self.backend
        for v6, p in self.procs.items():
            b._feed(p, self.texts[v6])
        try:
            if routing:
                rc.add_routing(self.opts.ipv6)
        finally:
            firsts = {v6: b._finish(v6, p) for v6, p in self.procs.items()}
        outcomes = [b._after_first(self.opts, v6, self.texts[v6], firsts[v6])
                    for v6 in self.procs]
        return "replaced" if "replaced" in outcomes else "applied"

    def abandon(self) -> None:
        """Kill the restores before they read anything: nothing is applied."""
        _kill_all(self.procs.values())


def _kill_all(procs) -> None:
    """Kill and reap ``procs`` (started tools that must not act); never raises."""
    for p in procs:
        try:
            p.kill()
        except OSError:
            pass
        try:
            p.communicate(timeout=TOOL_TIMEOUT)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
