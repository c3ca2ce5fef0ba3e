"""A real ztunnel with this agent as its only control plane.

The binary is built by hand from istio/ztunnel (never by this repository) and named by
``AMBIENT_TEST_ZTUNNEL``; without it these tests skip. The node is the demo's node in
a box (:mod:`agent.demo.driver`, ``--ztunnel``): real CNI plugins chaining our ``istio-cni``,
pods as named netns, the agent in this process on a YAML directory source, and ztunnel
as a child process speaking ZDS on the agent's socket and xDS + CA over TLS with a
bearer token (no client certificate), exactly as it does against istiod.

What is shown:

- ztunnel becomes ready; every ambient pod gets an in-pod proxy (``workloadState`` Up in
  ztunnel's ``/config_dump``) and its workload over xDS; the legacy pod gets none;
- ztunnel holds certificates for both pods' SPIFFE identities, issued by our mesh root;
- client → server carries traffic over HBONE with mTLS between both identities
  (ztunnel's ``istio_tcp_connections_opened_total{connection_security_policy="mutual_tls"}``)
  and the STRICT PeerAuthentication of the example cluster refuses plaintext;
- an agent restart (same state dir) with 22 ambient pods drains no proxy: an HBONE
  connection opened before the restart still carries data after it, and ztunnel stops
  no proxy (``workload_manager_proxies_stopped_total`` unchanged);
- a ztunnel restart gets every pod back from the agent's snapshot and HBONE works again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from agent.demo.envoy import free_port

ZTUNNEL = os.environ.get("AMBIENT_TEST_ZTUNNEL", "")
EXTRA_PODS = 20  # ambient pods beyond the demo's, enrolled before the agent restart

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, bridge, iptables)"),
    pytest.mark.skipif(not (ZTUNNEL and os.access(ZTUNNEL, os.X_OK)),
                       reason="AMBIENT_TEST_ZTUNNEL does not name a ztunnel binary (build one "
                              "by hand from istio/ztunnel; see docs/ztunnel.md)"),
]


def _readiness_port_free() -> bool:
    """Free to listen on, as ztunnel binds it (SO_REUSEADDR: a previous ztunnel's
    TIME_WAIT connections do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", 15021))
            return True
        except OSError:
            return False


@pytest.fixture
def readiness_port():
    if not _readiness_port_free():
        pytest.skip("port 15021 (ztunnel's fixed readiness port) is taken on this host")


def test_demo_with_real_ztunnel(tmp_path, readiness_port):
    """The README's main job with ``--ztunnel``: every row passes, nothing is left."""
    workdir = tmp_path / "demo"
    argv = [sys.executable, "-m", "agent.cli", "demo", "--once", "--runtime", "netns",
            "--ztunnel", ZTUNNEL, "--workdir", str(workdir),
            "--status-port", str(free_port()), "--health-port", str(free_port()),
            "--xds-port", str(free_port())]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for subject, check in [("ztunnel", "ready (xDS + CA over TLS, token)"),
                           ("ztunnel", "certificates from our CA"),
                           ("demo/client", "ZDS (in-pod proxy in ztunnel)"),
                           ("demo/server", "ZDS (in-pod proxy in ztunnel)"),
                           ("client -> server:8080", "HBONE through ztunnel"),
                           ("legacy -> server:8080", "plaintext refused (STRICT mTLS)")]:
        assert re.search(rf"^{re.escape(subject)}\S*\s.*{re.escape(check)}\s+ok\b", out,
                         re.M), f"row {subject} / {check} missing or failed:\n{out}"
    assert "clean: no netns" in out, out
    assert not workdir.exists()


def _demo_args(workdir) -> argparse.Namespace:
    return argparse.Namespace(once=True, runtime="netns", image="", workdir=str(workdir),
                              status_port=free_port(), health_port=free_port(), monitoring_port=0,
                              xds_port=free_port(), log_level="warning", ztunnel=ZTUNNEL)


async def _eventually(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s: {what}")
        await asyncio.sleep(0.1)


async def _ztunnel_config_joins(demo, zt, pods) -> None:
    """``ambient-agent ztunnel-config`` against the real ztunnel's admin port and the
    agent's admin socket: each ambient pod is enrolled here, served by our xDS and acked
    over ZDS; certificates and connections views read the real dump too."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from agent import cli as agent_cli

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = agent_cli.main(["ztunnel-config", *argv, "--ztunnel-admin",
                                   f"127.0.0.1:{zt.settings.admin_port}",
                                   "--socket", demo.config.admin_socket])
        return code, out.getvalue(), err.getvalue()

    code, out, err = await asyncio.to_thread(run, "workloads", "-o", "json", "-n", "demo")
    assert code == 0, err
    by_name = {w["name"]: w for w in json.loads(out)}
    for pod in pods:
        assert by_name[pod.name]["agent"] == {"enrolled": "enabled", "xds": True,
                                              "zds_acked": True}, by_name.get(pod.name)
    for view in ("services", "policies", "certificates", "connections"):
        code, out, err = await asyncio.to_thread(run, view)
        assert code == 0 and out, (view, err)


def _open_pod_connection(demo, src, dst_ip: str, port: int) -> socket.socket:
    """A TCP connection made inside ``src``'s netns (so ztunnel captures it); the socket
    stays usable from any thread once connected."""
    from agent.demo.traffic import run_in_pod

    return run_in_pod(src, lambda: socket.create_connection((dst_ip, port), timeout=10))


def _echo(conn: socket.socket, data: bytes) -> bytes:
    conn.sendall(data)
    return conn.recv(4096)


async def _restart_agent(demo) -> None:
    from agent import daemon

    await demo.agent.stop()
    demo.agent = daemon.Agent(demo.config)
    await demo.agent.start()


async def test_restarts_keep_the_mesh(tmp_path, readiness_port):
    from agent.demo.driver import Demo
    from agent.demo.traffic import mtls_connections

    demo = Demo(_demo_args(tmp_path / "node"))
    demo.preflight()
    try:
        await demo.bring_up()
        await demo.verify()
        failed = [c for c in demo.checks if not c.ok]
        assert not failed, failed
        client, server, legacy = demo.pods
        zt = demo.ztunnel

        # certificates: ztunnel fetched both identities from our CA
        dump = await asyncio.to_thread(zt.config_dump)
        identities = {c.get("identity") for c in dump.get("certificates") or []}
        td = demo.config.trust_domain
        for sa in (client.service_account, server.service_account):
            assert f"spiffe://{td}/ns/demo/sa/{sa}" in identities, dump.get("certificates")
        with open(demo.config.mesh_root_file) as f:
            root_pem = f.read()
        chains = [c for c in dump.get("certificates") or []
                  if c.get("identity", "").endswith(f"/sa/{client.service_account}")]
        _assert_chain_from_root(chains[0], root_pem)

        # ambient-agent ztunnel-config: this ztunnel's view joined with the agent's
        await _ztunnel_config_joins(demo, zt, [client, server])

        # more ambient pods, so a snapshot sent before recovery completes would miss some
        from agent.demo.model import DemoPod

        extra = [DemoPod(f"extra{i}", "demo", "client", True) for i in range(EXTRA_PODS)]
        for pod in extra:
            demo.pods.append(pod)
            await demo.start_pod(pod)
        await _eventually(lambda: all(zt.pod_states().get(p.uid) == "Up" for p in extra), 60,
                          "every extra pod's proxy Up in ztunnel")

        # agent restart: the proxies stay, an open HBONE connection keeps working
        conn = await asyncio.to_thread(_open_pod_connection, demo, client, server.ip, 8080)
        try:
            assert await asyncio.to_thread(_echo, conn, b"before\n") == b"before\n"
            stopped_before = _proxies_stopped(await asyncio.to_thread(zt.metrics))
            await _restart_agent(demo)
            # ztunnel reconnects and gets its snapshot from the new agent
            await _eventually(lambda: _zds_connections(demo) >= 1, 30,
                              "ztunnel reconnected to the restarted agent's ZDS socket")
            states = await asyncio.to_thread(zt.pod_states)
            assert all(states.get(p.uid) == "Up" for p in [client, server, *extra]), states
            assert await asyncio.to_thread(_echo, conn, b"after\n") == b"after\n"
            assert _proxies_stopped(await asyncio.to_thread(zt.metrics)) == stopped_before
        finally:
            conn.close()

        # ztunnel restart: every pod comes back from the agent's snapshot
        await asyncio.to_thread(zt.stop)
        await asyncio.to_thread(zt.start)
        await zt.wait_ready_async(timeout=30)
        await _eventually(lambda: {client.uid, server.uid} <= {
            u for u, s in zt.pod_states().items() if s == "Up"}, 30,
            "both pods' proxies Up in the restarted ztunnel")
        src, dst = (f"spiffe://{td}/ns/demo/sa/{client.service_account}",
                    f"spiffe://{td}/ns/demo/sa/{server.service_account}")
        conn = await asyncio.to_thread(_open_pod_connection, demo, client, server.ip, 8080)
        try:
            assert await asyncio.to_thread(_echo, conn, b"again\n") == b"again\n"
        finally:
            conn.close()
        await _eventually(lambda: mtls_connections(zt.metrics(), src, dst) >= 1, 10,
                          "the restarted ztunnel counted the mTLS connection")
    finally:
        await demo.teardown()
    assert not await asyncio.to_thread(demo.leftovers)


def _zds_connections(demo) -> int:
    """ztunnel connections of the (new) agent whose snapshot is complete."""
    state = demo.agent.zds.debug_state()
    return sum(1 for c in state.get("connections") or [] if c.get("snapshot_sent"))


def _proxies_stopped(metrics: str) -> float:
    m = re.search(r"^workload_manager_proxies_stopped_total (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else 0.0


def _assert_chain_from_root(cert_entry: dict, root_pem: str) -> None:
    """An entry of ztunnel's ``/config_dump`` ``certificates`` (``identity``, ``state``,
    ``certChain`` and ``rootCerts`` as ``[{pem (base64 of the PEM), serialNumber, ...}]``):
    Available, its leaf signed by our mesh root, and our root among its roots."""
    import base64

    from cryptography import x509

    def load(entry: dict) -> x509.Certificate:  # admin.rs dump_cert: base64 of the PEM
        return x509.load_pem_x509_certificate(base64.b64decode(entry["pem"]))

    assert cert_entry.get("state") == "Available", cert_entry
    root = x509.load_pem_x509_certificate(root_pem.encode())
    leaf = load(cert_entry["certChain"][0])
    leaf.verify_directly_issued_by(root)  # raises if not signed by our root
    roots = [load(c) for c in cert_entry.get("rootCerts") or []]
    assert root in roots, [r.subject for r in roots]
