"""CNI plugin figures.

1. ADD round trip through the installed launcher against an agent that answers at once
   (the real event server, enroller returning immediately), next to the floor
   ``python -I -S -c pass`` with the same interpreter (target ratio <= 1.5).
2. Container start with rootful podman (CNI backend, runc) on a bridge-only network vs
   the same bridge with istio-cni chained, the agent answering at once: ms added per
   pod (target <= 25 ms; floor column: the bridge-only time). "Start" is ``podman start``
   of a container created beforehand (the runtime runs CNI VERSION and ADD in it);
   teardown (``podman rm -f``: VERSION and DEL) and the whole ``podman run --rm ... true``
   (all four execs) are reported next to it. Skipped when podman or root is missing.
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


def _exec_once_ms(argv, env, stdin) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, input=stdin, env=env, capture_output=True, check=False)
    return (time.perf_counter() - t0) * 1000


def _interleaved_ms(commands: dict, n: int) -> dict[str, float]:
    """Median wall ms per command; commands run in turn so load drift hits all alike.
    ``commands``: name -> (argv, env, stdin bytes)."""
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(n):
        for name, (argv, env, stdin) in commands.items():
            samples[name].append(_exec_once_ms(argv, env, stdin))
    return {name: median(s) for name, s in samples.items()}


async def _plugin_round_trip(tmp: str, n: int = 60) -> list[Result]:
    from cni.install import Installer
    from tests.cni.conftest import cni_env, net_conf, start_agent

    inst = Installer(conf_dir=f"{tmp}/net.d", bin_dir=f"{tmp}/bin", run_dir=f"{tmp}/state")
    inst.install_binary()
    agent = await start_agent(f"{tmp}/state")
    try:
        stdin = json.dumps(net_conf(agent.run_dir, ambient_default=True)).encode()
        times = await asyncio.to_thread(_interleaved_ms, {
            "floor": ([sys.executable, "-I", "-S", "-c", "pass"], None, b""),
            "add": ([inst.binary_path], cni_env(), stdin),
            "version": ([inst.binary_path], cni_env("VERSION"), b'{"cniVersion":"1.0.0"}'),
        }, n)
        enrolled = len(agent.enroller.enrolled)
    finally:
        await agent.server.stop(1)
    note = f"median of {n} execs interleaved with the floor's; {enrolled} enrollments recorded"
    add = Result("cni plugin ADD round trip (launcher -> agent -> result)", times["add"], "ms",
                 times["floor"], "ratio <= 1.5", None, note)
    add.passed = add.ratio is not None and add.ratio <= 1.5
    version = Result("cni plugin VERSION (answered by the sh launcher)", times["version"], "ms",
                     times["floor"], "report", None, note)
    return [add, version]


def _podman_per_pod(tmp: str) -> list[Result]:
    import secrets

    from agent import podman
    from cni.install import Installer

    if not podman.available() or os.geteuid() != 0:
        return [Result("podman start: ms added per pod by istio-cni", float("nan"), "ms",
                       note="skipped: needs root, podman and runc")]
    results = {}
    image = f"localhost/ambient-cni-bench:{secrets.token_hex(4)}"
    bridges = []
    try:
        for variant in ("bridge", "bridge+istio-cni"):
            d = f"{tmp}/{variant}"
            os.makedirs(f"{d}/net.d")
            podman.write_containers_conf(f"{d}/containers.conf", [f"{d}/bin", "/usr/lib/cni"],
                                         f"{d}/net.d")
            pm = podman.Podman(f"{d}/containers.conf")
            br, name = "bb" + secrets.token_hex(4), "bn" + secrets.token_hex(4)
            bridges.append(br)
            with open(f"{d}/net.d/50-{name}.conflist", "w") as f:
                json.dump({"cniVersion": "1.0.0", "name": name, "plugins": [
                    {"type": "bridge", "bridge": br, "isGateway": True,
                     "ipam": {"type": "host-local", "ranges": [[{"subnet":
                              f"10.{secrets.randbelow(50) + 60}.{secrets.randbelow(250)}.0/24"}]],
                              "dataDir": f"{d}/ipam"}}]}, f)
            if variant == "bridge":
                pm.import_busybox(image)
            else:
                Installer(conf_dir=f"{d}/net.d", bin_dir=f"{d}/bin", run_dir=f"{d}/state",
                          ambient_default=True).install()
            results[variant] = (pm.env, name)
        return asyncio.run(_podman_measure(results, image, tmp))
    finally:
        subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
        for br in bridges:
            subprocess.run(["ip", "link", "del", br], capture_output=True)


def _podman(env, *argv, check=True) -> float:
    """One podman command; returns its wall time in ms."""
    t0 = time.perf_counter()
    subprocess.run(["podman", *argv], env=env, capture_output=True, check=check)
    return (time.perf_counter() - t0) * 1000


SETTLE_S = 0.25  # conmon's asynchronous `podman container cleanup` must not overlap a timing


def _podman_round(env, name, image) -> dict[str, float]:
    """create (untimed) -> start (timed: CNI VERSION + ADD happen here) -> rm -f (timed:
    teardown, CNI VERSION + DEL) -> run --rm ... true (timed: both, plus the container)."""
    ctr = _podman_one_name()
    _podman(env, "create", "--name", ctr, "--network", name, image, "/bin/busybox", "sleep",
            "600")
    time.sleep(SETTLE_S)
    try:
        start = _podman(env, "start", ctr)
    finally:
        teardown = _podman(env, "rm", "-f", "-t", "0", ctr, check=False)
    time.sleep(SETTLE_S)
    run = _podman(env, "run", "--rm", "--network", name, image, "/bin/busybox", "true")
    time.sleep(SETTLE_S)
    return {"start": start, "teardown": teardown, "run": run}


def _podman_one_name() -> str:
    import secrets
    return "cnibench-" + secrets.token_hex(4)


async def _podman_measure(variants, image, tmp, rounds=12) -> list[Result]:
    from tests.cni.conftest import start_agent

    agent = await start_agent(f"{tmp}/bridge+istio-cni/state")
    added: dict[str, list[float]] = {"start": [], "teardown": [], "run": []}
    base: dict[str, list[float]] = {"start": [], "teardown": [], "run": []}
    try:
        for i in range(rounds):
            # paired rounds, order alternated, so drift and other load hit both alike
            order = list(variants.items()) if i % 2 else list(variants.items())[::-1]
            got = {}
            for variant, (env, name) in order:
                got[variant] = await asyncio.to_thread(_podman_round, env, name, image)
            for k in added:
                added[k].append(got["bridge+istio-cni"][k] - got["bridge"][k])
                base[k].append(got["bridge"][k])
    finally:
        await agent.server.stop(1)
    enrolled, unenrolled = len(agent.enroller.enrolled), len(agent.enroller.unenrolled)
    note = (f"median of {rounds} paired rounds (chained - bridge only); agent answers at once "
            f"(recording enroller): {enrolled} ADDs, {unenrolled} DELs reached it")
    start = Result("podman start: ms added per pod by istio-cni (VERSION+ADD)",
                   median(added["start"]), "ms", median(base["start"]), "added <= 25 ms", None,
                   "container created beforehand; " + note)
    start.passed = start.value <= 25
    teardown = Result("podman rm -f: ms added per pod by istio-cni (VERSION+DEL)",
                      median(added["teardown"]), "ms", median(base["teardown"]), "report",
                      None, note)
    run = Result("podman run --rm true: ms added per pod (VERSION+ADD+VERSION+DEL)",
                 median(added["run"]), "ms", median(base["run"]), "report", None, note)
    return [start, teardown, run]


def run() -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="bench-cni-") as tmp:
        results = asyncio.run(_plugin_round_trip(tmp))
    with tempfile.TemporaryDirectory(prefix="bench-cni-podman-") as tmp:
        results += _podman_per_pod(tmp)
    return results
