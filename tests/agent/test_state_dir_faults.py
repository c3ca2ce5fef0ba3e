"""A full state dir at start and an immutable one at shutdown (statedir lane findings 2
and 3): one clear line, no traceback, nothing left behind, shutdown goes on."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from agent.core.config import ConfigError
from agent.daemon import StateDirLock


def _fill(path: Path) -> None:
    """Writes ``path/fill`` until the filesystem says ENOSPC."""
    with open(path / "fill", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    # the last partial block may still be buffered: fill what is left byte-wise
    with open(path / "fill2", "wb", buffering=0) as f, __import__("contextlib").suppress(OSError):
        while True:
            f.write(b"\0")


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0711", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)


def test_full_state_dir_names_errno_and_leaves_no_lock(small_tmpfs):
    _fill(small_tmpfs)
    lock = StateDirLock(small_tmpfs)
    with pytest.raises(ConfigError) as e:
        lock.acquire()
    msg = str(e.value)
    assert str(small_tmpfs) in msg and "ENOSPC" in msg, msg
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert not (small_tmpfs / "agent.lock").exists()
    assert lock.fd is None


def test_release_on_an_immutable_dir_warns_once_and_closes(tmp_path, caplog):
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr")
    state = tmp_path / f"state-{uuid.uuid4().hex[:8]}"
    state.mkdir(mode=0o711)
    lock = StateDirLock(state)
    lock.acquire()
    fd = lock.fd
    assert fd is not None
    r = subprocess.run(["chattr", "+i", str(state)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        lock.release()
        pytest.skip(f"chattr +i not supported here: {r.stderr.strip()}")
    try:
        with caplog.at_level(logging.WARNING, logger="agent.daemon"):
            lock.release()  # must not raise
        warns = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert len(warns) == 1 and str(lock.path) in warns[0].getMessage()
        assert "EPERM" in warns[0].getMessage()
        assert lock.fd is None
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
    finally:
        subprocess.run(["chattr", "-i", str(state)], capture_output=True, timeout=60)
