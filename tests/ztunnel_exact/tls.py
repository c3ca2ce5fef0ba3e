"""ztunnel's control-plane TLS, reproduced for the ztunnel-exact clients.

Written from ztunnel's source (istio/ztunnel ``src/tls/control.rs``, ``src/tls/lib.rs``,
``src/identity/auth.rs``, ``src/config.rs``), not from this repository's clients:

- **TLS 1.3 only** (``tls_versions()``: TLS 1.2 only with ``TLS12_ENABLED=true``),
  ALPN ``h2`` (hyper-rustls ``enable_http2`` + hyper ``http2_only``), **no client
  certificate** (``with_no_client_auth``).
- **Server verification** as rustls/webpki does it: the chain must lead to a root of
  ``XDS_ROOT_CA``/``CA_ROOT_CA``, be valid *now*, and name the URI's host — a DNS name or,
  for an IP literal, an iPAddress SAN; if that fails and ``ALT_XDS_HOSTNAME`` /
  ``ALT_CA_HOSTNAME`` is set, that DNS name is tried instead (``AltHostnameVerifier``).
  The check here uses ``cryptography.x509.verification`` (a strict RFC 5280 / CABF
  verifier, like webpki) with an injectable verification time, so a test can be
  "ztunnel 25 hours later".
- **Headers** (``AuthSource::insert_headers``): ``authorization: Bearer <token>`` and
  ``clusterid: <CLUSTER_ID>`` on every call when a token is configured; none otherwise.
- **TCP**: 5 s connect timeout, keepalive 300 s / 75 s / 9 (``grpc_connector``).

How it is built: grpcio speaks HTTP/2 to a loopback plaintext port of
:class:`ControlPlaneTunnel`, which opens, per connection, the TLS connection to the
server exactly as above and relays the bytes. It also counts the HTTP/2 frames that
matter for keepalive in both directions (PING, PING ACK, GOAWAY with its error code and
debug data) with ``hyperframe``, so tests can prove what was on the wire.

Gaps (grpcio / Python ``ssl`` cannot do otherwise), none of which the server can see
except the first: Python 3.11 cannot restrict the TLS 1.3 cipher suites, so
TLS_CHACHA20_POLY1305_SHA256 is offered besides ztunnel's two AES-GCM suites; only the
leaf of the server chain is visible to the verifier (an intermediate CA between the
mesh root and the server certificate is not supported here); HTTP/2 framing, window
sizes and the PING timer are grpc core's, not hyper's (cadence set to ztunnel's 30 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import ipaddress
import logging
import socket
import ssl
import time
from typing import Callable
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.x509 import verification
from hyperframe.frame import Frame, GoAwayFrame, PingFrame

log = logging.getLogger("tests.ztunnel_exact.tls")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class VerifyError(Exception):
    """The server certificate was refused; ``str()`` says why (webpki-style)."""


def verify_server(leaf_der: bytes, roots_pem: bytes, host: str, alt_hostname: str | None,
                  at: float) -> None:
    """Verify like rustls' default verifier (+ ztunnel's alt hostname): chain to
    ``roots_pem``, valid at ``at`` (epoch seconds), names ``host``. Raises VerifyError."""
    try:
        roots = x509.load_pem_x509_certificates(roots_pem)
    except ValueError as e:
        raise VerifyError(f"InvalidRootCert: {e}") from None
    leaf = x509.load_der_x509_certificate(leaf_der)
    when = dt.datetime.fromtimestamp(at, dt.timezone.utc)

    def attempt(name: str) -> None:
        try:
            subject = verification.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            subject = verification.DNSName(name)
        verifier = (verification.PolicyBuilder().store(verification.Store(roots)).time(when)
                    .build_server_verifier(subject))
        verifier.verify(leaf, [])

    try:
        attempt(host)
    except verification.VerificationError as first:
        if not alt_hostname:
            raise VerifyError(f"{host}: {first}") from None
        try:
            attempt(alt_hostname)
        except verification.VerificationError as second:
            raise VerifyError(f"{host}: {first}; alt {alt_hostname}: {second}") from None


@dataclasses.dataclass
class FrameStats:
    """HTTP/2 frames seen on one side of the wire (see :class:`ControlPlaneTunnel`)."""

    pings: list[float] = dataclasses.field(default_factory=list)  # monotonic times
    ping_acks: int = 0
    goaways: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)
    frames: int = 0


class _FrameWatcher:
    """Walks an HTTP/2 byte stream (optionally starting with the client preface) and
    records PING / GOAWAY frames; never alters the bytes."""

    def __init__(self, stats: FrameStats, preface: bool):
        self.stats = stats
        self.buf = bytearray()
        self.skip_preface = preface

    def feed(self, data: bytes) -> None:
        self.buf += data
        if self.skip_preface:
            if len(self.buf) < len(PREFACE):
                return
            del self.buf[:len(PREFACE)]
            self.skip_preface = False
        while len(self.buf) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self.buf[:9]))
            if len(self.buf) < 9 + length:
                return
            body = memoryview(bytes(self.buf[9:9 + length]))
            del self.buf[:9 + length]
            self.stats.frames += 1
            if isinstance(frame, PingFrame):
                if "ACK" in frame.flags:
                    self.stats.ping_acks += 1
                else:
                    self.stats.pings.append(time.monotonic())
            elif isinstance(frame, GoAwayFrame):
                frame.parse_body(body)
                self.stats.goaways.append((frame.error_code, bytes(frame.additional_data)))


@dataclasses.dataclass
class Connection:
    """One TLS connection the tunnel made: what was negotiated and the frames seen."""

    version: str = ""
    alpn: str | None = None
    cipher: str = ""
    error: str = ""
    sent: FrameStats = dataclasses.field(default_factory=FrameStats)      # client → server
    received: FrameStats = dataclasses.field(default_factory=FrameStats)  # server → client
    closed: bool = False


class ControlPlaneTunnel:
    """A loopback plaintext port that grpcio connects to; each connection is carried to
    ``address`` (``https://host:port``, as ``XDS_ADDRESS``) over ztunnel's TLS.

    ``roots_pem``: ``XDS_ROOT_CA`` content; ``alt_hostname``: ``ALT_XDS_HOSTNAME``;
    ``now``: the verifier's clock (default real time); ``tls12``: ``TLS12_ENABLED``.
    ``connections`` lists every TLS connection made, newest last.
    """

    def __init__(self, address: str, roots_pem: bytes, *, alt_hostname: str | None = None,
                 now: Callable[[], float] = time.time, tls12: bool = False):
        url = urlsplit(address)
        if url.scheme != "https" or not url.hostname or not url.port:
            raise ValueError(f"{address!r}: expected https://host:port (ztunnel only speaks TLS)")
        self.host, self.port = url.hostname, url.port
        self.roots_pem = roots_pem
        self.alt_hostname = alt_hostname
        self.now = now
        self.tls12 = tls12
        self.connections: list[Connection] = []
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self.local_port = 0

    @property
    def target(self) -> str:
        """What to give grpcio: ``127.0.0.1:<local port>``."""
        return f"127.0.0.1:{self.local_port}"

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2 if self.tls12 else ssl.TLSVersion.TLSv1_3
        ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.set_alpn_protocols(["h2"])
        # Verification is ours (verify_server), at our clock; no client certificate.
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx

    async def start(self) -> "ControlPlaneTunnel":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.local_port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _open(self, conn: Connection):
        # hyper's HttpConnector: every resolved address in order, 5 s connect timeout.
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port,
                                                             type=socket.SOCK_STREAM)
        error: Exception | None = None
        for family, _, _, _, sockaddr in infos:
            try:
                is_ip = True
                try:
                    ipaddress.ip_address(self.host)
                except ValueError:
                    is_ip = False
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    sockaddr[0], sockaddr[1], ssl=self.context(),
                    server_hostname=None if is_ip else self.host, family=family), 5.0)
                break
            except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
                error = e
        else:
            raise ConnectionError(f"connect {self.host}:{self.port}: {error}")
        sock = writer.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 300)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 75)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 9)
        except OSError:
            pass
        sslobj = writer.get_extra_info("ssl_object")
        conn.version, conn.alpn = sslobj.version(), sslobj.selected_alpn_protocol()
        conn.cipher = (sslobj.cipher() or ("",))[0]
        der = sslobj.getpeercert(binary_form=True)
        if not der:
            writer.close()
            raise VerifyError("server sent no certificate")
        verify_server(der, self.roots_pem, self.host, self.alt_hostname, self.now())
        return reader, writer

    async def _handle(self, local_r: asyncio.StreamReader, local_w: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._tasks.add(task)
        conn = Connection()
        self.connections.append(conn)
        remote_w = None
        try:
            try:
                remote_r, remote_w = await self._open(conn)
            except (OSError, ConnectionError, ssl.SSLError, VerifyError,
                    asyncio.TimeoutError) as e:
                conn.error = f"{type(e).__name__}: {e}"
                log.info("ztunnel-exact TLS to %s:%d failed: %s", self.host, self.port,
                         conn.error)
                return
            await asyncio.gather(
                _relay(local_r, remote_w, _FrameWatcher(conn.sent, preface=True)),
                _relay(remote_r, local_w, _FrameWatcher(conn.received, preface=False)))
        except asyncio.CancelledError:
            pass
        finally:
            conn.closed = True
            for w in (local_w, remote_w):
                if w is not None:
                    w.close()
            self._tasks.discard(task)


async def _relay(reader, writer, watcher: _FrameWatcher) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            watcher.feed(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, ssl.SSLError):
        pass
    finally:
        writer.close()


def auth_headers(token: str | None, cluster_id: str) -> list[tuple[str, str]]:
    """``AuthSource::insert_headers``: bearer token + clusterid, or nothing."""
    if not token:
        return []
    return [("authorization", f"Bearer {token}"), ("clusterid", cluster_id)]
