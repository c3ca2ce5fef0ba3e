"""Embedded CA signing rules and root handling."""

from __future__ import annotations

import datetime as dt
import os

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent.sds import keys
from agent.sds.ca_embedded import CAError, EmbeddedCA, create_root

ID = "spiffe://cluster.local/ns/a/sa/b"


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return EmbeddedCA.load_or_create(tmp_path_factory.mktemp("ca") / "ca", "cluster.local")


def test_root_stored_private_and_reloaded(tmp_path):
    ca = EmbeddedCA.load_or_create(tmp_path / "ca", "example.org")
    assert os.stat(tmp_path / "ca").st_mode & 0o777 == 0o700
    assert os.stat(tmp_path / "ca" / "root-key.pem").st_mode & 0o777 == 0o600
    root = x509.load_pem_x509_certificate(ca.root_pem)
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert root.subject.rfc4514_string() == "O=example.org"
    again = EmbeddedCA.load_or_create(tmp_path / "ca", "example.org")
    assert again.root_pem == ca.root_pem


def test_leaf_follows_istiod_rules(ca):
    _, csr = keys.new_key_and_csr("ECDSA", ["spiffe://cluster.local/ns/evil/sa/x", "evil.com"])
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    chain = ca.sign(csr, [ID], 7200, now=now)
    assert len(chain) == 2 and chain[1] == ca.root_pem.decode() and chain[0].endswith("\n")
    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    assert keys.uri_sans(leaf) == [ID]  # CSR SANs ignored
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical and san.value.get_values_for_type(x509.DNSName) == []
    assert leaf.not_valid_before_utc == now - dt.timedelta(minutes=2)
    assert leaf.not_valid_after_utc == now + dt.timedelta(hours=2)
    ku = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and ku.value.key_encipherment
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    bc = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.root_pem))
    assert len(leaf.subject) == 0


def test_ttl_rules(ca):
    _, csr = keys.new_key_and_csr("ECDSA", [ID])
    leaf = x509.load_pem_x509_certificate(ca.sign(csr, [ID], 0)[0].encode())
    life = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert life == dt.timedelta(hours=24, minutes=2)
    with pytest.raises(CAError) as e:
        ca.sign(csr, [ID], 91 * 86400)
    assert e.value.code == "INVALID_ARGUMENT" and "max allowed TTL" in str(e.value)
    late = ca.cert.not_valid_after_utc - dt.timedelta(hours=1)
    clamped = x509.load_pem_x509_certificate(ca.sign(csr, [ID], 86400, now=late)[0].encode())
    assert clamped.not_valid_after_utc == ca.cert.not_valid_after_utc
    with pytest.raises(CAError) as e:
        ca.sign(csr, [ID], 3600, now=ca.cert.not_valid_after_utc + dt.timedelta(seconds=1))
    assert e.value.code == "INTERNAL" and "expired" in str(e.value)


def test_malformed_or_forged_csr(ca):
    with pytest.raises(CAError) as e:
        ca.sign("not a csr", [ID])
    assert e.value.code == "INVALID_ARGUMENT" and "csr" in str(e.value)
    _, csr = keys.new_key_and_csr("ECDSA", [ID])
    body = csr.decode().splitlines()
    body[5] = body[5][:-4] + ("AAAA" if body[5][-4:] != "AAAA" else "BBBB")
    with pytest.raises(CAError) as e:
        ca.sign("\n".join(body), [ID])
    assert e.value.code == "INVALID_ARGUMENT"


def test_user_root_and_bad_root_files(tmp_path):
    cert, key = create_root("cluster.local")
    from cryptography.hazmat.primitives import serialization
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(keys.key_pem(key))
    (tmp_path / "k.pem").chmod(0o600)
    ca = EmbeddedCA.load_or_create(tmp_path / "unused", "cluster.local",
                                   str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    assert ca.cert.serial_number == cert.serial_number
    assert not (tmp_path / "unused").exists()
    (tmp_path / "bad.pem").write_text("garbage")
    with pytest.raises(CAError, match="bad.pem"):
        EmbeddedCA.load_or_create(tmp_path, "cluster.local", str(tmp_path / "bad.pem"),
                                  str(tmp_path / "k.pem"))
    other_cert, _ = create_root("cluster.local")
    (tmp_path / "o.pem").write_bytes(other_cert.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(CAError, match="does not match"):
        EmbeddedCA.load_or_create(tmp_path, "cluster.local", str(tmp_path / "o.pem"),
                                  str(tmp_path / "k.pem"))
    (tmp_path / "kbad.pem").write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    with pytest.raises(CAError) as e:
        EmbeddedCA.load_or_create(tmp_path, "cluster.local", str(tmp_path / "c.pem"),
                                  str(tmp_path / "kbad.pem"))
    assert "secret" not in str(e.value)


def test_inconsistent_rsa_root_key_is_refused_naming_the_file(tmp_path):
    """The CA key's numbers are checked as Go's crypto/rsa does (OpenSSL's slower check on
    load is skipped): a tampered CRT value is refused with the file named, no bytes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    cert, key = create_root("cluster.local")
    n = key.private_numbers()
    bad = rsa.RSAPrivateNumbers(n.p, n.q, n.d, n.dmp1 ^ 2, n.dmq1, n.iqmp, n.public_numbers)
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(keys.key_pem(bad.private_key(
        unsafe_skip_rsa_key_validation=True)))
    (tmp_path / "k.pem").chmod(0o600)
    with pytest.raises(CAError) as e:
        EmbeddedCA.load_or_create(tmp_path, "td", str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    assert str(tmp_path / "k.pem") in str(e.value) and "CRT values" in str(e.value)
    assert "PRIVATE KEY" not in str(e.value)


def test_root_key_of_another_kind_is_refused_naming_the_file(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.ORGANIZATION_NAME, "td")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1)).sign(key, None))
    cert_path, key_path = tmp_path / "c.pem", tmp_path / "k.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    with pytest.raises(CAError) as e:
        EmbeddedCA.load_or_create(tmp_path, "td", str(cert_path), str(key_path))
    assert e.value.code == "INTERNAL" and str(key_path) in str(e.value)
    assert "RSA or ECDSA" in str(e.value)


def test_kept_key_without_its_root_is_never_replaced(tmp_path):
    """Issue 28: ``ca/root-cert.pem`` missing at start used to mint a new mesh root over the
    kept key (one INFO line). Now the start is refused naming the missing file, and both
    the key and (the other way round) the certificate stay as they were."""
    d = tmp_path / "ca"
    EmbeddedCA.load_or_create(d, "cluster.local")
    key_before = (d / "root-key.pem").read_bytes()
    cert_before = (d / "root-cert.pem").read_bytes()
    (d / "root-cert.pem").unlink()
    with pytest.raises(CAError) as e:
        EmbeddedCA.load_or_create(d, "cluster.local")
    assert str(d / "root-cert.pem") in str(e.value) and "refusing" in str(e.value)
    assert (d / "root-key.pem").read_bytes() == key_before
    assert not (d / "root-cert.pem").exists()
    (d / "root-cert.pem").write_bytes(cert_before)
    (d / "root-key.pem").unlink()
    with pytest.raises(CAError) as e:
        EmbeddedCA.load_or_create(d, "cluster.local")
    assert str(d / "root-key.pem") in str(e.value)
    assert (d / "root-cert.pem").read_bytes() == cert_before


def test_root_not_yet_valid_is_refused_naming_the_file(tmp_path):
    from cryptography.hazmat.primitives import serialization
    future = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=2)
    cert, key = create_root("cluster.local", now=future)
    cert_path, key_path = tmp_path / "c.pem", tmp_path / "k.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(keys.key_pem(key))
    key_path.chmod(0o600)
    with pytest.raises(CAError) as e:
        EmbeddedCA.load_or_create(tmp_path / "unused", "cluster.local", str(cert_path),
                                  str(key_path))
    assert str(cert_path) in str(e.value) and "not yet valid" in str(e.value)


def test_new_root_on_tmpfs_is_warned_about(tmp_path, caplog):
    """The default state dir /var/run is tmpfs: a root created there is lost at reboot
    (newuser finding 13); creating one says so, naming ca_dir. On disk: no warning."""
    import logging
    import subprocess

    from agent.sds.ca_embedded import EmbeddedCA, filesystem_type

    caplog.set_level(logging.WARNING, logger="agent.sds")
    EmbeddedCA.load_or_create(tmp_path / "disk-ca", "cluster.local")
    assert filesystem_type(tmp_path) not in ("tmpfs", "ramfs")
    assert not [r for r in caplog.records if "reboot" in r.getMessage()]
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "volatile"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                   check=True)
    try:
        assert filesystem_type(mnt / "ca") == "tmpfs"
        EmbeddedCA.load_or_create(mnt / "ca", "cluster.local")
        warned = [r.getMessage() for r in caplog.records if "reboot" in r.getMessage()]
        assert len(warned) == 1 and "ca_dir" in warned[0] and "tmpfs" in warned[0], warned
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_sign_for_peer_records_when_the_holder_renews(tmp_path):
    """The CA service's certificates (ztunnel's) record, per signer, the latest time a
    holder renewing at half the span replaces one (NotBefore + span/2); SDS signing
    (sign) records nothing: SDS pushes a changed root bundle at once."""
    ca = EmbeddedCA.load_or_create(str(tmp_path), "cluster.local")
    ident = "spiffe://cluster.local/ns/a/sa/b"
    _, csr = keys.new_key_and_csr("ECDSA", [ident])
    ca.sign(csr, [ident], 3600)
    assert ca.max_peer_renew_by == {}
    chain = ca.sign_for_peer(csr, [ident], 600)
    leaf = x509.load_pem_x509_certificate(chain[0].encode())
    start, end = leaf.not_valid_before_utc.timestamp(), leaf.not_valid_after_utc.timestamp()
    assert end - start == 600 + 120  # 10 minutes, NotBefore backdated 2
    [(ski, renew_by)] = ca.max_peer_renew_by.items()
    assert renew_by == start + 360  # 4 minutes after issue
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert ski == aki.key_identifier
    ca.sign_for_peer(csr, [ident], 600 * 2)
    assert ca.max_peer_renew_by[ski] > renew_by  # the latest one counts
