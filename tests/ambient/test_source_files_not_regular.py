"""A config file name that is a symlink to a FIFO or a device is refused and logged as
refused (a newuser finding: it was logged "removed" when it had just been added)."""

from __future__ import annotations

import logging
import os

from ambient.source_files import DirectorySource
from ambient.store import ObjectStore
from tests.helpers import eventually


async def run_blocking(fn, *args):
    return fn(*args)


async def test_symlink_to_fifo_or_device_is_refused_not_removed(tmp_path, caplog):
    directory = tmp_path / "cluster"
    directory.mkdir()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    src = DirectorySource(ObjectStore(), str(directory), run_blocking, debounce_ms=10)
    await src.start()
    try:
        caplog.set_level(logging.INFO, logger="ambient")
        (directory / "pipe.yaml").symlink_to(fifo)
        (directory / "zero.yaml").symlink_to("/dev/zero")
        await eventually(lambda: "zero.yaml refused" in caplog.text
                         and "pipe.yaml refused" in caplog.text)
        assert f"config file {directory}/pipe.yaml refused: not a regular file (a FIFO)" \
            in caplog.text
        assert "(a character device)" in caplog.text
        assert "pipe.yaml removed" not in caplog.text and "zero.yaml removed" not in caplog.text
    finally:
        await src.stop()
