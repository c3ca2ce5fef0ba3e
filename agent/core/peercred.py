"""Who is on the other end of a Unix socket: the kernel's ``SO_PEERCRED``.

Used by SDS attestation (the caller's PID leads to its pod) and by the ZDS server (the
connected ztunnel's PID, for the debug view). Linux only.
"""

from __future__ import annotations

import socket
import struct

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer of a connected AF_UNIX socket. Raises OSError."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
