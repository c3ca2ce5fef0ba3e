"""2,000 idle connections to the status port must not take the node down (bounded load test).

Once, 1,100 idle connections from one pod exhausted the agent's 1,024 fds: health, CNI
ADD, ZDS and SDS failed together and the log grew 112 MB in 40 s (a traceback per failed
accept). Here a real ``ambient-agent run`` process, under the open-files limit of our
systemd unit (``LimitNOFILE`` in systemd/ambient-agent.service) and under 1,024, gets 2,000
connections to its status port that send nothing, twice; while they are open a CNI ADD is
answered over the event socket, a ztunnel (our ZDS client) gets its snapshot, SDS issues a
certificate, the health port and the admin socket answer; the log stays under 1 MB and
never mentions running out of files. Needs root (the agent enters netns, binds ports).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.demo.envoy import free_port
from tests.agent.test_run_signals import (EXPECTED_SOCKETS, ROOT_ONLY, node_netns,  # noqa: F401
                                          sockets_under)
from agent.demo.fake_ztunnel import FakeZtunnel

REPO = Path(__file__).resolve().parents[2]
IDLE = 2000


def unit_nofile() -> int:
    text = (REPO / "systemd" / "ambient-agent.service").read_text()
    return int(re.search(r"^LimitNOFILE=(\d+)", text, re.M).group(1))


def settable(nofile: int) -> int:
    """``nofile``, or this machine's hard limit when a process may not raise its hard
    limit that far (no CAP_SYS_RESOURCE in some containers)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or nofile <= hard:
        return nofile
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, nofile))
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(
            resource.RLIMIT_NOFILE)[0], hard))
        return nofile
    except (ValueError, OSError):
        print(f"note: RLIMIT_NOFILE {nofile} cannot be set here; using the hard limit {hard}")
        return hard


POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "web-0", "namespace": "demo", "uid": "uid-web-0"},
       "spec": {"nodeName": "load-node", "serviceAccountName": "web"},
       "status": {"podIP": "10.9.0.5", "phase": "Running"}}
EVENT = {"command": "ADD", "container_id": "cid-1", "netns": "/var/run/netns/none",
         "pod_name": "web-0", "pod_namespace": "demo", "pod_uid": "uid-web-0",
         "ips": ["10.9.0.5"]}


@pytest.fixture
def client_fds():
    """This test process holds the 2,000 client sockets: make room (or skip)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def state():
    path = Path(tempfile.mkdtemp(prefix="load-"))  # short: AF_UNIX paths
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start(state: Path, node_netns: str, nofile: int, log, *extra: str
          ) -> tuple[subprocess.Popen, dict]:
    ports = {"status": free_port(), "health": free_port(), "xds": free_port()}
    cluster = state / "cluster"
    cluster.mkdir()
    (cluster / "pod.json").write_text(json.dumps(POD))
    argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(state),
            "--xds-tls-port", "0", "--host-rules-netns", node_netns, "--log-level", "info",
            "--node-name", "load-node", "--status-port", str(ports["status"]),
            "--health-port", str(ports["health"]), "--xds-port", str(ports["xds"]),
            "--monitoring-port", "0", "--ztunnel-wait", "1", "--ecc-signature-algorithm", "ECDSA",
            *extra]
    env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(state / "ztunnel" / "ztunnel.sock"),
               SERVICE_ACCOUNT="web", POD_NAMESPACE="demo")

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=limit, cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if EXPECTED_SOCKETS | {"admin.sock"} <= sockets_under(str(state)):
            return proc, ports
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise AssertionError(f"agent did not come up: {sockets_under(str(state))}")


async def flood(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to ``port`` that never send a byte (connect errors tolerated:
    the listen queue may be full for an instant)."""
    loop = asyncio.get_running_loop()
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 5)
            out.append(s)
        except (OSError, asyncio.TimeoutError):
            s.close()
    return out


async def node_local_services_work(state: Path, ports: dict) -> None:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(str(state / "pluginevent.sock")),
            timeout=timeout) as s:
        async with s.post("http://localhost/cmdadd", json=EVENT) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["ambient"] is False
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(f"http://127.0.0.1:{ports['health']}/healthz") as r:
            assert r.status == 200
    async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(str(state / "admin.sock")), timeout=timeout) as s:
        async with s.get("http://localhost/debug/components") as r:
            assert r.status == 200 and "zds" in await r.json()
    zds = FakeZtunnel(str(state / "ztunnel" / "ztunnel.sock"))
    task = asyncio.create_task(zds.run())
    try:
        await zds.wait_snapshot(timeout=10)
    finally:
        zds.stop()
        await asyncio.wait_for(task, 10)
    async with grpc.aio.insecure_channel(
            "unix:" + str(state / "workload-spiffe-uds" / "socket")) as ch:
        resp = await sds_pb2_grpc.SecretDiscoveryServiceStub(ch).FetchSecrets(
            discovery_pb2.DiscoveryRequest(resource_names=["default"]), timeout=20)
        assert len(resp.resources) == 1


@ROOT_ONLY
@pytest.mark.parametrize("nofile", ["unit", 1024], ids=["unit-LimitNOFILE", "1024"])
async def test_idle_flood_on_status_port_leaves_cni_zds_sds_working(state, node_netns,
                                                                   client_fds, nofile):
    nofile = settable(unit_nofile()) if nofile == "unit" else nofile
    log_path = state / "agent.log"
    with open(log_path, "wb") as log:
        # the flood stands for many pods at once (many addresses), which only the global
        # cap and the fd budget stop; from one loopback address the per-source cap
        # (tests/status/test_health_starvation.py) would stop it first, so it is off here
        proc, ports = start(state, node_netns, nofile, log, "--max-connections-per-source", "0")
        held: list[socket.socket] = []
        try:
            for _ in range(2):
                held = await flood(ports["status"], IDLE)
                await asyncio.sleep(0.5)
                await node_local_services_work(state, ports)
                for s in held:
                    s.close()
                held = []
            assert proc.poll() is None, "the agent died"
        finally:
            for s in held:
                s.close()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    text = log_path.read_text(errors="replace")
    assert log_path.stat().st_size < 1_000_000, f"log grew to {log_path.stat().st_size} bytes"
    assert "Too many open files" not in text and "out of system resource" not in text
    assert "Traceback" not in text
    # the cap was hit (the flood is larger than it) and said so, rate-limited: idle
    # connections make room for new ones (the least recently active one is closed)
    assert 1 <= text.count("connections open, the cap") <= 3, text[-2000:]
    assert "closing the least recently active connection" in text, text[-2000:]
