"""agent/core/sdnotify.py: the sd_notify(3) datagram, path and abstract sockets, and the
cases where nothing may be sent or sending fails (never raises)."""

from __future__ import annotations

import secrets
import socket

from agent.core import sdnotify


def _receiver(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(2)
    return s


def test_path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as s:
        assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": path})
        assert s.recv(100) == b"READY=1"


def test_abstract_socket():
    name = "ambient-test-" + secrets.token_hex(4)
    with _receiver("\0" + name) as s:
        assert sdnotify.notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(100) == b"STOPPING=1"


def test_unset_sends_nothing():
    assert sdnotify.notify("READY=1", {}) is False


def test_bad_or_missing_socket_is_logged_not_raised(tmp_path, caplog):
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "relative.sock"}) is False
    assert "neither an absolute path" in caplog.text
    missing = str(tmp_path / "gone.sock")
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": missing}) is False
    assert missing in caplog.text
