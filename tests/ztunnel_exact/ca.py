"""ztunnel's CA client, reproduced from ztunnel's source for tests.

Written from istio/ztunnel ``src/identity/caclient.rs`` (``CaClient::fetch_certificate``),
``src/tls/csr.rs`` (rcgen flavour, ``tls-ring``/``tls-aws-lc``) and
``src/identity/manager.rs`` (how it is constructed), not from ``agent/sds/ca_istio.py``:

- **Transport**: the same control-plane TLS as xDS (:mod:`tests.ztunnel_exact.tls`) to
  ``CA_ADDRESS`` (default: the xDS address), verified against ``CA_ROOT_CA`` (alt name
  ``ALT_CA_HOSTNAME``); one channel reused for every call.
- **CSR**: a new ECDSA P-256 key per call, PKCS#8 PEM; CSR signed with SHA-256, an empty
  subject (rcgen's default CN removed) and one URI SAN: the SPIFFE ID wanted (critical,
  as rcgen marks the SAN when the subject is empty).
- **Request**: ``IstioCertificateRequest{csr, validity_duration: SECRET_TTL seconds
  (24 h), metadata: {"ImpersonatedIdentity": <SPIFFE ID>}}`` — the metadata only when
  ``enable_impersonated_identity`` (``PROXY_MODE=shared``, the node proxy: always for a
  ztunnel serving many pods); headers ``authorization: Bearer``, ``clusterid``, plus
  ``CA_HEADER_*``.
- **Response**: leaf = ``cert_chain[0]``, the rest is the chain (ztunnel warns when it is
  empty); with impersonation the leaf's identity must equal the one requested, else a
  ``SanError``. The last element is the certificate's own trust store: every root it
  holds (``src/tls/certificate.rs`` ``WorkloadCertificate::new`` splits it), the roots
  ztunnel verifies peers against for connections made with this certificate, until its
  next one (:attr:`WorkloadCertificate.roots`).
"""

from __future__ import annotations

import dataclasses

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf import struct_pb2

from agent.sds import ca_pb2, ca_pb2_grpc
from tests.ztunnel_exact.tls import ControlPlaneTunnel, auth_headers

DEFAULT_SECRET_TTL = 24 * 3600


class SanError(Exception):
    """The CA returned a certificate for another identity than requested."""


@dataclasses.dataclass
class WorkloadCertificate:
    key_pem: bytes
    leaf: x509.Certificate
    chain: list[x509.Certificate]  # each later element's first certificate
    roots: list[x509.Certificate] = dataclasses.field(default_factory=list)

    def roots_pem(self) -> bytes:
        """The trust store as PEM (what a ztunnel holding this certificate trusts)."""
        return b"".join(r.public_bytes(serialization.Encoding.PEM) for r in self.roots)

    @property
    def identity(self) -> str | None:
        try:
            ext = self.leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        except x509.ExtensionNotFound:
            return None
        uris = ext.value.get_values_for_type(x509.UniformResourceIdentifier)
        return next((u for u in uris if u.startswith("spiffe://")), None)


def csr_for(spiffe_id: str) -> tuple[bytes, bytes]:
    """``CsrOptions{san}.generate()``: ``(csr_pem, pkcs8_key_pem)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([]))
           .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_id)]),
                          critical=True)
           .sign(key, hashes.SHA256()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return csr.public_bytes(serialization.Encoding.PEM), pem


class ZtunnelCaClient:
    """``CaClient``: ``address`` as ``CA_ADDRESS``; ``root_pem`` ``CA_ROOT_CA`` content;
    ``token``/``cluster_id`` the AuthSource; ``now`` the TLS verifier's clock."""

    def __init__(self, address: str, root_pem: bytes, *, token: str | None = None,
                 cluster_id: str = "Kubernetes", alt_hostname: str | None = None,
                 enable_impersonated_identity: bool = True,
                 secret_ttl: int = DEFAULT_SECRET_TTL, ca_headers: dict[str, str] | None = None,
                 now=None):
        self.tunnel = ControlPlaneTunnel(address, root_pem, alt_hostname=alt_hostname,
                                         **({"now": now} if now else {}))
        self.token, self.cluster_id = token, cluster_id
        self.enable_impersonated_identity = enable_impersonated_identity
        self.secret_ttl = secret_ttl
        self.ca_headers = dict(ca_headers or {})
        self._channel: grpc.aio.Channel | None = None

    async def start(self) -> "ZtunnelCaClient":
        await self.tunnel.start()
        from tests.ztunnel_exact.xds import grpc_channel_options

        self._channel = grpc.aio.insecure_channel(self.tunnel.target,
                                                  options=grpc_channel_options())
        return self

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        await self.tunnel.close()

    async def fetch_certificate(self, spiffe_id: str, timeout: float = 10.0) -> WorkloadCertificate:
        """One CreateCertificate as ztunnel sends it. Raises grpc.RpcError / SanError."""
        csr, key = csr_for(spiffe_id)
        req = ca_pb2.IstioCertificateRequest(csr=csr.decode(), validity_duration=self.secret_ttl)
        if self.enable_impersonated_identity:
            meta = struct_pb2.Struct()
            meta.fields["ImpersonatedIdentity"].string_value = spiffe_id
            req.metadata.CopyFrom(meta)
        metadata = auth_headers(self.token, self.cluster_id) + list(self.ca_headers.items())
        stub = ca_pb2_grpc.IstioCertificateServiceStub(self._channel)
        resp = await stub.CreateCertificate(req, metadata=metadata, timeout=timeout)
        if not resp.cert_chain:
            raise ValueError(f"EmptyResponse({spiffe_id})")
        leaf = x509.load_pem_x509_certificate(resp.cert_chain[0].encode())
        chain = [x509.load_pem_x509_certificate(c.encode()) for c in resp.cert_chain[1:]]
        roots = (x509.load_pem_x509_certificates(resp.cert_chain[-1].encode())
                 if len(resp.cert_chain) > 1 else [])
        cert = WorkloadCertificate(key, leaf, chain, roots)
        if self.enable_impersonated_identity and cert.identity != spiffe_id:
            raise SanError(f"expected identity {spiffe_id}, got {cert.identity}")
        return cert
