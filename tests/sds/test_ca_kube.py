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
    }


@pytest.mark.parametrize("case", ["key does not match", "cert not a CA", "chain not to the root",
                                  "expired", "not yet valid", "incomplete", "garbage key",
                                  "garbage cert"])
def test_bad_secret_is_refused_naming_the_secret_and_key(pki, case):
    data, key, why = _bad_cases(pki)[case]
    with pytest.raises(CASecretError) as e:
        material_from_secret("istio-system", "cacerts", data, now())
    assert e.value.secret == "istio-system/cacerts" and e.value.key == key, str(e.value)
    assert str(e.value).startswith(f"Secret istio-system/cacerts key {key}: ") and why in str(e.value)
    assert "c2VjcmV0" not in str(e.value)  # never a key's bytes
