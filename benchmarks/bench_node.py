"""The real node (tests/node/realnode.py: kubelet + containerd + runc, controller manager,
scheduler, a kube-apiserver of its own) with the shipped DaemonSet running the agent.

Figure: a pod created through the API -> its app container started on the node
(containerd's ``/tasks/start`` event for the pod's container, read from ``ctr events``:
the moment the runtime ran it, free of the kubelet's 1 s status relist), for a pod in an
ambient namespace on the node's default runtime handler, whose CNI chain the agent
extended with istio-cni (so the ADD waits for the in-pod rules and ztunnel's ack; the
rules are checked in the pod's netns after each one). Floor: the same pod in a plain
namespace on the ``bare`` runtime handler (RuntimeClass), whose CNI config is the same
bridge network without istio-cni. The two alternate pod by pod (20 pairs), so the
machine's load hits both alike; the judged row is the median of the paired differences.
The ztunnel is the fake one (``agent.demo.fake_ztunnel``) with its in-pod listeners.

Breakdown (report rows, the same run): the paired difference split at the pod sandbox's
start (containerd's ``/tasks/start`` of the sandbox, which the CRI plugin starts only
after the CNI ADD returned: everything istio-cni adds is before it), and the agent's
side of each ADD from its own metrics (``ambient_agent_cni_add_seconds`` and the
per-stage ``ambient_agent_cni_add_stage_seconds``, scraped from the status port before
and after the timed pods: means per pod). What the agent does not see (the plugin's
exec and its round trip, containerd reading the chained result) is the ADD's part of the
sandbox difference minus the agent's ADD.

Skipped (a row saying why) without root, Go, containerd, or the agent's image
(``scripts/build-image.sh``). Takes ~2-4 minutes (the node's start is most of it).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from benchmarks.common import Result, median

PAIRS = 20
_ORDER = {s: i for i, s in enumerate(("total", "lookup", "netns", "rules", "zds", "hostset",
                                      "state", "status", "status: API server's own handling"))}
FIGURE = "real node: ms added per pod by istio-cni + enrollment (API create -> container started)"


class TaskStarts:
    """``ctr events`` of the node's containerd, on a thread: container id -> start time
    (epoch seconds) of every ``/tasks/start``."""

    def __init__(self, node):
        self.starts: dict[str, float] = {}
        self.proc = subprocess.Popen(["ctr", "--address", str(node.sock), "events"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            # "2026-12-01 20:23:17.781518007 +0000 UTC k8s.io /tasks/start {...}"
            parts = line.split(" ", 6)
            if len(parts) < 7 or parts[5] != "/tasks/start":
                continue
            try:
                body = json.loads(parts[6])
                clock = parts[1] if "." in parts[1] else parts[1] + ".0"  # Go trims zeros
                stamp = f"{parts[0]} {clock[:15]} {parts[2]}"
                ts = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f %z").timestamp()
            except ValueError:
                continue
            self.starts[body["container_id"]] = ts

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _app_container(node, pod_uid: str) -> str:
    out = node.ctr("containers", "list", "-q",
                   f'labels."io.kubernetes.pod.uid"=={pod_uid},'
                   'labels."io.kubernetes.container.name"==app', check=False).stdout.split()
    return out[0] if out else ""


def _sandbox_container(node, pod_uid: str) -> str:
    out = node.ctr("containers", "list", "-q",
                   f'labels."io.kubernetes.pod.uid"=={pod_uid},'
                   'labels."io.cri-containerd.kind"==sandbox', check=False).stdout.split()
    return out[0] if out else ""


async def _one(api, node, sc, events: TaskStarts, pod: dict, check_rules: bool
               ) -> tuple[float, float]:
    """Create ``pod``; ms from the POST to its sandbox's start and to its app
    container's start."""
    t0 = time.time()
    created = await sc.create_pod(api, pod)
    uid = created["metadata"]["uid"]

    # ``ctr containers list`` (a Go binary's start, ~20-50 ms of CPU on this box) runs only
    # when a task started since the last look, not on every poll: the harness's own
    # load would otherwise compete with what is measured on the 2 CPUs
    seen = [-1]

    async def started():
        count = len(events.starts)
        if count == seen[0]:
            return None
        seen[0] = count
        cid = await asyncio.to_thread(_app_container, node, uid)
        return cid if cid and cid in events.starts else None
    cid = await sc.until(f"{pod['metadata']['name']} started", started, node, timeout=120,
                         interval=0.01)
    ms = (events.starts[cid] - t0) * 1000
    sandbox = await asyncio.to_thread(_sandbox_container, node, uid)
    sandbox_ms = (events.starts[sandbox] - t0) * 1000 if sandbox in events.starts else ms
    if check_rules:
        text = await asyncio.to_thread(sc.rules_in, sc.pod_netns(node, uid))
        if not sc.has_inpod_rules(text):
            raise AssertionError(f"{pod['metadata']['name']} started without in-pod rules")
    return sandbox_ms, ms


def _agent_metrics(node, port: int) -> dict[str, float]:
    """``{series: value}`` of the agent's ADD histograms' ``_sum``/``_count`` (the
    status port's ``/stats/prometheus``, fetched from inside the node's netns)."""
    import urllib.request

    from agent.core.netns import run_in_netns_thread

    def fetch() -> str:
        url = f"http://{node.node_ip}:{port}/stats/prometheus"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode()
    out: dict[str, float] = {}
    for line in run_in_netns_thread(node.netns_path, fetch).splitlines():
        if line.startswith("ambient_agent_cni_add_") and ("_sum" in line or "_count" in line):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _agent_cpu_seconds(node) -> float | None:
    """CPU seconds the agent's container has used so far, or None when it can't be
    read: its cgroup's ``cpu.stat`` ``usage_usec`` (everything it runs included), else
    its main process's ``/proc/<pid>/stat`` user + system time with that of the children
    it waited for (iptables-restore and every other tool it runs)."""
    ids = node.ctr("containers", "list", "-q", 'labels."io.kubernetes.container.name"==agent',
                   check=False).stdout.split()
    tasks = {}
    for line in node.ctr("tasks", "list", check=False).stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and fields[1].isdigit():
            tasks[fields[0]] = int(fields[1])
    for cid in ids:
        pid = tasks.get(cid)
        if not pid:
            continue
        try:
            rel = Path(f"/proc/{pid}/cgroup").read_text().strip().split("::", 1)[1]
            for line in Path(f"/sys/fs/cgroup{rel}/cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, IndexError, ValueError):
            pass
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
            return ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return None


async def _apiserver_patch_status(api) -> tuple[float, float]:
    """``(sum seconds, count)`` of the API server's own ``PATCH pods/status`` handling
    (``apiserver_request_duration_seconds``; the kubelet's status writes are the same
    request): the server-side part of the agent's annotation write."""
    from agent.core import kubecall

    text = (await kubecall.read(api, "GET", "/metrics", accept="text/plain",
                                timeout=None)).decode()
    total = count = 0.0
    for line in text.splitlines():
        if (line.startswith("apiserver_request_duration_seconds_")
                and 'verb="PATCH"' in line and 'resource="pods"' in line
                and 'subresource="status"' in line):
            name, _, value = line.rpartition(" ")
            if name.startswith("apiserver_request_duration_seconds_sum"):
                total += float(value)
            elif name.startswith("apiserver_request_duration_seconds_count"):
                count += float(value)
    return total, count


def _stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms per observation of each ADD stage (and ``total``) between two scrapes."""
    means = {}
    for name, value in after.items():
        if "_sum" not in name:
            continue
        count_name = name.replace("_sum", "_count")
        n = after.get(count_name, 0) - before.get(count_name, 0)
        if n <= 0:
            continue
        stage = name.split('stage="')[1].split('"')[0] if 'stage="' in name else "total"
        means[stage] = (value - before.get(name, 0)) / n * 1000
    return means


async def _measure(bin_dir: Path) -> list[Result]:
    from agent.demo.fake_ztunnel import FakeZtunnel
    from tests.kube import cluster as kc
    from tests.node import realnode
    from tests.node import scenario as sc

    node = realnode.RealNode(bin_dir)
    zt = zt_task = events = api = ds = None
    # removed only after node.close(): the cluster's stop needs its pid files in there
    tmp = tempfile.mkdtemp(prefix="bench-node-")
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    for sig in (signal.SIGTERM, signal.SIGHUP):  # SIGINT: asyncio.run cancels us already
        loop.add_signal_handler(sig, main.cancel)
    try:
        ds = sc.agent_daemonset(node)
        sc.import_agent_image_prepare_check()
        await sc.start(node, Path(tmp) / "cluster")
        await sc.in_thread(sc.import_agent_image, node)
        api = await node.cluster.admin_client()
        zds = sc.agent_settings()["ztunnel_uds_address"]
        zt = FakeZtunnel(str(node.host_path(zds)), open_listeners=True)
        zt_task = asyncio.create_task(zt.run())
        await sc.deploy_agent(api, node, ds)

        async def agent_ready():
            pods = await sc.agent_pods(api, ds)
            return len(pods) == 1 and sc.ready(pods[0])
        await sc.until("the agent Ready", agent_ready, node, timeout=180, interval=0.5)
        conflist = node.cni_conf_dir / "10-kn.conflist"
        await sc.until("istio-cni chained", lambda: asyncio.to_thread(sc.chained, conflist),
                       node, timeout=60)
        await zt.wait_snapshot(timeout=60)
        await kc.apply(api, {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                             "metadata": {"name": realnode.BARE_HANDLER},
                             "handler": realnode.BARE_HANDLER})
        await sc.namespace(api, "mesh", ambient=True)
        await sc.namespace(api, "plain", ambient=False)
        events = TaskStarts(node)
        port = int(sc.agent_settings().get("status_port", 15020))
        samples: list[dict[str, tuple[float, float]]] = []
        before: dict[str, float] = {}
        # one of each first, not timed (first-use costs: plugin exec caches, image)
        for i in range(-1, PAIRS):
            pair = {}
            for kind in ("bare", "mesh") if i % 2 else ("mesh", "bare"):
                if kind == "bare":
                    pod = sc.app_pod(f"bare-{i + 1}", "plain", probe=False)
                    pod["spec"]["runtimeClassName"] = realnode.BARE_HANDLER
                else:
                    pod = sc.app_pod(f"mesh-{i + 1}", "mesh", probe=False)
                pair[kind] = await _one(api, node, sc, events, pod, kind == "mesh")
            if i >= 0:
                samples.append(pair)
            else:
                before = await asyncio.to_thread(_agent_metrics, node, port)
                patch_before = await _apiserver_patch_status(api)
                cpu_before = await asyncio.to_thread(_agent_cpu_seconds, node)
        after = await asyncio.to_thread(_agent_metrics, node, port)
        patch_after = await _apiserver_patch_status(api)
        cpu_after = await asyncio.to_thread(_agent_cpu_seconds, node)
        stages = _stage_means(before, after)
        patches = patch_after[1] - patch_before[1]
        if patches > 0:  # the API server's part of the status stage
            stages["status: API server's own handling"] = (
                (patch_after[0] - patch_before[0]) / patches * 1000)
        bare = [p["bare"][1] for p in samples]
        mesh = [p["mesh"][1] for p in samples]
        added = median([p["mesh"][1] - p["bare"][1] for p in samples])
        to_sandbox = median([p["mesh"][0] - p["bare"][0] for p in samples])
        after_sandbox = median([(p["mesh"][1] - p["mesh"][0]) - (p["bare"][1] - p["bare"][0])
                                for p in samples])
        held = sum(1 for p in zt.pods.values() if p.namespace == "mesh")
        note = (f"{PAIRS} pairs alternated; {held} ambient pods held by the fake ztunnel; "
                "containerd 1.6 + runc, kubelet/scheduler/controller-manager 1.37")
        return [
            Result("real node: API create -> container started, bare handler (no istio-cni)",
                   median(bare), "ms", None, "report", None, "the floor of the row below"),
            Result("real node: API create -> container started, ambient, istio-cni chained",
                   median(mesh), "ms", median(bare), "report", None, note),
            Result(FIGURE, added, "ms", median(bare), "added <= 30 ms", added <= 30,
                   "median of paired differences; " + note),
            Result("real node breakdown: added before the sandbox started (CNI ADD "
                   "included)", to_sandbox, "ms", None, "report", None,
                   "median of paired differences of API create -> sandbox /tasks/start "
                   f"(mean {sum(p['mesh'][0] - p['bare'][0] for p in samples) / len(samples):.1f}"
                   " ms, to compare with the agent's means below)"),
            Result("real node breakdown: added between sandbox start and app start",
                   after_sandbox, "ms", None, "report", None,
                   "median of paired differences"),
            *[Result(f"real node breakdown: agent's ADD, {stage}", ms, "ms", None,
                     "report", None, "mean per pod, " + (
                         "the agent's ambient_agent_cni_add_seconds" if stage == "total"
                         else "the API server's apiserver_request_duration_seconds of "
                         "every PATCH pods/status in the timed pods (the kubelet's "
                         "status writes too)" if stage.startswith("status:")
                         else "the agent's ambient_agent_cni_add_stage_seconds"))
              for stage, ms in sorted(stages.items(), key=lambda kv: _ORDER.get(kv[0], 99))],
            Result("real node breakdown: the agent container's CPU per ambient pod",
                   ((cpu_after - cpu_before) * 1000 / PAIRS
                    if cpu_before is not None and cpu_after is not None else float("nan")),
                   "ms", None, "report", None,
                   "its cgroup's usage_usec over the timed pods / ambient pods (the tools "
                   "it runs included; its watch of the bare pods too): load-independent, "
                   "where the wall-clock rows above grow with the machine's load"),
        ]
    finally:
        # a second signal must not cut the cleanup short (it would leave the node's
        # processes and the API server running)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        previous = {sig: signal.signal(sig, signal.SIG_IGN)
                    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            await _cleanup(api, node, sc, ds, events, zt, zt_task)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _cleanup(api, node, sc, ds, events, zt, zt_task) -> None:
    """Everything :func:`_measure` started, newest first; the node (its API server,
    etcd, kubelet, containerd and the pods' shims) always, whatever fails before."""
    try:
        if events is not None:
            events.close()
        if api is not None:
            node.remember_netns()
            await sc.delete_everything(api, node, ["mesh", "plain", ds["metadata"]["namespace"]])
            await api.close()
        if zt is not None:
            zt.stop()
            await asyncio.wait_for(asyncio.gather(zt_task, return_exceptions=True), 10)
    finally:
        node.close()


def run() -> list[Result]:
    from tests.node import realnode
    reason = realnode.why_not()
    if reason is None and os.system("podman image exists localhost/ambient-node-agent:0.1.0"):
        reason = "needs the agent's image: bash scripts/build-image.sh"
    if reason:
        return [Result(FIGURE, float("nan"), "ms", note=f"skipped: {reason}")]
    return asyncio.run(_measure(realnode.build()))
