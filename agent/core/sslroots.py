"""aiohttp's two default TLS client contexts, with the system's CA roots read on first use.

When ``aiohttp.connector`` is imported it builds two module-level ``SSLContext`` objects
(``_SSL_CONTEXT_VERIFIED`` from ``ssl.create_default_context()``, ``_SSL_CONTEXT_UNVERIFIED``
with ``set_default_verify_paths()``), the ones a request gets when its caller passes no
context of its own. Each reads and parses the system CA bundle: ~36 ms apiece with
OpenSSL 3.0 on this project's 2-CPU box, ~72 ms of the path to the Kubernetes source's
first LIST (benchmarks/README.md, "Night of 2026-12-04"). The agent never uses either:
kubernetes_asyncio passes the context it builds from the kubeconfig's CA, and the agent's
other aiohttp clients speak plain HTTP to local ports or pass ``ssl=False``.

:func:`install` imports ``aiohttp.connector`` with ``SSLContext.set_default_verify_paths``
(what ``load_default_certs()`` does on Linux) patched for that one import: called by the
importing thread, it records the call on the context instead of making it; called by any
other thread, it does what it always does. After the import the patch is removed and
every context that recorded a call becomes a :class:`DeferredRootsContext` (a plain
``SSLContext`` subclass; ``__class__`` assignment), which makes the recorded call once,
under a lock, before it is first used or looked into (``wrap_bio``, which asyncio's TLS
transport calls, ``wrap_socket``, ``get_ca_certs``, ``cert_store_stats``). A request that
does use aiohttp's default context so verifies against the same roots as before.
(``ssl.SSLContext`` itself cannot be swapped for a subclass: its properties name the
module's ``SSLContext`` global.)

Nothing is done when ``aiohttp.connector`` is already imported or aiohttp is absent.
Idempotent; call it before anything imports aiohttp (:mod:`agent.daemon` does, beside
:func:`agent.core.kubelazy.install`).
"""

from __future__ import annotations

import importlib
import importlib.util
import ssl
import sys
import threading
from typing import Any

_LOCK = threading.RLock()  # re-entrant: install() holds it while a context may load
_DEFERRING_THREAD: int | None = None  # the thread inside install()'s import, if any
_DEFERRED: list[ssl.SSLContext] = []  # contexts that recorded a call during that import
_LOAD_ROOTS = ssl.SSLContext.set_default_verify_paths  # the C method, before any patch


def _recording_set_default_verify_paths(self: ssl.SSLContext) -> None:
    if threading.get_ident() == _DEFERRING_THREAD:
        self.roots_pending = True  # type: ignore[attr-defined]
        _DEFERRED.append(self)
        return
    _LOAD_ROOTS(self)


class DeferredRootsContext(ssl.SSLContext):
    """An ``SSLContext`` that holds back one ``set_default_verify_paths()`` until first
    use (see the module docstring). ``roots_pending`` says whether it still does."""

    roots_pending = False

    def _load_pending_roots(self) -> None:
        if self.roots_pending:
            with _LOCK:
                if self.roots_pending:
                    _LOAD_ROOTS(self)
                    self.roots_pending = False

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self._load_pending_roots()
        return super().wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        self._load_pending_roots()
        return super().wrap_socket(*args, **kwargs)

    def get_ca_certs(self, *args: Any, **kwargs: Any) -> Any:
        self._load_pending_roots()
        return super().get_ca_certs(*args, **kwargs)

    def cert_store_stats(self) -> dict[str, int]:
        self._load_pending_roots()
        return super().cert_store_stats()


def install() -> bool:
    """Import ``aiohttp.connector`` with its default contexts' roots deferred. Returns
    whether they are :class:`DeferredRootsContext` (False: aiohttp was imported already,
    or is not installed). Re-raises whatever the import raises (unpatched first)."""
    global _DEFERRING_THREAD
    if "aiohttp.connector" in sys.modules or importlib.util.find_spec("aiohttp") is None:
        return _contexts_deferred()
    with _LOCK:
        _DEFERRING_THREAD = threading.get_ident()
        ssl.SSLContext.set_default_verify_paths = (  # type: ignore[method-assign]
            _recording_set_default_verify_paths)
        try:
            importlib.import_module("aiohttp.connector")
        finally:
            del ssl.SSLContext.set_default_verify_paths  # the C method shows through again
            _DEFERRING_THREAD = None
            for context in _DEFERRED:
                context.__class__ = DeferredRootsContext
            _DEFERRED.clear()
    return _contexts_deferred()


def _contexts_deferred() -> bool:
    connector = sys.modules.get("aiohttp.connector")
    context = getattr(connector, "_SSL_CONTEXT_VERIFIED", None)
    return isinstance(context, DeferredRootsContext)
