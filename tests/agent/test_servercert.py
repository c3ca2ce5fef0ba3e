"""Server certificates of the TLS ports: renewed in the background and on demand with an
injected clock, a failed renewal keeps the current certificate, bad certificates are
refused; and the TLS front door's client-certificate policy (optional, verified when
presented) over real TLS handshakes."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from agent.sds.ca_embedded import EmbeddedCA
from agent.tlsport.servercert import ServerCertificate, TlsMaterial, check_server_leaf, server_names
from agent.tlsport.frontdoor import TlsFrontDoor
from tests.xds.certs import Pki


class Clock:
    def __init__(self):
        import time
        self.now = time.time()

    def __call__(self):
        return self.now


@pytest.fixture
def ca(tmp_path):
    clock = Clock()
    ca = EmbeddedCA.load_or_create(tmp_path / "ca", "cluster.local")
    ca.clock = clock
    return ca, clock


def provider(ca, calls, fail=None):
    async def provide():
        calls.append(1)
        if fail and fail[0]:
            raise RuntimeError("CA down")
        chain, key = ca.issue(["localhost", "127.0.0.1"], "ECDSA", 3600)
        return TlsMaterial(chain, key, ca.root_pem)
    return provide


async def test_background_renewal_follows_the_injected_clock(ca):
    ca, clock = ca
    calls = []
    cert = ServerCertificate("test_port", provider(ca, calls), clock=clock, check_interval=0.01)
    await cert.start()
    try:
        first = cert.material
        assert first.not_after - first.not_before == 3600 + 120
        await asyncio.sleep(0.05)
        assert cert.renewals == 0 and len(calls) == 1
        clock.now = cert.renew_at + 1  # half the lifetime has passed
        for _ in range(100):
            if cert.renewals:
                break
            await asyncio.sleep(0.01)
        assert cert.renewals == 1 and cert.material.not_after > first.not_after
        assert cert.debug_state()["last_error"] is None
    finally:
        await cert.stop()


async def test_failed_renewal_keeps_the_certificate_and_retries(ca, caplog):
    ca, clock = ca
    calls, fail = [], [False]
    cert = ServerCertificate("test_port", provider(ca, calls, fail), clock=clock,
                             check_interval=3600, retry_initial=5, retry_max=60)
    await cert.start()
    try:
        first_ctx = cert.context
        fail[0] = True
        clock.now = cert.renew_at + 1
        assert await cert.current() is first_ctx  # renewal failed: the old one is served
        assert cert.last_error == "CA down" and "renewing the server certificate failed" \
            in caplog.text
        await cert.current()
        assert len(calls) == 2  # backing off: no second attempt inside the 5 s
        fail[0] = False
        clock.now += 6
        assert await cert.current() is not first_ctx and cert.renewals == 1
    finally:
        await cert.stop()


def test_bad_server_certificates_are_refused():
    pki = Pki()
    no_san, _ = pki.leaf(None)
    with pytest.raises(ValueError, match="subjectAltName"):
        check_server_leaf(no_san)
    names = server_names("istio-system", "node-a", ["extra.example", " ", "localhost"])
    assert names[:3] == ["localhost", "127.0.0.1", "::1"]
    assert "istiod.istio-system.svc" in names and names.count("localhost") == 1
    assert names[-2:] == ["node-a", "extra.example"]


async def _handshake(port, root, cert=None, key=None, tmp_path=None):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=root.decode())
    ctx.set_alpn_protocols(["h2"])
    if cert:
        (tmp_path / "c.pem").write_bytes(cert + key)
        ctx.load_cert_chain(str(tmp_path / "c.pem"))
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                   server_hostname="localhost")
    # TLS 1.3: the server judges the client certificate after the client's Finished, so
    # a refusal shows on the first read.
    writer.write(b"x")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(1), 5)
    writer.close()
    return data


async def test_front_door_client_certificate_optional_and_verified(tmp_path):
    mesh, other = Pki(), Pki("another root")
    server_cert, server_key = mesh.leaf(None, dns=["localhost"])

    async def provide():
        return TlsMaterial(server_cert, server_key, mesh.root_pem)

    cert = ServerCertificate("test_port", provide)
    await cert.start()
    seen = []

    async def backend(reader, writer):  # echo, and remember who the door says it was
        seen.append(door.peers.copy())
        writer.write(await reader.read(1))
        await writer.drain()
        writer.close()

    sock = tmp_path / "b.sock"
    server = await asyncio.start_unix_server(backend, str(sock))
    door = TlsFrontDoor("test_port", "127.0.0.1", 0, str(sock), cert)
    await door.start()
    try:
        assert await _handshake(door.port, mesh.root_pem) == b"x"  # no client certificate
        [peers] = seen
        [peer] = peers.values()
        assert peer.cert_der is None and peer.alpn == "h2" and peer.version == "TLSv1.3"
        c, k = mesh.leaf("spiffe://cluster.local/ns/a/sa/b")
        assert await _handshake(door.port, mesh.root_pem, c, k, tmp_path) == b"x"
        [peer] = seen[1].values()
        assert peer.spiffe_ids == ["spiffe://cluster.local/ns/a/sa/b"]
        c, k = other.leaf("spiffe://cluster.local/ns/a/sa/b")
        try:  # refused: an alert or a closed connection, never the backend's answer
            answer = await _handshake(door.port, mesh.root_pem, c, k, tmp_path)
        except (ssl.SSLError, ConnectionError):
            answer = None
        assert answer in (None, b"")
        assert door.handshake_failures == 1 and len(seen) == 2
        assert not door.peers  # forgotten when the connections closed
    finally:
        await door.stop()
        server.close()
        await cert.stop()


async def test_front_door_bounds_connections_and_handshakes(tmp_path):
    mesh = Pki()
    server_cert, server_key = mesh.leaf(None, dns=["localhost"])

    async def provide():
        return TlsMaterial(server_cert, server_key, mesh.root_pem)

    cert = ServerCertificate("test_port", provide)
    await cert.start()
    door = TlsFrontDoor("test_port", "127.0.0.1", 0, str(tmp_path / "none.sock"), cert,
                        max_connections=1, handshake_timeout=0.3)
    await door.start()
    try:
        silent = await asyncio.open_connection("127.0.0.1", door.port)  # never says hello
        await asyncio.sleep(0.05)
        second = await asyncio.open_connection("127.0.0.1", door.port)
        # past the cap the newcomer takes the place of the unfinished handshake
        assert await asyncio.wait_for(silent[0].read(), 5) == b""
        assert door.handshakes_displaced == 1 and door.refused_over_limit == 0
        assert await asyncio.wait_for(second[0].read(), 5) == b""  # handshake timed out
        assert door.handshake_failures == 1
        for _, w in (silent, second):
            w.close()
    finally:
        await door.stop()
        await cert.stop()


@pytest.mark.parametrize("ttl", [60, 120, 300])
async def test_short_certificates_renew_from_their_real_validity_not_in_a_loop(ca, ttl):
    """Issue 26: a certificate of 2 minutes or less, NotBefore backdated 2 minutes, was due
    for renewal at once (half of [NotBefore, NotAfter] is already past), so the TLS port
    renewed thousands of times a second. Renewal is computed from when the certificate
    arrived; the counter shows no storm over 10 simulated minutes."""
    ca, clock = ca
    calls = []

    async def provide():
        calls.append(1)
        chain, key = ca.issue(["localhost"], "ECDSA", ttl)
        return TlsMaterial(chain, key, ca.root_pem)

    cert = ServerCertificate("test_port", provide, clock=clock, check_interval=0.005)
    await cert.start()
    try:
        m = cert.material
        assert m.not_after - m.not_before == ttl + 120  # backdated: the span is longer
        assert cert.renew_at == pytest.approx(clock() + ttl / 2, abs=1)
        start = clock.now
        while clock.now < start + 600:  # 10 minutes, in 1 s steps
            clock.now += 1
            await asyncio.sleep(0.002)
            await cert.current()
        # one renewal per half-lifetime (±1), never a loop
        assert len(calls) - 1 <= 600 / (ttl / 2) + 1, len(calls)
        assert len(calls) - 1 >= 600 / (ttl / 2) - 2, len(calls)
    finally:
        await cert.stop()


def test_node_local_material_names_hosts_and_keeps_no_issuer_key():
    """Remote-CA mode's serving certificate: DNS and IP SANs a hostname check accepts (the
    strict RFC 5280 verifier of ``cryptography``, as rustls/webpki), the SPIFFE ID as a URI,
    a leaf that is no CA, and an issuer whose key is nowhere in what is returned."""
    import datetime as dt

    from cryptography import x509
    from cryptography.x509 import verification

    from agent.tlsport.servercert import check_server_leaf, node_local_material, server_context

    material, issuer_pem = node_local_material(
        ["localhost", "127.0.0.1", "istiod.istio-system.svc", "localhost"],
        "spiffe://cluster.local/ns/istio-system/sa/ambient-agent")
    leaf = x509.load_pem_x509_certificate(material.cert_chain_pem)
    issuer = x509.load_pem_x509_certificate(issuer_pem)
    check_server_leaf(material.cert_chain_pem)
    server_context(material)  # the key matches the leaf
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert issuer.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 0
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "istiod.istio-system.svc"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://cluster.local/ns/istio-system/sa/ambient-agent"]
    now = dt.datetime.now(dt.timezone.utc)
    for name in ("istiod.istio-system.svc", "localhost"):
        verifier = (verification.PolicyBuilder().store(verification.Store([issuer])).time(now)
                    .build_server_verifier(verification.DNSName(name)))
        verifier.verify(leaf, [])
    with pytest.raises(verification.VerificationError):
        (verification.PolicyBuilder().store(verification.Store([issuer])).time(now)
         .build_server_verifier(verification.DNSName("elsewhere.example"))).verify(leaf, [])
    assert b"PRIVATE KEY" not in issuer_pem and material.key_pem.count(b"PRIVATE KEY") == 2
    assert material.not_after - material.not_before >= 365 * 24 * 3600
    with pytest.raises(ValueError, match="no server names"):
        node_local_material([" ", ""])
