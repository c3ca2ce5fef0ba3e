"""Files replaced in one step: readers see the old content or the new, never a part.

One implementation for every file the agent writes that another process (or the agent
after a restart) reads: CNI conflists and the plugin binary, pod records, the ZDS
snapshot, the iptables flavor record, CA keys and the published mesh root.
"""

from __future__ import annotations

import os
import secrets


def write_atomic(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o600, *,
                 fsync: bool = True) -> None:
    """Write ``data`` (``str`` is UTF-8 encoded) to ``path`` through a temporary file in
    the same directory, then rename it over ``path``.

    The temporary file is created with ``O_EXCL`` and ``mode`` (then ``fchmod``, so the
    umask cannot widen or narrow it) before any byte is written: a private file is never
    readable by others, not even half-written. ``fsync`` (default) makes the content
    durable before the rename. The directory must exist. Raises OSError; the temporary
    file is removed on any failure, ``path`` is untouched then.
    """
    target = os.fspath(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = f"{target}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(payload)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.rename(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
