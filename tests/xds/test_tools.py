"""Independent clients and tools: state-of-the-world ADS, grpcurl via reflection, the
`ambient-agent xds dump` CLI, metrics and debug_state."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from prometheus_client import generate_latest

from ambient import workload_pb2
from ambient.xds.generators import ADDRESS_TYPE
from tests.xds.fake_index import pod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPCURL = os.path.join(ROOT, ".venv", "bin", "grpcurl")
POD_A = "Kubernetes//Pod/default/a"


async def test_state_of_the_world_stream(server, index):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).StreamAggregatedResources()
        node = base_pb2.Node(id="sidecar~10.0.0.5~app.default~default.svc.cluster.local")
        await call.write(discovery_pb2.DiscoveryRequest(type_url=ADDRESS_TYPE, node=node))
        first = await asyncio.wait_for(call.read(), 5)
        assert len(first.resources) == 3
        await call.write(discovery_pb2.DiscoveryRequest(
            type_url=ADDRESS_TYPE, version_info=first.version_info, response_nonce=first.nonce))
        index.put(pod("a", ip="10.0.0.42"))
        second = await asyncio.wait_for(call.read(), 5)
        assert len(second.resources) == 3 and second.version_info != first.version_info
        addrs = [workload_pb2.Address.FromString(a.value) for a in second.resources]
        assert any(a.workload.addresses == [bytes([10, 0, 0, 42])] for a in addrs)
        call.cancel()


def _grpcurl(*args, stdin=None):
    return subprocess.run([GRPCURL, "-plaintext", *args], input=stdin, capture_output=True,
                          text=True, timeout=20)


async def test_grpcurl_lists_and_calls_the_service(server):
    addr = f"127.0.0.1:{server.port}"
    listed = await asyncio.to_thread(_grpcurl, addr, "list")
    assert "envoy.service.discovery.v3.AggregatedDiscoveryService" in listed.stdout.split()
    request = json.dumps({"type_url": ADDRESS_TYPE, "node": {"id": "ztunnel~1.1.1.1~z.ns~ns.svc"}})
    called = await asyncio.to_thread(
        _grpcurl, "-d", "@", addr,
        "envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources",
        stdin=request)
    assert called.returncode == 0, called.stderr
    resp = json.loads(called.stdout)
    names = {r["name"] for r in resp["resources"]}
    assert POD_A in names
    # the Any payload was decoded through reflection into istio.workload.Address JSON
    wl = next(r for r in resp["resources"] if r["name"] == POD_A)["resource"]
    assert wl["@type"] == ADDRESS_TYPE and wl["workload"]["uid"] == POD_A


async def test_cli_dump_prints_resources_as_json(server):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "xds", "dump", "--addr", f"127.0.0.1:{server.port}",
        "--type", "address", "--type", "authorization", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    data = json.loads(out)
    assert data[ADDRESS_TYPE][POD_A]["workload"]["name"] == "a"
    # IP bytes are printed as IP text, not base64
    assert data[ADDRESS_TYPE][POD_A]["workload"]["addresses"] == ["10.0.0.1"]
    assert "default/deny-9999" in data["type.googleapis.com/istio.security.Authorization"]


async def test_cli_dump_unreachable_server_is_one_line():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "xds", "dump", "--addr", "127.0.0.1:1",
        "--timeout", "2", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert err.decode().count("\n") == 1 and "127.0.0.1:1" in err.decode()


async def test_metrics_and_debug_state(connect, server, index):
    client = await connect()
    await client.wait_synced()
    index.put(pod("a", ip="10.0.0.43"))
    await client.wait(lambda: client.resources()[POD_A].workload.addresses[0][-1] == 43)
    state = server.debug_state()
    [c] = state["clients"]
    assert c["node_id"].startswith("ztunnel~") and c["node_name"] == "node1"
    assert c["types"][ADDRESS_TYPE]["held"] == 3 and c["types"][ADDRESS_TYPE]["wildcard"]
    assert c["types"][ADDRESS_TYPE]["last_nonce"]
    json.dumps(state)
    text = generate_latest(server.registry).decode()
    assert (f'ambient_agent_xds_connected_clients{{proxy_type="ztunnel",type_url="{ADDRESS_TYPE}"}} 1.0'
            in text)
    assert f'ambient_agent_xds_pushes_total{{type_url="{ADDRESS_TYPE}"}} 2.0' in text
    assert f'ambient_agent_xds_push_latency_seconds_count{{type_url="{ADDRESS_TYPE}"}} 1.0' in text
    await client.close()
    await asyncio.sleep(0.1)
    text = generate_latest(server.registry).decode()
    assert (f'ambient_agent_xds_connected_clients{{proxy_type="ztunnel",type_url="{ADDRESS_TYPE}"}} 0.0'
            in text)


async def test_cli_dump_into_a_closed_pipe_is_quiet(server):
    """`ambient-agent xds dump | head -1`: no BrokenPipeError traceback."""
    import subprocess

    def run_like_head() -> tuple[int, bytes]:
        dump = subprocess.Popen([sys.executable, "-m", "agent.cli", "xds", "dump", "--addr",
                                 f"127.0.0.1:{server.port}"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        dump.stdout.close()  # the reader is gone before the dump writes anything
        _, err = dump.communicate(timeout=30)
        return dump.returncode, err

    code, err = await asyncio.to_thread(run_like_head)  # the server runs on this loop
    assert b"Traceback" not in err and code == 0, err.decode()
