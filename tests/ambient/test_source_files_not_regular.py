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


async def test_symlink_loop_and_removed_file_are_named_for_what_they_are(tmp_path, caplog):
    """A symlink loop was called "a dangling symlink", and a removed file was logged as
    "removed: 0 objects" whatever it had held (newuser findings)."""
    directory = tmp_path / "cluster"
    directory.mkdir()
    (directory / "svc.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: demo}\nspec: {}\n"
        "---\n"
        "apiVersion: v1\nkind: Service\nmetadata: {name: b, namespace: demo}\nspec: {}\n")
    src = DirectorySource(ObjectStore(), str(directory), run_blocking, debounce_ms=10)
    await src.start()
    try:
        caplog.set_level(logging.INFO, logger="ambient")
        (directory / "loop1.yaml").symlink_to("loop2.yaml")
        (directory / "loop2.yaml").symlink_to("loop1.yaml")
        (directory / "gone.yaml").symlink_to("nowhere.yaml")
        await eventually(lambda: "loop1.yaml refused" in caplog.text
                         and "gone.yaml refused" in caplog.text)
        assert "loop1.yaml refused: not a regular file (a symlink loop)" in caplog.text
        assert "gone.yaml refused: not a regular file (a dangling symlink)" in caplog.text
        (directory / "svc.yaml").unlink()
        await eventually(lambda: "svc.yaml removed" in caplog.text)
        assert "svc.yaml removed: its 2 objects deleted" in caplog.text
    finally:
        await src.stop()
