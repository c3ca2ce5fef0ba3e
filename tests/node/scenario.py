"""What the real-node test and benchmark do on a :class:`tests.node.realnode.RealNode`:
bring the node up, deploy the shipped DaemonSet, create pods through the API and look
at them (phase, annotation, the rules in their netns).

All API calls go through kubernetes_asyncio (``tests.kube.cluster.request``); waits poll
with a deadline and raise AssertionError naming what was awaited, with the node's logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from kubernetes_asyncio.client.exceptions import ApiException

from agent.core.netns import run_in_netns_thread
from tests.kube import cluster as kc
from tests.node import realnode
from tests.node.realnode import BUSYBOX_IMAGE, RealNode

REDIRECTION = "ambient.istio.io/redirection"
DATAPLANE_MODE = "istio.io/dataplane-mode"
APP_PORT = 8080
PROBE_SNAT_V4 = "169.254.7.127"  # the host probe SNAT source (cni/hostrules.py)
AGENT_IMAGE = "localhost/ambient-node-agent:0.1.0"


async def until(what: str, check: Callable[[], Awaitable[Any]], node: RealNode,
                timeout: float = 120.0, interval: float = 0.2, logs: tuple = ()) -> Any:
    """Poll ``check`` until it returns a truthy value (returned); AssertionError after
    ``timeout`` seconds or when a node process died."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        node.check_alive()
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n} ---\n{node.log(n, 4000)}"
                              for n in (*logs, "kubelet", "containerd"))
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{tails}")
        await asyncio.sleep(interval)


def bridge_conflist(node: RealNode) -> Path:
    """The node's CNI config before any agent: bridge + host-local (as a cluster's
    network add-on would leave it), in the node's private conf dir."""
    path = node.cni_conf_dir / "10-kn.conflist"
    path.write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "kn-pods", "plugins": [
            {"type": "bridge", "bridge": "knbr0", "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "dataDir": str(node.root / "ipam"),
                      "ranges": [[{"subnet": node.pod_subnet}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=2))
    return path


def bare_conflist(node: RealNode) -> Path:
    """The same bridge network for the ``bare`` runtime handler (its own bridge and
    subnet, no istio-cni ever)."""
    path = node.cni_conf_dir_bare / "10-kn-bare.conflist"
    path.write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "kn-bare", "plugins": [
            {"type": "bridge", "bridge": "knbr1", "isGateway": True, "ipMasq": False,
             "ipam": {"type": "host-local", "dataDir": str(node.root / "ipam-bare"),
                      "ranges": [[{"subnet": node.pod_subnet_bare}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=2))
    return path


def chained(conflist: Path) -> bool:
    return any(p.get("type") == "istio-cni"
               for p in json.loads(conflist.read_text()).get("plugins", []))


async def node_ready(api, node: RealNode) -> bool:
    try:
        n = await kc.request(api, "GET", f"/api/v1/nodes/{node.name}")
    except ApiException:
        return False
    conds = {c["type"]: c["status"] for c in (n.get("status") or {}).get("conditions", [])}
    return conds.get("Ready") == "True"


async def in_thread(fn, *args):
    """``fn(*args)`` on a worker thread; when cancelled, waits for the thread to finish
    before re-raising: a thread can't be stopped, and the caller's cleanup
    (:meth:`RealNode.close`) must not run while it may still start processes and register
    their cleanups (an interrupted run would leave them running)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        if not work.cancelled():
            work.exception()  # retrieved: the cancellation is what is reported
        raise


async def start(node: RealNode, cluster_dir: Path) -> None:
    """Control plane, netns, containerd with the test images, the bridge config, kubelet;
    returns when the Node is Ready. Cancelled, it returns only after its worker threads
    did (see :func:`in_thread`), so :meth:`RealNode.close` then undoes everything."""
    await in_thread(node.start, cluster_dir)
    await in_thread(node.import_test_images)
    bridge_conflist(node)
    bare_conflist(node)
    node.start_kubelet()
    api = await node.cluster.admin_client()
    try:
        await until(f"Node {node.name} Ready", lambda: node_ready(api, node), node,
                    timeout=180, interval=0.5)
    finally:
        await api.close()


def import_agent_image(node: RealNode) -> None:
    """The agent's image from podman's store (scripts/build-image.sh) into the node's
    containerd: ``podman save`` under the image build lock (the tag is shared), ``ctr
    import``. Raises LookupError when podman has no such image."""
    tar = node.root / "agent-image.tar"
    with open("/tmp/build-image.lock", "w") as lock:
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX)
        if subprocess.run(["podman", "image", "exists", AGENT_IMAGE]).returncode:
            raise LookupError(f"{AGENT_IMAGE} is not in podman's store: run "
                              "`flock /tmp/build-image.lock bash scripts/build-image.sh`")
        subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(tar),
                        AGENT_IMAGE], check=True, capture_output=True, timeout=300)
    node.import_image(tar)
    tar.unlink()


def crd_manifests() -> list[Path]:
    """The CRDs the agent needs where Istio's base chart is not installed: deploy/crds/
    (where they are moving) or deploy/kubernetes/crds.yaml."""
    root = realnode.ROOT / "deploy"
    if (root / "crds").is_dir():
        return sorted((root / "crds").glob("*.yaml"))
    return [p for p in [root / "kubernetes" / "crds.yaml"] if p.exists()]


def agent_daemonset(node: RealNode) -> dict:
    """deploy/kubernetes/daemonset.yaml as shipped, but for the two CNI host dirs, which
    point at the node's private ones (containerd's ``bin_dir``/``conf_dir``)."""
    docs = [d for d in kc.manifest("daemonset.yaml") if d.get("kind") == "DaemonSet"]
    ds = docs[0]
    override = {"/opt/cni/bin": str(node.cni_bin_dir), "/etc/cni/net.d": str(node.cni_conf_dir)}
    for v in ds["spec"]["template"]["spec"]["volumes"]:
        hp = v.get("hostPath")
        if hp and hp["path"] in override:
            hp["path"] = override[hp["path"]]
    return ds


async def deploy_agent(api, node: RealNode, ds: dict) -> None:
    """Namespace, CRDs, RBAC, ConfigMap and the DaemonSet, applied as shipped."""
    await kc.apply(api, {"apiVersion": "v1", "kind": "Namespace",
                         "metadata": {"name": ds["metadata"]["namespace"]}})
    names = []
    for crds in crd_manifests():
        names += [d["metadata"]["name"] for d in await kc.apply_manifest(api, str(crds))]
    if names:
        await kc.wait_crds_established(api, names)
    for m in ("rbac.yaml", "configmap.yaml"):
        await kc.apply_manifest(api, m)
    await kc.apply(api, ds)


async def agent_pods(api, ds: dict) -> list[dict]:
    sel = ",".join(f"{k}={v}" for k, v in ds["spec"]["selector"]["matchLabels"].items())
    out = await kc.request(api, "GET", f"/api/v1/namespaces/{ds['metadata']['namespace']}/pods",
                           query=[("labelSelector", sel)])
    return out["items"]


def ready(pod: dict) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))


def running(pod: dict) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and bool(st.get("podIP"))


async def namespace(api, name: str, ambient: bool) -> None:
    """A namespace (ambient: labelled istio.io/dataplane-mode=ambient); waits for the
    ``default`` ServiceAccount kube-controller-manager creates in it."""
    labels = {DATAPLANE_MODE: "ambient"} if ambient else {}
    await kc.apply(api, {"apiVersion": "v1", "kind": "Namespace",
                         "metadata": {"name": name, "labels": labels}})

    async def sa() -> bool:
        try:
            await kc.request(api, "GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
            return True
        except ApiException:
            return False
    deadline = time.monotonic() + 60
    while not await sa():
        if time.monotonic() > deadline:
            raise AssertionError(f"no default ServiceAccount in {name} after 60s "
                                 "(kube-controller-manager's serviceaccount controller)")
        await asyncio.sleep(0.2)


def app_pod(name: str, ns: str, probe: bool = True) -> dict:
    """A busybox httpd pod (verbose: its log names each client's address) with an httpGet
    readiness probe, not yet bound: the scheduler places it."""
    c: dict = {"name": "app", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
               "command": ["/bin/busybox", "httpd", "-f", "-vv", "-p", str(APP_PORT),
                           "-h", "/www"],
               "ports": [{"containerPort": APP_PORT}]}
    if probe:
        c["readinessProbe"] = {"httpGet": {"path": "/index.html", "port": APP_PORT},
                               "periodSeconds": 1, "failureThreshold": 1}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
            "spec": {"containers": [c], "terminationGracePeriodSeconds": 1,
                     "automountServiceAccountToken": False}}


async def create_pod(api, pod: dict) -> dict:
    ns = pod["metadata"]["namespace"]
    return await kc.request(api, "POST", f"/api/v1/namespaces/{ns}/pods", body=pod)


async def get_pod(api, ns: str, name: str) -> dict:
    return await kc.request(api, "GET", f"/api/v1/namespaces/{ns}/pods/{name}")


def sandbox_pid(node: RealNode, pod_uid: str) -> int:
    """The pid of the pod sandbox's process (containerd's CRI labels name the pod's UID);
    0 when there is none running."""
    ids = node.ctr("containers", "list", "-q",
                   f'labels."io.kubernetes.pod.uid"=={pod_uid},'
                   'labels."io.cri-containerd.kind"==sandbox', check=False).stdout.split()
    tasks = {}
    for line in node.ctr("tasks", "list", check=False).stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "RUNNING":
            tasks[parts[0]] = int(parts[1])
    for cid in ids:
        if cid in tasks:
            return tasks[cid]
    return 0


def pod_netns(node: RealNode, pod_uid: str) -> str:
    pid = sandbox_pid(node, pod_uid)
    if not pid:
        raise AssertionError(f"no running sandbox for pod {pod_uid}")
    return f"/proc/{pid}/ns/net"


def rules_in(netns: str) -> str:
    """Every iptables table and the nftables ruleset in ``netns`` (text)."""
    def dump() -> str:
        out = []
        for argv in (["iptables-save"], ["ip6tables-save"], ["iptables-legacy-save"],
                     ["nft", "list", "ruleset"]):
            if not shutil.which(argv[0]):
                continue
            r = subprocess.run(argv, capture_output=True, text=True)
            out.append(r.stdout)
        return "\n".join(out)
    return run_in_netns_thread(netns, dump)


def has_inpod_rules(text: str) -> bool:
    """The agent's in-pod redirection: the iptables ISTIO_* chains or its nftables tables."""
    return ":ISTIO_PRERT" in text or ":ISTIO_OUTPUT" in text or "istio" in text.lower()


def container_log(node: RealNode, pod: dict, container: str = "app") -> str:
    """The container's log file as the kubelet keeps it (podLogsDir/<ns>_<name>_<uid>/)."""
    d = (node.root / "pod-logs" /
         f"{pod['metadata']['namespace']}_{pod['metadata']['name']}_{pod['metadata']['uid']}"
         / container)
    out = []
    with contextlib.suppress(OSError):
        for f in sorted(d.iterdir()):
            out.append(f.read_text(errors="replace"))
    return "".join(out)


async def delete_everything(api, node: RealNode, namespaces: list[str],
                            timeout: float = 90) -> None:
    """Delete the test's namespaces (their pods) and the DaemonSet's namespace, and wait
    until the kubelet has no pod left (sandboxes torn down through CNI DEL)."""
    deadline = time.monotonic() + timeout
    for ns in namespaces:  # in order: the app pods go while the agent still runs
        with contextlib.suppress(ApiException):
            ds = await kc.request(api, "GET", f"/apis/apps/v1/namespaces/{ns}/daemonsets")
            for d in ds["items"]:
                await kc.request(api, "DELETE", f"/apis/apps/v1/namespaces/{ns}/daemonsets/"
                                 f"{d['metadata']['name']}")
        with contextlib.suppress(ApiException):
            await kc.request(api, "DELETE", f"/api/v1/namespaces/{ns}/pods",
                             query=[("gracePeriodSeconds", 0)])
        while time.monotonic() < deadline:
            try:
                pods = await kc.request(api, "GET", f"/api/v1/namespaces/{ns}/pods")
            except ApiException:
                break
            if not pods["items"]:
                break
            await asyncio.sleep(0.5)
    # the kubelet removes sandboxes after the API objects are gone
    while time.monotonic() < deadline and node.procs.get("kubelet") is not None:
        if not node.ctr("containers", "list", "-q", check=False, timeout=20).stdout.strip():
            break
        await asyncio.sleep(0.5)


def kubectl(node: RealNode, *args: str) -> str:
    r = subprocess.run([str(node.bin / "kubectl"), "--kubeconfig",
                        os.path.join(node.cluster.directory, "admin.kubeconfig"), *args],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise AssertionError(f"kubectl {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def import_agent_image_prepare_check() -> None:
    """LookupError when podman's store has no agent image (before any node is started)."""
    if subprocess.run(["podman", "image", "exists", AGENT_IMAGE]).returncode:
        raise LookupError(f"{AGENT_IMAGE} is not in podman's store: run "
                          "`flock /tmp/build-image.lock bash scripts/build-image.sh`")


def agent_settings() -> dict:
    """The agent's settings as the shipped ConfigMap gives them."""
    import yaml
    cm = next(d for d in kc.manifest("configmap.yaml") if d.get("kind") == "ConfigMap")
    return yaml.safe_load(cm["data"]["config.yaml"])
