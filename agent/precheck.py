"""``ambient-agent precheck``: is this node ready for ambient mode, before the agent runs?

One line per check (``ok``, ``warn`` or ``FAIL``, the check's name, what was found) and
exit 1 when any check failed (2 for a bad setting, as every subcommand). Checks, with the
settings they read (flags, env and config file as for ``run``):

- ``privileges``: this process holds CAP_NET_ADMIN, as ``run`` needs (run precheck as the
  agent runs, as root): without it the netlink checks below cannot tell anything.
- ``state dir``: ``state_dir`` is a writable directory, or the nearest existing directory
  above it is writable so ``run`` can create it (a read-only file system is not).
- ``kernel modules``: the iptables (or, with ``native_nftables``, nftables) modules
  Istio's platform requirements list for ambient, IPv6 ones with ``ambient_ipv6``: each
  loaded (``/proc/modules``), built in (``modules.builtin``) or loadable (a ``.ko`` under
  ``/lib/modules/<release>``). Without ``/lib/modules`` (a container) a module not loaded
  is a warning: it can't be told whether the kernel would load it.
- ``iptables``: the flavor (legacy / nf_tables) and its restore tool, as enrollment
  detects it (:func:`cni.rules_iptables.detect_flavor`); or ``nft`` with nftables.
- ``ipset``: the host probe set needs the ``ip_set`` netlink family (a probe set is
  created and removed).
- ``CNI config``: ``cni_conf_dir`` exists and holds a primary network config
  (:func:`cni.conflist.find_primary`; why not, when not).
- ``istio-cni``: no other istio-cni is installed: the ``istio-cni`` binary in
  ``cni_bin_dir`` is ours (our launcher, or a standalone build we installed) and no
  upstream istio-cni node agent answers on ``/var/run/istio-cni/pluginevent.sock``.
- ``ports``: every TCP port the agent listens on can be bound now; a busy one names who
  listens on it (the running agent of this state dir, from its ``agent.lock``, or a pid and
  process name).
- ``ZDS socket``: the directory of ``ztunnel_uds_address`` is (or can be made) writable and
  no live server answers on the socket (another agent).
- ``ztunnel``: a ztunnel answers its readiness port (``http://127.0.0.1:15021/healthz/ready``);
  a warning when none does (ztunnel usually starts after the agent).
- ``Kubernetes API`` (``config_source: kubernetes``; credentials as ``run``): the API
  server answers and lets the agent do what its config source does for every kind it
  reads (:data:`ambient.source_kube.RESOURCES`): a ``list`` (``?limit=1``) and a
  ``watch`` from that list's resourceVersion (closed once the server has accepted it),
  the very requests of ``run``, all kinds at once. FAIL, in one line: the server
  unreachable (naming its URL and the error), 401 (the credentials are refused: which
  ones), 403 (each refused ``verb Kind``, with the server's message for the first), a
  kubeconfig that cannot be loaded. A kind that is not served (404: its CRD is missing)
  is left to the next check.
- ``Istio CRDs`` (``config_source: kubernetes``; credentials as ``run``: ``kubeconfig``,
  else in-cluster): for each custom kind the index reads (Istio's ServiceEntry,
  WorkloadEntry, AuthorizationPolicy, PeerAuthentication; the Gateway API's Gateway,
  GatewayClass) whether its CRD is on the cluster and whose it is, told by the labels
  and annotations its installer sets (:func:`crd_owner`): Istio's base chart or
  ``crd-all.gen.yaml``, the Gateway API's release, this project's ``deploy/crds/``, or
  unknown; and whether it serves the version the agent reads. A warning for a missing
  CRD (its kind is treated as empty) or one not serving that version; the API server
  unreachable is a warning (``run`` retries it). Needs ``get`` on those CRDs by name
  (the DaemonSet's ClusterRole has it).

Nothing is changed on the node (the probe ipset is created under a unique name and
removed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import os
import platform
import secrets
import shutil
import socket
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from agent.core import unixsocket
from agent.core.capabilities import has_net_admin
from agent.core.portholders import port_holders
from agent.core.kubeclient import client_configuration

if TYPE_CHECKING:
    from agent.core.config import Config

OK, WARN, FAIL = "ok", "warn", "FAIL"

IPTABLES_MODULES = ["iptable_mangle", "iptable_nat", "xt_REDIRECT", "xt_connmark",
                    "xt_conntrack", "xt_mark", "xt_owner", "xt_tcpudp", "xt_multiport",
                    "ip_set", "ip_set_hash_ip"]
IPTABLES6_MODULES = ["ip6table_mangle", "ip6table_nat"]
NFTABLES_MODULES = ["nf_tables", "ip_set", "ip_set_hash_ip"]
UPSTREAM_EVENT_SOCKET = "/var/run/istio-cni/pluginevent.sock"
ZTUNNEL_READY_URL = "http://127.0.0.1:15021/healthz/ready"


@dataclasses.dataclass
class Check:
    """One result line: ``state`` is ok, warn or FAIL."""

    name: str
    state: str
    detail: str

    def line(self) -> str:
        return f"{self.state:<4}  {self.name:<15} {self.detail}"


def _module_state(name: str, loaded: set[str], release_dir: str | None,
                  builtin: set[str], files: set[str]) -> str:
    if name in loaded or name.lower() in loaded:
        return "loaded"
    if name in builtin:
        return "built in"
    if name in files or name.replace("_", "-") in files:
        return "loadable"
    return "unknown" if release_dir is None else "missing"


def check_modules(config: Config, proc_modules: str = "/proc/modules",
                  lib_modules: str = "/lib/modules") -> Check:
    wanted = list(NFTABLES_MODULES if config.native_nftables else IPTABLES_MODULES)
    if config.ambient_ipv6 and not config.native_nftables:
        wanted += IPTABLES6_MODULES
    try:
        with open(proc_modules) as f:
            loaded = {line.split()[0] for line in f if line.strip()}
    except OSError:
        loaded = set()
    release = os.path.join(lib_modules, platform.release())
    release_dir: str | None = None  # None: the module tree is not readable here
    builtin: set[str] = set()
    files: set[str] = set()
    if os.path.isdir(release):
        release_dir = release
        try:
            with open(os.path.join(release, "modules.builtin")) as f:
                builtin = {os.path.basename(line.strip()).split(".ko")[0] for line in f}
        except OSError:
            pass
        for _root, _dirs, names in os.walk(release):
            files |= {n.split(".ko")[0] for n in names if ".ko" in n}
    states = {m: _module_state(m, loaded, release_dir, builtin, files) for m in wanted}
    missing = [m for m, s in states.items() if s == "missing"]
    unknown = [m for m, s in states.items() if s == "unknown"]
    counts = {s: sum(1 for v in states.values() if v == s)
              for s in ("loaded", "built in", "loadable")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    if missing:
        return Check("kernel modules", FAIL, f"missing: {', '.join(missing)} ({summary})")
    if unknown:
        return Check("kernel modules", WARN, f"not loaded and {lib_modules} not readable "
                     f"(can't tell if they load): {', '.join(unknown)}")
    return Check("kernel modules", OK, f"{len(wanted)} needed: {summary}")


def check_iptables(config: Config) -> Check:
    if config.native_nftables:
        return (Check("nftables", OK, f"nft at {shutil.which('nft')}") if shutil.which("nft")
                else Check("nftables", FAIL, "native_nftables is set but nft is not installed"))
    from cni.rules_common import RulesError
    from cni.rules_iptables import detect_flavor

    try:
        flavor = detect_flavor(None)
    except RulesError as e:
        return Check("iptables", FAIL, str(e))
    tools = [f"iptables-{flavor}-restore"] + ([f"ip6tables-{flavor}-restore"]
                                              if config.ambient_ipv6 else [])
    absent = [t for t in tools if not shutil.which(t)]
    if absent:
        return Check("iptables", FAIL, f"flavor {flavor}: {', '.join(absent)} not installed")
    return Check("iptables", OK, f"flavor {'nf_tables' if flavor == 'nft' else 'legacy'} "
                 f"({', '.join(tools)})")


def check_privileges(status_path: str = "/proc/self/status") -> Check:
    if not has_net_admin(status_path):
        return Check("privileges", FAIL, "this process lacks CAP_NET_ADMIN, which the agent "
                     "needs for its rules and sets: run precheck (and the agent) as root, "
                     "or grant CAP_NET_ADMIN and CAP_SYS_ADMIN")
    return Check("privileges", OK, "CAP_NET_ADMIN held")


def check_ipset() -> Check:
    try:
        from pyroute2 import IPSet
    except ImportError as e:
        return Check("ipset", FAIL, f"pyroute2 missing: {e}")
    name = f"ambpre-{secrets.token_hex(3)}"
    try:
        with IPSet() as ips:
            ips.create(name, stype="hash:ip")
            ips.destroy(name)
    except Exception as e:  # noqa: BLE001 - any netlink failure is the answer
        if getattr(e, "code", None) == errno.EPERM:  # pyroute2's NetlinkError
            return Check("ipset", FAIL, "cannot create a hash:ip set: operation not "
                         "permitted (needs CAP_NET_ADMIN: see privileges)")
        return Check("ipset", FAIL, f"cannot create a hash:ip set ({e}); load ip_set and "
                     "ip_set_hash_ip")
    return Check("ipset", OK, "hash:ip sets work (host probe set)")


def _nearest_dir(path: str) -> str:
    """``path`` if it is a directory, else its nearest existing ancestor directory."""
    probe = path
    while not os.path.isdir(probe):
        up = os.path.dirname(probe)
        if up == probe:
            break
        probe = up
    return probe


def check_state_dir(config: Config) -> Check:
    path = config.state_dir
    probe = _nearest_dir(path)
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "read-only file system" if _read_only(probe) else "not writable"
        return Check("state dir", FAIL, f"{probe} is {why} (for state_dir {path})")
    where = "writable" if probe == path else f"{probe} writable (creates {path})"
    return Check("state dir", OK, f"{path}: {where}")


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_cni_config(config: Config) -> Check:
    from cni.conflist import explain_no_primary, find_primary

    primary = find_primary(config.cni_conf_dir, config.cni_conf_name)
    if primary is None:
        return Check("CNI config", FAIL, explain_no_primary(config.cni_conf_dir,
                                                            config.cni_conf_name))
    return Check("CNI config", OK, f"primary config {primary}")


def check_istio_cni(config: Config) -> Check:
    from cni.install import PLUGIN_NAME

    found = []
    binary = os.path.join(config.cni_bin_dir, PLUGIN_NAME)
    try:
        with open(binary, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        head = None
    except OSError as e:
        return Check("istio-cni", WARN, f"cannot read {binary}: {e.strerror}")
    if head is not None and b"ambient-agent cni install" not in head:
        found.append(f"{binary} was not installed by this agent"
                     + (" (an ELF binary: upstream istio-cni?)" if head.startswith(b"\x7fELF")
                        else ""))
    if unixsocket.answers(UPSTREAM_EVENT_SOCKET, socket.SOCK_STREAM) and \
            os.path.realpath(UPSTREAM_EVENT_SOCKET) != os.path.realpath(config.cni_event_socket):
        found.append(f"an istio-cni node agent answers on {UPSTREAM_EVENT_SOCKET}")
    if found:
        return Check("istio-cni", FAIL, "; ".join(found) + " (remove it first: docs/operating.md"
                     ", \"Replacing an installed istio-cni\")")
    if head is not None:
        state = "ours installed"
    elif config.cni_manage_config:
        state = "not installed yet (run installs it: cni_manage_config is on)"
    else:
        state = ("not installed yet (run does not install it while cni_manage_config is "
                 "off: `ambient-agent cni install`, or --cni-manage-config)")
    return Check("istio-cni", OK, f"no other istio-cni; {binary} {state}")


def running_agent(state_dir: str) -> int | None:
    """The pid of the agent holding ``<state_dir>/agent.lock`` (its ``flock`` is taken,
    the file holds the pid), or None when no agent runs on that state dir."""
    import fcntl

    path = os.path.join(state_dir, "agent.lock")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _held_by(port: int, holders: dict[int, list[tuple[int, str]]], agent_pid: int | None,
             state_dir: str) -> str:
    """`` (held by ...)`` naming who listens on ``port``: the running agent of
    ``state_dir`` when its pid is the listener, else each listener's pid and name."""
    who = holders.get(port, [])
    if agent_pid and any(pid == agent_pid for pid, _ in who):
        return f" (held by the running agent, pid {agent_pid}, of {state_dir})"
    if who:
        return " (held by " + ", ".join(f"pid {pid} {name}" if pid else "a process not "
                                        "visible to this user" for pid, name in who) + ")"
    return ""


def check_ports(config: Config) -> Check:
    """Each of the agent's TCP ports can be bound now; a busy one names its holder (the
    running agent of this state dir, or the pid and name of whoever listens), since a
    port held by our own running agent is a different finding from a foreign process."""
    from agent.core.config import ConfigError, ensure_tcp_port_free

    from agent.core.config import tcp_listeners

    taken: list[tuple[int, str]] = []
    free = []
    for setting, host, port in tcp_listeners(config):
        try:
            ensure_tcp_port_free(setting, host, port)
            free.append(str(port))
        except ConfigError as e:
            taken.append((port, str(e)))
    busy = []
    if taken:
        holders = port_holders({p for p, _ in taken})
        agent_pid = running_agent(config.state_dir)
        busy = [text + _held_by(port, holders, agent_pid, config.state_dir)
                for port, text in taken]
    if busy:
        return Check("ports", FAIL, "; ".join(busy))
    return Check("ports", OK, f"free: {', '.join(free)}")


def check_zds(config: Config) -> Check:
    path = config.ztunnel_uds_address
    parent = os.path.dirname(path) or "."
    probe_dir = _nearest_dir(parent)
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        return Check("ZDS socket", FAIL, f"{probe_dir} is not writable (for {path})")
    if os.path.exists(path) and unixsocket.answers(path, socket.SOCK_SEQPACKET):
        agent_pid = running_agent(config.state_dir)
        who = (f"the running agent, pid {agent_pid}, of {config.state_dir}" if agent_pid
               else "another agent?")
        return Check("ZDS socket", FAIL, f"a live server already answers on {path} ({who})")
    where = parent if os.path.isdir(parent) else f"{probe_dir} (creates {parent})"
    return Check("ZDS socket", OK, f"{path}: {where} writable")


def check_ztunnel(url: str = ZTUNNEL_READY_URL, timeout: float = 2.0) -> Check:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return Check("ztunnel", OK, f"{url} answers {resp.status}")
    except urllib.error.HTTPError as e:
        return Check("ztunnel", WARN, f"{url} answers {e.code} (not ready yet)")
    except (urllib.error.URLError, OSError) as e:
        return Check("ztunnel", WARN, f"no ztunnel answers {url} "
                     f"({getattr(e, 'reason', e)}); ambient pod ADDs wait for one")


def crd_owner(crd: dict) -> str:
    """Who installed a CustomResourceDefinition, from its metadata: ``"Istio"`` (Istio's
    base chart labels it ``app.kubernetes.io/part-of: istio`` and ``helm.sh/chart:
    base-<version>``; its plain ``crd-all.gen.yaml`` and istioctl keep ``app: istio-pilot``,
    ``chart: istio``), ``"Gateway API"`` (its releases annotate
    ``gateway.networking.k8s.io/bundle-version``), ``"ambient-agent"`` (deploy/crds/:
    ``app.kubernetes.io/name: ambient-agent``), else ``"unknown"``."""
    meta = crd.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    if labels.get("app.kubernetes.io/name") == "ambient-agent":
        return "ambient-agent"
    if (labels.get("app.kubernetes.io/part-of") == "istio"
            or str(labels.get("helm.sh/chart", "")).startswith("base-")
            or labels.get("chart") == "istio" or labels.get("app") == "istio-pilot"):
        return "Istio"
    if "gateway.networking.k8s.io/bundle-version" in annotations:
        return "Gateway API"
    return "unknown"


def _error(e: BaseException) -> str:
    """``Type: message`` (``TimeoutError`` alone when there is no message)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _credentials(config: Config) -> str:
    return (f"the token or certificate of kubeconfig {config.kubeconfig}" if config.kubeconfig
            else "the in-cluster service account token")


async def _may_list_and_watch(api: Any, kind: str, timeout: float) -> list[tuple[str, str]]:
    """``list`` then ``watch`` ``kind`` as the config source does; returns the refused
    verbs with the server's message (``[]``: both allowed, or the kind is not served).
    Raises KubeError for any other error answer, aiohttp/OSError/timeouts when
    unreachable. ``timeout``: seconds per request."""
    import aiohttp

    from agent.core import kubecall
    from ambient.source_kube import RESOURCES

    _, group, version, plural = RESOURCES[kind]
    path = f"/api/{version}/{plural}" if not group else f"/apis/{group}/{version}/{plural}"
    bounds = aiohttp.ClientTimeout(total=timeout, sock_connect=timeout)
    try:
        body = await kubecall.call(api, "GET", path, query=[("limit", 1)], timeout=bounds)
    except kubecall.KubeError as e:
        if e.forbidden:
            return [("list", e.reason)]  # a watch needs the list's version: not asked
        if e.not_found:
            return []  # not served: the CRD check reports it
        raise
    rv = str(((body or {}).get("metadata") or {}).get("resourceVersion") or "")
    try:
        # accepted once the answer's status is 200: nothing of the stream is read
        async with kubecall.stream(api, path, query=[("watch", "true"), ("resourceVersion", rv),
                                                     ("timeoutSeconds", 1)], timeout=bounds):
            pass
    except kubecall.KubeError as e:
        if e.forbidden:
            return [("watch", e.reason)]
        raise
    return []


async def _api_access(config: Config, timeout: float) -> Check:
    from kubernetes_asyncio import client as kclient

    from agent.core import kubecall
    from ambient.source_kube import RESOURCES

    name = "Kubernetes API"
    try:
        cfg = await client_configuration(config.kubeconfig)
    except Exception as e:  # noqa: BLE001 - a bad kubeconfig, no in-cluster environment
        where = f"kubeconfig {config.kubeconfig}" if config.kubeconfig else "in-cluster config"
        return Check(name, FAIL, f"cannot load {where}: {type(e).__name__}: {e}")
    url = cfg.host
    kinds = list(RESOURCES)
    async with kclient.ApiClient(cfg) as api:
        results = await asyncio.gather(*(_may_list_and_watch(api, k, timeout) for k in kinds),
                                       return_exceptions=True)
    refused = [(f"{verb} {kind}", why) for kind, r in zip(kinds, results)
               if isinstance(r, list) for verb, why in r]
    errors = [(kind, r) for kind, r in zip(kinds, results) if isinstance(r, BaseException)]
    unauthorized = [e for _, e in errors if isinstance(e, kubecall.KubeError) and e.status == 401]
    if unauthorized:
        return Check(name, FAIL, f"{url} answered 401 {unauthorized[0].reason}: it refuses "
                                 f"{_credentials(config)}")
    answers = [(k, e) for k, e in errors if isinstance(e, kubecall.KubeError)]
    unreachable = [(k, e) for k, e in errors if not isinstance(e, kubecall.KubeError)]
    if unreachable and len(unreachable) == len(kinds):
        first = unreachable[0][1]
        return Check(name, FAIL, f"cannot reach the API server at {url}: {_error(first)}")
    problems = []
    if refused:
        problems.append(f"refused (403): {', '.join(v for v, _ in refused)} (the agent's "
                        "ClusterRole needs list and watch on each, deploy/kubernetes/rbac.yaml;"
                        f" the server said: {refused[0][1]})")
    problems += [f"{kind}: {e}" for kind, e in answers]
    problems += [f"{kind}: no answer ({_error(e)})" for kind, e in unreachable]
    if problems:
        return Check(name, FAIL, f"{url}: " + "; ".join(problems))
    return Check(name, OK, f"{url}: list and watch allowed for all {len(kinds)} kinds the "
                           "agent reads")


def check_kube_api(config: Config, timeout: float = 5.0) -> Check:
    """The ``Kubernetes API`` line (module docstring); OK without asking anything when
    ``config_source`` is not ``kubernetes``."""
    if config.config_source != "kubernetes":
        return Check("Kubernetes API", OK, f"not asked (config_source {config.config_source})")
    return asyncio.run(asyncio.wait_for(_api_access(config, timeout), timeout * 3 + 5))


async def _get_crds(config: Config, names: list[str], timeout: float
                    ) -> dict[str, dict | None]:
    from kubernetes_asyncio import client as kclient
    from kubernetes_asyncio.client.exceptions import ApiException

    cfg = await client_configuration(config.kubeconfig)
    out: dict[str, dict | None] = {}
    async with kclient.ApiClient(cfg) as api:
        ext = kclient.ApiextensionsV1Api(api)
        for name in names:
            try:
                crd = await ext.read_custom_resource_definition(name, _request_timeout=timeout)
                out[name] = api.sanitize_for_serialization(crd)
            except ApiException as e:
                if e.status != 404:
                    raise
                out[name] = None
    return out


def check_istio_crds(config: Config, timeout: float = 5.0) -> Check:
    from ambient.source_kube import RESOURCES

    if config.config_source != "kubernetes":
        return Check("Istio CRDs", OK, f"not asked (config_source {config.config_source})")
    wanted = {f"{plural}.{group}": (kind, version) for kind, (_, group, version, plural)
              in RESOURCES.items() if group not in ("", "discovery.k8s.io")}
    try:
        found = asyncio.run(asyncio.wait_for(_get_crds(config, sorted(wanted), timeout),
                                             timeout * (len(wanted) + 1)))
    except Exception as e:  # noqa: BLE001 - unreachable, forbidden, bad kubeconfig
        reason = getattr(e, "reason", None) or str(e) or type(e).__name__
        status = getattr(e, "status", None)
        return Check("Istio CRDs", WARN, "cannot read the CRDs from the API server ("
                     + (f"{status} " if status else "") + f"{reason})")
    by_owner: dict[str, list[str]] = {}
    missing, wrong = [], []
    for name, (kind, version) in sorted(wanted.items()):
        crd = found.get(name)
        if crd is None:
            missing.append(kind)
            continue
        by_owner.setdefault(crd_owner(crd), []).append(kind)
        served = [v.get("name") for v in (crd.get("spec") or {}).get("versions") or []
                  if v.get("served")]
        if version not in served:
            wrong.append(f"{kind} serves {', '.join(served) or 'nothing'}, not {version}")
    parts = [f"{owner}'s: {', '.join(sorted(kinds))}"
             for owner, kinds in sorted(by_owner.items())]
    if missing:
        parts.append(f"missing: {', '.join(missing)} (treated as empty; Istio's base chart "
                     "or deploy/crds/ installs them)")
    parts += wrong
    return Check("Istio CRDs", WARN if missing or wrong else OK, "; ".join(parts))


def run_checks(config: Config) -> list[Check]:
    """Every check, in order; a check that raises is a FAIL naming the error."""
    checks = [check_privileges, lambda: check_state_dir(config),
              lambda: check_modules(config), lambda: check_iptables(config), check_ipset,
              lambda: check_cni_config(config), lambda: check_istio_cni(config),
              lambda: check_ports(config), lambda: check_zds(config), check_ztunnel,
              lambda: check_kube_api(config), lambda: check_istio_crds(config)]
    names = ["privileges", "state dir", "kernel modules", "iptables", "ipset", "CNI config", "istio-cni", "ports",
             "ZDS socket", "ztunnel", "Kubernetes API", "Istio CRDs"]
    out = []
    for name, fn in zip(names, checks):
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 - one broken check is one FAIL line
            out.append(Check(name, FAIL, f"check crashed: {type(e).__name__}: {e}"))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from agent.cli import add_setting_flags

    add_setting_flags(parser)


def main(args: argparse.Namespace) -> int:
    from agent.cli import load_config

    config = load_config(args)
    results = run_checks(config)
    for r in results:
        print(r.line())
    failed = [r for r in results if r.state == FAIL]
    warned = [r for r in results if r.state == WARN]
    # a warning is not a pass: counted on its own, so "N/N passed" means all ok
    passed = len(results) - len(failed) - len(warned)
    print(f"{passed}/{len(results)} checks passed"
          + (f"; {len(warned)} with warnings: {', '.join(r.name for r in warned)}"
             if warned else "")
          + (f"; failed: {', '.join(r.name for r in failed)}" if failed else ""))
    sys.stdout.flush()
    return 1 if failed else 0
