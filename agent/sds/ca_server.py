"""The embedded CA served as ``istio.v1.auth.IstioCertificateService``.

Lets ztunnel (or istio-agent) on a host without istiod get certificates from this
agent. Spec ``docs/sds.md``; upstream ``security/pkg/server/ca/server.go``.

- Where: on the xDS TLS port (``xds_tls_port``, 15012, next to xDS, as istiod does; the
  daemon's wiring, ``agent.daemon.mount_ca``, mounts :class:`CertificateService` on the
  ``xds`` component's gRPC server with :meth:`CertificateService.add_to_server`), and optionally
  on a separate TLS port (``ca_port``, :class:`CaPort`). Both are TLS front doors
  (:mod:`agent.tlsport.frontdoor`): server certificate renewed before expiry, client certificate
  optional and verified against the mesh root when presented.
- Authentication: the agent's one chain (:mod:`agent.tlsport.authn`): client certificate SPIFFE
  ID, else ``authorization: Bearer`` from ``tokens_file``, else (Kubernetes) a
  TokenReview. Nothing → UNAUTHENTICATED ``request authenticate failure: <reason>``
  (istiod's text, plus why; never the token). Calls that did not come through TLS are
  refused the same way.
- ``ImpersonatedIdentity`` (ztunnel's node-proxy mode): the caller's
  ``ns/sa`` must be in ``ca_trusted_node_accounts``, the target must be a SPIFFE ID of
  our trust domain, and — when a config source is available — a pod with that
  namespace/service account must run on this node; a caller authenticated by a
  Kubernetes token naming its pod must itself run on this node (istiod checks the
  caller pod's node the same way). Otherwise UNAUTHENTICATED "request impersonation
  authentication failure" (the reason is only logged).
- ``validity_duration`` below :data:`agent.sds.ca_embedded.MIN_TTL` (10 min) is raised to it
  (0 keeps meaning the default): a caller renewing at half of a certificate's span
  (NotBefore backdated 2 minutes) would otherwise renew in a loop (issue 26).
- The CSR's SANs and subject are ignored; errors map to gRPC codes as istiod's do
  (:class:`agent.sds.ca_embedded.SigningError`).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_reflection.v1alpha import reflection

from agent.core import unixsocket
from agent.core.annotations import REGISTERED_BY
from agent.core.grpc_decode import UndecodableRequest, add_service, decoding
from agent.core.ratelimit import RefusalLog
from agent.core.spiffe import Identity
from agent.tlsport.authn import AuthenticationError, Authenticator, Caller, bearer_token
from agent.tlsport.frontdoor import TlsFrontDoor, remove_private_socket
from agent.tlsport.servercert import ServerCertificate
from agent.sds import ca_pb2, ca_pb2_grpc
from agent.sds.attest import PodStore, identity_of_pod
from agent.sds.ca_embedded import MIN_TTL, CAError, EmbeddedCA
from agent.sds.ca_istio import CAClientError, IstioCAClient

log = logging.getLogger(__name__)

CA_SERVICE = ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"].full_name


def _on(node: str, node_wanted: str) -> bool:
    """A workload placed on ``node`` qualifies for ``node_wanted`` ("" = any node)."""
    return bool(node) and (not node_wanted or node == node_wanted)


def _pod_runs_on(store: PodStore, wanted: Identity, node_wanted: str, trust_domain: str) -> bool:
    """A pod of ``wanted``'s namespace, not Failed, placed on ``node_wanted``, whose
    identity (derived as attestation derives it: one rule) is ``wanted``."""
    return any(
        identity_of_pod(pod, trust_domain) == wanted
        and (pod.get("status") or {}).get("phase", "") != "Failed"
        and _on((pod.get("spec") or {}).get("nodeName") or "", node_wanted)
        for pod in store.list("Pod", wanted.namespace))


def _entry_registered_on(store: PodStore, wanted: Identity, node_wanted: str) -> bool:
    """A WorkloadEntry of ``wanted``'s namespace and service account registered by
    ``node_wanted``: hosts without Kubernetes register their pods that way, annotated
    with the registering node (cni/registration_kube.py)."""
    return any(
        ((we.get("spec") or {}).get("serviceAccount") or "default") == wanted.service_account
        and _on(((we.get("metadata") or {}).get("annotations") or {}).get(REGISTERED_BY, ""),
                node_wanted)
        for we in store.list("WorkloadEntry", wanted.namespace))

class CertificateService(ca_pb2_grpc.IstioCertificateServiceServicer):
    """CreateCertificate on top of an :class:`EmbeddedCA`."""

    def __init__(self, ca: EmbeddedCA | None, run_blocking: Callable[..., Awaitable],
                 trust_domain: str,
                 authenticator: Authenticator | Callable[[], Authenticator | None],
                 trusted_node_accounts: Iterable[str],
                 store_getter: Callable[[], PodStore | None] = lambda: None, node_name: str = ""):
        self.ca = ca
        self._run = run_blocking
        self.trust_domain = trust_domain
        self._authenticator = authenticator
        self.trusted = set(trusted_node_accounts)
        self.store = store_getter
        self.node_name = node_name
        self.issued = 0
        # a client retrying with a bad or missing token: one line per source per minute
        self._refusal_log = RefusalLog(log, "CA")

    @property
    def authenticator(self) -> Authenticator | None:
        a = self._authenticator
        return a if isinstance(a, Authenticator) or a is None else a()

    def _impersonation_ok(self, who: Caller, target: str) -> str:
        """"" when ``who`` may act for ``target``, else the reason (logged only).

        Upstream's node authorizer (istiod ``security/pkg/server/ca/node_auth.go``) in
        three questions: is the caller a trusted node account, which node does it speak
        for, and does the target identity run there."""
        caller = who.identity
        if f"{caller.namespace}/{caller.service_account}" not in self.trusted:
            return f"{caller} is not in ca_trusted_node_accounts"
        try:
            wanted = Identity.parse(target)
        except ValueError as e:
            return str(e)
        if wanted.trust_domain != self.trust_domain:
            return f"{target} is not in trust domain {self.trust_domain}"
        store = self.store()
        if store is None:
            return ""
        node_wanted, why = self._caller_node(who, store)
        if why:
            return why
        if _pod_runs_on(store, wanted, node_wanted, self.trust_domain) or \
                _entry_registered_on(store, wanted, node_wanted):
            return ""
        return f"no pod with identity {target} on node {node_wanted or '(any)'}"

    def _caller_node(self, who: Caller, store: PodStore) -> tuple[str, str]:
        """``(node, "")``: the node the caller speaks for, ours unless (no ``node_name``)
        its token names a pod, whose node it is then; ``("", reason)`` when the token's
        pod is not the caller's, or runs elsewhere (or nowhere: a pod that is not
        scheduled never qualifies, as upstream indexes only pods with a nodeName)."""
        if not who.pod_name:
            return self.node_name, ""
        caller = who.identity
        where = f"caller pod {caller.namespace}/{who.pod_name}"
        pod = next((p for p in store.list("Pod", caller.namespace)
                    if (p.get("metadata") or {}).get("name") == who.pod_name), None)
        if pod is None:
            return "", f"{where} not found"
        uid = (pod.get("metadata") or {}).get("uid") or ""
        if who.pod_uid and uid != who.pod_uid:
            return "", f"{where}: UID does not match"
        if identity_of_pod(pod, self.trust_domain) != caller:
            return "", f"{where} does not run as {caller}"
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if not node or (self.node_name and node != self.node_name):
            return "", f"{where} runs on node {node or '(none)'}, not {self.node_name or 'a node'}"
        return node, ""

    async def CreateCertificate(  # noqa: N802 - gRPC name
            self, request: ca_pb2.IstioCertificateRequest, context: grpc.aio.ServicerContext
            ) -> ca_pb2.IstioCertificateResponse:
        authenticator = self.authenticator
        if isinstance(request, UndecodableRequest):
            self._refusal_log.refused(self._source(authenticator, context), request)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        try:
            if authenticator is None:
                raise AuthenticationError("no caller authentication configured")
            caller = await authenticator.authenticate(context)
        except AuthenticationError as e:
            self._refusal_log.refused(self._source(authenticator, context), e)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"request authenticate failure: {e}")
        ids = list(caller.identities)
        meta = dict(request.metadata.fields.items()) if request.HasField("metadata") else {}
        target = meta["ImpersonatedIdentity"].string_value if "ImpersonatedIdentity" in meta else ""
        signer = meta["CertSigner"].string_value if "CertSigner" in meta else ""
        if signer and self.ca is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"CertSigner {signer!r}: external signers are not supported by "
                                "the embedded CA")
        sans = [i.spiffe_id for i in ids]
        if target:
            why = self._impersonation_ok(caller, target)
            if why:
                log.warning("CA: impersonation of %s by %s refused: %s", target, ids[0], why)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "request impersonation authentication failure")
            sans = [target]
        chain = await self._issue(request, context, caller, sans)
        self.issued += 1
        log.info("CA: issued certificate for %s", ",".join(sans))
        return ca_pb2.IstioCertificateResponse(cert_chain=chain)

    @staticmethod
    def _source(authenticator: Authenticator | None, context: grpc.aio.ServicerContext) -> str:
        """The caller's address for the refusal log. On the TLS port gRPC sees the front
        door's per-connection socket; the front door knows the TCP peer, which is the
        source the log is limited by."""
        tls = authenticator.tls_peer(context) if authenticator is not None else None
        return tls.remote if tls is not None else context.peer()

    async def _issue(self, request: ca_pb2.IstioCertificateRequest,
                     context: grpc.aio.ServicerContext, caller: Caller, sans: list[str]
                     ) -> list[str]:
        """Sign for ``sans`` (the caller's identities, or the impersonated one, checked).
        Aborts the call with the CA error's gRPC code."""
        assert self.ca is not None
        try:
            ttl = int(request.validity_duration)
            if 0 < ttl < MIN_TTL:
                ttl = MIN_TTL
            return await self._run(self.ca.sign_for_peer, request.csr, sans, ttl)
        except CAError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
            raise  # not reached: abort raises

    def add_to_server(self, server: grpc.aio.Server) -> str:
        """Register this service on ``server`` (another component's gRPC server, e.g. the
        xDS TLS port, which thus never imports this package); returns the service's full
        name (:data:`CA_SERVICE`) for server reflection. The method is registered as the
        generated code does, with :func:`decoding` as its deserializer (bytes that are not
        an ``IstioCertificateRequest`` end ``INVALID_ARGUMENT``, logged once)."""
        add_service(server, CA_SERVICE, {
            "CreateCertificate": grpc.unary_unary_rpc_method_handler(
                self.CreateCertificate,
                request_deserializer=decoding(ca_pb2.IstioCertificateRequest),
                response_serializer=ca_pb2.IstioCertificateResponse.SerializeToString)})
        return CA_SERVICE


class ForwardingCertificateService(CertificateService):
    """CreateCertificate for a node with no CA key (remote-CA mode, setting ``ca_addr``):
    ztunnel's CA calls to the agent are checked here as :class:`CertificateService` checks
    them (the caller authenticated by the agent's chain; ``ImpersonatedIdentity`` only for
    ``ca_trusted_node_accounts`` and an identity with a pod on this node) and then passed to
    the remote Istio CA unchanged, with the caller's own bearer token
    (:meth:`agent.sds.ca_istio.IstioCAClient.forward`), so the remote CA authenticates the
    caller itself and runs its own node checks, as it would if ztunnel called it directly.

    A caller authenticated without a bearer token (a client certificate) is asked for by the
    agent itself: ``remote.sign`` with the agent's token and ``ImpersonatedIdentity`` = the
    identity checked here (the remote CA must then trust the agent's account as a node
    account). The remote CA's error comes back with its gRPC code and message; nothing is
    ever signed here, there is no key to sign with."""

    def __init__(self, remote: IstioCAClient, trust_domain: str,
                 authenticator: Authenticator | Callable[[], Authenticator | None],
                 trusted_node_accounts: Iterable[str],
                 store_getter: Callable[[], PodStore | None] = lambda: None, node_name: str = ""):
        async def never(*_a: object) -> None:  # no embedded CA: _run is never used
            raise RuntimeError("no CA key on this node")
        super().__init__(None, never, trust_domain, authenticator, trusted_node_accounts,
                         store_getter, node_name)
        self.remote = remote
        self.forwarded = 0

    async def _issue(self, request: ca_pb2.IstioCertificateRequest,
                     context: grpc.aio.ServicerContext, caller: Caller, sans: list[str]
                     ) -> list[str]:
        token = bearer_token(context.invocation_metadata())
        try:
            if token:
                chain = await self.remote.forward(request, token, context.time_remaining())
            else:
                ttl = int(request.validity_duration) or 24 * 3600
                chain = await self.remote.sign(request.csr.encode(), ttl, sans[0])
        except CAClientError as e:
            log.warning("CA: the remote CA refused %s for %s: %s", ",".join(sans),
                        caller.spiffe_id, e)
            code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNAVAILABLE)
            await context.abort(code, str(e).split(" desc = ", 1)[-1])
            raise  # not reached: abort raises
        self.forwarded += 1
        return chain


class CaPort:
    """The embedded CA alone on its own TLS port (setting ``ca_port``): the gRPC server on
    the private Unix socket ``backend_path`` (``agent.tlsport.frontdoor.private_socket_path``)
    behind a TLS front door at ``address:port`` (0 = pick), with ``certificate`` (a
    renewing :class:`~agent.tlsport.servercert.ServerCertificate`, not started yet).
    Callers are authenticated by ``authenticator``, which learns of the door at start.
    :meth:`stop` releases whatever :meth:`start` got to, also after a failed start."""

    def __init__(self, service: CertificateService, address: str, port: int,
                 certificate: ServerCertificate, backend_path: str,
                 authenticator: Authenticator):
        self.service = service
        self.address, self.port = address, port
        self.certificate = certificate
        self.backend_path = backend_path
        self.authenticator = authenticator
        self._server: grpc.aio.Server | None = None
        self.door: TlsFrontDoor | None = None

    async def start(self) -> int:
        """Start the certificate, the gRPC server and the door; returns the bound port.
        Raises ConfigError naming ``ca_port`` when the port is taken or can't be bound,
        or what the certificate's first issuance raised."""
        from agent.core.config import ensure_tcp_port_free
        from agent.core.grpc_options import KEEPALIVE_SERVER_OPTIONS

        await self.certificate.start()
        server = self._server = grpc.aio.server(options=KEEPALIVE_SERVER_OPTIONS)
        self.service.add_to_server(server)
        reflection.enable_server_reflection((CA_SERVICE, reflection.SERVICE_NAME), server)
        server.add_insecure_port("unix:" + self.backend_path)
        unixsocket.note_published(self.backend_path)
        await server.start()
        door = TlsFrontDoor("ca_port", self.address, self.port, self.backend_path,
                            self.certificate)
        ensure_tcp_port_free("ca_port", self.address, self.port)
        await door.start()
        self.door = door
        self.authenticator.add_front_door(door)
        self.port = door.port
        return door.port

    async def stop(self, grace: float) -> None:
        if self.door is not None:
            self.authenticator.remove_front_door(self.door)
            await self.door.stop()
            self.door = None
        await self.certificate.stop()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        remove_private_socket(self.backend_path)

    def debug_state(self) -> dict | None:
        """The front door's state (None before start)."""
        return self.door.debug_state() if self.door is not None else None
