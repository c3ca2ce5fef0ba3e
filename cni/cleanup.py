"""``ambient-agent cleanup [--dry-run] [--force]``: decommission a node whose agent is stopped.

Removes what the agent put on the node, in this order, each step idempotent:

1. in-pod rules: for every pod record in ``<state_dir>/pods/`` whose netns still exists,
   our chains/tables and routing in every rules stack that holds them
   (:func:`cni.rules_detect.delete_everywhere`, what a CNI DEL of a running pod does);
2. host rules: the probe SNAT chain with its jumps and the ipsets (iptables, both flavors
   that are installed), and the nftables table with its sets, in ``host_rules_netns`` or
   the node netns (:meth:`cni.hostrules.HostProbeRules.teardown`);
3. the ``istio-cni`` entry of every conflist in ``cni_conf_dir`` (a converted ``.conf``
   restored) and the plugin launcher and bundles in ``cni_bin_dir``
   (:meth:`cni.install.Installer.uninstall`);
4. state: the pod records, registrations, enablement snapshot, iptables flavor record,
   stale sockets and the lock in ``state_dir``. The embedded CA (``ca_dir``), the mesh
   root file and the config directory are kept: they are the operator's, not the node's.

It refuses, changing nothing (one line, exit 1): when not root; while an agent runs on
the state dir (its ``agent.lock`` is held, which names the pid, or its admin, CNI event
or ZDS socket answers); when the plugin in ``cni_bin_dir`` or an ``istio-cni`` conflist entry is not
this agent's (another istio-cni, e.g. upstream's: a binary without our launcher's mark,
an entry whose ``cni_agent_run_dir`` is not this agent's) unless ``--force``.
``--dry-run`` prints what would be removed and changes nothing, also where a real run
would refuse: it then lists the plan all the same, after one line on stderr saying why the
real run would refuse now (the running agent's pid, the answering socket, the foreign
plugin), and exits 1. Exit 0 when everything listed was removed (or nothing was there),
1 when a step failed (the others still ran).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import functools
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from agent.core import unixsocket

LOCK_NAME = "agent.lock"  # agent/daemon.py StateDirLock's file in the state dir
LAUNCHER_MARK = b"ambient-agent cni install"  # in every launcher cni.install writes
# state_dir entries the agent creates and cleanup removes (files or directories)
STATE_ENTRIES = ("pods", "registrations.json", "enablement.json", "iptables-flavor",
                 "sds-private", "tls-private", "cni-install.json")

# The settings cleanup reads, with their flags (as `run` names them).
CLI_SETTINGS = ("state_dir", "config_file", "cni_conf_dir", "cni_bin_dir", "cni_event_socket",
                "admin_socket", "ztunnel_uds_address", "host_rules_netns", "ambient_ipv6")


class Refused(RuntimeError):
    """Cleanup will not run; the message is one line for the operator."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from agent.core.config import SETTINGS_BY_NAME

    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be removed; change nothing")
    parser.add_argument("--force", action="store_true",
                        help="also remove an istio-cni plugin or conflist entry that is not "
                             "this agent's")
    group = parser.add_argument_group("settings (flag > env > config file > default)")
    for name in CLI_SETTINGS:
        s = SETTINGS_BY_NAME[name]
        group.add_argument(s.flag, dest=name, default=None, metavar=s.metavar,
                           help=f"{s.help} (default: {s.shown_default}; env {s.env_name})"
                           .replace("%", "%%"))


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Any:
    """The Config from :data:`CLI_SETTINGS` (flags, their env variables, the config
    file). Raises :class:`agent.core.config.ConfigError` naming the setting."""
    from agent.core import config as agent_config

    environ: Mapping[str, str] = os.environ if env is None else env
    wanted = {agent_config.SETTINGS_BY_NAME[n].env_name for n in CLI_SETTINGS}
    flags = {name: getattr(args, name, None) for name in CLI_SETTINGS}
    return agent_config.load(flags, {k: v for k, v in environ.items() if k in wanted})


# --- refusals -----------------------------------------------------------------------------

def hold_lock(state_dir: str, create: bool) -> int | None:
    """An exclusive lock on ``<state_dir>/agent.lock`` (None when there is no lock file
    and ``create`` is false), so no agent starts during the cleanup. Raises Refused
    naming the pid when an agent holds it."""
    path = os.path.join(state_dir, LOCK_NAME)
    if not create and not os.path.exists(path):
        return None
    try:
        # O_NOFOLLOW: a symlink planted at the lock's name is refused, never written through
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise Refused(f"lock file {path} is a symlink: refused, not followed") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise Refused(f"an ambient-agent (pid {holder}) is running on state dir {state_dir}: "
                      "stop it first (cleanup is for a node whose agent is gone)") from None
    return fd


def lock_holder(state_dir: str) -> str | None:
    """The pid (text) of the agent holding ``<state_dir>/agent.lock``, or None when it is
    free or absent. Takes no lock that outlives the call (a dry run must not keep an agent
    from starting)."""
    path = os.path.join(state_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 32).decode(errors="replace").strip() or "?"
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a shared lock we got
    return None


def check_no_agent(config: Any) -> None:
    """Raises Refused when the admin, CNI event or ZDS socket answers (an agent, or
    another node agent serving ztunnel there)."""
    for setting, kind in (("admin_socket", socket.SOCK_STREAM),
                          ("cni_event_socket", socket.SOCK_STREAM),
                          ("ztunnel_uds_address", socket.SOCK_SEQPACKET)):  # ZDS: SEQPACKET
        path = getattr(config, setting)
        if unixsocket.answers(path, kind):
            raise Refused(f"an agent answers on {path} ({setting}): stop it first")


def foreign(installer: Any) -> list[str]:
    """Why the plugin or a conflist entry in the CNI dirs is not this agent's, or []."""
    found = []
    try:
        with open(installer.binary_path, "rb") as f:
            head = f.read(4096)
        if LAUNCHER_MARK not in head:
            found.append(f"{installer.binary_path} was not installed by this agent"
                         + (" (an ELF binary: upstream istio-cni?)"
                            if head.startswith(b"\x7fELF") else ""))
    except FileNotFoundError:
        pass
    try:
        names = sorted(os.listdir(installer.conf_dir))
    except OSError:
        names = []
    for name in names:
        if not name.endswith(".conflist"):
            continue
        path = os.path.join(installer.conf_dir, name)
        try:
            with open(path, "rb") as f:
                config = json.loads(f.read() or b"")
        except (OSError, ValueError):
            continue
        for p in config.get("plugins") or [] if isinstance(config, dict) else []:
            if isinstance(p, dict) and p.get("type") == "istio-cni" and os.path.normpath(
                    str(p.get("cni_agent_run_dir", ""))) != os.path.normpath(installer.run_dir):
                found.append(f"{path}: its istio-cni entry is another agent's "
                             f"(cni_agent_run_dir {p.get('cni_agent_run_dir')!r}, this "
                             f"agent's is {installer.run_dir!r})")
    return found


# --- the plan -----------------------------------------------------------------------------

# (what, action): action() does it and may return the lines saying what it did; None:
# done by the step before (one uninstall covers every conflist and the plugin)
Step = tuple[str, Callable[[], Any] | None]


def _host_rules(config: Any) -> list[Any]:
    """Host rules of both backends and every installed iptables flavor."""
    from cni.hostrules import HostProbeRules

    netns = config.host_rules_netns or None
    out = [HostProbeRules(backend="nftables", ipv6=config.ambient_ipv6, netns=netns,
                          kubelet_uid=0)]
    for flavor in ("nft", "legacy"):
        if shutil.which(f"iptables-{flavor}-save"):
            out.append(HostProbeRules(backend="iptables", flavor=flavor,
                                      ipv6=config.ambient_ipv6, netns=netns))
    return out


def _pod_steps(config: Any) -> list[Step]:
    from cni import rules_detect
    from cni.enrollment.kernel import KernelNetns
    from cni.enrollment.records import PodStateStore
    from cni.rules_iptables import IptablesBackend, detect_flavor
    from agent.core import netns as netns_mod

    steps: list[Step] = []
    flavor_file = Path(config.state_dir, "iptables-flavor")
    try:
        flavor = detect_flavor(config.state_dir if flavor_file.exists() else None)
    except Exception:  # noqa: BLE001 - no iptables: the nft stacks are still looked at
        flavor = "nft"
    backend = IptablesBackend(flavor)
    kernel = KernelNetns()
    for rec in PodStateStore(config.state_dir).load():
        path = rec.netns
        if not path or not os.path.exists(path):
            continue
        try:
            with netns_mod.entered(path):
                held = rules_detect.held_stacks(config.ambient_ipv6)
        except Exception:  # noqa: BLE001 - unreadable netns: nothing we can remove
            continue
        if not held:
            continue
        steps.append((f"in-pod rules of {rec.label()} in {path} ({', '.join(sorted(held))})",
                      functools.partial(kernel.delete_rules, path, backend,
                                        config.ambient_ipv6)))
    return steps


def installers(config: Any) -> list[Any]:
    """The installs to remove: the one the settings name, then each one ``cni install``
    (or the agent's ``cni_manage_config``) recorded in the state dir with other dirs
    (``cni.install.RECORD_NAME``), so a plain ``cleanup`` finds an install made with
    ``--conf-dir``/``--bin-dir``."""
    import dataclasses

    from cni.install import installer_from_config, read_records

    base = installer_from_config(config)
    out = [base]
    seen = {(os.path.normpath(base.conf_dir), os.path.normpath(base.bin_dir))}
    for rec in read_records(config.state_dir):
        key = (os.path.normpath(rec["conf_dir"]), os.path.normpath(rec["bin_dir"]))
        if key not in seen:
            seen.add(key)
            out.append(dataclasses.replace(base, conf_dir=rec["conf_dir"],
                                           bin_dir=rec["bin_dir"],
                                           conf_name=rec["conf_name"]))
    return out


def plan(config: Any, installs: list[Any]) -> list[Step]:
    """Every removal that would change something now, in order (:data:`Step`)."""
    steps = _pod_steps(config)
    said: set[str] = set()
    for rules in _host_rules(config):
        # the ipset is one kernel object both iptables flavors report: named once
        parts = [p for p in rules.present() if p not in said]
        said.update(parts)
        if parts:
            where = f" in {rules.netns}" if rules.netns else ""
            steps.append(("host " + ", ".join(parts) + where, rules.teardown))
    for installer in installs:
        for i, line in enumerate(installer.uninstall(dry_run=True)):
            steps.append((line, installer.uninstall if i == 0 else None))
    state = Path(config.state_dir)
    paths = [state / name for name in STATE_ENTRIES]
    paths += [Path(p) for p in (config.cni_event_socket, config.admin_socket,
                                config.ztunnel_uds_address)]
    for path in paths:
        if path.exists() or path.is_symlink():
            steps.append((f"state {path}", functools.partial(_remove, path)))
    return steps


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def run(config: Any, dry_run: bool, force: bool, out: Any = None) -> int:
    """The command's work (lines to ``out``, default stdout). Raises Refused before any
    change; returns the exit code."""
    out = out or sys.stdout
    if os.geteuid() != 0:
        raise Refused("cleanup must run as root (it removes rules in network namespaces)")
    state_dir = config.state_dir
    if dry_run:
        return _dry_run(config, force, out)
    fd = hold_lock(state_dir, create=False)
    try:
        check_no_agent(config)
        installs = installers(config)
        problems = [p for installer in installs for p in foreign(installer)]
        if problems and not force:
            raise Refused("; ".join(problems) + " (nothing changed; --force removes it too)")
        steps = plan(config, installs)
        if not steps:
            print("nothing to clean up", file=out)
            return 0
        failed = 0
        for desc, action in steps:
            if action is None:
                continue
            try:
                said = action()
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                failed += 1
                print(f"failed to remove {desc}: {e}", file=sys.stderr)
                continue
            for line in said if isinstance(said, list) and said else [f"removed {desc}"]:
                print(line, file=out)
        lock = os.path.join(state_dir, LOCK_NAME)
        if os.path.exists(lock):
            os.unlink(lock)
        return 1 if failed else 0
    finally:
        if fd is not None:
            os.close(fd)


def _dry_run(config: Any, force: bool, out: Any) -> int:
    """``--dry-run``: the plan, changing nothing and holding no lock. Where a real run
    would refuse now (an agent running, a foreign plugin without ``force``) one line on
    stderr says why, the plan is printed all the same, and the exit code is 1."""
    refusals = []
    holder = lock_holder(config.state_dir)
    if holder is not None:
        refusals.append(f"an ambient-agent (pid {holder}) is running on state dir "
                        f"{config.state_dir}")
    else:
        try:
            check_no_agent(config)
        except Refused as e:
            refusals.append(str(e))
    installs = installers(config)
    problems = [p for installer in installs for p in foreign(installer)]
    if problems and not force:
        refusals.append("; ".join(problems) + " (--force removes it too)")
    if refusals:
        print(f"ambient-agent cleanup: a real run would refuse now: {'; '.join(refusals)}; "
              "what it would remove once it can:", file=sys.stderr)
    steps = plan(config, installs)
    if not steps:
        print("nothing to clean up", file=out)
    for desc, _ in steps:
        print(f"would {desc}" if desc.startswith(("remove ", "restore "))
              else f"would remove {desc}", file=out)
    return 1 if refusals else 0


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        return run(config, args.dry_run, args.force)
    except Refused as e:
        print(f"ambient-agent cleanup: {e}", file=sys.stderr)
        return 1
