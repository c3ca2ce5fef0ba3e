"""CA clients: the Istio CA over gRPC (``istio.v1.auth.IstioCertificateService``) and an
adapter that gives the embedded CA the same shape.

Every CA client (these two and :class:`agent.sds.signer.SignerCAClient`) implements
:class:`CAClient`: ``async sign(csr_pem, ttl_seconds, identity) -> list[str]`` (the
response ``cert_chain``: leaf first, root bundle last) for a CSR made elsewhere, and
``async issue(identity, algorithm, ttl_seconds, run_blocking, on_csr)`` for the secret
cache: key, CSR and signature, each client where it is cheapest. They raise
:class:`CAClientError`.

Istio CA protocol (``docs/sds.md``; upstream
``security/pkg/nodeagent/caclient/providers/citadel/client.go``):

- request ``csr`` (PEM text), ``validity_duration`` (seconds), ``metadata``
  ``{"CertSigner": ""}`` plus ``ImpersonatedIdentity`` when asking on behalf of an
  attested workload (ztunnel's node-proxy mode);
- gRPC metadata ``clusterid`` and, when the token file is readable and non-empty,
  ``authorization: Bearer <token>`` (re-read on every call; a missing token is not an
  error, mTLS may still authenticate);
- TLS with ``ca_root_cert`` unless the address ends in ``:15010`` (plaintext); a host
  containing ``localhost`` is verified as ``istiod.istio-system.svc``;
- retry CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNAVAILABLE
  up to 5 times, 100 ms doubling with ±10 % jitter; rebuild the channel after any
  failure (re-reading the root file) so a rotated istiod root is picked up;
- calls may overlap (the readiness check and forwarded ztunnel requests share one
  client): a failed call's channel stops being handed out and is closed by its last
  user, never under another call;
- fewer than 2 chain elements → ``invalid empty CertChain``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol

import grpc
from google.protobuf import struct_pb2

from agent.core.backoff import Backoff
from agent.sds import ca_pb2, ca_pb2_grpc, keys
from agent.sds.ca_embedded import CAError, EmbeddedCA

log = logging.getLogger(__name__)

RETRY_CODES = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
               grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
MAX_RETRIES = 5
CALL_TIMEOUT = 10.0  # seconds, one CreateCertificate call to the remote CA
ISTIOD_SAN = "istiod.istio-system.svc"


class CAClientError(Exception):
    """Signing failed. ``code`` is the gRPC status code name (e.g. ``"UNAVAILABLE"``)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"code = {code} desc = {message}")
        self.code = code


Issued = tuple[bytes, list[str], keys.Validity]
"""``(key_pem, cert_chain, (not_before, not_after, serial))`` of one issuance."""


class CAClient(Protocol):
    """What the secret cache and the SDS server need of a CA, whichever it is."""

    async def sign(self, csr_pem: bytes, ttl_seconds: int, identity: str) -> list[str]:
        """Sign a CSR for ``identity`` (a SPIFFE ID or list of SANs joined by commas)."""

    async def issue(self, identity: str, algorithm: str, ttl_seconds: int,
                    run_blocking: Callable[..., Awaitable], on_csr: Callable[[], None]
                    ) -> Issued:
        """A new key (``algorithm``: ``ECDSA`` or ``RSA``) and a certificate for it for
        ``identity``: :data:`Issued`. ``run_blocking`` runs CPU work off the loop;
        ``on_csr`` is called once when the CSR goes to the signer (the cache counts CSRs
        sent and those that came to nothing). Raises :class:`CAClientError`."""

    async def close(self) -> None: ...


async def issue_by_csr(sign: Callable[[bytes, int, str], Awaitable[list[str]]], identity: str,
                       algorithm: str, ttl_seconds: int,
                       run_blocking: Callable[..., Awaitable], on_csr: Callable[[], None]
                       ) -> Issued:
    """:meth:`CAClient.issue` for a CA reached by ``sign`` (a remote one): the key and
    CSR in one worker hop, the signature by ``sign`` on the loop, the leaf's validity
    parsed in another hop."""
    key_pem, csr_pem = await run_blocking(keys.new_key_and_csr, algorithm, [identity])
    on_csr()
    chain = await sign(csr_pem, ttl_seconds, identity)
    return key_pem, chain, await run_blocking(keys.leaf_validity, chain[0])


class EmbeddedCAClient:
    """The embedded CA behind the CA-client interface; signing runs on ``run_blocking``."""

    def __init__(self, ca: EmbeddedCA, run_blocking: Callable[..., Awaitable]):
        self.ca = ca
        self._run = run_blocking

    async def sign(self, csr_pem: bytes, ttl_seconds: int, identity: str) -> list[str]:
        return await self._run(self.sign_blocking, csr_pem, ttl_seconds, identity)

    def sign_blocking(self, csr_pem: bytes, ttl_seconds: int, identity: str) -> list[str]:
        """Same as :meth:`sign`, on the calling (worker) thread."""
        return self.sign_with_validity_blocking(csr_pem, ttl_seconds, identity)[0]

    async def issue(self, identity: str, algorithm: str, ttl_seconds: int,
                    run_blocking: Callable[..., Awaitable], on_csr: Callable[[], None]
                    ) -> Issued:
        """All of it in one worker hop; the leaf's validity comes from the certificate
        object the CA built (no PEM re-parse). The CSR is still made and verified as
        istiod would: it proves the caller holds the key."""
        def blocking() -> Issued:
            key_pem, csr_pem = keys.new_key_and_csr(algorithm, [identity])
            on_csr()
            chain, validity = self.sign_with_validity_blocking(csr_pem, ttl_seconds, identity)
            return key_pem, chain, validity
        return await run_blocking(blocking)

    def sign_with_validity_blocking(self, csr_pem: bytes, ttl_seconds: int, identity: str
                                    ) -> tuple[list[str], keys.Validity]:
        """:meth:`sign_blocking` plus the leaf's ``(not_before, not_after, serial)`` (UTC
        datetimes, int), taken from the certificate just built instead of re-parsing its
        PEM (the secret cache's issuance path). Raises :class:`CAClientError`."""
        try:
            chain, leaf = self.ca.sign_leaf(csr_pem, identity.split(","), int(ttl_seconds))
        except CAError as e:
            raise CAClientError(e.code, str(e)) from None
        return chain, (leaf.not_valid_before_utc, leaf.not_valid_after_utc, leaf.serial_number)

    async def close(self) -> None:
        return None


class IstioCAClient:
    """Client of a remote ``IstioCertificateService`` (istiod, or another agent's CA port).

    ``address`` is ``host:port``; ``root_cert`` a PEM file path (required for TLS);
    ``token_file`` a bearer token path ("" for none); ``own_identity`` the identity the
    token/cert authenticates as: other identities are requested with
    ``ImpersonatedIdentity``. Raises :class:`CAClientError` from :meth:`sign`.
    """

    def __init__(self, address: str, root_cert: str = "", token_file: str = "",
                 cluster_id: str = "Kubernetes", own_identity: str = "",
                 client_cert: tuple[bytes, bytes] | None = None,
                 server_name: str = "", retry_base: float = 0.1):
        if not address or ":" not in address:
            raise ValueError(f"ca_addr={address!r}: expected host:port")
        self.address = address
        self.root_cert = root_cert
        self.token_file = token_file
        self.cluster_id = cluster_id
        self.own_identity = own_identity
        self.client_cert = client_cert
        self.server_name = server_name
        self.retry_base = retry_base
        self.plaintext = address.endswith(":15010")
        self.retries = 0
        self._channel: grpc.aio.Channel | None = None
        # calls in flight per channel: a channel is closed only when none uses it, because
        # closing a grpc.aio channel cancels its calls with asyncio.CancelledError (not an
        # AioRpcError), which would end a concurrent caller's task (the SDS readiness check
        # and a forwarded ztunnel request share this client) instead of being retried
        self._users: dict[grpc.aio.Channel, int] = {}

    def _build_channel(self) -> grpc.aio.Channel:
        if self.plaintext:
            return grpc.aio.insecure_channel(self.address)
        if not self.root_cert:
            raise CAClientError("FAILED_PRECONDITION",
                                "ca_root_cert: a root certificate file is required for TLS to "
                                f"{self.address}")
        try:
            with open(self.root_cert, "rb") as f:
                root = f.read()
        except OSError as e:
            raise CAClientError("FAILED_PRECONDITION",
                                f"ca_root_cert={self.root_cert!r}: {e.strerror or e}") from None
        if b"-----BEGIN CERTIFICATE-----" not in root:
            raise CAClientError("FAILED_PRECONDITION",
                                f"ca_root_cert={self.root_cert!r}: no PEM certificate in file")
        key, chain = (self.client_cert[1], self.client_cert[0]) if self.client_cert else (None, None)
        creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                             certificate_chain=chain)
        host = self.address.rsplit(":", 1)[0].strip("[]")
        name = self.server_name or (ISTIOD_SAN if "localhost" in host else "")
        options = [("grpc.ssl_target_name_override", name)] if name else []
        return grpc.aio.secure_channel(self.address, creds, options=options)

    def _token(self) -> str:
        """The bearer token, re-read each call; missing/unreadable → "" (not an error)."""
        if not self.token_file:
            return ""
        try:
            with open(self.token_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""

    def _request(self, csr_pem: bytes, ttl_seconds: int, identity: str
                 ) -> tuple[ca_pb2.IstioCertificateRequest, tuple[tuple[str, str], ...]]:
        metadata = struct_pb2.Struct()
        metadata.update({"CertSigner": ""})
        if identity and self.own_identity and identity != self.own_identity:
            metadata.update({"ImpersonatedIdentity": identity})
        req = ca_pb2.IstioCertificateRequest(
            csr=csr_pem.decode() if isinstance(csr_pem, bytes) else csr_pem,
            validity_duration=int(ttl_seconds), metadata=metadata)
        headers = [("clusterid", self.cluster_id)]
        token = self._token()
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        return req, tuple(headers)

    async def sign(self, csr_pem: bytes, ttl_seconds: int, identity: str = "") -> list[str]:
        """One CreateCertificate with retries. Returns ``cert_chain`` (>= 2 elements)."""
        req, headers = self._request(csr_pem, ttl_seconds, identity)
        return await self._call(req, headers)

    async def issue(self, identity: str, algorithm: str, ttl_seconds: int,
                    run_blocking: Callable[..., Awaitable], on_csr: Callable[[], None]
                    ) -> Issued:
        return await issue_by_csr(self.sign, identity, algorithm, ttl_seconds, run_blocking,
                                  on_csr)

    async def forward(self, request: ca_pb2.IstioCertificateRequest, token: str,
                      within: float | None = None) -> list[str]:
        """Pass a caller's ``CreateCertificate`` on to the remote CA unchanged (its CSR,
        ``validity_duration`` and ``metadata``, e.g. ``ImpersonatedIdentity``), sent with the
        caller's own bearer ``token`` and ``clusterid``, so the remote CA authenticates the
        caller and runs its own impersonation checks (istiod: the caller's service account
        in ``CA_TRUSTED_NODE_ACCOUNTS``, the identity running on the caller pod's node).
        Same retries and errors as :meth:`sign`, but all within ``within`` seconds (the
        caller's own deadline, ``context.time_remaining()``; None: no bound), so the caller
        gets the remote CA's error (a ``ca_root_cert`` that does not verify it) and not
        its own DEADLINE_EXCEEDED; ValueError when ``token`` is empty."""
        if not token:
            raise ValueError("forward: the caller's bearer token is required")
        headers = (("clusterid", self.cluster_id), ("authorization", f"Bearer {token}"))
        return await self._call(request, headers, within)

    def _explain(self, code: grpc.StatusCode, details: str) -> str:
        """The remote CA's error with what to check: ``ca_addr`` and, for a TLS failure
        (the CA's certificate not verified by ``ca_root_cert``), that root."""
        text = f"remote CA ca_addr={self.address}: {details or code.name}"
        low = (details or "").lower()
        if code == grpc.StatusCode.UNAVAILABLE and any(
                w in low for w in ("ssl", "handshake", "certificate", "tls")):
            text += (f" (the CA's certificate did not verify: is ca_root_cert="
                     f"{self.root_cert!r} the remote CA's root?)")
        return text

    async def _call(self, req: ca_pb2.IstioCertificateRequest,
                    headers: tuple[tuple[str, str], ...], within: float | None = None
                    ) -> list[str]:
        attempt = 0
        # retry_base doubling, ±10 %; at most MAX_RETRIES retries, so the step never caps
        retry = Backoff(self.retry_base, self.retry_base * 2 ** MAX_RETRIES, jitter=(0.9, 1.1))
        loop = asyncio.get_running_loop()
        # the answer must reach the caller before its deadline: keep a fifth (<= 1 s) of it
        end = None if within is None else loop.time() + within - min(1.0, within / 5)
        last: grpc.aio.AioRpcError | None = None  # the error before a cut-short last try
        while True:
            timeout = CALL_TIMEOUT if end is None else \
                max(0.05, min(CALL_TIMEOUT, end - loop.time()))
            channel: grpc.aio.Channel | None = None
            try:
                channel = self._acquire()
                stub = ca_pb2_grpc.IstioCertificateServiceStub(channel)
                resp = await stub.CreateCertificate(req, metadata=headers, timeout=timeout)
            except grpc.aio.AioRpcError as error:
                await self._release(channel, failed=True)
                e = error
                if (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and end is not None
                        and last is not None):
                    e = last  # our own bound ran out: say why the tries before failed
                last = e
                delay = retry.next() if e.code() in RETRY_CODES and attempt < MAX_RETRIES \
                    else None
                if delay is not None and (end is None or loop.time() + delay < end):
                    attempt += 1
                    self.retries += 1
                    log.debug("CA %s: %s, retry %d in %.2fs", self.address, e.code().name,
                              attempt, delay)
                    await asyncio.sleep(delay)
                    continue
                raise CAClientError(e.code().name, self._explain(e.code(), e.details() or "")
                                    ) from None
            except CAClientError:
                await self._release(channel, failed=True)
                raise
            except BaseException:  # our own task cancelled: the channel stays usable
                if channel is not None:
                    await asyncio.shield(self._release(channel, failed=False))
                raise
            else:
                await self._release(channel, failed=False)
                break
        chain = list(resp.cert_chain)
        if len(chain) < 2:
            raise CAClientError("INTERNAL", "invalid empty CertChain")
        return chain

    async def reload(self) -> None:
        """Drop the channel; the next call builds a new one, re-reading ``root_cert``."""
        await self._reset()

    def _acquire(self) -> grpc.aio.Channel:
        """The current channel (built on first use; raises CAClientError from
        ``_build_channel``), counted as in use until :meth:`_release`."""
        if self._channel is None:
            self._channel = self._build_channel()
            self._users[self._channel] = 0
        self._users[self._channel] += 1
        return self._channel

    async def _release(self, channel: grpc.aio.Channel | None, failed: bool) -> None:
        """One call done with ``channel``. ``failed``: the next call builds a new channel
        (re-reading ``root_cert``). A channel no longer current is closed by its last user."""
        if failed and self._channel is channel:
            self._channel = None
        if channel is None or channel not in self._users:  # none, or closed by close()
            return
        self._users[channel] -= 1
        if self._channel is not channel and self._users[channel] == 0:
            del self._users[channel]
            await channel.close()

    async def _reset(self) -> None:
        """Make the next call build a new channel; the current one closes when idle."""
        channel, self._channel = self._channel, None
        if channel is not None and self._users.get(channel) == 0:
            del self._users[channel]
            await channel.close()

    async def close(self) -> None:
        """Close every channel, cancelling calls still in flight (shutdown)."""
        self._channel = None
        channels, self._users = list(self._users), {}
        for channel in channels:
            await channel.close()
