"""Rootful podman (CNI backend, runc; ``docs/maintainers/testing.md``) running a container on a
network
whose conflist has istio-cni chained by our installer: the container starts, the (test)
enroller records its ADD, and its DEL arrives when the container exits. podman uses a
private containers.conf (CONTAINERS_CONF, written by agent.demo.podman) and a tmp
network_config_dir, so the host's podman and CNI configuration are untouched."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess

import pytest

from agent.demo import podman
from cni.install import Installer
from tests.cni.conftest import start_agent
from tests.netns.toolkit import unique

pytestmark = [pytest.mark.podman,
              pytest.mark.skipif(not podman.available(), reason="podman or runc not installed")]


@pytest.fixture
def podman_env(tmp_path):
    """(env, network name, image, installer); image and bridge removed at the end."""
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    conf_dir.mkdir()
    podman.write_containers_conf(tmp_path / "containers.conf", [bin_dir, "/usr/lib/cni"],
                                 conf_dir)
    pm = podman.Podman(tmp_path / "containers.conf")
    env = pm.env
    bridge, name = unique("tpbr"), unique("tpnet")
    subnet = f"10.{secrets.randbelow(50) + 120}.{secrets.randbelow(250)}.0/24"
    (conf_dir / f"50-{name}.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": name, "plugins": [
            {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(tmp_path / "ipam")}}]}))
    image = f"localhost/ambient-cni-test:{secrets.token_hex(4)}"
    pm.import_busybox(image)
    installer = Installer(conf_dir=str(conf_dir), bin_dir=str(bin_dir),
                          run_dir=str(tmp_path / "state"), ambient_default=True)
    try:
        yield env, name, image, installer
    finally:
        pm.run("rmi", "-f", image, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


async def podman_run(env, network, image, *cmd):
    proc = await asyncio.create_subprocess_exec(
        "podman", "run", "--rm", "--network", network, image, *cmd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


async def test_podman_container_is_enrolled_and_removed(tmp_path, podman_env):
    env, network, image, installer = podman_env
    installer.install()
    agent = await start_agent(tmp_path / "state")
    try:
        rc, out, err = await podman_run(env, network, image, "/bin/busybox", "ip", "-4", "addr")
        assert rc == 0, err
        [event] = agent.enroller.enrolled
        assert event.ips and event.ips[0] in out  # the address the container saw
        assert "netns" in event.netns and event.ifname == "eth0"
        assert event.key == event.container_id
        [gone] = agent.enroller.unenrolled
        assert gone.container_id == event.container_id
    finally:
        await agent.server.stop(1)


async def test_podman_refuses_to_start_unmeshed_when_enrollment_fails(tmp_path, podman_env):
    env, network, image, installer = podman_env
    installer.install()
    agent = await start_agent(tmp_path / "state")
    agent.enroller.fail_with = "no ztunnel connected"
    try:
        rc, out, err = await podman_run(env, network, image, "/bin/busybox", "true")
        assert rc != 0 and "no ztunnel connected" in err
    finally:
        await agent.server.stop(1)
