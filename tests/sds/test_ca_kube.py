"""The cluster CA Secret's content, checked as istiod checks a plug-in bundle (and a little
more): every refusal names the Secret and the data key at fault, never a key's bytes.
The Secret read from a real API server, bootstrap races, rotation and deletion are in
tests/kube/test_ca_secret.py."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from agent.sds import keys
from agent.sds.ca_embedded import create_root
from agent.sds.ca_kube import CASecretError, material_from_secret, self_signed_secret, _decoded

def now() -> dt.datetime:
    """The time of each check: a module-level constant went stale while the suite ran
    (certificates made minutes later were "not yet valid" at it)."""
    return dt.datetime.now(dt.timezone.utc)


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def intermediate(root, root_key, *, ca=True, start=None, days=365, name="intermediate"):
    key = keys.generate_key("ECDSA")
    start = start or now() - dt.timedelta(hours=1)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, name)]))
         .issuer_name(root.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=not ca, content_commitment=False,
                                      key_encipherment=False, data_encipherment=False,
                                      key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                                      encipher_only=False, decipher_only=False), critical=True))
    return b.sign(root_key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki():
    root, root_key = create_root("cluster.local")
    inter, inter_key = intermediate(root, root_key)
    other, other_key = create_root("other")
    return root, root_key, inter, inter_key, other, other_key


def plugin(inter, inter_key, root, chain=None):
    return {"ca-cert.pem": pem(inter), "ca-key.pem": keys.key_pem(inter_key),
            "root-cert.pem": pem(root), "cert-chain.pem": chain if chain is not None
            else pem(inter) + pem(root)}


def test_plugin_cacerts_with_an_intermediate(pki):
    root, _, inter, inter_key, _, _ = pki
    m = material_from_secret("istio-system", "cacerts", plugin(inter, inter_key, root), now())
    assert m.secret == "istio-system/cacerts" and m.cert == inter
    assert keys.load_certs(m.roots) == [root]
    assert keys.load_certs(m.chain)[0] == inter  # sent after the leaf, as istiod does


def test_istio_ca_secret_as_istiod_writes_it():
    body = self_signed_secret("istio-system", "cluster.local")
    assert body["type"] == "istio.io/ca-root"
    assert set(body["data"]) == {"ca-cert.pem", "ca-key.pem", "root-cert.pem", "cert-chain.pem",
                                 "key.pem"}
    m = material_from_secret("istio-system", "istio-ca-secret", _decoded(body["data"]), now())
    assert keys.load_certs(m.roots) == [m.cert] and m.chain == b""
    # istiod before root-cert.pem existed: the CA certificate is the root
    data = _decoded(body["data"])
    del data["root-cert.pem"]
    assert material_from_secret("ns", "istio-ca-secret", data, now()).roots == m.roots


def test_kubernetes_tls_form_of_cacerts(pki):
    root, _, inter, inter_key, _, _ = pki
    m = material_from_secret("ns", "cacerts", {"tls.crt": pem(inter), "tls.key": keys.key_pem(inter_key),
                                               "ca.crt": pem(root)}, now())
    assert m.cert == inter and keys.load_certs(m.roots) == [root]


def _bad_cases(pki):
    root, root_key, inter, inter_key, other, other_key = pki
    leafish, leafish_key = intermediate(root, root_key, ca=False, name="not-a-ca")
    expired, expired_key = intermediate(root, root_key, start=now() - dt.timedelta(days=30), days=1)
    future, future_key = intermediate(root, root_key, start=now() + dt.timedelta(days=1))
    return {
        "key does not match": (plugin(inter, other_key, root), "ca-key.pem", "does not match"),
        "cert not a CA": (plugin(leafish, leafish_key, root), "ca-cert.pem", "not a CA"),
        "chain not to the root": (plugin(inter, inter_key, other, chain=pem(inter)),
                                  "cert-chain.pem", "does not chain"),
        "expired": (plugin(expired, expired_key, root), "ca-cert.pem", "expired"),
        "not yet valid": (plugin(future, future_key, root), "ca-cert.pem", "not yet valid"),
        "incomplete": ({"ca-cert.pem": pem(inter), "ca-key.pem": keys.key_pem(inter_key)},
                       "root-cert.pem", "missing"),
        "garbage key": ({**plugin(inter, inter_key, root), "ca-key.pem": b"-----BEGIN PRIVATE KEY"
                         b"-----\nc2VjcmV0\n-----END PRIVATE KEY-----\n"}, "ca-key.pem",
                        "not a PEM private key"),
        "garbage cert": ({**plugin(inter, inter_key, root), "ca-cert.pem": b"hello"},
                         "ca-cert.pem", "not a PEM certificate"),
        # OpenSSL's check on load is skipped (its primality tests cost 40-100 ms on the
        # start path); the numbers are checked as Go's crypto/rsa checks them
        "inconsistent RSA key": ({**plugin(root, root_key, root),
                                  "ca-key.pem": _tampered_rsa_pem(root_key)}, "ca-key.pem",
                                 "inconsistent RSA private key: the CRT values"),
    }


def _tampered_rsa_pem(key) -> bytes:
    """``key`` (RSA) with its CRT coefficient q^-1 mod p off by one: it parses, and
    signing with it would give wrong signatures (the fault attacks the check is for)."""
    from cryptography.hazmat.primitives.asymmetric import rsa
    n = key.private_numbers()
    bad = rsa.RSAPrivateNumbers(n.p, n.q, n.d, n.dmp1, n.dmq1, (n.iqmp + 1) % n.p,
                                n.public_numbers).private_key(unsafe_skip_rsa_key_validation=True)
    return keys.key_pem(bad)


@pytest.mark.parametrize("case", ["key does not match", "cert not a CA", "chain not to the root",
                                  "expired", "not yet valid", "incomplete", "garbage key",
                                  "garbage cert", "inconsistent RSA key"])
def test_bad_secret_is_refused_naming_the_secret_and_key(pki, case):
    data, key, why = _bad_cases(pki)[case]
    with pytest.raises(CASecretError) as e:
        material_from_secret("istio-system", "cacerts", data, now())
    assert e.value.secret == "istio-system/cacerts" and e.value.key == key, str(e.value)
    assert str(e.value).startswith(f"Secret istio-system/cacerts key {key}: ") and why in str(e.value)
    assert "c2VjcmV0" not in str(e.value)  # never a key's bytes


@pytest.mark.parametrize("change, why", [
    (lambda n: dict(p=n.p + 2), "p*q is not the modulus"),
    (lambda n: dict(d=n.d + 1), "d is not the inverse of e"),
    (lambda n: dict(dmp1=n.dmp1 ^ 2), "CRT values"),
    (lambda n: dict(dmq1=n.dmq1 ^ 2), "CRT values"),
    (lambda n: dict(p=1, q=n.p * n.q), "a prime is <= 1"),
])
def test_rsa_numbers_checked_as_go_checks_them(pki, change, why):
    """:func:`keys.rsa_numbers_problem` (what :func:`keys.load_private_key` runs instead of
    OpenSSL's slow check): each inconsistency named; a good key passes."""
    from cryptography.hazmat.primitives.asymmetric import rsa
    _, root_key, *_ = pki
    n = root_key.private_numbers()
    assert keys.rsa_numbers_problem(n) == ""
    fields = dict(p=n.p, q=n.q, d=n.d, dmp1=n.dmp1, dmq1=n.dmq1, iqmp=n.iqmp,
                  public_numbers=n.public_numbers)
    fields.update(change(n))
    assert why in keys.rsa_numbers_problem(rsa.RSAPrivateNumbers(**fields))
    assert keys.load_private_key(keys.key_pem(root_key)).private_numbers() == n
