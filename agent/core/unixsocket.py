"""Unix listening sockets that are never reachable with wider permissions than asked.

``bind()`` creates the socket file with the process umask applied to 0777, so binding at
the final path and then ``chmod``-ing leaves a window in which a looser file is
connectable (with umask 0, by every local user); changing the umask instead is
process-wide and races every thread creating files at that moment. Here the socket is
bound under a temporary name next to the final one, ``chmod``-ed, then renamed into
place (``rename`` is atomic): a client can only ever find the file with its final mode.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import threading

# Every socket file this process published: path -> (st_ino, st_dev) of the file it put
# there. :func:`remove_published` unlinks the ones still there on an exit that skips the
# components' own stop (a second SIGTERM); a file replaced since (another agent's) is kept.
_published: dict[str, tuple[int, int]] = {}
_published_lock = threading.Lock()


def note_published(path: str) -> None:
    """Remember the socket file at ``path`` (bound by someone else, e.g. gRPC's own
    bind) for :func:`remove_published`."""
    try:
        st = os.stat(path)
    except OSError:
        return
    with _published_lock:
        _published[os.path.abspath(path)] = (st.st_ino, st.st_dev)


def remove_published() -> list[str]:
    """Unlink every socket file this process published that is still the one it put
    there (same inode and device); returns the paths removed. Never raises. Safe to call
    after the components removed their own (those are simply gone)."""
    with _published_lock:
        items = list(_published.items())
        _published.clear()
    removed = []
    for path, ident in items:
        try:
            st = os.lstat(path)
            if (st.st_ino, st.st_dev) == ident:
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
    return removed


def bind_unix(path: str, mode: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A non-blocking, close-on-exec ``AF_UNIX`` socket of type ``kind`` bound at ``path``
    with permission bits ``mode`` (not listening yet; the caller or asyncio calls
    ``listen``). A stale file at ``path`` is replaced. Raises OSError (the temporary
    name is removed)."""
    # A short temporary name (the final path may be close to the 108-byte limit).
    directory = os.path.dirname(path) or "."
    sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    tmp = ""
    try:
        for attempt in range(8):
            tmp = os.path.join(directory, f".s{secrets.token_hex(3)}")
            try:
                sock.bind(tmp)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE or attempt == 7:
                    tmp = ""
                    raise
        os.chmod(tmp, mode)
        os.rename(tmp, path)
        note_published(path)
        return sock
    except BaseException:
        sock.close()
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise


def publish(path: str, bind, mode: int) -> None:
    """The same for a server that binds by path itself (gRPC's
    ``add_insecure_port("unix:" + tmp)``): ``bind(tmp)`` creates the socket file under a
    temporary name next to ``path``, then it is ``chmod``-ed and renamed into place (the
    server keeps listening on the renamed file). A stale file at ``path`` is replaced.
    Raises OSError or what ``bind`` raises (the temporary name is removed)."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".s{secrets.token_hex(3)}")
    try:
        bind(tmp)
        os.chmod(tmp, mode)
        os.rename(tmp, path)
        note_published(path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def answers(path: str, kind: int = socket.SOCK_STREAM, timeout: float = 1.0) -> bool:
    """Whether a process accepts connections of socket type ``kind`` (``SOCK_STREAM``,
    or ``SOCK_SEQPACKET`` for ZDS) on the Unix socket ``path``; False when it is missing,
    refuses, is of another type, or does not answer within ``timeout`` seconds."""
    if not path or not os.path.exists(path):
        return False
    s = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
