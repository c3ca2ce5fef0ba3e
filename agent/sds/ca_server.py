"""The embedded CA served as ``istio.v1.auth.IstioCertificateService`` (setting ``ca_port``).

Lets ztunnel (or istio-agent) on a host without istiod get certificates from this
agent. Spec ``sds-ca-status.md`` §3.5-3.6; upstream ``security/pkg/server/ca/server.go``.

- TLS with a server certificate from the embedded CA, valid for
  ``istiod.istio-system.svc`` (the name istio-agent verifies when CA_ADDR is localhost),
  ``localhost``, ``127.0.0.1``, ``::1`` and the node name. With
  ``ca_client_cert_auth`` the port *requires* a client certificate signed by the
  embedded root: Python grpc can either not request a client certificate or require
  one (``require_client_auth`` maps to DONT_REQUEST / REQUEST_AND_REQUIRE in grpc
  core), so "optional mTLS" as istiod does it is not possible; tokens work either way.
- Authentication, first match wins: (1) a verified client certificate → its
  ``spiffe://`` URI SANs; (2) ``authorization: Bearer <token>`` looked up in
  ``ca_tokens_file`` (YAML ``{token: "namespace/serviceaccount"}``; there is no
  Kubernetes API server to run a TokenReview against, so the operator lists tokens).
  Nothing → UNAUTHENTICATED "request authenticate failure".
- ``ImpersonatedIdentity`` (ztunnel's node-proxy mode, §3.5 step 3): the caller's
  ``ns/sa`` must be in ``ca_trusted_node_accounts``, the target must be a SPIFFE ID of
  our trust domain, and — when a config source is available — a pod with that
  namespace/service account must run on this node. Otherwise UNAUTHENTICATED "request
  impersonation authentication failure" (the reason is only logged).
- The CSR's SANs and subject are ignored; errors map per §3.5 step 8.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Awaitable, Callable

import grpc
import yaml
from cryptography import x509
from grpc_reflection.v1alpha import reflection

from agent.config import ensure_tcp_port_free
from agent.sds import ca_pb2, ca_pb2_grpc, keys
from agent.sds.attest import identity_of_pod
from agent.sds.ca_embedded import CAError, EmbeddedCA

log = logging.getLogger("agent.sds.ca")


class TokenFile:
    """Bearer tokens → identity, from a YAML/JSON mapping file re-read when it changes."""

    def __init__(self, path: str, trust_domain: str):
        self.path = path
        self.trust_domain = trust_domain
        self._mtime: float | None = None
        self._tokens: dict[str, keys.Identity] = {}

    def lookup(self, token: str) -> keys.Identity | None:
        """Blocking (stat + maybe read). Unknown token or unusable file → None."""
        if not self.path or not token:
            return None
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime != self._mtime:
                self._tokens = self._load()
                self._mtime = mtime
        except (OSError, ValueError) as e:
            log.warning("ca_tokens_file=%s unusable: %s", self.path, e)
            return None
        return self._tokens.get(token)

    def _load(self) -> dict[str, keys.Identity]:
        with open(self.path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError("top level must be a mapping of token: namespace/serviceaccount")
        out = {}
        for token, who in data.items():
            who = str(who)
            if who.startswith("spiffe://"):
                out[str(token)] = keys.Identity.parse(who)
            elif who.count("/") == 1 and all(who.split("/")):
                ns, sa = who.split("/")
                out[str(token)] = keys.Identity(self.trust_domain, ns, sa)
            else:
                raise ValueError(f"identity {who!r} is neither namespace/serviceaccount nor a "
                                 "SPIFFE ID")
        return out


class CertificateService(ca_pb2_grpc.IstioCertificateServiceServicer):
    """CreateCertificate on top of an :class:`EmbeddedCA`."""

    def __init__(self, ca: EmbeddedCA, run_blocking: Callable[..., Awaitable],
                 trust_domain: str, tokens: TokenFile, trusted_node_accounts: list[str],
                 store_getter: Callable[[], object | None] = lambda: None, node_name: str = ""):
        self.ca = ca
        self._run = run_blocking
        self.trust_domain = trust_domain
        self.tokens = tokens
        self.trusted = set(trusted_node_accounts)
        self.store = store_getter
        self.node_name = node_name
        self.issued = 0

    async def _authenticate(self, context) -> list[keys.Identity]:
        pem = (context.auth_context() or {}).get("x509_pem_cert")
        if pem:
            try:
                cert = x509.load_pem_x509_certificate(pem[0])
                ids = [keys.Identity.parse(u) for u in keys.uri_sans(cert)
                       if u.startswith("spiffe://")]
                if ids:
                    return ids
            except ValueError as e:
                log.info("CA: client certificate unusable: %s", e)
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        if auth[:7].lower() == "bearer ":
            who = await self._run(self.tokens.lookup, auth[7:].strip())
            if who:
                return [who]
        return []

    def _impersonation_ok(self, caller: keys.Identity, target: str) -> str:
        """"" when ``caller`` may act for ``target``, else the reason (logged only)."""
        if f"{caller.namespace}/{caller.service_account}" not in self.trusted:
            return f"{caller} is not in ca_trusted_node_accounts"
        try:
            wanted = keys.Identity.parse(target)
        except ValueError as e:
            return str(e)
        if wanted.trust_domain != self.trust_domain:
            return f"{target} is not in trust domain {self.trust_domain}"
        store = self.store()
        if store is None:
            return ""
        for pod in store.list("Pod", wanted.namespace):
            node = (pod.get("spec") or {}).get("nodeName")
            phase = (pod.get("status") or {}).get("phase", "")
            # The pod's identity is derived as attestation derives it (one rule).
            if identity_of_pod(pod, self.trust_domain) == wanted and phase != "Failed" and (
                    not self.node_name or node in ("", None, self.node_name)):
                return ""
        return f"no pod with identity {target} on node {self.node_name}"

    async def CreateCertificate(self, request, context):  # noqa: N802 - gRPC name
        ids = await self._authenticate(context)
        if not ids:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "request authenticate failure")
        meta = dict(request.metadata.fields.items()) if request.HasField("metadata") else {}
        target = meta["ImpersonatedIdentity"].string_value if "ImpersonatedIdentity" in meta else ""
        signer = meta["CertSigner"].string_value if "CertSigner" in meta else ""
        if signer:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"CertSigner {signer!r}: external signers are not supported by "
                                "the embedded CA")
        sans = [i.spiffe_id for i in ids]
        if target:
            why = self._impersonation_ok(ids[0], target)
            if why:
                log.warning("CA: impersonation of %s by %s refused: %s", target, ids[0], why)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "request impersonation authentication failure")
            sans = [target]
        try:
            chain = await self._run(self.ca.sign, request.csr, sans, int(request.validity_duration))
        except CAError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        self.issued += 1
        log.info("CA: issued certificate for %s", ",".join(sans))
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)


def server_sans(node_name: str) -> list[str]:
    """Names the CA endpoint's certificate is valid for."""
    names = ["istiod.istio-system.svc", "localhost", "127.0.0.1", "::1", socket.gethostname()]
    if node_name:
        names.append(node_name)
    return list(dict.fromkeys(names))


async def start_ca_server(service: CertificateService, address: str, port: int,
                          cert_chain: bytes, key: bytes,
                          require_client_cert: bool = False) -> tuple[grpc.aio.Server, int]:
    """Serve ``service`` over TLS on ``address:port`` (0 = pick). Returns ``(server, port)``.

    ``require_client_cert``: clients must present a certificate from the embedded root.
    """
    server = grpc.aio.server()
    ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(service, server)
    reflection.enable_server_reflection(
        (ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"].full_name,
         reflection.SERVICE_NAME), server)
    creds = grpc.ssl_server_credentials([(key, cert_chain)], root_certificates=service.ca.root_pem,
                                        require_client_auth=require_client_cert)
    host = f"[{address}]" if ":" in address else address
    ensure_tcp_port_free("ca_port", address, port)
    bound = server.add_secure_port(f"{host}:{port}", creds)
    await server.start()
    return server, bound
