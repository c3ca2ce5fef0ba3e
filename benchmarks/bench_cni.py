"""CNI plugin figures.

1. ADD round trip through the installed launcher against an agent that answers at once
   (the real event server, enroller returning immediately), next to the floor
   ``python -I -S -c pass`` with the same interpreter (target ratio <= 1.5).
2. ``podman run --rm`` (rootful, CNI backend) on a bridge-only network vs the same
   bridge with istio-cni chained: ms added per pod (target <= 25 ms). Skipped when
   podman or root is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import Result, median


def _exec_ms(argv, env=None, stdin=b"", n=40) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, input=stdin, env=env, capture_output=True, check=False)
        samples.append((time.perf_counter() - t0) * 1000)
    return median(samples)


async def _plugin_round_trip(tmp: str) -> list[Result]:
    from cni.install import Installer
    from tests.cni.conftest import cni_env, net_conf, start_agent

    inst = Installer(conf_dir=f"{tmp}/net.d", bin_dir=f"{tmp}/bin", run_dir=f"{tmp}/state")
    inst.install_binary()
    agent = await start_agent(f"{tmp}/state")
    try:
        stdin = json.dumps(net_conf(agent.run_dir, ambient_default=True)).encode()
        env = cni_env()
        floor = await asyncio.to_thread(_exec_ms, [sys.executable, "-I", "-S", "-c", "pass"])
        value = await asyncio.to_thread(_exec_ms, [inst.binary_path], env, stdin)
        enrolled = len(agent.enroller.enrolled)
    finally:
        await agent.server.stop(1)
    r = Result("cni plugin ADD round trip (launcher -> agent -> result)", value, "ms", floor,
               "ratio <= 1.5", None, f"median of 40 execs; {enrolled} enrollments recorded")
    r.passed = r.ratio is not None and r.ratio <= 1.5
    return [r]


def _podman_per_pod(tmp: str) -> list[Result]:
    import secrets
    import shutil

    from cni.install import Installer
    from tests.peers.test_cni_podman import containers_conf

    if shutil.which("podman") is None or os.geteuid() != 0:
        return [Result("podman: ms added per pod by istio-cni", float("nan"), "ms",
                       note="skipped: needs root and podman")]
    results = {}
    image = f"localhost/ambient-cni-bench:{secrets.token_hex(4)}"
    root = f"{tmp}/rootfs/bin"
    os.makedirs(root)
    shutil.copy("/bin/busybox", f"{root}/busybox")
    bridges = []
    try:
        for variant in ("bridge", "bridge+istio-cni"):
            d = f"{tmp}/{variant}"
            os.makedirs(f"{d}/net.d")
            containers_conf(__import__("pathlib").Path(f"{d}/containers.conf"), f"{d}/bin",
                            f"{d}/net.d")
            env = {**os.environ, "CONTAINERS_CONF": f"{d}/containers.conf"}
            br, name = "bb" + secrets.token_hex(4), "bn" + secrets.token_hex(4)
            bridges.append(br)
            with open(f"{d}/net.d/50-{name}.conflist", "w") as f:
                json.dump({"cniVersion": "1.0.0", "name": name, "plugins": [
                    {"type": "bridge", "bridge": br, "isGateway": True,
                     "ipam": {"type": "host-local", "ranges": [[{"subnet":
                              f"10.{secrets.randbelow(50) + 60}.{secrets.randbelow(250)}.0/24"}]],
                              "dataDir": f"{d}/ipam"}}]}, f)
            if variant == "bridge":
                tar = subprocess.run(["tar", "-C", f"{tmp}/rootfs", "-c", "."],
                                     capture_output=True, check=True).stdout
                subprocess.run(["podman", "import", "-", image], input=tar, env=env, check=True,
                               capture_output=True)
            else:
                Installer(conf_dir=f"{d}/net.d", bin_dir=f"{d}/bin", run_dir=f"{d}/state",
                          ambient_default=True).install()
            results[variant] = (env, name)
        return asyncio.run(_podman_measure(results, image, tmp))
    finally:
        subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
        for br in bridges:
            subprocess.run(["ip", "link", "del", br], capture_output=True)


async def _podman_measure(variants, image, tmp) -> list[Result]:
    from tests.cni.conftest import start_agent

    agent = await start_agent(f"{tmp}/bridge+istio-cni/state")
    try:
        timing = {}
        for _ in range(2):  # interleave rounds so drift hits both variants alike
            for variant, (env, name) in variants.items():
                argv = ["podman", "run", "--rm", "--network", name, image, "/bin/busybox",
                        "true"]
                ms = await asyncio.to_thread(_exec_ms, argv, env, b"", 5)
                timing.setdefault(variant, []).append(ms)
    finally:
        await agent.server.stop(1)
    base, chained = min(timing["bridge"]), min(timing["bridge+istio-cni"])
    added = chained - base
    r = Result("podman run: ms added per pod by istio-cni (ADD+DEL+VERSIONs)", added, "ms",
               base, "added <= 25 ms", added <= 25,
               f"bridge only {base:.0f} ms, with istio-cni {chained:.0f} ms; "
               f"{len(agent.enroller.enrolled)} enrollments")
    return [r]


def run() -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="bench-cni-") as tmp:
        results = asyncio.run(_plugin_round_trip(tmp))
    with tempfile.TemporaryDirectory(prefix="bench-cni-podman-") as tmp:
        results += _podman_per_pod(tmp)
    return results
