"""The embedded CA: a root kept under the state dir that signs workload CSRs locally.

Signing follows istiod's rules (``docs/sds.md`` "CA
servers"; upstream ``security/pkg/pki/ca/ca.go``, ``pki/util/generate_cert.go``):

- SANs come only from the authenticated identity; the CSR's own SANs and subject are
  ignored. The CSR's signature is verified.
- Lifetime: requested seconds, or 24 h when <= 0; more than 90 days is refused
  (INVALID_ARGUMENT); NotAfter is clamped to the root's NotAfter; an expired root
  refuses to sign (INTERNAL).
- Leaf: random 128-bit serial, empty subject, NotBefore = now - 2 min (clock skew),
  KeyUsage digitalSignature|keyEncipherment (critical), ExtKeyUsage serverAuth +
  clientAuth, BasicConstraints CA:FALSE (critical), critical SAN, AKI from the root's
  SKI, SHA-256.
- Response: ``[leaf + "\\n", root_bundle]``, or ``[leaf, intermediates, root_bundle]``
  for a plug-in CA whose signing certificate is an intermediate (istiod's
  ``CreateCertificate``: leaf, ``cert-chain.pem``, root).

The root is RSA 2048, 10 years, O = trust domain, CA:TRUE, KeyUsage certSign (step 9). It is
created once at ``<ca_dir>/{root-cert.pem,root-key.pem}`` (setting ``ca_dir``, default
``<state_dir>/ca``) (key 0600,
dir 0700), or loaded from the files the user gives (``ca_cert_file``/``ca_key_file``).
A key kept in ``ca_dir`` whose certificate is missing (or the other way round) is never
replaced by a new root: the agent refuses to start naming the missing file. A root that is
not valid yet (beyond :data:`BACKDATE` of clock skew) or already expired is refused too
(:func:`check_signing_material`).

In Kubernetes mode the material comes from a Secret instead (:mod:`agent.sds.ca_kube`) and
can change while running (:meth:`EmbeddedCA.install`: a new root bundle during a rotation's
overlap, then a new signing key).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.sds import keys
from agent.core import trusted
from agent.core.files import write_atomic

log = logging.getLogger(__name__)

DEFAULT_TTL = 24 * 3600
MAX_TTL = 90 * 24 * 3600
MIN_TTL = 600  # what the CA port gives a shorter request (agent.sds.ca_server)
BACKDATE = dt.timedelta(minutes=2)
ROOT_TTL = dt.timedelta(days=3650)
CAKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey  # what the CA signs leaves with


class CAError(Exception):
    """A signing failure with the gRPC status it maps to.

    ``code`` is one of ``"INVALID_ARGUMENT"`` (CSR/TTL errors), ``"INTERNAL"`` (CA not
    ready, generation failure), ``"UNAUTHENTICATED"``; ``str()`` is the message.
    """

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def create_root(trust_domain: str, now: dt.datetime | None = None
                ) -> tuple[x509.Certificate, rsa.RSAPrivateKey]:
    """A self-signed RSA 2048 root: ``(cert, key)``. Blocking."""
    now = now or dt.datetime.now(dt.timezone.utc)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, trust_domain)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(int.from_bytes(secrets.token_bytes(16), "big") >> 1)
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + ROOT_TTL)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


class MaterialError(ValueError):
    """CA material that must not sign: ``part`` names the piece at fault (a Secret key
    such as ``ca-key.pem``, or a file path), ``str()`` says why."""

    def __init__(self, part: str, reason: str):
        super().__init__(f"{part}: {reason}")
        self.part = part
        self.reason = reason


def check_signing_material(cert: x509.Certificate, key: CAKey, intermediates: list[x509.Certificate],
                           roots: list[x509.Certificate], now: dt.datetime,
                           names: tuple[str, str, str, str] = ("ca-cert.pem", "ca-key.pem",
                                                               "cert-chain.pem", "root-cert.pem")
                           ) -> None:
    """Refuse material istiod's ``Verify`` (``security/pkg/pki/util/keycertbundle.go``) would
    refuse, and a little more: the key must match the certificate, the certificate must be
    a CA (BasicConstraints CA:TRUE, keyCertSign when KeyUsage is present), valid now (not
    before its NotBefore minus :data:`BACKDATE`, not after its NotAfter), and chain through
    ``intermediates`` to one of ``roots`` (each link's signature checked, each link valid
    now). ``names`` are how the certificate, key, chain and roots are named in errors.
    Raises :class:`MaterialError`."""
    cert_name, key_name, chain_name, root_name = names
    if not keys.same_public_key(key, cert):
        raise MaterialError(key_name, f"the private key does not match the certificate in "
                                      f"{cert_name}")
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = bc.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise MaterialError(cert_name, "the certificate is not a CA (no BasicConstraints CA:TRUE)")
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        if not ku.key_cert_sign:
            raise MaterialError(cert_name, "the certificate's KeyUsage lacks keyCertSign")
    except x509.ExtensionNotFound:
        pass

    def valid_now(c: x509.Certificate, where: str) -> None:
        if c.not_valid_before_utc - BACKDATE > now:
            raise MaterialError(where, f"certificate not valid before "
                                       f"{c.not_valid_before_utc.isoformat()} (not yet valid)")
        if c.not_valid_after_utc <= now:
            raise MaterialError(where, f"certificate expired at "
                                       f"{c.not_valid_after_utc.isoformat()}")

    valid_now(cert, cert_name)
    if not roots:
        raise MaterialError(root_name, "no root certificate")
    root_der = {r.public_bytes(serialization.Encoding.DER) for r in roots}
    current, seen = cert, 0
    pool = [c for c in intermediates
            if c.public_bytes(serialization.Encoding.DER) != cert.public_bytes(serialization.Encoding.DER)]
    while True:
        if current.public_bytes(serialization.Encoding.DER) in root_der:
            return  # reached a trusted root (the CA is itself a root)
        issuer = next((r for r in roots if _issued_by(current, r)), None)
        if issuer is not None:
            valid_now(issuer, root_name)
            return
        nxt = next((c for c in pool if _issued_by(current, c)), None)
        if nxt is None or seen > 8:
            raise MaterialError(chain_name if intermediates else root_name,
                                f"the certificate in {cert_name} does not chain to a root in "
                                f"{root_name}")
        valid_now(nxt, chain_name)
        pool.remove(nxt)
        current, seen = nxt, seen + 1


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    if cert.issuer != issuer.subject:
        return False
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


class _Signing(NamedTuple):
    """What one signature uses, swapped as a whole (:meth:`EmbeddedCA.install`)."""

    cert: x509.Certificate
    key: CAKey
    aki: x509.AuthorityKeyIdentifier
    chain: str  # intermediates between the leaf and the root bundle ("" for a root signer)
    roots: str  # the root bundle sent last in every response


VOLATILE_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_type(path: str | os.PathLike) -> str:
    """The type (``tmpfs``, ``ext4``...) of the mounted filesystem holding ``path``: the
    longest mount point that is a prefix of its real path (``/proc/self/mounts``); "" when
    unknown."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and \
                        len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return ""
    return kind


class EmbeddedCA:
    """A local signing CA. Build with :meth:`load_or_create` (blocking).

    ``root_pem`` is the root bundle (bytes) clients trust; :meth:`sign` issues leaves.
    ``clock`` (epoch seconds) dates what it signs; the agent sets its own (injectable) clock.
    """

    def __init__(self, cert: x509.Certificate, key: CAKey, root_bundle: bytes,
                 clock: Callable[[], float] = time.time, chain: bytes = b""):
        self.clock = clock
        self._lock = threading.Lock()
        self._signing: _Signing | None = (self._state(cert, key, chain, root_bundle)
                                          if cert is not None else None)
        self.refusal = ""  # set while the CA must not sign (why); "" when it may
        self.max_not_after: dict[bytes, float] = {}  # signer SKI -> latest leaf NotAfter
        # signer SKI -> latest renewal time (NotBefore + half the span) of a leaf handed to
        # a peer through the CA service (sign_for_peer): ztunnel verifies peers against the
        # roots that came with its certificate until it renews it at half its span
        self.max_peer_renew_by: dict[bytes, float] = {}

    @classmethod
    def pending(cls, reason: str, clock: Callable[[], float] = time.time) -> "EmbeddedCA":
        """A CA with no signing material yet (Kubernetes mode before its Secret loaded):
        every signature raises :class:`CAError` INTERNAL "CA is not ready: <reason>"."""
        ca = cls(None, None, b"", clock)  # type: ignore[arg-type]
        ca.refusal = reason
        return ca

    def _current(self) -> _Signing:
        signing = self._signing
        if signing is None or self.refusal:
            raise CAError("INTERNAL", f"CA is not ready: {self.refusal or 'no signing material'}")
        return signing

    @staticmethod
    def _state(cert: x509.Certificate, key: CAKey, chain: bytes, roots: bytes) -> _Signing:
        chain_str = chain.decode()
        if chain_str and not chain_str.endswith("\n"):
            chain_str += "\n"
        # the key's public half is the certificate's (checked when loaded)
        return _Signing(cert, key, x509.AuthorityKeyIdentifier.from_issuer_public_key(
            key.public_key()), chain_str, roots.decode())

    @property
    def cert(self) -> x509.Certificate:
        return self._current().cert

    @property
    def key(self) -> CAKey:
        return self._current().key

    @property
    def root_pem(self) -> bytes:
        """The root bundle (PEM bytes) clients trust and every response ends with (b""
        before any material is installed)."""
        signing = self._signing
        return signing.roots.encode() if signing is not None else b""

    @property
    def chain_pem(self) -> bytes:
        """Intermediates sent between the leaf and the root bundle (b"" for a root signer)."""
        signing = self._signing
        return signing.chain.encode() if signing is not None else b""

    def install(self, cert: x509.Certificate, key: CAKey, root_bundle: bytes,
                chain: bytes = b"") -> None:
        """Sign with ``cert``/``key`` from now on, sending ``chain`` and ``root_bundle``
        (checked by the caller). Signatures in flight finish with the previous material."""
        with self._lock:
            self._signing = self._state(cert, key, chain, root_bundle)
            self.refusal = ""

    def set_roots(self, root_bundle: bytes) -> None:
        """Keep the signing key, send (and publish) ``root_bundle`` from now on (a
        rotation's overlap: old and new roots)."""
        with self._lock:
            s = self._current()
            self._signing = s._replace(roots=root_bundle.decode())

    @classmethod
    def load_or_create(cls, directory: str | os.PathLike, trust_domain: str,
                       cert_file: str = "", key_file: str = "") -> "EmbeddedCA":
        """Load the user's root (``cert_file`` + ``key_file``), else ``<directory>/root-*.pem``,
        else create and store a new root there (dir 0700, key 0600). Blocking.

        Raises :class:`CAError` ("INTERNAL") naming the file when a root can't be read or
        its key does not match.
        """
        if bool(cert_file) != bool(key_file):
            raise CAError("INTERNAL", "ca_cert_file and ca_key_file must be given together")
        if cert_file:
            return cls._load(Path(cert_file), Path(key_file))
        d = Path(directory)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        cert_path, key_path = d / "root-cert.pem", d / "root-key.pem"
        if cert_path.exists() and key_path.exists():
            return cls._load(cert_path, key_path)
        if key_path.exists() or cert_path.exists():
            present, missing = ((key_path, cert_path) if key_path.exists()
                                else (cert_path, key_path))
            # Never mint a new mesh root over a kept key (every workload and peer trusts
            # the old one): the operator restores the file or removes the other on purpose.
            raise CAError("INTERNAL", f"{missing} is missing but {present} is kept: refusing "
                          f"to create a new mesh root over it (restore {missing.name}, or "
                          f"remove {present.name} to start a new mesh root on purpose)")
        cert, key = create_root(trust_domain)
        # 0600 from creation, via temp file + rename: never world-readable, even briefly.
        write_atomic(str(key_path), keys.key_pem(key), 0o600)
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        write_atomic(str(cert_path), cert_pem, 0o600)
        log.info("created embedded CA root serial %x at %s", cert.serial_number, cert_path)
        fstype = filesystem_type(d)
        if fstype in VOLATILE_FILESYSTEMS:
            # /var/run (the default state dir) is tmpfs on most hosts: after a reboot
            # a new root is minted and no peer trusts this one any more
            log.warning("the embedded CA root at %s is on %s: a reboot loses it and "
                        "changes the mesh root; set ca_dir (--ca-dir) to persistent "
                        "storage, e.g. /var/lib/ambient-agent/ca as the systemd unit does",
                        d, fstype)
        return cls(cert, key, cert_pem)

    @classmethod
    def _load(cls, cert_path: Path, key_path: Path) -> "EmbeddedCA":
        """The root in ``cert_path`` + ``key_path``. Each is judged on the opened file
        (:mod:`agent.core.trusted`; a symlink by its target): a key another user owns, may
        write or read, a certificate another user owns or may write is refused with a
        :class:`CAError` naming path, owner and mode."""
        try:
            with open(cert_path, "rb") as f:
                problem = trusted.public_file_problem(os.fstat(f.fileno()))
                if problem:
                    raise CAError("INTERNAL", f"CA root certificate {cert_path} {problem}")
                bundle = f.read()
            cert = keys.load_certs(bundle, f"CA root {cert_path}")[0]
        except (OSError, ValueError) as e:
            raise CAError("INTERNAL", f"CA root certificate {cert_path}: {e}") from None
        try:
            with open(key_path, "rb") as f:
                problem = trusted.secret_file_problem(os.fstat(f.fileno()))
                if problem:
                    raise CAError("INTERNAL", f"CA key {key_path} {problem}: it holds the "
                                  "mesh CA's signing key")
                pem = f.read()
            key = keys.load_private_key(pem)
        except keys.InconsistentKey as e:
            raise CAError("INTERNAL", f"CA key {key_path}: {e}") from None
        except (OSError, ValueError, TypeError) as e:
            # Never include the file's bytes: it holds a private key.
            raise CAError("INTERNAL", f"CA key {key_path}: unreadable or not a PEM private key "
                          f"({type(e).__name__})") from None
        if not isinstance(key, (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey)):
            raise CAError("INTERNAL", f"CA key {key_path}: an RSA or ECDSA key is required, "
                          f"not {type(key).__name__}")
        if not keys.same_public_key(key, cert):
            raise CAError("INTERNAL", f"CA key {key_path} does not match certificate {cert_path}")
        now = dt.datetime.now(dt.timezone.utc)
        if cert.not_valid_before_utc - BACKDATE > now:
            raise CAError("INTERNAL", f"CA root certificate {cert_path}: not valid before "
                          f"{cert.not_valid_before_utc.isoformat()} (not yet valid; check the "
                          "clock or the certificate)")
        return cls(cert, key, bundle)

    def sign(self, csr_pem: str | bytes, sans: list[str], ttl_seconds: int = 0,
             now: dt.datetime | None = None) -> list[str]:
        """Sign ``csr_pem`` for ``sans`` (the authenticated identities). Blocking (~1 ms).

        Returns the response chain ``[leaf PEM + "\\n", root bundle]``. Raises
        :class:`CAError` (INVALID_ARGUMENT for a bad CSR or TTL, INTERNAL for an expired
        root or no SANs).
        """
        return self.sign_leaf(csr_pem, sans, ttl_seconds, now)[0]

    def sign_for_peer(self, csr_pem: str | bytes, sans: list[str], ttl_seconds: int = 0
                      ) -> list[str]:
        """:meth:`sign` for a caller of the CA service (ztunnel, istio-agent), which trusts
        the roots that come with the certificate until it renews it at half its span:
        that time is recorded per signer in :attr:`max_peer_renew_by` (a root rotation
        whose overlap ends earlier is warned about, :mod:`agent.sds.ca_kube`). SDS
        certificates are not recorded: SDS pushes a changed root bundle at once."""
        chain, leaf = self.sign_leaf(csr_pem, sans, ttl_seconds)
        ski = leaf.extensions.get_extension_for_class(
            x509.AuthorityKeyIdentifier).value.key_identifier or b""
        start, end = leaf.not_valid_before_utc.timestamp(), leaf.not_valid_after_utc.timestamp()
        renew_by = start + (end - start) / 2
        with self._lock:
            if renew_by > self.max_peer_renew_by.get(ski, 0.0):
                self.max_peer_renew_by[ski] = renew_by
        return chain

    def sign_leaf(self, csr_pem: str | bytes, sans: list[str], ttl_seconds: int = 0,
                  now: dt.datetime | None = None) -> tuple[list[str], x509.Certificate]:
        """:meth:`sign`, also returning the leaf as an ``x509.Certificate`` so a local
        caller (the secret cache) reads its validity without parsing the PEM back."""
        now = now or dt.datetime.fromtimestamp(self.clock(), dt.timezone.utc)
        if isinstance(csr_pem, str):
            csr_pem = csr_pem.encode()
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError:
            raise CAError("INVALID_ARGUMENT", "csr: not a PEM CERTIFICATE REQUEST") from None
        if not csr.is_signature_valid:
            raise CAError("INVALID_ARGUMENT", "csr: signature does not verify")
        public_key = csr.public_key()
        if isinstance(public_key, rsa.RSAPublicKey) and public_key.key_size < 2048:
            raise CAError("INVALID_ARGUMENT", f"csr: RSA key size {public_key.key_size} < 2048")
        if not isinstance(public_key, (rsa.RSAPublicKey, ec.EllipticCurvePublicKey)):
            raise CAError("INVALID_ARGUMENT", "csr: key must be RSA or ECDSA")
        if not sans:
            raise CAError("INTERNAL", "no identity to put in the certificate")
        if ttl_seconds > MAX_TTL:
            raise CAError("INVALID_ARGUMENT", f"requested TTL {ttl_seconds}s is greater than the "
                          f"max allowed TTL {MAX_TTL}s")
        lifetime = dt.timedelta(seconds=ttl_seconds if ttl_seconds > 0 else DEFAULT_TTL)
        signing = self._current()  # one consistent view, whatever install() does meanwhile
        signer_end = signing.cert.not_valid_after_utc
        if signer_end <= now:
            raise CAError("INTERNAL", f"CA root expired at {signer_end.isoformat()}; refusing to sign")
        not_after = min(now + lifetime, signer_end)
        leaf = (x509.CertificateBuilder()
                .subject_name(x509.Name([]))
                .issuer_name(signing.cert.subject)
                .public_key(public_key)
                .serial_number(int.from_bytes(secrets.token_bytes(16), "big") >> 1 or 1)
                .not_valid_before(now - BACKDATE)
                .not_valid_after(not_after)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=True, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(signing.aki, critical=False)
                .add_extension(x509.SubjectAlternativeName(keys._general_names(sans)),
                               critical=True)
                .sign(signing.key, hashes.SHA256()))
        leaf_pem = leaf.public_bytes(serialization.Encoding.PEM).decode()
        chain = [leaf_pem if leaf_pem.endswith("\n") else leaf_pem + "\n"]
        if signing.chain:
            chain.append(signing.chain)
        chain.append(signing.roots)
        ski = signing.aki.key_identifier or b""
        end = not_after.timestamp()
        if end > self.max_not_after.get(ski, 0.0):
            self.max_not_after[ski] = end
        return chain, leaf

    def issue(self, sans: list[str], algorithm: str = "ECDSA",
              ttl_seconds: int = 0) -> tuple[bytes, bytes]:
        """Key + certificate for ``sans`` in one step (for the agent's own servers). Blocking.

        Returns ``(chain_pem, key_pem)``; the chain is leaf + root.
        """
        key_pem, csr_pem = keys.new_key_and_csr(algorithm, sans)
        return keys.concat_certs(self.sign(csr_pem, sans, ttl_seconds)).encode(), key_pem
