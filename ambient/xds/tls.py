"""Where the xDS TLS port's server certificate comes from: a :data:`TlsProvider` (an async
callable returning :class:`~agent.tlsport.servercert.TlsMaterial`, called again at each
renewal), by default backed by the ``sds`` component ``agent.daemon.build`` hands to the
xDS builder (:class:`WorkloadCertificates` is what it uses of it)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol

from agent.tlsport.servercert import TlsMaterial

TlsProvider = Callable[[], Awaitable[TlsMaterial]]


class WorkloadCertificates(Protocol):
    """What the xDS TLS port uses of SDS (``agent.sds.server.SdsServer`` has it; ambient
    never imports agent.sds): its server certificate and the mesh root."""

    def root_pem(self) -> bytes:
        """The mesh root bundle (PEM); b"" before the first certificate."""

    async def certificate_for(self, sans: list[str], algorithm: str = "ECDSA",
                              ttl: float | None = None) -> Any:
        """A fresh bundle with ``chain``, ``key`` and ``root`` PEM for ``sans``."""

    def tls_server_sans(self) -> list[str]:
        """SANs of the agent's TLS listeners."""

    async def server_material(self) -> TlsMaterial:
        """The TLS listeners' server certificate (SANs :meth:`tls_server_sans`), key and the
        root client certificates must chain to."""


def sds_tls_provider(sds: WorkloadCertificates) -> TlsProvider:
    """A provider of the TLS port's certificate, issued by ``sds``.

    The server certificate carries the SPIFFE ID
    ``spiffe://<trust_domain>/ns/<system_namespace>/sa/ambient-agent`` and the names of
    :func:`agent.tlsport.servercert.server_names`: the DNS names and IPs ztunnel verifies by
    default on a plain host (``localhost``, ``127.0.0.1``, ``::1``) and in a cluster
    (``istiod.<ns>.svc``, ...), the node name and ``tls_server_names``. With a remote CA
    the certificate is a node-local one (a remote Istio CA signs SPIFFE identities only;
    ``agent.sds.server.SdsServer.server_material``).
    """

    async def provide() -> TlsMaterial:
        return await sds.server_material()

    return provide

