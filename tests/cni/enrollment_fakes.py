"""In-memory fakes of enrollment's protocols (``cni/enrollment/api.py``) for tests that run
without root: a netns table (:class:`FakeNetns`), a ZDS server (:class:`FakeZds`), a host
probe set (:class:`FakeProbeSet`) and a config source (:class:`FakeSource`).

They model what the reconciler can observe of the real ones (``cni/enrollment/kernel.py``,
``zds/server.py``, ``cni/hostrules.py``), no more: what a real netns, kernel ruleset or
ztunnel does is shown by the root tests in ``tests/netns``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import itertools
import os
import threading
from typing import Callable, Iterable, Mapping

from agent.core.lifecycle import Component
from cni.enrollment.api import HostNetnsRefused, NetnsGone, ZdsPod, ZdsRejected, ZtunnelUnavailable
from cni.enrollment.kernel import LoopbackDown
from cni.rules_common import RuleOptions, RulesError


class FakeNetns:
    """Netns paths -> inodes; rules held per inode. ``apply_error``/``delete_error``: an
    exception the next apply/delete raises; ``moved``: ``uid -> path`` the ``/proc``
    scan finds (a pod whose recorded path is gone); ``host_paths``: paths naming the
    node's own netns (``open`` refuses them as :class:`KernelNetns` does); ``hold``: an
    apply (on its worker thread) sets ``applying`` and waits for this event before it
    looks at ``apply_error`` (rules being applied)."""

    host_netns = (1, 1)

    def __init__(self) -> None:
        self._inodes = itertools.count(1000)
        self._fds = itertools.count(100)
        self.paths: dict[str, int] = {}
        self.open_fds: dict[int, int] = {}
        self.rules: dict[int, RuleOptions] = {}
        self.apply_error: Exception | None = None
        self.delete_error: Exception | None = None
        self.moved: dict[str, str] = {}
        self.applied: list[tuple[str, bool]] = []  # (label, known)
        self.deleted: list[int | str] = []
        self.host_paths: set[str] = set()
        self.hold: threading.Event | None = None
        self.applying = threading.Event()

    def create(self, path: str) -> int:
        self.paths[path] = inode = next(self._inodes)
        return inode

    def destroy(self, path: str) -> None:
        """The sandbox went away: the path is gone and its rules with it."""
        self.rules.pop(self.paths.pop(path), None)

    def rules_at(self, path: str) -> RuleOptions | None:
        return self.rules.get(self.paths[path])

    def open(self, path: str) -> int:
        if path not in self.paths:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if path in self.host_paths:
            raise HostNetnsRefused(path)
        fd = next(self._fds)
        self.open_fds[fd] = self.paths[path]
        return fd

    def close(self, fd: int) -> None:
        del self.open_fds[fd]  # KeyError: closed twice or never opened

    def inode(self, fd: int) -> int:
        return self.open_fds[fd]

    def holds(self, path: str, inode: int) -> bool:
        return self.paths.get(path) == inode

    def exists(self, path: str) -> bool:
        return path in self.paths

    def apply_rules(self, fd: int, backend: object, opts: RuleOptions, label: str,
                    known: bool) -> str:
        self.applied.append((label, known))
        if self.hold is not None:
            self.applying.set()
            if not self.hold.wait(30):
                raise RulesError("test: rules held for 30 s and never released")
        error, self.apply_error = self.apply_error, None
        if error is not None:
            if not isinstance(error, LoopbackDown):
                self.rules[self.open_fds[fd]] = opts  # half-applied
            raise error
        inode = self.open_fds[fd]
        outcome = "reconciled" if inode in self.rules else "applied"
        self.rules[inode] = opts
        return outcome

    def delete_rules(self, target: int | str, backend: object, ipv6: bool,
                     during: Callable[[], None] | None = None) -> None:
        self.deleted.append(target)
        if isinstance(target, str):
            if target not in self.paths:
                raise NetnsGone(errno.ENOENT, f"enter netns {target}: gone")
            inode = self.paths[target]
        else:
            inode = self.open_fds[target]
        error, self.delete_error = self.delete_error, None
        if error is not None:
            raise error
        if during is not None:
            during()
        self.rules.pop(inode, None)

    def find(self, wanted: Mapping[str, tuple[str, list[str]]], proc_dir: str
             ) -> dict[str, str]:
        found = {}
        for uid, (path, _ips) in wanted.items():
            if path in self.paths:
                found[uid] = path
            elif self.moved.get(uid) in self.paths:
                found[uid] = self.moved[uid]
        return found


class FakeZds:
    """A ZDS server with or without a ztunnel (``ztunnel``). ``nack``: the next acked add
    is refused; ``hold``: acked adds wait for this event (an ADD in flight)."""

    path = "/fake/ztunnel.sock"

    def __init__(self, ztunnel: bool = True) -> None:
        self.ztunnel = ztunnel
        self.nack: str | None = None
        self.hold: asyncio.Event | None = None
        self.adding = asyncio.Event()  # set when an add is waiting on ``hold``
        self.pods: dict[str, ZdsPod] = {}
        self.adds: list[tuple[ZdsPod, bool]] = []  # (pod, wait_ack), in order
        self.deletes: list[str] = []
        self.accepting = False
        self.adds_before_accept = 0

    async def add(self, pod: ZdsPod, wait_ack: bool = True,
                  ztunnel_wait: float | None = None) -> None:
        self.adds.append((pod, wait_ack))
        if not self.accepting:
            self.adds_before_accept += 1
        self.pods[pod.uid] = pod  # recorded in every case, as the real server does
        if not wait_ack:
            return
        if self.hold is not None:
            self.adding.set()
            await self.hold.wait()
        if not self.ztunnel:
            raise ZtunnelUnavailable(f"no ztunnel connected to {self.path} for 0.0 s",
                                     self.path, 0.0)
        text, self.nack = self.nack, None
        if text is not None:
            raise ZdsRejected(f"ztunnel rejected pod {pod.uid}: {text}", "ZdsNack")

    async def delete(self, uid: str) -> None:
        self.deletes.append(uid)
        self.pods.pop(uid, None)

    def open_accept(self) -> None:
        self.accepting = True

    def connected(self) -> bool:
        return self.ztunnel


class FakeProbeSet:
    """Probe set entries by owner UID. ``add_error``: the next add raises it."""

    def __init__(self) -> None:
        self.entries: dict[str, set[str]] = {}
        self.add_error: Exception | None = None
        self.set_up = self.closed = False

    def setup(self) -> None:
        self.set_up = True

    def add_pod(self, uid: str, ips: Iterable[str]) -> None:
        error, self.add_error = self.add_error, None
        if error is not None:
            raise error
        self.entries.setdefault(uid, set()).update(ips)

    def remove_pod(self, uid: str, ips: Iterable[str] = ()) -> list[str]:
        return sorted(self.entries.pop(uid, set()))

    def sync(self, pods: dict[str, list[str]]) -> list[str]:
        pruned = sorted(u for u in self.entries if u not in pods)
        for uid in pruned:
            del self.entries[uid]
        for uid, ips in pods.items():
            self.entries.setdefault(uid, set()).update(ips)
        return pruned

    def teardown(self) -> None:
        self.entries.clear()

    def close(self) -> None:
        self.closed = True


class FakeSource(Component):
    """The ``config-source`` component with a synced store of Pod objects by uid."""

    name = "config-source"

    def kube_api(self):
        return None  # no Kubernetes API: Events are not written

    def __init__(self, synced: bool = True) -> None:
        self.store = self
        self.synced = synced
        self.pods: dict[str, dict] = {}
        self.listeners: list[Callable] = []

    def ready(self) -> tuple[bool, str]:
        return (self.synced, "")

    def pod_by_uid(self, uid: str) -> dict | None:
        return self.pods.get(uid)

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        for pod in self.pods.values() if kind == "Pod" else []:
            meta = pod["metadata"]
            if (meta.get("namespace"), meta.get("name")) == (namespace, name):
                return pod
        return None

    def list(self, kind: str, namespace: str | None = None) -> list[dict]:
        return list(self.pods.values()) if kind == "Pod" else []

    def subscribe(self, listener: Callable) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def update(self, pod: dict) -> None:
        """Store ``pod`` and tell the listeners, as one store transaction would."""
        old = self.pods.get(pod["metadata"]["uid"])
        self.pods[pod["metadata"]["uid"]] = pod
        event = StoreEvent("Pod", pod["metadata"].get("namespace", ""), pod["metadata"]["name"],
                           old, pod)
        for listener in list(self.listeners):
            listener([event])

    def delete(self, uid: str) -> None:
        """Remove the Pod object ``uid`` and tell the listeners (``new`` None)."""
        old = self.pods.pop(uid)
        event = StoreEvent("Pod", old["metadata"].get("namespace", ""), old["metadata"]["name"],
                           old, None)
        for listener in list(self.listeners):
            listener([event])


@dataclasses.dataclass(frozen=True)
class StoreEvent:
    """The fields of ``ambient.store.StoreEvent`` the watch reads."""

    kind: str
    namespace: str
    name: str
    old: dict | None
    new: dict | None


__all__ = ["FakeNetns", "FakeProbeSet", "FakeSource", "FakeZds", "RulesError"]
