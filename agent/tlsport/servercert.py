"""Server certificates of the agent's TLS ports, renewed before they expire.

Every TLS listener of the agent (the xDS + CA port ``xds_tls_port``, the separate CA
port ``ca_port``) holds one :class:`ServerCertificate`. It asks a provider for a
certificate (:class:`TlsMaterial`: chain, key, the mesh root client certificates must
chain to), builds the :class:`ssl.SSLContext` new handshakes use, and renews:

- at ``renew_ratio`` (default 0.5) of the certificate's lifetime, as istio-agent and
  ztunnel renew theirs — the lifetime that is left when it arrives (from the time it was
  installed to NotAfter), not from its NotBefore, which the CA backdates 2 minutes for
  clock skew: from NotBefore, a certificate of 2 minutes or less would be due at once and
  renew in a loop (issue 26). Never sooner than ``min_interval`` (5 s) after the last
  one. The renewal task re-reads the clock at least every
  ``check_interval`` seconds, so a host that slept (or a test clock that jumps) renews
  on the next check rather than after a stale timer;
- on demand: :meth:`ServerCertificate.current` (called before each handshake) renews at
  once when the renewal time has passed, so a late timer never serves an old
  certificate;
- a failed renewal keeps the current certificate and retries with backoff (5 s
  doubling, at most 60 s).

The clock (``clock``, epoch seconds) is injectable: the CA signs with the same clock
(``EmbeddedCA(clock=...)``), so a test can run the agent "25 hours" in seconds.

Issue 13 item 4: before this, the CA port's certificate was issued once for 24 h and
never renewed, so ztunnel's certificate renewals failed after a day.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import ssl
import time
from typing import Awaitable, Callable, Iterable

import datetime as dt
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.core.backoff import Backoff

log = logging.getLogger(__name__)

# HTTP/2 (RFC 9113 §9.2.2) forbids TLS 1.2 suites without ephemeral key exchange or AEAD.
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


@dataclasses.dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes for a TLS listener: the server chain (leaf first) and its key, and the
    mesh root that client certificates must chain to (``b""``: client certificates are
    not requested). ``not_before``/``not_after`` are epoch seconds; 0 means "read them
    from the leaf" (:meth:`with_validity`)."""

    cert_chain_pem: bytes
    key_pem: bytes
    root_pem: bytes
    not_after: float = 0.0
    not_before: float = 0.0

    def __repr__(self) -> str:  # never print the key
        return f"TlsMaterial(not_before={self.not_before}, not_after={self.not_after})"

    def with_validity(self) -> "TlsMaterial":
        """This material with ``not_before``/``not_after`` read from the leaf when unset.
        Raises ValueError when the chain holds no certificate."""
        if self.not_after and self.not_before:
            return self
        leaf = x509.load_pem_x509_certificate(self.cert_chain_pem)
        return dataclasses.replace(
            self, not_before=self.not_before or leaf.not_valid_before_utc.timestamp(),
            not_after=self.not_after or leaf.not_valid_after_utc.timestamp())


def server_names(system_namespace: str, node_name: str = "", extra: Iterable[str] = ()
                 ) -> list[str]:
    """The names a server certificate of the agent carries, in order, without duplicates.

    ztunnel verifies the host of its ``XDS_ADDRESS``/``CA_ADDRESS`` (or ``ALT_XDS_HOSTNAME``
    / ``ALT_CA_HOSTNAME``) against them: ``localhost``, ``127.0.0.1`` and ``::1`` (its
    default outside Kubernetes is ``https://localhost:15012``), the service names istiod
    signs for itself (``istiod``, ``istiod-remote``, ``istio-pilot`` in the system
    namespace, upstream ``pilot/pkg/bootstrap/server.go`` ``getDNSNames``; ztunnel's
    default in a cluster is ``https://istiod.istio-system.svc:15012``) plus
    ``istiod.<ns>.svc.cluster.local``, the node name, and ``extra`` (setting
    ``tls_server_names``, Istio's ``ISTIOD_CUSTOM_HOST``).
    """
    ns = system_namespace
    names = ["localhost", "127.0.0.1", "::1",
             f"istiod.{ns}.svc", f"istiod.{ns}.svc.cluster.local",
             f"istiod-remote.{ns}.svc", f"istio-pilot.{ns}.svc"]
    if node_name:
        names.append(node_name)
    names.extend(n.strip() for n in extra if n.strip())
    return list(dict.fromkeys(names))


def server_context(material: TlsMaterial) -> ssl.SSLContext:
    """A server-side SSLContext for ``material``: TLS 1.2 or 1.3 (istiod's minimum is
    1.2; ztunnel speaks 1.3 only), ALPN ``h2``, and — when a root is given — a client
    certificate *requested, optional, and verified against the root when presented*
    (Go's ``tls.VerifyClientCertIfGiven``, what istiod's 15012 does).

    The chain and key are handed to OpenSSL through a memfd, never written to disk.
    Raises ``ssl.SSLError`` when the key does not match the certificate.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_ciphers(_TLS12_CIPHERS)
    ctx.set_alpn_protocols(["h2"])
    fd = os.memfd_create("ambient-agent-tls", os.MFD_CLOEXEC)
    try:
        data = material.cert_chain_pem.rstrip(b"\n") + b"\n" + material.key_pem
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    if material.root_pem:
        ctx.load_verify_locations(cadata=material.root_pem.decode())
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def check_server_leaf(chain_pem: bytes) -> None:
    """Raise ValueError unless the leaf may serve TLS to ztunnel: webpki (rustls) wants a
    SAN and, when an EKU is present, serverAuth in it."""
    leaf = x509.load_pem_x509_certificate(chain_pem)
    try:
        leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        raise ValueError("server certificate has no subjectAltName") from None
    try:
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return
    if ExtendedKeyUsageOID.SERVER_AUTH not in eku:
        raise ValueError("server certificate's extendedKeyUsage lacks serverAuth")


def node_local_material(names: Iterable[str], spiffe_id: str = "", *, now: float | None = None,
                        lifetime: float = 365 * 24 * 3600.0) -> tuple[TlsMaterial, bytes]:
    """A serving certificate for a node that holds no CA key (remote-CA mode, ``ca_addr``).

    A remote Istio CA signs only SPIFFE identities (istiod ignores a CSR's DNS names), so it
    cannot give the agent a certificate ztunnel verifies by hostname. This makes one here:
    a throw-away issuer (self-signed, ECDSA P-256, ``CA:TRUE, pathlen 0``) signs one leaf
    (ECDSA P-256, ``CA:FALSE``, EKU serverAuth, SANs ``names`` as DNS or IP entries plus
    ``spiffe_id`` as a URI) and the issuer's key is dropped before this returns, so the
    issuer can never sign anything else: the node keeps a server key, no CA key. Both
    certificates are valid from 2 minutes before ``now`` (epoch seconds; default the
    current time) for ``lifetime`` seconds. Nothing is written to disk.

    Returns ``(material, issuer_pem)``: ``material`` carries the leaf and its key (its
    ``root_pem`` is empty: the caller sets the root client certificates must chain to);
    ``issuer_pem`` is what a client must trust to verify the leaf (published with the mesh
    root in ``mesh_root_file`` for ztunnel's ``XDS_ROOT_CA``/``CA_ROOT_CA``).
    Raises ValueError when ``names`` is empty.
    """
    names = [n for n in dict.fromkeys(n.strip() for n in names) if n]
    if not names:
        raise ValueError("node_local_material: no server names")
    start = dt.datetime.fromtimestamp((time.time() if now is None else now) - 120,
                                      dt.timezone.utc)
    end = start + dt.timedelta(seconds=lifetime + 120)
    issuer_key = ec.generate_private_key(ec.SECP256R1())
    issuer_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ambient-agent"),
                             x509.NameAttribute(NameOID.COMMON_NAME,
                                                f"node-local serving issuer {names[0]}")])
    issuer = (x509.CertificateBuilder().subject_name(issuer_name).issuer_name(issuer_name)
              .public_key(issuer_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(start).not_valid_after(end)
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                           False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(issuer_key.public_key()),
                             critical=False)
              .sign(issuer_key, hashes.SHA256()))
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    if spiffe_id:
        sans.append(x509.UniformResourceIdentifier(spiffe_id))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([]))
            .issuer_name(issuer_name).public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False,
                                         False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                issuer_key.public_key()), critical=False)
            .sign(issuer_key, hashes.SHA256()))
    del issuer_key  # the issuer signs this one leaf only
    pem = serialization.Encoding.PEM
    key_pem = leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
    material = TlsMaterial(leaf.public_bytes(pem), key_pem, b"",
                           not_after=leaf.not_valid_after_utc.timestamp(),
                           not_before=leaf.not_valid_before_utc.timestamp())
    return material, issuer.public_bytes(pem)


Provider = Callable[[], Awaitable[TlsMaterial]]


class ServerCertificate:
    """The certificate of one TLS listener and its renewal (see the module docstring).

    ``name`` is used in logs (e.g. ``"xds_tls_port"``); ``provide()`` returns fresh
    :class:`TlsMaterial` and may raise anything (the error is logged, the old certificate
    kept). Call :meth:`start` once, :meth:`stop` at the end.
    """

    def __init__(self, name: str, provide: Provider, *, clock: Callable[[], float] = time.time,
                 renew_ratio: float = 0.5, check_interval: float = 60.0,
                 retry_initial: float = 5.0, retry_max: float = 60.0, min_interval: float = 5.0):
        if not 0.0 < renew_ratio < 1.0:
            raise ValueError(f"renew_ratio={renew_ratio!r}: must be between 0 and 1")
        self.name = name
        self.provide = provide
        self.clock = clock
        self.renew_ratio = renew_ratio
        self.check_interval = check_interval
        self.retry_initial, self.retry_max = retry_initial, retry_max
        self.min_interval = min_interval
        self.material: TlsMaterial | None = None
        self._installed_at = 0.0
        self.context: ssl.SSLContext | None = None
        self.renewals = 0
        self.last_error = ""
        self._next_try = 0.0
        self._backoff = Backoff(retry_initial, retry_max, clock=clock)
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    @property
    def renew_at(self) -> float:
        m = self.material
        if m is None:
            return 0.0
        start = max(m.not_before, self._installed_at)  # the validity really left to use
        return max(start + self.renew_ratio * (m.not_after - start),
                   self._installed_at + self.min_interval)

    async def start(self) -> None:
        """Fetch the first certificate and start the renewal task. When the first
        issuance fails (a CA that is not ready, e.g. a Kubernetes CA Secret that is
        missing or refused), the port starts without a certificate: handshakes are refused
        (:meth:`current` raises ``ssl.SSLError`` naming why) while the task retries with
        backoff, so one bad CA Secret never stops the agent."""
        try:
            await self._install(await self.provide())
        except Exception as e:  # noqa: BLE001 - retried by the renewal task
            self.last_error = str(e) or type(e).__name__
            self._next_try = self.clock() + self._backoff.next()
            log.warning("%s: no server certificate yet (handshakes refused until there is "
                        "one; retrying): %s", self.name, self.last_error)
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name=f"renew-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def current(self) -> ssl.SSLContext:
        """The context for a new handshake, renewed first when its time has come (a
        failed renewal logs and returns the current one)."""
        if self.clock() >= self.renew_at:
            await self.renew()
        if self.context is None:
            raise ssl.SSLError(f"{self.name}: no server certificate yet: "
                               f"{self.last_error or 'not started'}")
        return self.context

    async def renew(self) -> bool:
        """Renew now unless a retry is not due yet; True when a new certificate is in use."""
        async with self._lock:
            now = self.clock()
            if now < self.renew_at or now < self._next_try:
                return False  # someone else renewed while we waited, or backing off
            try:
                material = await self._install(await self.provide())
            except Exception as e:  # noqa: BLE001 - keep serving the current certificate
                self.last_error = str(e) or type(e).__name__
                self._next_try = now + self._backoff.next()
                left = max(self.material.not_after - now, 0.0) if self.material else 0.0
                log.warning("%s: renewing the server certificate failed (current one expires "
                            "in %.0fs; retry in %.0fs): %s", self.name, left,
                            self._next_try - now, self.last_error)
                return False
            self.renewals += 1
            self.last_error = ""
            self._next_try = 0.0
            self._backoff.reset()
            log.info("%s: server certificate renewed, valid until %s", self.name,
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(material.not_after)))
            return True

    async def _install(self, material: TlsMaterial) -> TlsMaterial:
        """Check ``material`` and put it in use; returns it with its validity filled in.
        Raises ValueError (unusable leaf) or ssl.SSLError (key does not match)."""
        material = material.with_validity()
        check_server_leaf(material.cert_chain_pem)
        self.context = server_context(material)
        self.material = material
        self._installed_at = self.clock()
        return material

    async def _run(self) -> None:
        while True:
            wait = max(self.renew_at, self._next_try) - self.clock()
            if wait > 0:
                await asyncio.sleep(min(wait, self.check_interval))
                continue
            await self.renew()

    def debug_state(self) -> dict:
        m = self.material
        return {"not_before": m.not_before if m else None, "not_after": m.not_after if m else None,
                "renew_at": self.renew_at or None, "renewals": self.renewals,
                "last_error": self.last_error or None}
