"""What enrollment needs from the world, owned by enrollment (consumer-owned protocols).

The reconciler and the dataplane pipeline depend on these shapes only, never on the
``zds`` package or on entering a real netns, so they are unit-tested without root
against fakes (``tests/cni/enrollment_fakes.py``). The daemon wires the real ones in:
:class:`cni.enrollment.kernel.KernelNetns` for :class:`NetnsOps`, and
:class:`agent.enrollment_zds.ZdsServerChannel` (over :class:`zds.server.ZdsServer`) for
:class:`ZdsChannel`. Upstream's equivalents are Go interfaces of the same package
(``cni/pkg/nodeagent``: ``ZtunnelServer`` in ``ztunnelserver.go``, ``PodNetnsFinder``
and ``NetnsWithFd`` in ``netns.go``).
"""

from __future__ import annotations

import dataclasses
import errno
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol

if TYPE_CHECKING:
    from cni.rules_common import RuleOptions
    from cni.rules_detect import Backend as RulesBackend


@dataclasses.dataclass(frozen=True)
class ZdsPod:
    """A pod as enrollment hands it to ztunnel. ``uid`` = ``metadata.uid`` (the ZDS key);
    ``service_account`` = ``spec.serviceAccountName``; ``netns_fd`` an open fd of the pod
    netns (the channel dups it, the caller closes its own) or None when not known
    (ztunnel is then told to keep the pod's proxy as it is)."""

    uid: str
    name: str = ""
    namespace: str = ""
    service_account: str = ""
    netns_fd: int | None = None


class ZtunnelUnavailable(Exception):
    """No ztunnel was connected within the wait asked for. ``socket``: the ZDS socket
    path; ``waited``: seconds waited."""

    def __init__(self, text: str, socket: str = "", waited: float = 0.0):
        super().__init__(text)
        self.socket, self.waited = socket, waited


class ZdsRejected(Exception):
    """ztunnel did not take the pod (a NACK, a timeout, a lost connection). ``kind`` names
    the failure as the ZDS server does (e.g. ``ZdsNack``, ``ZdsTimeout``)."""

    def __init__(self, text: str, kind: str = "ZdsError"):
        super().__init__(text)
        self.kind = kind


class RegisteredPods(Protocol):
    """What enrollment reads of workload registration (``cni.registration.WorkloadRegistrar``
    has it): the Pod object of a pod registered from a CNI ADD, under the name its
    workload is served with, or None."""

    def served_pod(self, key: str) -> dict | None: ...


class ZdsChannel(Protocol):
    """The ZDS server as enrollment uses it (upstream's ``ZtunnelServer``)."""

    @property
    def path(self) -> str:
        """The ZDS socket path (for messages)."""
        ...

    async def add(self, pod: ZdsPod, wait_ack: bool = True,
                  ztunnel_wait: float | None = None) -> None:
        """Record the pod and (``wait_ack``) wait for ztunnel's ACK; a connected ztunnel is
        waited for at most ``ztunnel_wait`` seconds (None: the server's setting).
        Raises :class:`ZtunnelUnavailable`, :class:`ZdsRejected`, ValueError (a bad field)."""
        ...

    async def delete(self, uid: str) -> None:
        """Forget the pod; ztunnel drains its proxy. Never raises for an unknown ``uid``."""
        ...

    def open_accept(self) -> None:
        """Start accepting ztunnel connections (called once restart recovery recorded every
        kept pod, so the first snapshot names them all)."""
        ...

    def connected(self) -> bool:
        """Whether a ztunnel is connected now (has said hello)."""
        ...


class NetnsGone(OSError):
    """The pod netns vanished before it could be entered (nothing left to clean)."""


class HostNetnsRefused(OSError):
    """The netns path names the node's own network namespace (the agent's, or pid 1's),
    whatever the path: redirection rules are never installed there. ``path`` is the
    path as given."""

    def __init__(self, path: str):
        super().__init__(errno.EPERM, f"netns {path} is the node's own network namespace "
                                      "(the agent's or pid 1's), not a pod's: refused")
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


class NetnsOps(Protocol):
    """Pod netns operations. Methods marked blocking run in a worker thread."""

    @property
    def host_netns(self) -> tuple[int, int]:
        """``(st_ino, st_dev)`` of the node netns (skipped by ``/proc`` scans)."""
        ...

    def open(self, path: str) -> int:
        """An fd of the netns at ``path``; raises OSError (with ``errno``), and
        :class:`HostNetnsRefused` when it is the node's own netns."""
        ...

    def close(self, fd: int) -> None: ...

    def inode(self, fd: int) -> int:
        """The netns inode of ``fd``."""
        ...

    def holds(self, path: str, inode: int) -> bool:
        """Whether ``path`` still names the netns of inode ``inode`` (False when gone)."""
        ...

    def exists(self, path: str) -> bool: ...

    def apply_rules(self, fd: int, backend: RulesBackend, opts: RuleOptions, label: str,
                    known: bool) -> str:
        """Blocking. In the netns ``fd``: check ``lo`` is up, then apply the in-pod rules
        (:func:`cni.rules_detect.apply`). Returns the outcome word for the log. Raises
        :class:`cni.enrollment.kernel.LoopbackDown` before applying anything, RulesError,
        OSError."""
        ...

    def delete_rules(self, target: int | str, backend: RulesBackend, ipv6: bool,
                     during: Callable[[], None] | None = None) -> None:
        """Blocking. In the netns ``target`` (fd or path): our rules out of every stack,
        then the routing; ``during`` runs while the kernel commits the deletion. Raises
        :class:`NetnsGone`, RulesError, OSError."""
        ...

    def find(self, wanted: Mapping[str, tuple[str, list[str]]], proc_dir: str
             ) -> dict[str, str]:
        """Blocking. ``{uid: netns path}`` for ``wanted`` (``uid -> (recorded netns path,
        ips)``): the recorded path when it still holds one of the IPs, else a ``/proc``
        scan (the path is then ``<proc>/<pid>/ns/net``); pods not found are left out."""
        ...


class ProbeSet(Protocol):
    """The node's host probe set (:class:`cni.hostrules.HostProbeRules`). Blocking
    methods raise RulesError, OSError or ValueError."""

    def setup(self) -> None: ...

    def add_pod(self, uid: str, ips: Iterable[str]) -> None: ...

    def remove_pod(self, uid: str, ips: Iterable[str] = ()) -> list[str]: ...

    def sync(self, pods: dict[str, list[str]]) -> list[str]:
        """Upsert ``pods``' IPs, remove entries owned by no pod of it; returns what was
        removed."""
        ...

    def teardown(self) -> None: ...

    def close(self) -> None: ...
