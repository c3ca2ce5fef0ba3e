"""ZDS framing and encoders against the byte vectors of ``docs/zds.md``, and the
 receive rules (1024-byte limit, one fd, truncation flags), over real socketpairs."""

from __future__ import annotations

import os
import socket

import pytest

from zds import wire
from tests.zds.helpers import netns_fd, netns_fd_count


@pytest.mark.parametrize("data,hexbytes", [
    (wire.encode_hello(), "0801"),
    (wire.encode_snapshot_sent(), "1a00"),
    (wire.encode_ack(), "0a00"),
    (wire.encode_del("x"), "1203120178"),
    (wire.encode_keep("x"), "2a030a0178"),
    (wire.encode_add("u", "n", "s", "a"), "0a0e0a0175120 90a016e1201731a0161".replace(" ", "")),
])
def test_vectors(data, hexbytes):
    assert data.hex() == hexbytes


def test_decoders_round_trip_and_reject_garbage():
    assert wire.decode_hello(bytes.fromhex("0801")).version == 1
    assert wire.decode_ack(wire.encode_ack("boom")).error == "boom"
    req = wire.decode_request(bytes.fromhex("1203120178"))
    assert getattr(req, "del").uid == "x"
    with pytest.raises(wire.WireError, match="malformed WorkloadRequest"):
        wire.decode_request(b"\xff\xff\xff")
    with pytest.raises(wire.WireError, match="no payload"):
        wire.decode_request(b"")
    with pytest.raises(wire.WireError, match="without ack"):
        wire.decode_ack(b"")


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_fd_travels_and_is_the_same_netns(pair):
    a, b = pair
    fd = netns_fd()
    try:
        wire.send_packet(a, wire.encode_add("u", "n", "s", "a"), fd)
        packet = wire.recv_packet(b)
        assert len(packet.fds) == 1
        assert os.fstat(packet.fds[0]).st_ino == os.fstat(fd).st_ino
        assert not os.get_inheritable(packet.fds[0])  # MSG_CMSG_CLOEXEC
        packet.close_fds()
    finally:
        os.close(fd)


def test_truncated_message_rejected(pair):
    a, b = pair
    a.send(b"\x0a" * (wire.MAX_MESSAGE + 1))
    with pytest.raises(wire.WireError, match="truncated message"):
        wire.recv_packet(b)


def test_two_fds_rejected_and_closed(pair):
    a, b = pair
    f1, f2 = netns_fd(), netns_fd()
    before = netns_fd_count()
    try:
        socket.send_fds(a, [b"x"], [f1, f2])
        # CMSG_SPACE(4) is 8-byte aligned, so 2 fds fit; 3 set MSG_CTRUNC. Both are rejected.
        with pytest.raises(wire.WireError, match="truncated control message|2 fds in one"):
            wire.recv_packet(b)
        assert netns_fd_count() == before  # whatever arrived was closed
    finally:
        os.close(f1)
        os.close(f2)


def test_fd_where_none_allowed_is_closed(pair):
    a, b = pair
    fd = netns_fd()
    before = netns_fd_count()
    try:
        socket.send_fds(a, [wire.encode_ack()], [fd])
        with pytest.raises(wire.WireError, match="1 fds in one message"):
            wire.recv_packet(b, max_fds=0)
        assert netns_fd_count() == before
    finally:
        os.close(fd)


def test_eof_and_empty_queue(pair):
    a, b = pair
    with pytest.raises(BlockingIOError):
        wire.recv_packet(b)
    a.close()
    assert wire.recv_packet(b) is None
