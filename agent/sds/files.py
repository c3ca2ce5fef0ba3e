"""File-mounted certificates: the ``file-cert:``/``file-root:`` resource names and the
workload certificate directory, read from disk and watched for changes.

Upstream: ``istio/istio:security/pkg/nodeagent/cache/secretcache.go`` (file-mounted
names, resolution and watching; ``docs/sds.md``). Names: ``file-cert:<certPath>~<keyPath>``
(exactly two parts),
``file-root:<caPath>`` (one part), ``file-root:system`` (the OS bundle). Anything else
is "not a file name".

Watching follows the spec's Python suggestion: watch the parent *directories*
(``watchfiles``, inotify underneath) and filter by file name, which survives atomic
rename-over writes and kubelet's ``..data`` symlink swap. One callback per change of a
cert or root file; none for a key-only change (a key cannot legitimately change without
its cert); none at initial load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Callable

import watchfiles
from cryptography.hazmat.primitives.serialization import Encoding

from agent.core import trusted
from agent.core.backoff import Backoff
from agent.sds import keys

log = logging.getLogger(__name__)

SYSTEM_BUNDLES = ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                  "/etc/ssl/ca-bundle.pem", "/etc/pki/tls/cacert.pem",
                  "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", "/etc/ssl/cert.pem",
                  "/usr/local/etc/ssl/cert.pem", "/etc/ssl/certs/ca-certificates"]


class FileSecretError(Exception):
    """A file-backed secret can't be read; the message names the path (never the key bytes)."""


@dataclasses.dataclass(frozen=True)
class FileResource:
    """A parsed file resource name: ``kind`` is ``"cert"`` (``cert``+``key``) or ``"root"``."""

    name: str
    kind: str
    cert: str = ""
    key: str = ""


def system_bundle() -> str:
    """The first existing OS CA bundle path, or ""."""
    return next((p for p in SYSTEM_BUNDLES if os.path.isfile(p)), "")


def parse(name: str) -> FileResource | None:
    """Parse a resource name; None when it is not a (usable) file name (upstream rule)."""
    if name.startswith("file-cert:"):
        parts = name[len("file-cert:"):].split("~")
        if len(parts) == 2 and all(parts):
            return FileResource(name, "cert", parts[0], parts[1])
        return None
    if name.startswith("file-root:"):
        parts = name[len("file-root:"):].split("~")
        if len(parts) != 1 or not parts[0]:
            return None
        path = parts[0]
        if path == "system":
            path = system_bundle()
            if not path:
                return None  # upstream: falls through to the CSR path
        return FileResource(name, "root", path)
    return None


def _read(path: str) -> bytes:
    """The bytes of a certificate, key or root file the agent serves. Refused
    (:class:`FileSecretError` naming path, owner and mode) when the file, as opened (a
    symlink's target), is owned by neither the agent's euid nor root or is writable by
    group or others (:func:`agent.core.trusted.public_file_problem`): its writer could
    make the agent hand out a key pair or roots of their choosing. Readable by others is
    allowed, as Kubernetes mounts Secrets 0644 by default."""
    try:
        with open(path, "rb") as f:
            problem = trusted.public_file_problem(os.fstat(f.fileno()))
            if problem:
                raise FileSecretError(f"{path} {problem}: refused, not served")
            return f.read()
    except OSError as e:
        raise FileSecretError(f"{path}: {e.strerror or e}") from None


def read_root(path: str) -> bytes:
    """Valid certificates of a root bundle file, joined (bad ones such as negative
    serials skipped). Raises :class:`FileSecretError` for a missing/empty/garbage file."""
    data = _read(path)
    try:
        certs = keys.load_certs(data, f"root bundle {path}")
    except ValueError as e:
        raise FileSecretError(str(e)) from None
    return b"".join(c.public_bytes(Encoding.PEM) for c in certs)


def read_pair(cert_path: str, key_path: str, timeout: float = 2.0,
              first_delay: float = 0.1) -> tuple[bytes, bytes]:
    """Read a cert chain and its key, retrying while they don't match (the key is
    often written before the cert). Blocking. Returns ``(chain, key)``; raises
    :class:`FileSecretError` naming the paths."""
    deadline = time.monotonic() + timeout
    retry = Backoff(first_delay, max(first_delay, timeout))  # doubling
    while True:
        chain, key = _read(cert_path), _read(key_path)
        if not chain.strip():
            raise FileSecretError(f"{cert_path}: empty certificate file")
        if keys.key_matches_cert(key, chain):
            return chain, key
        delay = retry.next()
        if time.monotonic() + delay > deadline:
            raise FileSecretError(f"{key_path} does not hold the private key of {cert_path}")
        time.sleep(delay)


class FileWatcher:
    """Watch files by resource name; call ``on_change(resource_name)`` when one changes.

    :meth:`watch` is idempotent; a directory's watch task starts on first use. Call
    :meth:`close` to stop every task.
    """

    def __init__(self, on_change: Callable[[str], None], debounce_ms: int = 50):
        self.on_change = on_change
        self.debounce_ms = debounce_ms
        self.entries: dict[str, set[str]] = {}  # absolute file path -> resource names
        self._dirs: dict[str, asyncio.Task] = {}
        self._stop = asyncio.Event()

    def watch(self, path: str, resource_name: str) -> None:
        path = os.path.abspath(path)
        self.entries.setdefault(path, set()).add(resource_name)
        directory = os.path.dirname(path)
        if directory not in self._dirs and os.path.isdir(directory):
            self._dirs[directory] = asyncio.get_running_loop().create_task(
                self._run(directory), name=f"watch {directory}")

    async def wait_ready(self) -> None:
        """Give the watch tasks a moment to install their inotify watches (tests)."""
        await asyncio.sleep(0.2)

    async def _run(self, directory: str) -> None:
        try:
            async for changes in watchfiles.awatch(directory, stop_event=self._stop,
                                                   debounce=self.debounce_ms, step=20,
                                                   recursive=False, ignore_permission_denied=True):
                touched: set[str] = set()
                for _change, changed in changes:
                    base = os.path.basename(changed)
                    for path, names in self.entries.items():
                        # a ..data swap (kubelet secret volume) replaces every file in the dir
                        if changed == path or (base == "..data" and
                                               os.path.dirname(path) == directory):
                            touched |= names
                for name in sorted(touched):
                    log.info("file secret %s changed", name)
                    self.on_change(name)
        except Exception as e:  # noqa: BLE001 - a watch failure must not kill the agent
            log.warning("watching %s stopped: %s", directory, e)
        finally:
            self._dirs.pop(directory, None)

    async def close(self) -> None:
        self._stop.set()
        tasks = list(self._dirs.values())
        await asyncio.gather(*tasks, return_exceptions=True)
