"""Issue 27: on a podman host (``workload_registration``), a container created while the
agent was down started unmeshed even when ambient: its labels decide, and only the agent
reads them. The snapshot now says the agent registers this runtime's containers, and the
real plugin (executed as podman does, podman-style ``CNI_ARGS`` with no namespace) holds
a container it does not know with code 11; a known one still gets the agent's last
answer, and without registration the old rule (``ambient_default``) stands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cni import snapshot
from tests.cni.test_snapshot import start

ROOT = Path(__file__).resolve().parents[2]


def add(run_dir: str, container: str):
    conf = {"cniVersion": "1.0.0", "name": "mesh", "type": "istio-cni",
            "cni_agent_run_dir": run_dir, "timeout": 2,
            "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0"}],
                           "ips": [{"address": "10.87.10.5/24", "interface": 0}]}}
    env = {"PATH": "/usr/bin:/bin", "CNI_COMMAND": "ADD", "CNI_CONTAINERID": container,
           "CNI_NETNS": "/var/run/netns/none", "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni",
           "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=web"}
    r = subprocess.run([sys.executable, "-m", "cni.plugin"], input=json.dumps(conf), env=env,
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}


async def test_unknown_container_is_held_when_the_agent_registers(tmp_path):
    ctx, source, writer, cluster = await start(tmp_path, workload_registration="local")
    try:
        snap = json.loads(Path(writer.path).read_text())
        assert snap["registration"] == "local"
        run_dir = str(Path(writer.path).parent)
        rc, out = add(run_dir, "c" * 64)  # no agent socket there: the agent is down
        assert rc == 1 and out["code"] == 11, out
        assert "container not known" in out["msg"] and "try again later" in out["msg"]
        # a container the agent decided before: its last answer (not ambient: let through)
        snap["pods"]["d" * 64] = False
        snapshot.write_snapshot(writer.path, snap)
        rc, out = add(run_dir, "d" * 64)
        assert rc == 0 and out["ips"][0]["address"] == "10.87.10.5/24", out
    finally:
        await writer.stop(0.5)
        await source.stop(0.5)


async def test_without_registration_the_network_default_decides(tmp_path):
    ctx, source, writer, cluster = await start(tmp_path)
    try:
        assert "registration" not in json.loads(Path(writer.path).read_text())
        rc, out = add(str(Path(writer.path).parent), "e" * 64)
        assert rc == 0, out
    finally:
        await writer.stop(0.5)
        await source.stop(0.5)
