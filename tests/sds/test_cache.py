"""Secret cache: rotation timing vectors, trust merging, eager
rotation with CA outages, expiry and clock skew. The CA is the real embedded CA."""

from __future__ import annotations

import asyncio
import time

import pytest

from agent.sds import keys
from agent.sds.ca_embedded import EmbeddedCA
from agent.sds.ca_istio import EmbeddedCAClient
from agent.sds.cache import CacheError, SecretCache, rotate_delay
from tests.sds.helpers import SwitchableCA, executor_runner

ID = "spiffe://cluster.local/ns/a/sa/b"
H = 3600.0


@pytest.mark.parametrize("ratio, expected", [(0.5, 1800), (0.25, 2700), (0.75, 900), (1, 0),
                                             (0, 3600)])
def test_rotate_delay_vectors(ratio, expected):
    now = 1000.0
    assert rotate_delay(now, now + H, ratio, 0, now) == pytest.approx(expected)


def test_rotate_delay_edges_and_jitter():
    now = 1000.0
    assert rotate_delay(now - 2, now - 1, 0.5, 0, now) == 0
    assert rotate_delay(now + 1800, now + 5400, 0.25, 0, now) == pytest.approx(4500, abs=5)
    for _ in range(200):
        assert 1800 <= rotate_delay(now, now + H, 0, 0.5, now) <= 3600
        assert 0 <= rotate_delay(now, now + H, 1, 0.5, now) <= 1800
        assert 0 <= rotate_delay(now, now + H, 0.5, 0.5, now) <= 3600


def test_concat_and_merge_trust():
    assert keys.concat_certs([]) == ""
    assert keys.concat_certs(["a"]) == "a"
    assert keys.concat_certs(["a", "b"]) == "a\nb"
    assert keys.concat_certs(["a\n", "b"]) == "a\nb"
    c1 = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----"
    c2 = b"-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----"
    assert keys.merge_trust(c2 + b"\n" + c1 + b"\n", c1) == c1 + b"\n" + c2


def test_key_algorithm_setting():
    assert keys.key_algorithm("") == "RSA"
    assert keys.key_algorithm("ECDSA") == "ECDSA"
    with pytest.raises(ValueError, match="unsupported EC signature algorithm"):
        keys.key_algorithm("ED25519")


@pytest.fixture
async def ca(tmp_path):
    run = executor_runner()
    embedded = await run(EmbeddedCA.load_or_create, tmp_path / "ca", "cluster.local")
    yield SwitchableCA(EmbeddedCAClient(embedded, run)), run
    run.pool.shutdown(wait=False)


async def test_one_csr_for_a_burst_and_root_announced_once(ca):
    client, run = ca
    cache = SecretCache(client, run, "ECDSA", ttl=H)
    events = []
    cache.subscribe(lambda sid, name: events.append((sid, name)))
    items = await asyncio.gather(*(cache.workload(ID) for _ in range(10)))
    assert len({id(i) for i in items}) == 1 and cache.csr_count == 1
    assert events == [(None, "ROOTCA")]
    assert await cache.root_bundle(ID) == keys.merge_trust(items[0].root)
    await cache.close()


async def test_outage_keeps_cached_until_expiry_never_expired(ca):
    client, run = ca
    cache = SecretCache(client, run, "ECDSA", ttl=3, max_retry_interval=0.3)
    first = await cache.workload(ID)
    cache.watch(ID)
    events = []
    cache.subscribe(lambda sid, name: events.append((sid, name)))
    client.down = True
    await asyncio.sleep(2.0)  # rotation due at ~1.5 s fails; the cached cert is still served
    assert client.failures >= 1
    assert await cache.workload(ID) is first
    await asyncio.sleep(first.expire - time.time() + 0.5)  # past expiry
    assert (ID, "default") in events  # watchers were told it is gone
    with pytest.raises(CacheError, match="failed to generate workload certificate"):
        await cache.workload(ID)
    client.down = False
    fresh = await cache.workload(ID)
    assert fresh.serial != first.serial and fresh.expire > time.time()
    await cache.close()


async def test_unwatched_identity_is_dropped_not_renewed(ca):
    client, run = ca
    cache = SecretCache(client, run, "ECDSA", ttl=2)
    await cache.workload(ID)
    await asyncio.sleep(1.5)
    assert ID not in cache.items and cache.csr_count == 1
    await cache.close()


async def test_clock_skew_is_a_clear_error(ca):
    client, run = ca
    behind = SecretCache(client, run, "ECDSA", ttl=H, clock=lambda: time.time() - 86400)
    with pytest.raises(CacheError, match="clock skew: certificate from the CA is not valid before"):
        await behind.workload(ID)
    ahead = SecretCache(client, run, "ECDSA", ttl=H, clock=lambda: time.time() + 2 * H)
    with pytest.raises(CacheError, match="clock skew: certificate from the CA expired"):
        await ahead.workload(ID)


async def test_rsa_default_key_and_csr_shape(ca):
    client, run = ca
    cache = SecretCache(client, run, "RSA", ttl=H)
    item = await cache.workload(ID)
    assert item.key.startswith(b"-----BEGIN RSA PRIVATE KEY-----")
    assert b"PRIVATE KEY" not in item.chain
    from cryptography import x509
    key_pem, csr_pem = keys.new_key_and_csr("ECDSA", [ID])
    assert key_pem.startswith(b"-----BEGIN EC PRIVATE KEY-----")
    csr = x509.load_pem_x509_csr(csr_pem)
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical and san.value.get_values_for_type(x509.UniformResourceIdentifier) == [ID]
    assert len(csr.subject) == 0
    await cache.close()


async def test_local_ca_path_matches_the_remote_path(tmp_path):
    """The embedded CA's one-hop issuance (validity read from the built certificate, no
    PEM re-parse) yields exactly what parsing the returned chain says, the CSR is still
    counted (made and verified), and a CA rejection still surfaces as CacheError."""
    run = executor_runner()
    try:
        embedded = await run(EmbeddedCA.load_or_create, tmp_path / "ca", "cluster.local")
        client = EmbeddedCAClient(embedded, run)
        cache = SecretCache(client, run, "ECDSA", ttl=H)
        item = await cache.workload(ID)
        not_before, not_after, serial = keys.leaf_validity(item.chain)
        assert (item.serial, item.expire) == (serial, not_after.timestamp())
        assert not_before.timestamp() < time.time() < item.expire
        leaf = keys.load_certs(item.chain)[0]
        assert keys.uri_sans(leaf) == [ID] and cache.csr_count == 1
        assert keys.key_matches_cert(item.key, item.chain)
        assert item.root == embedded.root_pem
        chain, validity = client.sign_with_validity_blocking(
            keys.new_key_and_csr("ECDSA", [ID])[1], 60, ID)
        assert validity == keys.leaf_validity(chain[0])
        too_long = SecretCache(client, run, "ECDSA", ttl=91 * 24 * 3600)
        with pytest.raises(CacheError, match="max allowed TTL"):
            await too_long.workload(ID + "x")
        await cache.close()
        await too_long.close()
    finally:
        run.pool.shutdown(wait=False)
