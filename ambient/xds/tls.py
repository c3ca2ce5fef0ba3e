"""Where the xDS TLS port's server certificate comes from: a :data:`TlsProvider` (an async
callable returning :class:`~agent.tlsport.servercert.TlsMaterial`, called again at each
renewal), by default backed by the ``sds`` component found in the agent context."""

from __future__ import annotations

from typing import Awaitable, Callable

from agent.core.lifecycle import AgentContext
from agent.tlsport.servercert import TlsMaterial

TlsProvider = Callable[[], Awaitable[TlsMaterial]]


def sds_tls_provider(ctx: AgentContext) -> TlsProvider | None:
    """A provider backed by the ``sds`` component (``certificate_for(sans)`` returning a
    bundle with ``chain``/``key``/``root`` PEM, and ``root_pem()``), or None when that
    component or API is missing.

    The server certificate carries the SPIFFE ID
    ``spiffe://<trust_domain>/ns/<system_namespace>/sa/ambient-agent`` and the names of
    :func:`agent.tlsport.servercert.server_names`: the DNS names and IPs ztunnel verifies by
    default on a plain host (``localhost``, ``127.0.0.1``, ``::1``) and in a cluster
    (``istiod.<ns>.svc``, ...), the node name and ``tls_server_names``.
    """
    sds = ctx.get("sds")
    get_cert = getattr(sds, "certificate_for", None)
    root = getattr(sds, "root_pem", None)
    sans_of = getattr(sds, "tls_server_sans", None)
    if get_cert is None or root is None or sans_of is None:
        return None

    async def provide() -> TlsMaterial:
        bundle = await get_cert(sans_of(), "ECDSA")
        root_pem = root() if callable(root) else root
        return TlsMaterial(_b(bundle.chain), _b(bundle.key), _b(root_pem or bundle.root))

    return provide


def _b(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
