"""SDS benchmarks.

1. Issue 200 distinct identities through SDS (FetchSecrets over the Unix socket, 8 in
   flight, embedded CA), ECDSA and RSA, against a floor of the same work done directly
   with ``cryptography`` in the same run and the same thread-pool width: key generation,
   CSR, CSR parse + leaf signing. Target ratio <= 1.3.
   (Callers are identified by a benchmark-only ``identify`` hook reading a metadata
   header, because 200 distinct pods would need 200 cgroups; attestation cost is a
   cgroup file read, measured by the attested test, not here.)
2. Envoy from process start to serving TLS with our SDS secrets (``/ready`` and a
   completed TLS handshake), next to the same Envoy with the same certificate inline in
   its bootstrap (no SDS) as the floor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import ssl
import tempfile
import time
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent import config as agent_config
from agent.envoy import EnvoyProcess, free_port, sds_tls_bootstrap
from agent.sds import keys
from agent.sds.ca_embedded import EmbeddedCA
from agent.sds.server import SdsServer
from benchmarks.common import Result, ratio_result

N = 200
WIDTH = 8


def _config(state_dir: Path, **overrides) -> agent_config.Config:
    cfg = agent_config.load(flags={"state_dir": str(state_dir)}, env={})
    return cfg.replace(workload_certs_dir=str(state_dir / "none"), **overrides)


def _floor(ca: EmbeddedCA, algorithm: str, pool) -> float:
    def one(i: int) -> None:
        sid = f"spiffe://cluster.local/ns/bench/sa/floor-{algorithm}-{i}"
        _key, csr = keys.new_key_and_csr(algorithm, [sid])
        ca.sign(csr, [sid], 3600)

    t0 = time.perf_counter()
    list(pool.map(one, range(N)))
    return time.perf_counter() - t0


async def _through_sds(state_dir: Path, algorithm: str, pool) -> tuple[float, float, float]:
    """Returns ``(sds_seconds, floor_seconds, cached_seconds)`` for ``N`` identities;
    ``cached_seconds`` is the same ``N`` fetches again, served from the cache (the gRPC
    transport's share)."""
    loop = asyncio.get_running_loop()

    async def run(fn, *args):
        return await loop.run_in_executor(pool, fn, *args)

    def identify(context):
        return keys.Identity.parse(dict(context.invocation_metadata())["bench-identity"])

    cfg = _config(state_dir, ecc_signature_algorithm=algorithm if algorithm == "ECDSA" else "",
                  secret_ttl=3600.0)
    server = SdsServer(cfg, run, identify=identify)
    await server.start()
    try:
        floor = _floor(server.embedded, algorithm, pool)  # same CA, same pool, server idle
        sem = asyncio.Semaphore(WIDTH)
        async with grpc.aio.insecure_channel("unix:" + cfg.sds_socket) as channel:
            stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)

            async def fetch(i: int) -> None:
                sid = f"spiffe://cluster.local/ns/bench/sa/{algorithm.lower()}-{i}"
                async with sem:
                    resp = await stub.FetchSecrets(
                        discovery_pb2.DiscoveryRequest(resource_names=["default"]),
                        metadata=(("bench-identity", sid),))
                assert len(resp.resources) == 1

            await fetch(-1)  # warm the channel
            t0 = time.perf_counter()
            await asyncio.gather(*(fetch(i) for i in range(N)))
            elapsed = time.perf_counter() - t0
            t0 = time.perf_counter()
            await asyncio.gather(*(fetch(i) for i in range(N)))
            cached = time.perf_counter() - t0
    finally:
        await server.stop(0.5)
    return elapsed, floor, cached


def _tls_handshake(port: int, root: bytes) -> None:
    ctx = ssl.create_default_context(cadata=root.decode())
    ctx.check_hostname = False
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw):
            pass


async def _envoy_start(state_dir: Path) -> tuple[float, float]:
    """Seconds from spawn to a completed TLS handshake: with SDS, and with inline certs."""
    pool = concurrent.futures.ThreadPoolExecutor(4)
    loop = asyncio.get_running_loop()

    async def run(fn, *args):
        return await loop.run_in_executor(pool, fn, *args)

    cfg = _config(state_dir, service_account="bench", pod_namespace="bench",
                  ecc_signature_algorithm="ECDSA")
    server = SdsServer(cfg, run)
    await server.start()
    try:
        await server._tasks[0]  # warm-up done: measure Envoy, not the first CSR
        root = server.root_pem()
        pair = await server.certificate_for([server.fixed.spiffe_id])

        async def measure(bootstrap: dict, workdir: Path) -> float:
            envoy = EnvoyProcess(bootstrap, workdir).start()
            port = bootstrap["static_resources"]["listeners"][0]["address"][
                "socket_address"]["port_value"]
            try:
                await envoy.wait_ready_async()
                while True:
                    try:
                        await asyncio.to_thread(_tls_handshake, port, root)
                        break
                    except (OSError, ssl.SSLError):
                        await asyncio.sleep(0.005)
                return time.monotonic() - envoy.started_at
            finally:
                envoy.stop()

        sds_times, inline_times = [], []
        for i in range(3):
            b = sds_tls_bootstrap(cfg.sds_socket, free_port(), free_port())
            sds_times.append(await measure(b, state_dir / f"envoy-sds-{i}"))
            b = sds_tls_bootstrap(cfg.sds_socket, free_port(), free_port())
            ctx = b["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"][
                "typed_config"]["common_tls_context"]
            ctx.pop("tls_certificate_sds_secret_configs")
            ctx.pop("combined_validation_context")
            ctx["tls_certificates"] = [{"certificate_chain": {"inline_bytes": _b64(pair.chain)},
                                        "private_key": {"inline_bytes": _b64(pair.key)}}]
            inline_times.append(await measure(b, state_dir / f"envoy-inline-{i}"))
        return min(sds_times), min(inline_times)
    finally:
        await server.stop(0.5)
        pool.shutdown(wait=False)


def _b64(data: bytes) -> str:
    import base64
    return base64.b64encode(data).decode()


async def run() -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-sds-") as tmp:
        pool = concurrent.futures.ThreadPoolExecutor(WIDTH, thread_name_prefix="bench-blocking")
        try:
            for algorithm in ("ECDSA", "RSA"):
                state = Path(tmp) / algorithm
                state.mkdir(mode=0o700)
                sds_s, floor_s, cached_s = await _through_sds(state, algorithm, pool)
                results.append(ratio_result(
                    f"SDS: {N} distinct {algorithm} identities issued", sds_s * 1000,
                    floor_s * 1000, "ms", 1.3,
                    note=f"floor: keygen+CSR+sign with cryptography, {WIDTH} threads"))
                results.append(Result(
                    f"SDS: same {N} {algorithm} fetches again (cached, transport only)",
                    cached_s * 1000, "ms", floor_s * 1000, "report", None,
                    "gRPC-over-UDS cost per call, for reading the row above"))
        finally:
            pool.shutdown(wait=True)
        state = Path(tmp) / "envoy"
        state.mkdir(mode=0o700)
        try:
            sds_t, inline_t = await _envoy_start(state)
            results.append(Result("Envoy start → TLS served with SDS secrets", sds_t * 1000, "ms",
                                  inline_t * 1000, "report", None,
                                  "floor: same Envoy with the certificate inline (no SDS)"))
        except Exception as e:  # noqa: BLE001 - Envoy missing: report, don't crash the run
            results.append(Result(f"Envoy start (skipped: {e})", 0.0, "ms"))
    return results
