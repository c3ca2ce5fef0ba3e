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
- Response: ``[leaf + "\\n", root_bundle]`` (no intermediates for a self-signed root).

The root is RSA 2048, 10 years, O = trust domain, CA:TRUE, KeyUsage certSign (step 9). It is
created once at ``<ca_dir>/{root-cert.pem,root-key.pem}`` (setting ``ca_dir``, default
``<state_dir>/ca``) (key 0600,
dir 0700), or loaded from the files the user gives (``ca_cert_file``/``ca_key_file``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.sds import keys
from agent.core.files import write_atomic

log = logging.getLogger(__name__)

DEFAULT_TTL = 24 * 3600
MAX_TTL = 90 * 24 * 3600
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


class EmbeddedCA:
    """A local signing CA. Build with :meth:`load_or_create` (blocking).

    ``root_pem`` is the root bundle (bytes) clients trust; :meth:`sign` issues leaves.
    ``clock`` (epoch seconds) dates what it signs; the agent sets its own (injectable) clock.
    """

    def __init__(self, cert: x509.Certificate, key: CAKey, root_bundle: bytes,
                 clock: Callable[[], float] = time.time):
        self.clock = clock
        self.cert = cert
        self.key = key
        self.root_pem = root_bundle
        self._root_str = root_bundle.decode()  # decoded once, not per signature
        # the key's public half is the certificate's (checked when loaded)
        self._aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key())

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
        cert, key = create_root(trust_domain)
        # 0600 from creation, via temp file + rename: never world-readable, even briefly.
        write_atomic(str(key_path), keys.key_pem(key), 0o600)
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        write_atomic(str(cert_path), cert_pem, 0o600)
        log.info("created embedded CA root serial %x at %s", cert.serial_number, cert_path)
        return cls(cert, key, cert_pem)

    @classmethod
    def _load(cls, cert_path: Path, key_path: Path) -> "EmbeddedCA":
        try:
            bundle = cert_path.read_bytes()
            cert = keys.load_certs(bundle, f"CA root {cert_path}")[0]
        except (OSError, ValueError) as e:
            raise CAError("INTERNAL", f"CA root certificate {cert_path}: {e}") from None
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as e:
            # Never include the file's bytes: it holds a private key.
            raise CAError("INTERNAL", f"CA key {key_path}: unreadable or not a PEM private key "
                          f"({type(e).__name__})") from None
        if not isinstance(key, (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey)):
            raise CAError("INTERNAL", f"CA key {key_path}: an RSA or ECDSA key is required, "
                          f"not {type(key).__name__}")
        if not keys.same_public_key(key, cert):
            raise CAError("INTERNAL", f"CA key {key_path} does not match certificate {cert_path}")
        return cls(cert, key, bundle)

    def sign(self, csr_pem: str | bytes, sans: list[str], ttl_seconds: int = 0,
             now: dt.datetime | None = None) -> list[str]:
        """Sign ``csr_pem`` for ``sans`` (the authenticated identities). Blocking (~1 ms).

        Returns the response chain ``[leaf PEM + "\\n", root bundle]``. Raises
        :class:`CAError` (INVALID_ARGUMENT for a bad CSR or TTL, INTERNAL for an expired
        root or no SANs).
        """
        return self.sign_leaf(csr_pem, sans, ttl_seconds, now)[0]

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
        signer_end = self.cert.not_valid_after_utc
        if signer_end <= now:
            raise CAError("INTERNAL", f"CA root expired at {signer_end.isoformat()}; refusing to sign")
        not_after = min(now + lifetime, signer_end)
        leaf = (x509.CertificateBuilder()
                .subject_name(x509.Name([]))
                .issuer_name(self.cert.subject)
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
                .add_extension(self._aki, critical=False)
                .add_extension(x509.SubjectAlternativeName(keys._general_names(sans)),
                               critical=True)
                .sign(self.key, hashes.SHA256()))
        leaf_pem = leaf.public_bytes(serialization.Encoding.PEM).decode()
        chain = [leaf_pem if leaf_pem.endswith("\n") else leaf_pem + "\n", self._root_str]
        return chain, leaf

    def issue(self, sans: list[str], algorithm: str = "ECDSA",
              ttl_seconds: int = 0) -> tuple[bytes, bytes]:
        """Key + certificate for ``sans`` in one step (for the agent's own servers). Blocking.

        Returns ``(chain_pem, key_pem)``; the chain is leaf + root.
        """
        key_pem, csr_pem = keys.new_key_and_csr(algorithm, sans)
        return keys.concat_certs(self.sign(csr_pem, sans, ttl_seconds)).encode(), key_pem
