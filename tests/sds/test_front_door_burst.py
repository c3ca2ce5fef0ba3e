"""The attested SDS socket under a burst of callers (no root needed).

A node agent restart makes every Envoy on the node reconnect at once, and gRPC clients
connect non-blocking: a connect finding the listen queue full fails at once (EAGAIN),
it does not wait. The front door listened with asyncio's default backlog of 100 and
refused 298 of a burst of 500. The attestation reads a fixture ``/proc/<our pid>/cgroup``
(setting ``proc_dir``) naming a pod of this node, so every caller is a real attested one.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import uuid

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.sds.server import SdsServer
from tests.sds.helpers import executor_runner, make_config, secrets_of
from tests.sds.store import DictStore, pod

BURST = 500
# HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113 §3.4, §6.5)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.fixture
def fd_room():
    """Each proxied caller costs 4 fds in this process (client, accepted, backend client,
    gRPC's accepted): make room for them or skip."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * BURST + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
async def attested(state_dir, tmp_path):
    uid = str(uuid.uuid4())
    proc = tmp_path / "proc" / str(os.getpid())
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/ctr\n")
    store = DictStore([pod(uid, "shop", "cart", node="node-1")])
    run = executor_runner()
    cfg = make_config(state_dir, ecc_signature_algorithm="ECDSA", node_name="node-1",
                      proc_dir=str(tmp_path / "proc"))
    server = SdsServer(cfg, run, store_getter=lambda: store)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.5)
        run.pool.shutdown(wait=False)


async def test_burst_of_raw_connects_is_queued_and_each_reaches_grpc(attested, fd_room):
    path = attested.config.sds_socket
    loop = asyncio.get_running_loop()
    socks, refused = [], 0
    try:
        # all connects happen before the event loop can accept a single one
        for _ in range(BURST):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except (BlockingIOError, ConnectionRefusedError):
                refused += 1
                s.close()
                continue
            socks.append(s)
        assert refused == 0, f"{refused} of {BURST} connects refused"

        async def handshake(s: socket.socket) -> bytes:
            await loop.sock_sendall(s, PREFACE)
            return await asyncio.wait_for(loop.sock_recv(s, 9), 30)

        heads = await asyncio.gather(*(handshake(s) for s in socks))
        # every caller got the gRPC server's SETTINGS frame through the front door
        assert all(len(h) == 9 and h[3] == 0x04 for h in heads)
    finally:
        for s in socks:
            s.close()


async def test_burst_of_grpc_callers_all_get_their_certificate(attested, fd_room):
    path = attested.config.sds_socket
    channels = [grpc.aio.insecure_channel("unix:" + path) for _ in range(BURST)]

    async def fetch(ch):
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(ch)
        resp = await stub.FetchSecrets(
            discovery_pb2.DiscoveryRequest(resource_names=["default"]), timeout=120)
        return list(secrets_of(resp))

    try:
        results = await asyncio.gather(*(fetch(ch) for ch in channels), return_exceptions=True)
    finally:
        await asyncio.gather(*(ch.close() for ch in channels))
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of {BURST} failed, first: {failures[0]!r}"
    assert all(r == ["default"] for r in results)
