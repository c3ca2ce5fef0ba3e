"""Shared helpers: atomic file writes (agent.core.files) and publishing a gRPC server's
Unix socket race-free (agent.core.unixsocket.publish; bind_unix is tested in test_unixsocket.py)."""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from agent.core import unixsocket
from agent.core.files import write_atomic


@pytest.fixture
def open_umask():
    """umask 0: a helper that relied on the umask would leave files world-accessible."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_write_atomic_mode_content_and_no_leftovers(tmp_path, open_umask):
    target = tmp_path / "f.json"
    write_atomic(target, "first\n", 0o600)
    write_atomic(str(target), b"second\n", 0o640)
    assert target.read_bytes() == b"second\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_write_atomic_failure_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f"
    write_atomic(target, "old", 0o600)

    def broken_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", broken_rename)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, "new", 0o600)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_write_atomic_missing_directory_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no" / "f", "x")


def _watch_renames(monkeypatch) -> list[tuple[str, int]]:
    """Record (final path, mode of the file being renamed) at every rename."""
    seen: list[tuple[str, int]] = []
    real = os.rename

    def rename(src, dst):
        seen.append((os.fspath(dst), stat.S_IMODE(os.lstat(src).st_mode)))
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    return seen


async def test_publish_a_grpc_server_socket(tmp_path, monkeypatch, open_umask):
    """gRPC binds by path itself: published under its final name only after the chmod, and
    it keeps serving on the renamed file."""
    path = str(tmp_path / "g.sock")
    seen = _watch_renames(monkeypatch)
    server = grpc.aio.server()
    unixsocket.publish(path, lambda tmp: server.add_insecure_port("unix:" + tmp), 0o600)
    await server.start()
    try:
        assert seen == [(path, 0o600)]
        async with grpc.aio.insecure_channel("unix:" + path) as channel:
            await channel.channel_ready()
    finally:
        await server.stop(0)


def test_process_age_counts_from_the_process_start():
    """A fresh interpreter that sleeps 0.5 s before asking reports at least that much
    (its start is the kernel's, not the module's import), and not minutes."""
    import subprocess
    import sys
    code = ("import time; time.sleep(0.5); import sys; sys.path.insert(0, %r); "
            "from agent.core.uptime import process_age; print(process_age())"
            % os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True, timeout=60).stdout)
    assert 0.5 <= age < 60
