"""With no ztunnel connected, an ambient CNI ADD fails in time with the cause named
(issue 17 item 10), instead of the plugin timing out on an agent that waits
``ztunnel_wait`` (30 s) and reporting a generic "node agent did not answer".

The real ``istio-cni`` plugin (through our launcher, as a runtime runs it), the real CNI
event server, real enrollment into a real netns pod, the real ZDS server with nobody
connected; host probe sets in a scratch "node" netns.
"""

from __future__ import annotations

import asyncio
import re
import time

from tests.cni.conftest import run_plugin
from tests.netns.test_enrollment_cancel import start, stop
from tests.netns.test_enrollment_pod_ips import plugin_launcher, pod_env
from tests.netns.test_enrollment_reconciler import Harness, node_netns  # noqa: F401
from tests.cni.conftest import net_conf


async def test_add_without_ztunnel_names_the_cause_within_the_plugin_timeout(
        bridge, state_dir, node_netns, tmp_path):
    """Default plugin timeout (5 s) and the default ``ztunnel_wait`` (30 s): the plugin
    exits with code 11 (try again later) before its 5 s are up, and its message says no
    ztunnel connected to the ZDS socket for how long, and to retry. The pod stays pending
    with its rules in place (fail closed) and is handed over once a ztunnel connects."""
    h = await start(Harness(state_dir, node_netns))
    try:
        pod = await asyncio.to_thread(bridge.add_pod, "tz")
        conf = net_conf(h.config.cni_event_socket.rsplit("/", 1)[0], ambient_default=True)
        conf["prevResult"]["ips"] = [{"address": f"{pod.ip}/24", "interface": 0}]
        started = time.monotonic()
        code, out, err = await run_plugin(plugin_launcher(tmp_path), pod_env(h, pod, "ADD"),
                                          conf)
        took = time.monotonic() - started
        assert code == 1 and out["code"] == 11, (out, err)
        sock = re.escape(h.config.ztunnel_uds_address)
        assert re.search(rf"no ztunnel connected to {sock} for (4\.\d|5\.0) s; retry",
                         out["msg"]), out
        assert "did not answer" not in out["msg"]
        assert 4.0 < took < 5.0, took
        assert h.enrollment.pods()[pod.uid].status == "pending"
        assert ":ISTIO_OUTPUT" in pod.exec("iptables-save").stdout

        zt = await h.ztunnel()  # the background retry hands the pod over
        assert await asyncio.to_thread(zt.wait, lambda: pod.uid in zt.adds, 10)
    finally:
        await stop(h)
