"""CNI plugin figures.

Every row runs the standalone plugin build (``scripts/build-cni-plugin.py``, as the image
ships it) installed by the real installer (``cni_plugin_bundle``).

1. ADD round trip through the installed plugin against an agent that answers at once
   (the real event server, enroller returning immediately), next to the floor
   ``python3.11 -I -S -c pass`` with the installed build's own interpreter (target
   ratio <= 1.5).
2. Container start with rootful podman (CNI backend, runc), issue 4's figure: "bridge
   only vs. bridge + our plugin (agent enrolling for real)", target <= 25 ms added per
   pod. Three networks, each variant once per round in rotated order:
   - bridge only (the floor);
   - bridge + istio-cni chained by the real agent's own installer (``cni_manage_config``),
     the agent (``agent.daemon.Agent`` in this process: directory source, embedded CA,
     free ports, host probe set in a scratch netns) enrolling for real and the reference
     ztunnel (``agent.demo.fake_ztunnel.FakeZtunnel``) acking ZDS. Each container's Pod object
     (uid = container ID, ambient namespace ``demo``) is published before its start,
     as agent/demo/pods.py does; enrollment and ztunnel's hold are checked after each start;
   - bridge + istio-cni with an agent that answers at once (recording enroller): the
     plugin's own cost, a report row.
   "Start" is ``podman start`` of a container created beforehand (the runtime runs CNI
   VERSION and ADD in it); teardown (``podman rm -f``: VERSION and DEL, with the real
   agent its unenrollment) and, plugin-only, the whole ``podman run --rm ... true`` are
   reported next to it. Skipped when podman or root is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time

from benchmarks.common import Result, median


def plugin_bundle() -> str:
    """The standalone plugin build every row here installs (``build/istio-cni``, built by
    ``scripts/build-cni-plugin.py`` when missing or older than the plugin source): the
    binary the image ships, not the development launcher."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(root, "build", "istio-cni")
    manifest = os.path.join(out, "MANIFEST.json")
    sources = [os.path.join(root, "cni", n)
               for n in ("plugin.py", "plugin_request.py", "plugin_wire.py")]
    newest = max(os.path.getmtime(s) for s in sources)
    if not os.path.exists(manifest) or os.path.getmtime(manifest) < newest:
        subprocess.run(["/usr/bin/python3.11", os.path.join(root, "scripts",
                        "build-cni-plugin.py"), "--out", out], check=True,
                       capture_output=True)
    return out


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

    from cni.install_plugin import BUNDLE_DIR, read_bundle

    bundle = plugin_bundle()
    inst = Installer(conf_dir=f"{tmp}/net.d", bin_dir=f"{tmp}/bin", run_dir=f"{tmp}/state",
                     plugin_bundle=bundle)
    inst.install_binary()
    # the floor: the installed build's own interpreter starting and doing nothing
    python = f"{tmp}/bin/{BUNDLE_DIR}/{read_bundle(bundle)[0]}/bin/python3.11"
    agent = await start_agent(f"{tmp}/state")
    try:
        stdin = json.dumps(net_conf(agent.run_dir, ambient_default=True)).encode()
        times = await asyncio.to_thread(_interleaved_ms, {
            "floor": ([python, "-I", "-S", "-c", "pass"], None, b""),
            "add": ([inst.binary_path], cni_env(), stdin),
            "version": ([inst.binary_path], cni_env("VERSION"), b'{"cniVersion":"1.0.0"}'),
        }, n)
        enrolled = len(agent.enroller.enrolled)
    finally:
        await agent.server.stop(1)
    note = f"median of {n} execs interleaved with the floor's; {enrolled} enrollments recorded"
    add = Result("cni plugin ADD round trip (installed standalone build -> agent -> result)",
                 times["add"], "ms",
                 times["floor"], "ratio <= 1.5", None, note)
    add.passed = add.ratio is not None and add.ratio <= 1.5
    version = Result("cni plugin VERSION (answered by the sh launcher)", times["version"], "ms",
                     times["floor"], "report", None, note)
    return [add, version]


BRIDGE, PLUGIN_ONLY, REAL = "bridge", "bridge+istio-cni (instant)", "bridge+istio-cni (agent)"
POD_NAMESPACE = "demo"  # ambient-labelled in examples/cluster/namespaces.yaml
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "cluster")


def _write_network(d: str, bridges: list[str]) -> tuple[str, "object"]:
    """A podman setup under ``d``: containers.conf and a bridge + host-local conflist in
    ``d/net.d``. Returns ``(network name, agent.podman.Podman)``."""
    import secrets

    from agent.demo import podman

    os.makedirs(f"{d}/net.d")
    podman.write_containers_conf(f"{d}/containers.conf", [f"{d}/bin", "/usr/lib/cni"],
                                 f"{d}/net.d")
    br, name = "bb" + secrets.token_hex(4), "bn" + secrets.token_hex(4)
    bridges.append(br)
    with open(f"{d}/net.d/50-{name}.conflist", "w") as f:
        json.dump({"cniVersion": "1.0.0", "name": name, "plugins": [
            {"type": "bridge", "bridge": br, "isGateway": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet":
                      f"10.{secrets.randbelow(50) + 60}.{secrets.randbelow(250)}.0/24"}]],
                      "dataDir": f"{d}/ipam"}}]}, f)
    return name, podman.Podman(f"{d}/containers.conf")


def _podman_per_pod(tmp: str) -> list[Result]:
    import secrets

    from agent.demo import podman
    from cni.install import Installer

    if not podman.available() or os.geteuid() != 0:
        return [Result("podman start: ms added per pod by istio-cni + real enrollment",
                       float("nan"), "ms", note="skipped: needs root, podman and runc")]
    image = f"localhost/ambient-cni-bench:{secrets.token_hex(4)}"
    bridges: list[str] = []
    try:
        variants = {v: _write_network(f"{tmp}/{i}", bridges)
                    for i, v in enumerate((BRIDGE, PLUGIN_ONLY, REAL))}
        variants[BRIDGE][1].import_busybox(image)
        # plugin only: the installer chains istio-cni for an agent that answers at once
        Installer(conf_dir=f"{tmp}/1/net.d", bin_dir=f"{tmp}/1/bin", run_dir=f"{tmp}/1/state",
                  ambient_default=True, plugin_bundle=plugin_bundle()).install()
        # real: the agent's own installer chains it (cni_manage_config) when it starts
        return asyncio.run(_podman_measure(variants, image, tmp))
    finally:
        subprocess.run(["podman", "rmi", "-f", image], capture_output=True)
        for br in bridges:
            subprocess.run(["ip", "link", "del", br], capture_output=True)


def _podman(env, *argv, check=True) -> float:
    """One podman command; returns its wall time in ms."""
    t0 = time.perf_counter()
    r = subprocess.run(["podman", *argv], env=env, capture_output=True)
    ms = (time.perf_counter() - t0) * 1000
    if check and r.returncode != 0:
        raise RuntimeError(f"podman {' '.join(argv)}: exit {r.returncode}: "
                           f"{r.stderr.decode(errors='replace').strip()}")
    return ms


SETTLE_S = 0.25  # conmon's asynchronous `podman container cleanup` must not overlap a timing


def _podman_one_name() -> str:
    import secrets
    return "cnibench-" + secrets.token_hex(4)


class RealNode:
    """The real agent (agent.daemon.Agent, in this process, on this loop) with the
    directory source, embedded CA, cni_manage_config, its state/conf/bin dirs under
    ``root``, free ports, and the reference ztunnel (agent.demo.fake_ztunnel.FakeZtunnel) acking ZDS.
    Pods get Pod objects (uid = container ID, namespace ``demo``: ambient) before start,
    as agent/demo/pods.py's podman path does."""

    def __init__(self, root: str):
        import secrets

        self.root = root
        self.host_netns = "cnibh" + secrets.token_hex(4)
        self.netns_created = False
        self.agent = None
        self.zds = None
        self.zds_task = None

    def flags(self) -> dict[str, str]:
        from agent.demo.envoy import free_port

        r = self.root
        return {"state_dir": f"{r}/state", "config_dir": f"{r}/cluster",
                "config_file": os.devnull, "cni_conf_dir": f"{r}/net.d",
                "cni_bin_dir": f"{r}/bin", "cni_manage_config": "true",
                "cni_plugin_bundle": plugin_bundle(),
                "ztunnel_uds_address": f"{r}/state/ztunnel.sock",
                "status_port": str(free_port()), "health_port": str(free_port()),
                "monitoring_port": "0",
                "xds_port": str(free_port()), "xds_tls_port": "0",
                "exclude_namespaces": "kube-system", "log_level": "warn",
                "shutdown_grace": "3s", "ambient_disable_safe_upgrade": "true",
                # host probe set and SNAT rule in a scratch netns: the same ipset/iptables
                # work per pod, but the host's fixed-name set (istio-inpod-probes-v4) is
                # not shared with (and deleted under us by) other agents on this machine
                "host_rules_netns": f"/var/run/netns/{self.host_netns}"}

    async def start(self) -> None:
        import shutil

        from agent import daemon
        from agent.core import config as agent_config
        from agent.demo.fake_ztunnel import FakeZtunnel

        from pyroute2 import netns

        await asyncio.to_thread(netns.create, self.host_netns)
        self.netns_created = True
        os.makedirs(f"{self.root}/cluster", mode=0o700)
        shutil.copy(f"{EXAMPLES}/namespaces.yaml", f"{self.root}/cluster/namespaces.yaml")
        self.config = agent_config.load(self.flags(), env={})
        self.agent = daemon.Agent(self.config)
        await self.agent.start()
        self.zds = FakeZtunnel(self.config.ztunnel_uds_address, open_listeners=False)
        self.zds_task = asyncio.create_task(self.zds.run())
        await self.zds.wait_snapshot(timeout=10)
        await self._wait("istio-cni chained by the agent's installer", self._chained, 10)

    def _chained(self) -> bool:
        for f in os.listdir(f"{self.root}/net.d"):
            if f.endswith(".conflist"):
                with open(f"{self.root}/net.d/{f}") as fh:
                    if any(p.get("type") == "istio-cni" for p in json.load(fh)["plugins"]):
                        return True
        return False

    async def stop(self) -> None:
        if self.zds is not None:
            self.zds.stop()
            try:
                await asyncio.wait_for(self.zds_task, 5)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
        try:
            if self.agent is not None:
                await self.agent.stop()
        finally:
            if self.netns_created:
                from pyroute2 import netns

                await asyncio.to_thread(netns.remove, self.host_netns)

    @staticmethod
    async def _wait(what: str, predicate, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench: timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.01)

    def _pod_path(self, cid: str) -> str:
        return f"{self.root}/cluster/pod-{cid[:16]}.yaml"

    async def publish_pod(self, name: str, cid: str) -> None:
        """Pod object (Pending, no IP) with uid = container ID; waits for the store."""
        import yaml

        from agent.demo.examples import pod_manifest

        manifest = pod_manifest(name, POD_NAMESPACE, cid, "", self.config.node_name,
                                "default", {"app": "bench"}, ready=False)
        manifest["status"] = {"phase": "Pending"}
        path = self._pod_path(cid)
        with open(path + ".tmp", "w") as f:
            yaml.safe_dump(manifest, f)
        os.replace(path + ".tmp", path)
        store = self.agent.source.store
        await self._wait(f"pod {cid[:12]} in the store",
                         lambda: store.pod_by_uid(cid) is not None, 10)

    def enrolled(self, cid: str) -> bool:
        """Enrollment says enabled and the reference ztunnel holds the pod's netns."""
        pods = self.agent.enrollment.debug_state()["pods"]
        return (pods.get(cid) or {}).get("status") == "enabled" and cid in self.zds.pods

    def forget_pod(self, cid: str) -> None:
        try:
            os.unlink(self._pod_path(cid))
        except FileNotFoundError:
            pass


async def _podman_round(env, name, image, node: RealNode | None) -> dict[str, float]:
    """create (untimed; with ``node``: its Pod object published, untimed) -> start
    (timed: CNI VERSION + ADD, with ``node`` the real enrollment) -> rm -f (timed:
    VERSION + DEL, unenrollment) -> without ``node``: run --rm ... true (timed: all
    four execs plus the container). ``enrolled`` is 1.0 when the real agent enrolled
    the pod (checked after the timing)."""
    ctr = _podman_one_name()
    await asyncio.to_thread(_podman, env, "create", "--name", ctr, "--network", name, image,
                            "/bin/busybox", "sleep", "600")
    got = {}
    try:
        if node is not None:
            cid = (await asyncio.to_thread(subprocess.run, ["podman", "inspect", "--format",
                   "{{.Id}}", ctr], env=env, capture_output=True, text=True)).stdout.strip()
            await node.publish_pod(ctr, cid)
        await asyncio.sleep(SETTLE_S)
        got["start"] = await asyncio.to_thread(_podman, env, "start", ctr)
        if node is not None:
            got["enrolled"] = float(node.enrolled(cid))
    finally:
        got["teardown"] = await asyncio.to_thread(_podman, env, "rm", "-f", "-t", "0", ctr,
                                                  check=False)
        if node is not None:
            node.forget_pod(cid)
    await asyncio.sleep(SETTLE_S)
    if node is None:
        got["run"] = await asyncio.to_thread(_podman, env, "run", "--rm", "--network", name,
                                             image, "/bin/busybox", "true")
        await asyncio.sleep(SETTLE_S)
    return got


async def _podman_measure(variants, image, tmp, rounds=16) -> list[Result]:
    from tests.cni.conftest import start_agent

    instant = await start_agent(f"{tmp}/1/state")
    node = RealNode(f"{tmp}/2")
    samples: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        await node.start()
        names = list(variants)
        for i in range(rounds):
            # every variant once per round, order rotated, so drift hits all alike
            for variant in names[i % 3:] + names[:i % 3]:
                pm_name, pm = variants[variant]
                samples[variant].append(await _podman_round(
                    pm.env, pm_name, image, node if variant == REAL else None))
    finally:
        await instant.server.stop(1)
        await node.stop()
    return _podman_results(samples, rounds, len(instant.enroller.enrolled),
                           len(instant.enroller.unenrolled))


def _paired(samples, variant, key) -> list[float]:
    return [a[key] - b[key] for a, b in zip(samples[variant], samples[BRIDGE])]


def _podman_results(samples, rounds, instant_adds, instant_dels) -> list[Result]:
    def med(variant, key):
        return median([s[key] for s in samples[variant]])

    base_start, base_rm = med(BRIDGE, "start"), med(BRIDGE, "teardown")
    enrolled = int(sum(s["enrolled"] for s in samples[REAL]))
    how = (f"median of {rounds} rounds, the three variants in rotated order each round; "
           "container created beforehand")
    real_note = (f"{how}; real agent (directory source, Pod object uid = container ID in "
                 f"ambient namespace demo) + reference ztunnel acking ZDS: {enrolled}/{rounds}"
                 " pods enrolled and held by ztunnel")
    instant_note = (f"{how}; agent answers at once (recording enroller): {instant_adds} ADDs, "
                    f"{instant_dels} DELs reached it")
    added = median(_paired(samples, REAL, "start"))
    rows = [
        Result("podman start: bridge only (CNI VERSION+ADD)", base_start, "ms", None,
               "report", None, f"{how}; the floor of the rows below"),
        Result("podman start: bridge + istio-cni, agent enrolling for real", med(REAL, "start"),
               "ms", base_start, "report", None, real_note),
        Result("podman start: ms added per pod by istio-cni + real enrollment", added, "ms",
               base_start, "added <= 25 ms", added <= 25 and enrolled == rounds,
               "median of paired differences; " + real_note),
        Result("podman start: ms added per pod by istio-cni alone (agent answers at once)",
               median(_paired(samples, PLUGIN_ONLY, "start")), "ms", base_start, "report",
               None, instant_note),
        Result("podman rm -f: ms added per pod by istio-cni + real unenrollment (VERSION+DEL)",
               median(_paired(samples, REAL, "teardown")), "ms", base_rm, "report", None,
               real_note),
        Result("podman rm -f: ms added per pod by istio-cni alone (VERSION+DEL)",
               median(_paired(samples, PLUGIN_ONLY, "teardown")), "ms", base_rm, "report",
               None, instant_note),
        Result("podman run --rm true: ms added per pod by istio-cni alone (all four execs)",
               median(_paired(samples, PLUGIN_ONLY, "run")), "ms", med(BRIDGE, "run"),
               "report", None, instant_note),
    ]
    return rows


def run() -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="bench-cni-") as tmp:
        results = asyncio.run(_plugin_round_trip(tmp))
    with tempfile.TemporaryDirectory(prefix="bench-cni-podman-") as tmp:
        results += _podman_per_pod(tmp)
    return results
