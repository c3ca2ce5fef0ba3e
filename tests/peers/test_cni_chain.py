"""Debian's real CNI plugins (bridge + host-local, loopback) with istio-cni chained, driven
by agent.demo.cni_runtime exactly as a runtime drives a conflist, on a real netns, against the real
CNI event server with a recording enroller (tests/cni/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess

import pytest

from agent.demo.cni_runtime import CniPluginError, CniRuntime
from tests.cni.conftest import launcher, start_agent  # noqa: F401 - fixture
from tests.netns.toolkit import unique

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/lib/cni/bridge"),
                                reason="containernetworking-plugins not installed")


@pytest.fixture
def netns_path():
    name = unique("tc")
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def network(tmp_path, launcher):
    """A conflist with a unique bridge and subnet, ipam state in tmp; the bridge is
    deleted at the end whatever happens."""
    bridge = unique("tcbr")
    subnet = f"10.{secrets.randbelow(50) + 180}.{secrets.randbelow(250)}.0/24"
    conf = {"cniVersion": "1.0.0", "name": unique("tn"), "plugins": [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(tmp_path / "ipam")}},
        {"type": "istio-cni", "cni_agent_run_dir": str(tmp_path / "state"),
         "ambient_default": True},
    ]}
    runtime = CniRuntime([os.path.dirname(launcher), "/usr/lib/cni"], str(tmp_path / "cache"))
    try:
        yield conf, runtime
    finally:
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)


async def test_chain_add_del_on_real_netns(tmp_path, network, netns_path):
    conf, runtime = network
    agent = await start_agent(tmp_path / "state")
    args = {"K8S_POD_NAMESPACE": "demo", "K8S_POD_NAME": "web-0"}
    cid = "c" + secrets.token_hex(8)
    try:
        lo = {"cniVersion": "1.0.0", "name": "lo", "plugins": [{"type": "loopback"}]}
        await asyncio.to_thread(runtime.add, lo, cid, netns_path, "lo", args)
        result = await asyncio.to_thread(runtime.add, conf, cid, netns_path, "eth0", args)
        # what the runtime gets is bridge's result, passed through istio-cni unchanged
        assert result["cniVersion"] == "1.0.0"
        address = result["ips"][0]["address"]
        assert any(i.get("sandbox") == netns_path for i in result["interfaces"])
        [event] = agent.enroller.enrolled
        assert (event.container_id, event.netns, event.ifname) == (cid, netns_path, "eth0")
        assert (event.pod_namespace, event.pod_name) == ("demo", "web-0")
        assert event.ips == [address.split("/")[0]] and event.key == cid
        addrs = subprocess.run(["ip", "-n", os.path.basename(netns_path), "-j", "addr"],
                               capture_output=True, text=True, check=True).stdout
        assert address.split("/")[0] in addrs
        await asyncio.to_thread(runtime.check, conf, cid, netns_path, "eth0", args)

        await asyncio.to_thread(runtime.delete, conf, cid, netns_path, "eth0", args)
        await asyncio.to_thread(runtime.delete, lo, cid, netns_path, "lo", args)
        [gone] = agent.enroller.unenrolled
        assert gone.container_id == cid and gone.ips == event.ips  # DEL got the cached prevResult
        addrs = json.loads(subprocess.run(["ip", "-n", os.path.basename(netns_path), "-j",
                                           "addr"], capture_output=True, text=True).stdout)
        assert [a["ifname"] for a in addrs] == ["lo"]
        assert not os.listdir(tmp_path / "cache")
    finally:
        await agent.server.stop(1)


async def test_enrollment_failure_fails_the_chain_and_del_cleans_up(tmp_path, network,
                                                                    netns_path):
    conf, runtime = network
    agent = await start_agent(tmp_path / "state")
    agent.enroller.fail_with = "in-pod rules failed"
    cid = "c" + secrets.token_hex(8)
    try:
        with pytest.raises(CniPluginError) as err:
            await asyncio.to_thread(runtime.add, conf, cid, netns_path)
        assert err.value.plugin == "istio-cni" and "in-pod rules failed" in err.value.msg
        # the runtime tears the sandbox down after a failed ADD
        await asyncio.to_thread(runtime.delete, conf, cid, netns_path)
        await agent.server.stop(1)
        # DEL with the agent gone and the netns gone still succeeds
        subprocess.run(["ip", "netns", "del", os.path.basename(netns_path)], check=True)
        await asyncio.to_thread(runtime.delete, conf, cid, netns_path)
    finally:
        await agent.server.stop(1)
