"""Attested mode with real processes in real pod cgroups (cgroup v2, kubelet's cgroupfs
layout ``kubepods/besteffort/pod<uid>/<container>``), real SO_PEERCRED through the front door, and a
dict-backed ObjectStore standing in for the config source (built by another package).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import uuid

import pytest

from agent.sds.server import SdsServer
from tests.sds.helpers import executor_runner, make_config
from tests.sds.store import DictStore, pod

CGROUP2 = "/sys/fs/cgroup/unified"

CLIENT = r"""
import sys, grpc
from cryptography import x509
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc
sys.stdin.readline()  # wait until the test moved us into our cgroup
with grpc.insecure_channel("unix:" + sys.argv[1]) as ch:
    stub = sds_pb2_grpc.SecretDiscoveryServiceStub(ch)
    try:
        resp = stub.FetchSecrets(discovery_pb2.DiscoveryRequest(resource_names=["default"]),
                                 timeout=20)
    except grpc.RpcError as e:
        print("ERROR", e.code().name, e.details())
        sys.exit(0)
s = secret_pb2.Secret(); resp.resources[0].Unpack(s)
cert = x509.load_pem_x509_certificate(s.tls_certificate.certificate_chain.inline_bytes)
san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
print("OK", san.value.get_values_for_type(x509.UniformResourceIdentifier)[0])
"""


class PodCgroups:
    """Real cgroup v2 directories ``<root>/kubepods/besteffort/pod<uid>/<container>`` (a
    process lives in its container's cgroup, as under a kubelet); removed on close."""

    def __init__(self):
        if not os.path.isdir(CGROUP2):
            pytest.skip("no cgroup v2 mount at " + CGROUP2)
        self.root = os.path.join(CGROUP2, f"ambient-test-{secrets.token_hex(4)}")
        self.dirs: list[str] = []

    def make(self, uid: str) -> str:
        path = os.path.join(self.root, "kubepods", "besteffort", f"pod{uid}",
                            secrets.token_hex(8))
        os.makedirs(path)
        self.dirs.append(path)
        return path

    def move(self, path: str, pid: int) -> None:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def close(self) -> None:
        for path in self.dirs:  # move stragglers out, then remove bottom-up
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        with open(os.path.join(CGROUP2, "cgroup.procs"), "w") as root:
                            root.write(pid)
            except OSError:
                pass
        for dirpath, _dirs, _files in sorted(os.walk(self.root), key=lambda w: -len(w[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass


@pytest.fixture
def cgroups():
    cg = PodCgroups()
    try:
        yield cg
    finally:
        cg.close()


async def run_client(socket_path: str, cgroup: str | None, cgroups: PodCgroups) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, socket_path, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if cgroup:
            cgroups.move(cgroup, proc.pid)
        out, err = await asyncio.wait_for(proc.communicate(b"go\n"), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


async def test_two_pods_get_their_own_identity_unknown_callers_denied(state_dir, cgroups):
    """Also: a caller whose Pod object is bound to another node is refused, naming why."""
    uid_a, uid_b, uid_ghost, uid_far = (str(uuid.uuid4()) for _ in range(4))
    run = executor_runner()
    cfg = make_config(state_dir, ecc_signature_algorithm="ECDSA", node_name="node-1")
    store = DictStore([pod(uid_a, "shop", "cart", node="node-1"),
                       pod(uid_b, "bank", "ledger", node="node-1"),
                       pod(uid_far, "bank", "vault", name="vault-0", node="node-2")])
    server = SdsServer(cfg, run, store_getter=lambda: store)
    await server.start()
    try:
        assert oct(os.stat(cfg.sds_socket).st_mode & 0o777) == "0o600"
        a, b, ghost, far = (cgroups.make(u) for u in (uid_a, uid_b, uid_ghost, uid_far))
        results = await asyncio.gather(
            run_client(cfg.sds_socket, a, cgroups), run_client(cfg.sds_socket, b, cgroups),
            run_client(cfg.sds_socket, ghost, cgroups), run_client(cfg.sds_socket, None, cgroups),
            run_client(cfg.sds_socket, far, cgroups))
        assert results[0] == "OK spiffe://cluster.local/ns/shop/sa/cart"
        assert results[1] == "OK spiffe://cluster.local/ns/bank/sa/ledger"
        assert results[2].startswith("ERROR PERMISSION_DENIED") and uid_ghost in results[2]
        assert results[3].startswith("ERROR PERMISSION_DENIED")
        assert "not in a pod cgroup" in results[3]
        assert results[4].startswith("ERROR PERMISSION_DENIED")
        assert "pod bank/vault-0" in results[4] and \
            "bound to node 'node-2', not to this node 'node-1'" in results[4]
        ids = {c["spiffe_id"] for c in server.debug_state()["certificates"]}
        assert ids == {"spiffe://cluster.local/ns/shop/sa/cart",
                       "spiffe://cluster.local/ns/bank/sa/ledger"}
    finally:
        await server.stop(0.5)
        run.pool.shutdown(wait=False)
    assert not os.path.exists(cfg.sds_socket)
