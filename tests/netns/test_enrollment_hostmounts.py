"""Enrollment in the DaemonSet layout: the runtime's netns path is a host path, the agent
sees the host under ``host_mounts_path`` (upstream ``/host``).

The container's mounts are stood in for by symlinks under a test dir
(``<dir>/proc`` -> ``/proc``, ``<dir>/var/run/netns`` -> ``/var/run/netns``): path
resolution is what matters, and the real enrollment (rules in the pod netns, ZDS add
with the netns fd) runs on real netns pods. Paths as runtimes pass them:
``/proc/<pid>/ns/net`` (containerd/CRI-O pause process), ``/var/run/netns/<name>`` and
podman's ``/run/netns/<name>``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from cni.enrollment import EnrollmentError
from tests.netns.test_enrollment_reconciler import Harness, event, node_netns  # noqa: F401


@pytest.fixture
def host_dir(tmp_path):
    d = tmp_path / "host"
    (d / "var" / "run").mkdir(parents=True)
    os.symlink("/proc", d / "proc")
    os.symlink("/var/run/netns", d / "var" / "run" / "netns")
    return d


@pytest.mark.parametrize("kind", ["proc", "var-run-netns", "run-netns"])
async def test_enrolls_with_translated_netns_path(bridge, state_dir, node_netns, host_dir,
                                                  kind):
    h = await Harness(state_dir, node_netns, host_mounts_path=str(host_dir)).start()
    sleeper = None
    try:
        zt = await h.ztunnel()
        pod = await asyncio.to_thread(bridge.add_pod, "th")
        name = os.path.basename(pod.netns_path)
        if kind == "proc":
            sleeper = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "60"])
            await asyncio.sleep(0.3)  # ip netns exec has switched and exec'd sleep
            host_path = f"/proc/{sleeper.pid}/ns/net"
        elif kind == "var-run-netns":
            host_path = f"/var/run/netns/{name}"
        else:
            host_path = f"/run/netns/{name}"
        ev = event(pod)
        ev.netns = host_path
        await h.enrollment.enroll(ev)
        rec = h.enrollment.records[pod.uid]
        assert rec.netns.startswith(str(host_dir) + "/"), rec.netns
        assert zt.adds[pod.uid] == os.stat(pod.netns_path).st_ino
        assert ":ISTIO_OUTPUT" in pod.exec("iptables-save").stdout
        ev.command = "DEL"
        await h.enrollment.unenroll(ev, is_delete=True)
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        await h.stop()


async def test_untranslatable_path_names_the_mount(bridge, state_dir, node_netns, tmp_path):
    empty = tmp_path / "nothing-mounted"
    empty.mkdir()
    h = await Harness(state_dir, node_netns, host_mounts_path=str(empty)).start()
    try:
        pod = await asyncio.to_thread(bridge.add_pod, "th")
        ev = event(pod)
        ev.netns = "/var/run/docker/netns/abc"
        with pytest.raises(EnrollmentError) as e:
            await h.enrollment.enroll(ev)
        msg = str(e.value)
        assert f"{empty}/var/run/docker/netns/abc" in msg
        assert f"host_mounts_path={empty}: is the runtime's netns path mounted there" in msg
        ev.netns = "relative/ns"
        with pytest.raises(EnrollmentError, match="field 'netns' 'relative/ns' is not an "
                                                  "absolute path"):
            await h.enrollment.enroll(ev)
    finally:
        await h.stop()
