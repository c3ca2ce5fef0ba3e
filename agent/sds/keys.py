"""Keys, CSRs, SANs and PEM helpers shared by the secret cache and the CAs.

Upstream: ``istio/istio:security/pkg/pki/util/{generate_csr.go,crypto.go,san.go}`` and
``security/pkg/nodeagent/cache/secretcache.go`` (``concatCerts``, trust merging);
``docs/sds.md``.

Everything here is synchronous and CPU-bound (RSA key generation takes tens of
milliseconds): callers on the event loop run it through ``ctx.run_blocking``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey  # what generate_key makes
Validity = tuple[dt.datetime, dt.datetime, int]  # a leaf's not_before, not_after (UTC), serial

RSA_KEY_SIZE = 2048
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.*?-----END CERTIFICATE-----", re.S)


def key_algorithm(setting: str) -> str:
    """Map ``ECC_SIGNATURE_ALGORITHM`` to ``"RSA"`` (empty, upstream default) or ``"ECDSA"``.

    Raises ValueError for anything else, as upstream's "unsupported EC signature algorithm".
    """
    value = (setting or "").strip().upper()
    if value in ("", "RSA"):
        return "RSA"
    if value in ("ECDSA", "EC"):
        return "ECDSA"
    raise ValueError(f"ecc_signature_algorithm={setting!r}: unsupported EC signature algorithm "
                     "(expected ECDSA or empty for RSA 2048)")


def generate_key(algorithm: str = "RSA") -> PrivateKey:
    """A new private key: RSA 2048 (e=65537) or ECDSA P-256. Blocking (RSA ~50 ms)."""
    if algorithm == "ECDSA":
        return ec.generate_private_key(ec.SECP256R1())
    if algorithm == "RSA":
        return rsa.generate_private_key(public_exponent=65537, key_size=RSA_KEY_SIZE)
    raise ValueError(f"key algorithm {algorithm!r}: expected RSA or ECDSA")


def key_pem(key: PrivateKey) -> bytes:
    """PEM of a private key the way istio-agent writes it without ``PKCS8_KEY``:
    ``RSA PRIVATE KEY`` (PKCS#1) or ``EC PRIVATE KEY`` (SEC1)."""
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _general_names(sans: list[str]) -> list[x509.GeneralName]:
    """Upstream SAN rule (san.go): IP literal → iPAddress, ``spiffe://`` → URI, else dNSName."""
    names: list[x509.GeneralName] = []
    for san in sans:
        san = san.strip()
        if not san:
            continue
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
            continue
        except ValueError:
            pass
        if san.startswith("spiffe://"):
            names.append(x509.UniformResourceIdentifier(san))
        else:
            names.append(x509.DNSName(san))
    return names


def build_csr(key: PrivateKey, sans: list[str]) -> bytes:
    """A PEM CSR with an empty subject (one empty O, as upstream) and a critical SAN.

    The SHA-256 signature matches istio-agent for RSA and P-256 keys.
    """
    # An empty subject is what the spec calls fully compatible (istiod ignores it).
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([]))
           .add_extension(x509.SubjectAlternativeName(_general_names(sans)), critical=True)
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


def new_key_and_csr(algorithm: str, sans: list[str]) -> tuple[bytes, bytes]:
    """Blocking: generate a key and a CSR for ``sans``. Returns ``(key_pem, csr_pem)``."""
    key = generate_key(algorithm)
    return key_pem(key), build_csr(key, sans)


def concat_certs(certs: list[str]) -> str:
    """Join PEM elements, adding ``\\n`` only where an element lacks one (upstream ``concatCerts``).

    ``[]`` → ``""``, ``["a", "b"]`` → ``"a\\nb"``, ``["a\\n", "b"]`` → ``"a\\nb"``.
    """
    out = ""
    for i, c in enumerate(certs):
        out += c
        if i < len(certs) - 1 and not c.endswith("\n"):
            out += "\n"
    return out


def pem_blocks(data: bytes | str) -> list[bytes]:
    """Every ``CERTIFICATE`` PEM block in ``data``, as bytes, in order."""
    if isinstance(data, str):
        data = data.encode()
    return [m.group(0) for m in _PEM_CERT.finditer(data)]


def load_certs(data: bytes | str, what: str = "certificate bundle") -> list[x509.Certificate]:
    """Parse a PEM bundle, skipping blocks strict parsers reject (negative serials).

    Raises ValueError naming ``what`` when no valid certificate is left.
    """
    certs = []
    for block in pem_blocks(data):
        try:
            cert = x509.load_pem_x509_certificate(block)
            if cert.serial_number < 0:  # accepted by cryptography with a warning; Go rejects it
                continue
            certs.append(cert)
        except ValueError:
            continue
    if not certs:
        raise ValueError(f"{what}: no valid PEM certificate found")
    return certs


def leaf_validity(chain: bytes | str) -> Validity:
    """``(not_before, not_after, serial)`` of the first certificate of a chain (UTC datetimes).

    Raises ValueError "failed to extract expire time" when the chain has no parsable cert.
    """
    try:
        cert = load_certs(chain, "certificate chain")[0]
    except ValueError as e:
        raise ValueError(f"failed to extract expire time from the certificate chain: {e}") from None
    return cert.not_valid_before_utc, cert.not_valid_after_utc, cert.serial_number


def uri_sans(cert: x509.Certificate) -> list[str]:
    """The URI SANs of a certificate (empty when it has no SAN extension)."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return ext.value.get_values_for_type(x509.UniformResourceIdentifier)


def merge_trust(*bundles: bytes | str) -> bytes:
    """Upstream ``mergeTrustAnchorBytes``: split bundles into PEM certs, de-duplicate,
    sort lexicographically, join with ``\\n`` (no trailing newline)."""
    blocks = set()
    for bundle in bundles:
        for block in pem_blocks(bundle or b""):
            blocks.add(block.strip(b"\n"))
    return b"\n".join(sorted(blocks))


def same_public_key(key: PrivateKeyTypes, cert: x509.Certificate) -> bool:
    """True when private ``key`` belongs to ``cert`` (their SubjectPublicKeyInfo match)."""
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


class InconsistentKey(ValueError):
    """A private key that parsed but whose numbers do not belong together; its text
    says which check failed and never holds the key's bytes or numbers."""


def load_private_key(pem: bytes) -> PrivateKeyTypes:
    """Parse an unencrypted PEM private key, checking an RSA key's numbers as Go's
    ``crypto/rsa`` does when istiod loads its CA key (``PrivateKey.Validate``: n = p*q,
    e odd and > 1, d*e = 1 mod p-1 and mod q-1, the CRT values d mod p-1, d mod q-1 and
    q^-1 mod p; not the FIPS rule that p and q be of one length). OpenSSL's own check
    on load adds primality tests of p and q, 40-100 ms for a 2048-bit key on a loaded
    2-CPU node, on the agent's start path; Go dropped them from ``Validate`` for the
    same cost. Raises :class:`InconsistentKey`, or
    ValueError/TypeError (not PEM, encrypted) whose text may quote the input: callers
    name only the exception's type for those."""
    key = serialization.load_pem_private_key(pem, password=None,
                                             unsafe_skip_rsa_key_validation=True)
    if isinstance(key, rsa.RSAPrivateKey):
        problem = rsa_numbers_problem(key.private_numbers())
        if problem:
            raise InconsistentKey(f"inconsistent RSA private key: {problem}")
    return key


def rsa_numbers_problem(n: rsa.RSAPrivateNumbers) -> str:
    """What is wrong with an RSA private key's numbers, or ``""`` (see
    :func:`load_private_key`); pure integer arithmetic, microseconds."""
    pub = n.public_numbers
    p, q, d, e, modulus = n.p, n.q, n.d, pub.e, pub.n
    if p <= 1 or q <= 1:
        return "a prime is <= 1"
    if p * q != modulus:
        return "p*q is not the modulus"
    if e < 3 or e % 2 == 0 or modulus % 2 == 0:
        return "the public exponent or the modulus is even or too small"
    if (d * e) % (p - 1) != 1 or (d * e) % (q - 1) != 1:
        return "d is not the inverse of e"
    if n.dmp1 != d % (p - 1) or n.dmq1 != d % (q - 1) or (n.iqmp * q) % p != 1:
        return "the CRT values do not match p, q and d"
    return ""


def key_matches_cert(key_pem_bytes: bytes, cert_pem: bytes) -> bool:
    """True when the private key belongs to the first certificate (file pair validation)."""
    try:
        key = load_private_key(key_pem_bytes)
        cert = load_certs(cert_pem)[0]
    except (ValueError, TypeError):
        return False
    return same_public_key(key, cert)
