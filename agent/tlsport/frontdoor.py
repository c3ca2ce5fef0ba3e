"""The TLS front door of a gRPC server: server-authenticated TLS, client certificate
optional and verified when presented.

Why it exists: istiod's 15012 verifies a client certificate *if one is given*
(``tls.VerifyClientCertIfGiven``) and otherwise authenticates the call by its bearer
token; ztunnel relies on that (TLS 1.3, ALPN h2, no client certificate,
``authorization: Bearer <JWT>``). grpc Python's server credentials offer only "do not
request a client certificate" or "require one" (``require_client_auth`` maps to grpc
core's DONT_REQUEST / REQUEST_AND_REQUIRE_AND_VERIFY; checked with grpcio 1.85), so
neither serves both ztunnel and a client that authenticates by certificate.

How: :class:`TlsFrontDoor` listens on the public TCP port and terminates TLS with
Python's ``ssl`` (OpenSSL) using the context of a
:class:`agent.tlsport.servercert.ServerCertificate` (renewed without restart). For each
connection it records a :class:`TlsPeer` (remote address, verified client certificate
if any, TLS version, ALPN), then relays the bytes to the gRPC server's private Unix
socket from a client socket **bound to a unique abstract address**; gRPC reports that
address as the call's peer (``"unix-abstract:<name>"``), which :meth:`TlsFrontDoor.lookup`
maps back to the :class:`TlsPeer`. The same mechanism as the SDS front door
(:mod:`agent.sds.attest`). HTTP/2 frames (including keepalive PINGs) pass through
untouched, so gRPC core's keepalive enforcement sees exactly what the client sent.

Bounds: TLS handshake deadline (``handshake_timeout``, 10 s), at most
``max_connections`` concurrent connections and at most ``max_per_source`` from one client
address (the host part of the peer), TCP keepalive on client sockets (ztunnel's values:
300 s idle, 75 s interval, 9 probes) so dead peers go away. A connection that would pass
either cap takes the place of the oldest connection still in its TLS handshake (the
same address's for the per-source cap, anyone's for the global one) and is closed at
accept, counted, only when there is none: sockets that stall before their handshake
completes can hold a port only until a real client arrives, never lock it for the
length of a handshake deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import secrets
import socket
import ssl
import time

from cryptography import x509

from agent.core.ratelimit import RepeatLimiter
from agent.tlsport.servercert import ServerCertificate

log = logging.getLogger(__name__)

_RATE_LIMIT = 10.0  # seconds between two identical handshake-failure log lines
_CHUNK = 1024 * 1024  # relay read size and buffer unit
MAX_PER_SOURCE = 16  # connections one client address may hold (ztunnel opens two or three)


@dataclasses.dataclass(frozen=True)
class TlsPeer:
    """One TLS connection as the front door saw it.

    ``remote``: the client's address in gRPC's peer format (``ipv4:1.2.3.4:5678``);
    ``cert_der``: the verified client leaf (None when the client sent none);
    ``uri_sans``: its URI SANs; ``version``: e.g. ``"TLSv1.3"``; ``alpn``: e.g. ``"h2"``.
    """

    remote: str
    cert_der: bytes | None
    uri_sans: tuple[str, ...]
    version: str
    alpn: str | None

    @property
    def spiffe_ids(self) -> list[str]:
        return [u for u in self.uri_sans if u.startswith("spiffe://")]


def grpc_peer(address: object) -> str:
    """A socket address in gRPC's peer format: ``ipv4:h:p`` / ``ipv6:[h]:p`` (an
    IPv4-mapped IPv6 address is shown as IPv4)."""
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        if host.startswith("::ffff:") and "." in host:
            host = host[len("::ffff:"):]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return str(address)


def _source(address: object) -> str:
    """The client address a per-source cap counts by: the host part (an IPv4-mapped IPv6
    address as IPv4)."""
    if isinstance(address, tuple) and address:
        host = str(address[0])
        return host[len("::ffff:"):] if host.startswith("::ffff:") and "." in host else host
    return str(address)


def _uri_sans(der: bytes | None) -> tuple[str, ...]:
    if not der:
        return ()
    try:
        cert = x509.load_der_x509_certificate(der)
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (ValueError, x509.ExtensionNotFound):
        return ()
    return tuple(ext.value.get_values_for_type(x509.UniformResourceIdentifier))


def _keepalive(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 300)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 75)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 9)
    except OSError:
        pass


class TlsFrontDoor:
    """See the module docstring.

    ``name`` appears in logs (the setting of the port, e.g. ``"xds_tls_port"``);
    ``host``/``port`` the public listener (``0.0.0.0`` or ``::`` with a non-zero port
    listen on every IPv4 and IPv6 address, as gRPC core does for them; port 0 lets the
    kernel choose, see :attr:`port` after :meth:`start`); ``backend_path`` the gRPC
    server's private Unix socket; ``certificate`` the listener's certificate.
    """

    def __init__(self, name: str, host: str, port: int, backend_path: str,
                 certificate: ServerCertificate, *, max_connections: int = 256,
                 handshake_timeout: float = 10.0, max_per_source: int = MAX_PER_SOURCE):
        self.name = name
        self.host, self.port = host, port
        self.backend_path = backend_path
        self.certificate = certificate
        self.max_connections = max_connections
        self.max_per_source = max_per_source  # 0: no per-source cap
        self.handshake_timeout = handshake_timeout
        self.peers: dict[str, TlsPeer] = {}
        self.accepted = 0
        self.refused_over_limit = 0
        self.refused_per_source = 0
        self.handshakes_displaced = 0
        # open connections per client address, and the ones still in their handshake
        # (insertion order: oldest first) with the address each came from
        self._per_source: dict[str, int] = {}
        self._handshaking: dict[asyncio.Task, str] = {}
        self._started: set[asyncio.Task] = set()
        self._refusal_log = RepeatLimiter()
        self.handshake_failures = 0
        self._prefix = f"ambient-tls-{os.getpid()}-{secrets.token_hex(4)}-"
        self._counter = itertools.count(1)
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last_log: dict[str, float] = {}

    async def start(self) -> None:
        """Bind the public port. Raises OSError when it can't be bound."""
        self._listener = self._bind()
        self.port = self._listener.getsockname()[1]
        self._accept_task = asyncio.get_running_loop().create_task(
            self._accept_loop(self._listener), name=f"accept-{self.name}")

    def _bind(self) -> socket.socket:
        # One socket per door: a wildcard address listens dual-stack on [::] (IPv4
        # clients appear as ::ffff:a.b.c.d), falling back to 0.0.0.0 without IPv6.
        wildcard = self.host in ("0.0.0.0", "::", "")
        candidates = [(socket.AF_INET6, "::")] if wildcard and socket.has_ipv6 else []
        if wildcard:
            candidates.append((socket.AF_INET, "0.0.0.0"))
        else:
            candidates.append((socket.AF_INET6 if ":" in self.host else socket.AF_INET,
                               self.host.strip("[]")))
        error: OSError | None = None
        for family, host in candidates:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and wildcard:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((host, self.port))
                sock.listen(512)
                sock.setblocking(False)
                return sock
            except OSError as e:
                sock.close()
                error = e
        assert error is not None
        raise error

    async def stop(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
            self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as e:  # EMFILE and friends: back off, keep the listener
                log.warning("%s: accept failed: %s", self.name, e)
                await asyncio.sleep(0.5)
                continue
            remote = grpc_peer(address)
            source = _source(address)
            if not self._admit(source, remote):
                sock.close()
                continue
            self.accepted += 1
            task = loop.create_task(self._handle(sock, remote))
            self._tasks.add(task)
            self._handshaking[task] = source
            self._per_source[source] = self._per_source.get(source, 0) + 1
            task.add_done_callback(functools.partial(self._ended, source=source, sock=sock))

    def _admit(self, source: str, remote: str) -> bool:
        """Make room for a new connection from ``source``: past the per-source cap the
        oldest handshake in progress from that address is closed, past the global cap
        the oldest one from anyone; False (refused, counted, logged at most once a
        minute) when no handshake is in progress to displace."""
        if self.max_per_source and self._per_source.get(source, 0) >= self.max_per_source:
            if not self._displace(source):
                self.refused_per_source += 1
                self._warn_refused(f"{self._per_source[source]} connections open from "
                                   f"{source} (the per-source limit)", remote)
                return False
        if len(self._tasks) >= self.max_connections and not self._displace(None):
            self.refused_over_limit += 1
            self._warn_refused(f"{len(self._tasks)} connections open (the limit)", remote)
            return False
        return True

    def _displace(self, source: str | None) -> bool:
        for task, src in self._handshaking.items():
            if source is None or src == source:
                task.cancel()
                self._forget(task, src)
                self.handshakes_displaced += 1
                return True
        return False

    def _ended(self, task: asyncio.Task, source: str, sock: socket.socket) -> None:
        if task not in self._started:  # cancelled before it ran: nobody owns the socket
            sock.close()
        self._started.discard(task)
        self._forget(task, source)

    def _forget(self, task: asyncio.Task, source: str) -> None:
        """Give the task's slots back (idempotent: a displaced task is forgotten when it
        is cancelled and again when it ends)."""
        if task not in self._tasks:
            return
        self._tasks.discard(task)
        self._handshaking.pop(task, None)
        left = self._per_source.get(source, 0) - 1
        if left > 0:
            self._per_source[source] = left
        else:
            self._per_source.pop(source, None)

    def _warn_refused(self, why: str, remote: str) -> None:
        allowed, held = self._refusal_log.check(self.name, time.monotonic())
        if allowed:  # a flood of connects must not become a flood of log lines
            log.warning("%s: %s: closing the one from %s%s", self.name, why, remote,
                        f" ({held} more closed since the last warning)" if held else "")

    def lookup(self, peer: str) -> TlsPeer | None:
        """The :class:`TlsPeer` for a gRPC ``context.peer()``, or None when the call did
        not come through this door."""
        if not peer.startswith("unix-abstract:"):
            return None
        return self.peers.get(peer[len("unix-abstract:"):])

    @property
    def connections(self) -> int:
        return len(self._tasks)

    def _log_failure(self, remote: str, error: BaseException) -> None:
        self.handshake_failures += 1
        what = f"{type(error).__name__}: {error}"[:300]
        now = time.monotonic()
        if now - self._last_log.get(what, -_RATE_LIMIT) >= _RATE_LIMIT:
            self._last_log[what] = now
            if len(self._last_log) > 256:
                self._last_log.clear()
            log.info("%s: TLS handshake from %s failed: %s", self.name, remote, what)

    async def _handshake(self, sock: socket.socket
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """TLS from the first byte (the context is chosen, and renewed if due, before any
        byte is read). Returns ``(reader, writer)``; raises on failure or timeout."""
        loop = asyncio.get_running_loop()
        context = await self.certificate.current()
        reader = asyncio.StreamReader(limit=_CHUNK)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await asyncio.wait_for(
            loop.connect_accepted_socket(lambda: protocol, sock, ssl=context,
                                         ssl_handshake_timeout=self.handshake_timeout),
            self.handshake_timeout + 1.0)
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _handle(self, sock: socket.socket, remote: str) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._started.add(task)
        name = self._prefix + str(next(self._counter))
        writer: asyncio.StreamWriter | None = None
        backend: asyncio.StreamWriter | None = None
        try:
            sock.setblocking(False)
            _keepalive(sock)
            try:
                reader, writer = await self._handshake(sock)
            except (ssl.SSLError, OSError, asyncio.TimeoutError, ConnectionError) as e:
                self._log_failure(remote, e)
                sock.close()
                return
            except asyncio.CancelledError:  # displaced by a newer connection, or stop()
                sock.close()
                raise
            if task is not None:
                self._handshaking.pop(task, None)
            sslobj = writer.get_extra_info("ssl_object")
            der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
            self.peers[name] = TlsPeer(remote, der, _uri_sans(der),
                                       sslobj.version() if sslobj else "",
                                       sslobj.selected_alpn_protocol() if sslobj else None)
            bsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            bsock.setblocking(False)
            try:
                bsock.bind("\0" + name)
                await asyncio.get_running_loop().sock_connect(bsock, self.backend_path)
            except OSError:
                bsock.close()
                raise
            b_reader, backend = await asyncio.open_unix_connection(sock=bsock,
                                                                   limit=_CHUNK)
            for w in (writer, backend):  # fewer, larger writes for big xDS pushes
                w.transport.set_write_buffer_limits(high=_CHUNK * 4)
            await asyncio.gather(_pump(reader, backend), _pump(b_reader, writer))
        except (OSError, ConnectionError) as e:
            log.debug("%s: connection from %s: %s", self.name, remote, e)
        except asyncio.CancelledError:
            pass
        finally:
            # Forget the peer before the backend socket (and its abstract name) is freed,
            # so a later connection can never be mistaken for this one.
            self.peers.pop(name, None)
            for stream in (backend, writer):
                if stream is not None:
                    stream.close()

    def debug_state(self) -> dict:
        return {"listen": f"{self.host}:{self.port}", "connections": self.connections,
                "handshaking": len(self._handshaking), "sources": len(self._per_source),
                "max_connections": self.max_connections,
                "max_per_source": self.max_per_source,
                "accepted": self.accepted, "refused_over_limit": self.refused_over_limit,
                "refused_per_source": self.refused_per_source,
                "handshakes_displaced": self.handshakes_displaced,
                "handshake_failures": self.handshake_failures,
                "certificate": self.certificate.debug_state()}


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes until EOF, then half-close (Unix side) or close (TLS side) the other."""
    try:
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:
            writer.close()
    except (ConnectionError, OSError, ssl.SSLError):
        writer.close()


def private_socket_path(state_dir: str, name: str) -> str:
    """``<state_dir>/tls-private/<name>.sock`` in a 0700 directory (only root reaches the
    gRPC server behind the door); a fresh 0700 temp directory when that path would be
    longer than a Unix socket path may be."""
    directory = os.path.join(state_dir, "tls-private")
    path = os.path.join(directory, f"{name}.sock")
    if len(os.fsencode(path)) > 100:
        import tempfile

        directory = tempfile.mkdtemp(prefix="ambient-tls-")
        path = os.path.join(directory, f"{name}.sock")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return path


def remove_private_socket(path: str) -> None:
    """Unlink a backend socket made by :func:`private_socket_path` (or a caller's temp
    directory named ``ambient-*``) and remove that temp directory when it is empty."""
    if not path:
        return
    try:
        os.unlink(path)
    except OSError:
        pass
    import tempfile

    directory = os.path.dirname(path)
    if (os.path.dirname(directory) == tempfile.gettempdir()
            and os.path.basename(directory).startswith("ambient-")):
        try:
            os.rmdir(directory)
        except OSError:
            pass
