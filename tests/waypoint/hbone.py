"""HBONE for the waypoint tests, on the ``h2`` library over asyncio TLS.

:func:`hbone_request`, the client, stands in for the *source* ztunnel: mTLS 1.3 with a
SPIFFE certificate from our CA, ALPN ``h2``, one HTTP/2 ``CONNECT`` whose ``:authority``
is the destination ``VIP:port``, then plain HTTP/1.1 inside the tunnel.

:class:`HboneTerminator` stands in for the *destination* ztunnel, written from ztunnel's
``src/proxy/inbound.rs``: TLS on ``<pod IP>:15008`` requiring a client certificate from
the mesh root, ALPN ``h2``; a request that is not ``CONNECT`` gets 400
(``build_inbound_request``: ``NonConnectMethod``), an ``:authority`` that is not
``IP:port`` 400, a destination that is not this workload's IP 400
(``validate_destination``); then it connects to the destination (503 when that fails,
``ConnectionFailure``), answers 200 and copies bytes both ways
(``copy_bidirectional``). The caller's identity is the URI SAN of the client
certificate, as ztunnel's ``Connection.src_identity``; each accepted tunnel is
recorded in ``tunnels`` as ``(peer identity, authority)``.

:class:`HboneForwarder` is the source ztunnel's outbound for clients that speak their own
protocol (grpcio, a raw TCP client): it listens on a local address and carries each
accepted connection, byte for byte, in its own HBONE tunnel (``CONNECT <VIP:port>``) to
the waypoint, as ztunnel carries a captured connection; HTTP/2 flow control is respected
both ways (DATA is sent only within the stream's window).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import tempfile
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions


def _ssl_context(server: bool, chain: bytes, key: bytes, root: bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory() as d:
        cert, keyf = Path(d, "c.pem"), Path(d, "k.pem")
        cert.write_bytes(chain)
        keyf.write_bytes(key)
        ctx.load_cert_chain(str(cert), str(keyf))
    ctx.load_verify_locations(cadata=root.decode())
    ctx.check_hostname = False  # SPIFFE certificates carry URI SANs only
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    return ctx


def peer_uri(writer: asyncio.StreamWriter) -> str:
    cert = writer.get_extra_info("peercert") or {}
    return next((v for k, v in cert.get("subjectAltName", ()) if k == "URI"), "")


class _H2Pump:
    """Moves h2 frames between an asyncio stream and an ``H2Connection``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 conn: h2.connection.H2Connection):
        self.reader, self.writer, self.conn = reader, writer, conn

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def events(self) -> list[h2.events.Event]:
        data = await self.reader.read(65536)
        if not data:
            return [h2.events.ConnectionTerminated()]
        evs = self.conn.receive_data(data)
        await self.flush()
        return evs


async def hbone_request(waypoint: tuple[str, int], authority: str, request: bytes, *,
                        chain: bytes, key: bytes, root: bytes, timeout: float = 10.0
                        ) -> tuple[int, bytes, str]:
    """One HTTP/1.1 ``request`` through an HBONE tunnel to ``authority`` via the waypoint
    at ``waypoint``. Returns ``(CONNECT status, bytes read from the tunnel until it
    closed, the waypoint's URI SAN)``."""
    ctx = _ssl_context(False, chain, key, root)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(*waypoint, ssl=ctx), timeout)
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        pump = _H2Pump(reader, writer, conn)
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "CONNECT"), (":authority", authority)])
        await pump.flush()
        status, body, sent = 0, b"", False
        async with asyncio.timeout(timeout):
            while True:
                for ev in await pump.events():
                    if isinstance(ev, h2.events.ResponseReceived):
                        status = int(dict(ev.headers)[b":status"])
                        if status == 200 and not sent:
                            conn.send_data(sid, request)
                            sent = True
                    elif isinstance(ev, h2.events.DataReceived):
                        body += ev.data
                        conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                        if _complete(body):
                            return status, body, peer_uri(writer)
                    elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset,
                                         h2.events.ConnectionTerminated)):
                        return status, body, peer_uri(writer)
                await pump.flush()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _complete(raw: bytes) -> bool:
    """Whether ``raw`` holds a whole HTTP/1.1 response with a ``content-length`` body
    (so the client need not wait for the tunnel to close)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value.strip())
    return False


class HboneTerminator:
    """The destination ztunnel's HBONE inbound (module docstring) on ``ip:port``."""

    def __init__(self, ip: str, *, chain: bytes, key: bytes, root: bytes, port: int = 15008):
        self.ip, self.port = ip, port
        self.ctx = _ssl_context(True, chain, key, root)
        self.tunnels: list[tuple[str, str]] = []
        self.refused: list[tuple[int, str]] = []
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "HboneTerminator":
        self._server = await asyncio.start_server(self._serve, self.ip, self.port, ssl=self.ctx)
        return self

    async def stop(self) -> None:
        if self._server:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._server:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        identity = peer_uri(writer)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        pump = _H2Pump(reader, writer, conn)
        upstreams: dict[int, asyncio.StreamWriter] = {}
        lock = asyncio.Lock()
        try:
            await pump.flush()
            while True:
                for ev in await pump.events():
                    if isinstance(ev, h2.events.ConnectionTerminated):
                        return
                    if isinstance(ev, h2.events.RequestReceived):
                        up = await self._open(ev, identity, conn, pump, lock)
                        if up is not None:
                            upstreams[ev.stream_id] = up
                    elif isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                        up = upstreams.get(ev.stream_id)
                        if up is not None:
                            up.write(ev.data)
                    elif isinstance(ev, h2.events.StreamEnded):
                        up = upstreams.get(ev.stream_id)
                        if up is not None and up.can_write_eof():
                            up.write_eof()
                async with lock:
                    await pump.flush()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError,
                asyncio.CancelledError):  # stop() cancels open tunnels
            return
        finally:
            for up in upstreams.values():
                up.close()
            writer.close()
            self._tasks.discard(task)

    async def _open(self, ev: h2.events.RequestReceived, identity: str,
                    conn: h2.connection.H2Connection, pump: _H2Pump, lock: asyncio.Lock
                    ) -> asyncio.StreamWriter | None:
        headers = {k.decode(): v.decode() for k, v in ev.headers}
        sid = ev.stream_id

        def refuse(code: int) -> None:
            self.refused.append((code, headers.get(":authority", "")))
            conn.send_headers(sid, [(":status", str(code))], end_stream=True)

        if headers.get(":method") != "CONNECT":
            refuse(400)
            return None
        host, sep, port = headers.get(":authority", "").rpartition(":")
        if not sep or not port.isdigit() or host.strip("[]") != self.ip:
            refuse(400)
            return None
        try:
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError:
            refuse(503)
            return None
        self.tunnels.append((identity, headers[":authority"]))
        conn.send_headers(sid, [(":status", "200")])

        async def copy_back() -> None:
            try:
                while data := await up_reader.read(16384):
                    async with lock:
                        conn.send_data(sid, data)
                        await pump.flush()
                async with lock:
                    conn.end_stream(sid)
                    await pump.flush()
            except Exception:
                pass

        t = asyncio.ensure_future(copy_back())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return up_writer


class HboneForwarder:
    """Local ``ip:port`` (``port`` 0: any; the bound port is :attr:`port`) -> one HBONE
    tunnel per connection to ``authority`` through the waypoint at ``waypoint``."""

    def __init__(self, ip: str, waypoint: tuple[str, int], authority: str, *, chain: bytes,
                 key: bytes, root: bytes, timeout: float = 10.0):
        self.ip, self.waypoint, self.authority, self.timeout = ip, waypoint, authority, timeout
        self.ctx = _ssl_context(False, chain, key, root)
        self.port = 0
        self.statuses: list[int] = []  # the CONNECT status of each tunnel
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "HboneForwarder":
        self._server = await asyncio.start_server(self._serve, self.ip, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        if self._server:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, local_r: asyncio.StreamReader, local_w: asyncio.StreamWriter
                     ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        writer = None
        up: asyncio.Task | None = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(*self.waypoint, ssl=self.ctx), self.timeout)
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            pump = _H2Pump(reader, writer, conn)
            lock = asyncio.Lock()
            window = asyncio.Event()
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(":method", "CONNECT"), (":authority", self.authority)])
            async with lock:
                await pump.flush()

            async def upload() -> None:
                while data := await local_r.read(16384):
                    while data:
                        room = min(conn.local_flow_control_window(sid),
                                   conn.max_outbound_frame_size)
                        if room <= 0:
                            window.clear()
                            await window.wait()
                            continue
                        chunk, data = data[:room], data[room:]
                        async with lock:
                            conn.send_data(sid, chunk)
                            await pump.flush()
                async with lock:
                    conn.end_stream(sid)
                    await pump.flush()

            while True:
                for ev in await pump.events():
                    if isinstance(ev, h2.events.ResponseReceived):
                        status = int(dict(ev.headers)[b":status"])
                        self.statuses.append(status)
                        if status != 200:
                            return
                        up = asyncio.ensure_future(upload())
                        self._tasks.add(up)
                        up.add_done_callback(self._tasks.discard)
                    elif isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                        local_w.write(ev.data)
                        await local_w.drain()
                    elif isinstance(ev, h2.events.WindowUpdated):
                        window.set()
                    elif isinstance(ev, h2.events.StreamEnded):
                        if local_w.can_write_eof():
                            local_w.write_eof()
                    elif isinstance(ev, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                        return
                async with lock:
                    await pump.flush()
        except (ConnectionError, OSError, TimeoutError, ssl.SSLError, asyncio.CancelledError,
                h2.exceptions.ProtocolError):
            return
        finally:
            if up is not None:
                up.cancel()
            local_w.close()
            if writer is not None:
                writer.close()
            self._tasks.discard(task)
