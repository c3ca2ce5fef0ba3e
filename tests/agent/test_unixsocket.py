"""``agent.core.unixsocket.bind_unix``: the socket file appears at its path only with the
requested mode, whatever the umask; a stale file is replaced; a failed bind leaves no
temporary file behind."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from agent.core.unixsocket import bind_unix


@pytest.fixture
def open_umask():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o600, 0o660, 0o666])
def test_mode_is_the_requested_one_under_umask_0(tmp_path, open_umask, mode):
    path = str(tmp_path / "a.sock")
    sock = bind_unix(path, mode)
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == mode
        assert os.listdir(tmp_path) == ["a.sock"]  # the temporary name is gone
        sock.listen(1)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)
        client.close()
    finally:
        sock.close()


def test_stale_file_is_replaced_and_seqpacket_works(tmp_path):
    path = str(tmp_path / "z.sock")
    with open(path, "w") as f:
        f.write("stale")
    sock = bind_unix(path, 0o600, socket.SOCK_SEQPACKET)
    try:
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert sock.type == socket.SOCK_SEQPACKET
    finally:
        sock.close()


def test_failure_leaves_nothing(tmp_path):
    target = tmp_path / "dir-as-target"
    target.mkdir()
    (target / "x").write_text("")  # a non-empty directory can't be renamed over
    with pytest.raises(OSError):
        bind_unix(str(target), 0o600)
    assert sorted(os.listdir(tmp_path)) == ["dir-as-target"]
