"""Entering network namespaces from Python 3.11 (which has no ``os.setns``).

A thread that calls ``setns(fd, CLONE_NEWNET)`` switches only its own network
namespace; sockets it creates stay in that netns after it leaves, and a child
process it forks inherits the netns (``docs/maintainers/testing.md``). So blocking work that must
run "inside the pod" runs in a worker thread that enters the netns, does the work,
and always restores the thread's original netns before returning to the pool.

All functions here block; call them from a worker thread (``AgentContext.run_blocking``),
never on the event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
from typing import Callable, Iterator, TypeVar

CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class NetnsError(OSError):
    """A netns could not be opened or entered; ``path`` names it."""

    def __init__(self, path: str, errno_: int, what: str):
        self.path = path
        super().__init__(errno_, f"{what} netns {path}: {os.strerror(errno_)}")


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling thread into the namespace ``fd`` refers to. Raises OSError."""
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_netns(path: str) -> int:
    """Open a netns file (``/var/run/netns/X``, ``/proc/PID/ns/net``) read-only, close-on-exec.

    Returns the fd (caller closes it). Raises :class:`NetnsError` if it does not exist
    or is not accessible.
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsError(path, e.errno or 0, "cannot open") from None


def host_path(path: str, host_mounts: str) -> str:
    """The path under which the agent sees a host path a runtime passed (``CNI_NETNS``).

    Upstream's node agent runs in a container that has the host's ``/proc`` at
    ``/host/proc`` and the host's netns dir at ``/host/var/run/netns`` and opens every
    netns path from the plugin as ``filepath.Join("/host", path)``
    (``cni/pkg/nodeagent/pod_cache.go`` ``openNetnsInRoot``, ``constants.HostMountsPath``);
    this does the same with ``host_mounts`` (setting ``host_mounts_path``; empty: the agent
    runs on the host and ``path`` is returned unchanged).

    ``path`` is normalised first, so ``..`` never leads above ``host_mounts``
    (``/proc/../etc`` -> ``<host_mounts>/etc``). ``/run`` and ``/var/run`` are one
    directory on every FHS 3.0 host (``/var/run`` is a symlink the container can't
    follow): when ``<host_mounts>/run/...`` is missing and ``<host_mounts>/var/run/...``
    exists (or the other way round) that one is returned, so podman's
    ``/run/netns/netns-<id>`` works with the DaemonSet's ``/var/run/netns`` mount.
    Raises ValueError when ``path`` is not absolute (CNI_NETNS is always a path).
    """
    if not host_mounts:
        return path
    if not path.startswith("/"):
        raise ValueError(f"netns path {path!r} is not absolute")
    clean = "/" + os.path.normpath(path).lstrip("/")
    root = host_mounts.rstrip("/")
    candidate = root + clean
    if not os.path.exists(candidate):
        for a, b in (("/run/", "/var/run/"), ("/var/run/", "/run/")):
            if clean.startswith(a) and os.path.exists(root + b + clean[len(a):]):
                return root + b + clean[len(a):]
    return candidate


def current_netns_fd() -> int:
    """An fd for the calling thread's own netns (``/proc/thread-self/ns/net``)."""
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def netns_inode(path_or_fd: str | int) -> int:
    """The inode identifying a netns; two handles name the same netns iff inodes match."""
    return os.stat(path_or_fd).st_ino


@contextlib.contextmanager
def entered(target: str | int) -> Iterator[None]:
    """Run the ``with`` body in netns ``target`` (path or fd), then return to the original.

    Only the calling thread moves. If restoring fails the thread is unusable, so we
    raise loudly rather than leave it in a pod's netns. Raises :class:`NetnsError` when
    ``target`` can't be opened or entered (no fd is left open then).
    """
    fd = open_netns(target) if isinstance(target, str) else target
    try:
        own = current_netns_fd()
        try:
            try:
                setns(fd)
            except OSError as e:
                raise NetnsError(str(target), e.errno or 0, "cannot enter") from None
            try:
                yield
            finally:
                setns(own)
        finally:
            os.close(own)
    finally:
        if isinstance(target, str):
            os.close(fd)


def run_in_netns(target: str | int, fn: Callable[..., T], *args, **kwargs) -> T:
    """Call ``fn(*args, **kwargs)`` inside netns ``target`` on the calling thread."""
    with entered(target):
        return fn(*args, **kwargs)


def run_in_netns_thread(target: str | int, fn: Callable[..., T], *args, **kwargs) -> T:
    """Like :func:`run_in_netns` but on a fresh short-lived thread (for callers on a thread
    that must never change netns, e.g. the main thread). Re-raises ``fn``'s exception."""
    result: dict[str, object] = {}

    def body() -> None:
        try:
            result["value"] = run_in_netns(target, fn, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    t = threading.Thread(target=body, name="netns-enter", daemon=True)
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]
