"""The TLS front door under connections that stall before their TLS handshake: one
address holds at most its per-source quota, a newcomer takes the place of the oldest
unfinished handshake, and a good client's gRPC call through the door completes while
the stalled sockets are still open. Real sockets, real TLS, a real grpc.aio server and
client behind and in front of the door (the abusers are plain TCP sockets from other
loopback addresses: 127.0.0.0/8 is all loopback on Linux)."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import pytest

from agent.tlsport.frontdoor import TlsFrontDoor
from agent.tlsport.servercert import ServerCertificate, TlsMaterial
from tests.xds.certs import Pki

CALL_TIMEOUT = 30.0  # generous: a failed admission shows as no answer at all


def _stalled(source: str, port: int) -> socket.socket:
    """A TCP connection from ``source`` that never sends its ClientHello."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


async def _until(predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "the door did not reach the expected state"
        await asyncio.sleep(0.02)


class _Door:
    """A front door (long handshake deadline, so only the caps can free a slot) in front
    of a grpc.aio server answering ``/test.Echo/Call`` with the request bytes."""

    def __init__(self, tmp_path, **door_kw):
        self.tmp_path, self.door_kw = tmp_path, door_kw

    async def __aenter__(self):
        self.mesh = Pki()
        cert_pem, key_pem = self.mesh.leaf(None, dns=["localhost"])

        async def provide():
            return TlsMaterial(cert_pem, key_pem, self.mesh.root_pem)

        self.cert = ServerCertificate("test_port", provide)
        await self.cert.start()

        async def call(request: bytes, context) -> bytes:
            return request

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}),))
        path = str(self.tmp_path / "backend.sock")
        self.server.add_insecure_port("unix:" + path)
        await self.server.start()
        self.door = TlsFrontDoor("test_port", "127.0.0.1", 0, path, self.cert,
                                 handshake_timeout=300, **self.door_kw)
        await self.door.start()
        self.sockets: list[socket.socket] = []
        return self

    async def __aexit__(self, *exc):
        for s in self.sockets:
            s.close()
        await self.door.stop()
        await self.server.stop(0)
        await self.cert.stop()

    async def good_call(self) -> bytes:
        creds = grpc.ssl_channel_credentials(root_certificates=self.mesh.root_pem)
        async with grpc.aio.secure_channel(
                f"localhost:{self.door.port}", creds,
                options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
            call = channel.unary_unary("/test.Echo/Call")
            return await call(b"hello", timeout=CALL_TIMEOUT, wait_for_ready=True)


async def test_one_source_of_stalled_handshakes_holds_only_its_quota(tmp_path):
    """More stalled sockets from one address than the whole door holds: on the old door
    they filled it and every good client was closed at accept until a handshake deadline
    freed a slot."""
    async with _Door(tmp_path, max_connections=32, max_per_source=8) as d:
        for _ in range(48):
            d.sockets.append(_stalled("127.0.0.2", d.door.port))
        await _until(lambda: d.door.accepted + d.door.refused_over_limit
                     + d.door.refused_per_source >= 48)
        state = d.door.debug_state()
        assert state["handshaking"] == 8 and state["sources"] == 1
        assert d.door.handshakes_displaced == 40  # the newest 8 are the ones still held
        assert await d.good_call() == b"hello"
        assert d.door.connections == 9  # 8 stalled from 127.0.0.2 + the good client
        assert d.door.debug_state()["handshaking"] == 8


async def test_many_sources_of_stalled_handshakes_yield_to_a_good_client(tmp_path):
    """One stalled socket from each of more addresses than the door holds: the good
    client takes the place of the oldest unfinished handshake."""
    async with _Door(tmp_path, max_connections=24, max_per_source=8) as d:
        for i in range(40):
            d.sockets.append(_stalled(f"127.0.1.{i + 1}", d.door.port))
        await _until(lambda: d.door.accepted >= 40)
        assert d.door.connections == 24 and d.door.handshakes_displaced == 16
        assert await d.good_call() == b"hello"
        assert d.door.connections == 24 and d.door.handshakes_displaced == 17


async def test_established_connections_are_never_displaced_and_refusals_are_counted(
        tmp_path, caplog):
    """Only unfinished handshakes make room: past the cap with every slot an established
    TLS connection, a newcomer is closed at accept, counted, and warned about once a
    minute however many come (moved from test_servercert.py, where the held
    connection was an unfinished handshake, which a newcomer now displaces)."""
    caplog.set_level(logging.WARNING)
    async with _Door(tmp_path, max_connections=1) as d:
        assert await d.good_call() == b"hello"  # (its connection is closed again)
        await _until(lambda: d.door.connections == 0)
        creds = grpc.ssl_channel_credentials(root_certificates=d.mesh.root_pem)
        async with grpc.aio.secure_channel(
                f"localhost:{d.door.port}", creds,
                options=[("grpc.ssl_target_name_override", "localhost")]) as held:
            assert await held.unary_unary("/test.Echo/Call")(b"x", timeout=CALL_TIMEOUT) == b"x"
            loop = asyncio.get_running_loop()
            for _ in range(50):
                s = _stalled("127.0.0.3", d.door.port)
                s.setblocking(False)
                assert await asyncio.wait_for(loop.sock_recv(s, 1), 10) == b""  # closed
                s.close()
            assert d.door.refused_over_limit == 50 and d.door.handshakes_displaced == 0
            # the held connection still works
            assert await held.unary_unary("/test.Echo/Call")(b"y", timeout=CALL_TIMEOUT) == b"y"
    lines = [r for r in caplog.records if "connections open (the limit)" in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.parametrize("address,expected", [
    (("::ffff:10.0.0.1", 5, 0, 0), "10.0.0.1"), (("10.0.0.2", 9), "10.0.0.2"),
    (("fd00::1", 7, 0, 0), "fd00::1")])
def test_per_source_counts_by_the_host_part(address, expected):
    from agent.tlsport.frontdoor import _source

    assert _source(address) == expected
