"""Who is calling the SDS socket: peer credentials → cgroup → pod UID → identity.

grpc (Python, 1.85) does not expose a Unix-socket peer's credentials: ``context.peer()``
is just ``"unix:"`` and the auth context holds no PID, and Python has no custom
transport credentials. So attested mode puts a small **front door** on the public
socket (:class:`FrontDoor`): it accepts each connection itself, reads ``SO_PEERCRED``
(pid, uid, gid, from the kernel, unforgeable), reads the caller's pod UID from
``/proc/<pid>/cgroup`` right away (while the caller is certainly alive), then connects
to the real gRPC server on a private socket from a client socket **bound to a unique
abstract address**. grpc reports that address as the RPC's peer
(``"unix-abstract:<name>"``), which :meth:`FrontDoor.lookup` maps back to the
credentials. The private socket lives in a 0700 directory; a connection that did not
come through the front door has no entry and is denied.

Pod UID from the cgroup path (kubelet, both drivers, v1 and v2):
``/kubepods/burstable/pod<uid>/<ctr>`` (cgroupfs) and
``/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_with_underscores>.slice/...``
(systemd). The identity then comes from the Pod object in the config source:
``spiffe://<trust domain>/ns/<metadata.namespace>/sa/<spec.serviceAccountName or "default">``,
served only when the Pod is bound to this node (``spec.nodeName == node_name``): a pod
object that says it runs elsewhere (a stale or forged UID match, a pod not scheduled yet)
gets nothing, as istiod's node authorizer refuses a node agent asking for another node's
pods. Upstream reference: SPIRE's k8s workload attestor does the same cgroup → pod UID step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import secrets
import socket
from typing import Callable, Iterable, Protocol

from agent.core import unixsocket
from agent.core.peercred import peer_cred
from agent.core.spiffe import Identity
from agent.core.podcgroup import CgroupError, parse_cgroup

log = logging.getLogger(__name__)


class PodStore(Protocol):
    """What SDS reads of the config source's object store (``ambient.store.ObjectStore``
    has it): Pod and WorkloadEntry objects as dicts, the way the store holds them."""

    def pod_by_uid(self, uid: str) -> dict | None:
        """The Pod with ``metadata.uid == uid``, or None."""

    def list(self, kind: str, namespace: str | None = None) -> Iterable[dict]:
        """Every object of ``kind`` (in ``namespace`` when given)."""


class AttestationError(Exception):
    """The caller can't be tied to a pod; the message says which step failed."""


@dataclasses.dataclass(frozen=True)
class PeerCred:
    """Kernel-reported credentials of a Unix-socket peer, plus the pod UID found at accept."""

    pid: int
    uid: int
    gid: int
    pod_uid: str = ""
    error: str = ""


def pod_uid_from_cgroup(text: str) -> str:
    """The pod UID in a ``/proc/<pid>/cgroup`` file's text (dashes restored), or "".

    Parsed exactly as the restart scan does (:func:`agent.core.podcgroup.parse_cgroup`,
    upstream's ``podcgroupns`` rules): a container cgroup under ``pod<uid>``. Lines naming several
    pods or containers raise :class:`AttestationError`.
    """
    try:
        uid, _container = parse_cgroup(text)
    except CgroupError as e:
        raise AttestationError(f"cgroup names several pods or containers: {e}") from None
    return uid


def pod_uid_of_pid(pid: int, proc_dir: str = "/proc") -> str:
    """Read ``<proc_dir>/<pid>/cgroup`` and return the pod UID. Raises AttestationError."""
    path = os.path.join(proc_dir, str(pid), "cgroup")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise AttestationError(f"caller pid {pid}: cannot read {path}: {e.strerror or e}") from None
    uid = pod_uid_from_cgroup(text)
    if not uid:
        raise AttestationError(f"caller pid {pid} is not in a pod cgroup")
    return uid


def identity_of_pod(pod: dict, trust_domain: str) -> Identity:
    """The SPIFFE identity of a Pod object (dict as the config source stores it)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    namespace = meta.get("namespace") or "default"
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    return Identity(trust_domain, namespace, sa)


class PodAttestor:
    """Maps a :class:`PeerCred` to an identity using ``store_getter()`` (an ObjectStore or None).

    Raises :class:`AttestationError` when the pod UID is unknown, the pod is not in the
    store, the pod is not bound to ``node_name``, or no store is available; never guesses.
    """

    def __init__(self, store_getter: Callable[[], PodStore | None], trust_domain: str,
                 node_name: str):
        self._store = store_getter
        self.trust_domain = trust_domain
        self.node_name = node_name

    def identify(self, cred: PeerCred) -> Identity:
        if cred.error:
            raise AttestationError(cred.error)
        store = self._store()
        if store is None:
            raise AttestationError("no config source to look the caller's pod up in")
        pod = store.pod_by_uid(cred.pod_uid)
        if not pod:
            raise AttestationError(f"caller pid {cred.pid}: pod uid {cred.pod_uid} is unknown")
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if node != self.node_name:
            where = f"bound to node {node!r}" if node else "not bound to any node"
            raise AttestationError(
                f"caller pid {cred.pid}: pod {meta.get('namespace')}/{meta.get('name')} "
                f"(uid {cred.pod_uid}) is {where}, not to this node {self.node_name!r}")
        return identity_of_pod(pod, self.trust_domain)


class FrontDoor:
    """The attesting proxy in front of the gRPC server (see module docstring).

    ``public_path`` is the socket clients use, created with permission bits ``mode``
    (setting ``sds_socket_mode``; upstream uses 0666 so Envoy as uid 1337 can connect);
    ``backend_path`` the private gRPC socket. ``backlog`` is the listen queue (the kernel
    caps it at ``net.core.somaxconn``): every Envoy and node process of a node may connect
    at once after an agent restart, and a gRPC client connects non-blocking, so a full
    queue is an immediate refusal (EAGAIN) rather than a wait. asyncio's default of 100
    refused 298 of a burst of 500; 4096 matches gRPC's own listener (somaxconn).
    """

    BACKLOG = 4096

    def __init__(self, public_path: str, backend_path: str, proc_dir: str = "/proc",
                 mode: int = 0o600, backlog: int = BACKLOG):
        self.public_path = public_path
        self.backend_path = backend_path
        self.proc_dir = proc_dir
        self.mode = mode
        self.backlog = backlog
        self.peers: dict[str, PeerCred] = {}
        self._prefix = f"ambient-sds-{os.getpid()}-{secrets.token_hex(4)}-"
        self._counter = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        try:
            os.unlink(self.public_path)
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(
            self._handle, sock=unixsocket.bind_unix(self.public_path, self.mode),
            backlog=self.backlog)

    def lookup(self, peer: str) -> PeerCred | None:
        """Credentials for a grpc ``context.peer()`` string, or None if not via the door."""
        if not peer.startswith("unix-abstract:"):
            return None
        return self.peers.get(peer[len("unix-abstract:"):])

    def _attest(self, sock: socket.socket) -> PeerCred:
        pid, uid, gid = peer_cred(sock)
        try:
            return PeerCred(pid, uid, gid, pod_uid=pod_uid_of_pid(pid, self.proc_dir))
        except AttestationError as e:
            return PeerCred(pid, uid, gid, error=str(e))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # asyncio runs each connection's handler as a task
        self._tasks.add(task)
        name = self._prefix + str(next(self._counter))
        backend = None
        try:
            self.peers[name] = self._attest(writer.get_extra_info("socket"))
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.bind("\0" + name)
            try:
                await asyncio.get_running_loop().sock_connect(sock, self.backend_path)
            except OSError:
                sock.close()
                raise
            b_reader, backend = await asyncio.open_unix_connection(sock=sock)
            await asyncio.gather(_pipe(reader, backend), _pipe(b_reader, writer))
        except (OSError, asyncio.CancelledError) as e:
            if isinstance(e, OSError):
                log.debug("SDS front door connection %s: %s", name, e)
        finally:
            self.peers.pop(name, None)
            for w in (writer, backend):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        try:
            os.unlink(self.public_path)
        except FileNotFoundError:
            pass


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes until EOF, then half-close the other side."""
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
