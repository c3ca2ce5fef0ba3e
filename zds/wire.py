"""ZDS framing: one protobuf per SOCK_SEQPACKET packet, the netns fd in SCM_RIGHTS.

Spec ``docs/zds.md``: no length prefix (packet boundaries frame messages), a
1024-byte receive buffer on both sides, ``MSG_TRUNC``/``MSG_CTRUNC`` rejected, exactly
one fd and only on ``AddWorkload``. Encoders here produce the byte vectors ztunnel's decoder
expects (``tests/test_protos.py`` pins them).

The socket helpers are non-blocking and event-loop friendly: ``recv_packet`` /
``send_packet`` never block (they raise ``BlockingIOError``); :func:`wait_ready` waits
for readiness with ``loop.add_reader``/``add_writer`` under a timeout.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import os
import socket
from typing import TypeVar

from google.protobuf.message import Message

from zds import zds_pb2

MAX_MESSAGE = 1024  # bytes; both upstream sides read into a 1024-byte buffer
# Room for exactly one fd, as ztunnel reserves: a second fd makes the kernel set MSG_CTRUNC.
FD_CMSG_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)
MSG_CMSG_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0x40000000)
# Plain ints: testing an IntFlag member costs an enum operation on every packet.
_MSG_TRUNC, _MSG_CTRUNC = int(socket.MSG_TRUNC), int(socket.MSG_CTRUNC)
_SOL_SOCKET, _SCM_RIGHTS = int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)


class WireError(ValueError):
    """A packet that breaks the ZDS framing or does not parse; the text says which rule."""


@dataclasses.dataclass(slots=True)
class Packet:
    """One received packet: ``data`` (bytes) and the fds that came with it (caller owns them)."""

    data: bytes
    fds: list[int]

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


# ------------------------------------------------------------------ encoders

def encode_hello(version: zds_pb2.Version = zds_pb2.V1) -> bytes:
    """``ZdsHello{version}`` (bare, not wrapped): ``08 01`` for V1."""
    return zds_pb2.ZdsHello(version=version).SerializeToString()


def encode_add(uid: str, name: str, namespace: str, service_account: str) -> bytes:
    """``WorkloadRequest{add{uid, workload_info}}``; workload_info is always present
    (ztunnel treats an Add without it as a fatal protocol error)."""
    info = zds_pb2.WorkloadInfo(name=name, namespace=namespace, service_account=service_account)
    req = zds_pb2.WorkloadRequest(add=zds_pb2.AddWorkload(uid=uid, workload_info=info))
    return req.SerializeToString()


def encode_keep(uid: str) -> bytes:
    """``WorkloadRequest{keep{uid}}`` (field 5)."""
    return zds_pb2.WorkloadRequest(keep=zds_pb2.KeepWorkload(uid=uid)).SerializeToString()


def encode_del(uid: str) -> bytes:
    """``WorkloadRequest{del{uid}}``; note DelWorkload.uid is field 2."""
    return zds_pb2.WorkloadRequest(**{"del": zds_pb2.DelWorkload(uid=uid)}).SerializeToString()


def encode_snapshot_sent() -> bytes:
    """``WorkloadRequest{snapshot_sent{}}`` = ``1a 00``."""
    return zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent()).SerializeToString()


def encode_ack(error: str = "") -> bytes:
    """``WorkloadResponse{ack{error}}``; success = ``0a 00`` (empty submessage kept)."""
    if not error:
        return ACK_OK
    return zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error=error)).SerializeToString()


# The success ack is one fixed byte vector; sent and recognized without protobuf.
ACK_OK = zds_pb2.WorkloadResponse(ack=zds_pb2.Ack()).SerializeToString()
assert ACK_OK == b"\x0a\x00", ACK_OK


# ------------------------------------------------------------------ decoders

_M = TypeVar("_M", bound=Message)


def _parse(message_type: type[_M], data: bytes, what: str) -> _M:
    msg = message_type()
    try:
        msg.ParseFromString(data)
    except Exception as e:  # protobuf raises DecodeError (and others on garbage)
        raise WireError(f"malformed {what} ({len(data)} bytes): {e}") from None
    return msg


def decode_hello(data: bytes) -> zds_pb2.ZdsHello:
    """Parse a ``ZdsHello``; raises WireError on garbage."""
    return _parse(zds_pb2.ZdsHello, data, "ZdsHello")


def decode_request(data: bytes) -> zds_pb2.WorkloadRequest:
    """Parse a ``WorkloadRequest``; raises WireError on garbage or a missing payload."""
    req = _parse(zds_pb2.WorkloadRequest, data, "WorkloadRequest")
    if req.WhichOneof("payload") is None:
        raise WireError("WorkloadRequest has no payload")
    return req


def decode_ack(data: bytes) -> zds_pb2.Ack:
    """Parse a ``WorkloadResponse`` and return its Ack; WireError if garbage or not an ack."""
    if data == ACK_OK:
        return zds_pb2.Ack()
    resp = _parse(zds_pb2.WorkloadResponse, data, "WorkloadResponse")
    if not resp.HasField("ack"):
        raise WireError(f"WorkloadResponse without ack ({data[:32].hex()})")
    return resp.ack


# ------------------------------------------------------------------ non-blocking socket I/O

def recv_packet(sock: socket.socket, max_fds: int = 1) -> Packet | None:
    """Read one packet now. Returns None on EOF (a zero-length read with no fds).

    Raises BlockingIOError when nothing is queued, OSError on socket errors, and
    :class:`WireError` (after closing any fds received) on ``MSG_TRUNC`` ("truncated
    message"), ``MSG_CTRUNC`` ("truncated control message") or more than ``max_fds`` fds.
    Received fds are close-on-exec (``MSG_CMSG_CLOEXEC``, as ztunnel does).
    """
    data, ancdata, flags, _ = sock.recvmsg(MAX_MESSAGE, FD_CMSG_SPACE, MSG_CMSG_CLOEXEC)
    return check_received(data, ancdata, flags, max_fds)


def check_received(data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int,
                   max_fds: int = 1) -> Packet | None:
    """The framing checks of :func:`recv_packet` on what ``recvmsg`` returned (for
    callers that call ``recvmsg`` themselves on a hot path). Returns None on EOF;
    raises :class:`WireError` (fds closed) as :func:`recv_packet` does."""
    fds: list[int] = []
    for level, kind, cdata in ancdata:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
            fds.extend(arr)
    packet = Packet(data, fds)
    if flags & _MSG_TRUNC:
        packet.close_fds()
        raise WireError(f"truncated message (over {MAX_MESSAGE} bytes)")
    if flags & _MSG_CTRUNC:
        packet.close_fds()
        raise WireError("truncated control message (more than one fd)")
    if len(fds) > max_fds:
        packet.close_fds()
        raise WireError(f"{len(fds)} fds in one message (at most {max_fds} allowed)")
    if not data and not fds:
        return None
    return packet


def send_packet(sock: socket.socket, data: bytes, fd: int | None = None) -> None:
    """Send one packet now, with ``fd`` as SCM_RIGHTS when given.

    Raises BlockingIOError when the socket buffer is full, OSError (e.g. EPIPE) otherwise.
    """
    if fd is None:
        sock.sendmsg([data])
    else:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


async def wait_ready(sock: socket.socket, timeout: float | None, write: bool = False) -> bool:
    """Wait until ``sock`` is readable (or writable). Returns False on timeout."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = sock.fileno()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader,
                                                                        loop.remove_reader)
    def ready() -> None:
        if not fut.done():
            fut.set_result(True)

    add(fd, ready)
    try:
        if timeout is None:
            return await fut
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            return False
    finally:
        remove(fd)

