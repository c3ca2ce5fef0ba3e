"""In-pod redirection rules, iptables backend (``docs/enrollment.md``).

:class:`IptablesBackend` applies the ruleset of :mod:`cni.rules_iptables_text`
(``build_rules``, ``render_restore``: the text, built without running anything) inside
a pod's netns with ``iptables-restore``, and removes it.

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

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from agent.core.files import write_atomic
from cni import rules_common as rc
from cni import rules_iptables_text as rt
from cni.rules_common import RuleOptions, RulesError
from cni.rules_iptables_text import Rule, build_rules, render_restore

log = logging.getLogger(__name__)

WAIT_SECONDS = "30"
TOOL_TIMEOUT = 60.0


# --- tool invocation -------------------------------------------------------------------

FLAVOR_FILE = "iptables-flavor"


def detect_flavor(state_dir: str | None = None,
                  holding: Callable[[], set[str]] | None = None) -> str:
    """``"nft"`` or ``"legacy"``: the recorded value from ``<state_dir>/iptables-flavor``
    if present; else the flavor whose tables already hold our ``ISTIO_*`` chains on the
    host (``holding()`` returns those flavors, looked at in the host netns by the
    caller); else the host's ``iptables --version``. The result is recorded.

    A lost record must not move the host's rules to another flavor: the host's
    ``iptables`` alternative may point at legacy while the previous agent wrote to
    iptables-nft, and writing there again would leave the nft copy (with whatever SNAT
    address it had) in place. Upstream picks the flavor by where rules are defined in the
    netns (legacy when legacy holds rules, else nft: ``DetectIptablesVersion``); we look
    for our own chains first, so other software's rules do not decide. When both flavors
    hold ours, the ``iptables`` alternative's flavor is kept (the other copy is removed
    by :meth:`cni.hostrules.HostProbeRules.setup`).

    A recorded value that is not one of those two (any bytes: a damaged file) is
    ignored with a warning naming the file and showing at most 32 bytes of it, and the
    flavor is detected and recorded again. Raises :class:`RulesError` when no iptables is
    installed, naming the file when it can't be read (a directory, no permission), and
    whatever ``holding`` raises (RulesError when the host can't be read).
    """
    path = Path(state_dir, FLAVOR_FILE) if state_dir else None
    if path and path.exists():
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise RulesError(f"cannot read the recorded iptables flavor {path}: "
                             f"{e.strerror or e}") from None
        flavor = raw.strip().decode("ascii", errors="replace")
        if flavor in ("nft", "legacy") and shutil.which(f"iptables-{flavor}-restore"):
            return flavor
        log.warning("ignoring recorded iptables flavor %r in %s (expected nft or legacy); "
                    "detecting it again", raw[:32], path)
    try:
        out = subprocess.run(["iptables", "--version"], capture_output=True, text=True,
                             timeout=TOOL_TIMEOUT).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RulesError(f"cannot run iptables --version: {e}") from None
    flavor = "legacy" if "legacy" in out else "nft"
    held = {f for f in (holding() if holding is not None else set())
            if shutil.which(f"iptables-{f}-restore")}
    if held and flavor not in held:
        (other,) = held
        log.warning("host iptables is %s, but our host rules are in iptables-%s: keeping "
                    "iptables-%s%s", flavor, other, other,
                    f" (no flavor record in {path})" if path else "")
        flavor = other
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
        stdin = p.stdin
        assert stdin is not None  # _spawn made it a pipe
        try:
            stdin.write(text)  # a few KiB: fits the pipe buffer, never blocks
            stdin.close()
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
        residue = rt.istio_residue(self.save(v6)) if rt.chain_exists_error(first.stderr, text) else {}
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
                for c in (r.chain, rt.jump_target(r)):
                    if c and c not in rt.BUILTIN_CHAINS and c not in chains:
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
            residue = rt.istio_residue(saves[v6])
            if not residue:
                continue
            empty = rt.empty_without_istio(saves[v6]) if self.flavor == "nft" else set()
            family = "ip6" if v6 else "ip"
            drops += [f"add table {family} {t}\ndelete table {family} {t}\n"
                      for t in sorted(residue) if t in empty]
            keep = {t: have for t, have in residue.items() if t not in empty}
            if keep:
                p = self._restore(v6, rt.delete_text(keep))
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
        return all(rt.istio_residue(self.save(v6)) for v6 in ([False, True] if ipv6 else [False]))


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
