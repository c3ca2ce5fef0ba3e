"""The DaemonSet's pod spec run on this host with rootful podman, as a kubelet would.

The agent container's image, command, args, env, security context, hostPID/hostNetwork,
resources (memory limit, CPU request as shares), termination grace and volume mounts are
READ from ``deploy/kubernetes/daemonset.yaml`` and turned into
``podman run`` flags (:func:`podman_run_args`); nothing of them is restated here. What
the test chooses itself, and why:

- the host CNI dirs (hostPath ``/opt/cni/bin``, ``/etc/cni/net.d``) point at a test dir,
  which the test's podman uses as its CNI config and plugin dirs;
- ``hostNetwork``: the container joins a scratch netns standing in for the node's
  network (the agent's ports, host probe SNAT rules and ipsets stay out of the real
  host, which other agents on this machine share); pods are podman containers on a
  bridge in the real host netns, as any runtime makes them;
- the ConfigMap volume: the DaemonSet's ConfigMap with ``config_source: files`` (no
  API server here) and its ``config_dir`` on the state dir hostPath, where the test
  writes each container's Pod object (uid = container ID, ambient namespace ``demo``);
- ``fieldRef`` env: ``spec.nodeName`` = this host's name, ``metadata.namespace`` = the
  DaemonSet's namespace.

The reference ztunnel (``agent.demo.fake_ztunnel.FakeZtunnel`` with listeners in each pod netns)
connects to the ZDS socket on the shared hostPath ``/var/run/ztunnel``. Checked: the
in-container ``cni install`` chained istio-cni into the test conflist and left the
standalone plugin in the bin dir; pods started by podman are enrolled and held by the
reference ztunnel, and traffic from one pod to another lands on ztunnel's outbound
listener; stopping the agent container leaves the pods' in-pod rules in place and the
plugin chained, answering "try again" (CNI code 11) for an enrolled pod and letting an
unknown non-ambient one through (its decision from the agent's enablement snapshot);
starting it again re-snapshots both pods.

Requires root, podman + runc and the image (``bash scripts/build-image.sh``; .ci/run
builds it). Skipped otherwise (failed under CI=true when the image is missing).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from agent.demo import podman

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
EXAMPLES = ROOT / "examples" / "cluster"
POD_NAMESPACE = "demo"
APP_PORT = 8080


def manifests() -> tuple[dict, dict]:
    docs = {}
    for name in ("daemonset.yaml", "configmap.yaml"):
        for d in yaml.safe_load_all((DEPLOY / name).read_text()):
            if d:
                docs[d["kind"]] = d
    return docs["DaemonSet"], docs["ConfigMap"]


def field_ref(path: str, ds: dict, node: str, fields: dict[str, str] | None = None) -> str:
    """A downward-API ``fieldRef`` as kubelet resolves it for this pod; ``fields`` adds
    the ones only the caller knows (``status.hostIP``, ``status.podIP``)."""
    values = {"spec.nodeName": node, "metadata.namespace": ds["metadata"]["namespace"],
              "metadata.name": ds["metadata"]["name"] + "-test",
              "spec.serviceAccountName": ds["spec"]["template"]["spec"].get(
                  "serviceAccountName", "default"), **(fields or {})}
    if path not in values:
        raise AssertionError(f"the DaemonSet uses fieldRef {path!r}: teach the test")
    return values[path]


def expand(value: str, defined: dict[str, str]) -> str:
    """Kubernetes' env ``$(VAR)`` expansion: a reference to a variable defined EARLIER in
    the container's env is replaced, ``$$`` is a literal ``$``, anything else is kept as
    written (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and ")" in value[i:]:
            end = value.index(")", i)
            name = value[i + 2:end]
            out.append(defined.get(name, value[i:end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def container_env(ds: dict, node: str, fields: dict[str, str] | None = None) -> dict[str, str]:
    """The first container's env as kubelet hands it to the process (in order)."""
    env: dict[str, str] = {}
    for e in ds["spec"]["template"]["spec"]["containers"][0].get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        else:
            env[e["name"]] = field_ref(e["valueFrom"]["fieldRef"]["fieldPath"], ds, node,
                                       fields)
    return env


def podman_run_args(ds: dict, name: str, node: str, network: str,
                    host_path: dict[str, str], volume_dir: Path,
                    fields: dict[str, str] | None = None) -> list[str]:
    """``podman run`` arguments for the DaemonSet's first container, as a kubelet (via a
    CRI runtime) would set it up. ``host_path`` maps a hostPath to the directory used
    here; ``volume_dir`` holds configMap, projected and emptyDir volumes (prepared by the
    caller, one directory per volume name); ``fields``: extra downward-API values."""
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = ["run", "-d", "--name", name, "--network", network]
    if pod.get("hostPID"):
        args += ["--pid", "host"]
    sc = c.get("securityContext") or {}
    if "runAsUser" in sc:
        args += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', 0)}"]
    if sc.get("privileged"):
        args.append("--privileged")
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = sc.get("capabilities") or {}
    for cap in caps.get("drop") or []:
        args += ["--cap-drop", cap.lower()]
    for cap in caps.get("add") or []:
        args += ["--cap-add", cap.lower()]
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    annotations = ds["spec"]["template"]["metadata"].get("annotations") or {}
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined" or annotations.get(
            f"container.apparmor.security.beta.kubernetes.io/{c['name']}") == "unconfined":
        args += ["--security-opt", "apparmor=unconfined"]
    for key, value in container_env(ds, node, fields).items():
        args += ["--env", f"{key}={value}"]
    res = c.get("resources") or {}
    memory = (res.get("limits") or {}).get("memory")
    if memory:  # kubelet puts limits.memory on the container's cgroup
        units = {"Ki": "k", "Mi": "m", "Gi": "g"}
        args += ["--memory", memory[:-2] + units[memory[-2:]] if memory[-2:] in units
                 else memory]
    cpu = (res.get("requests") or {}).get("cpu")
    if cpu:  # and requests.cpu as cpu shares (1 CPU = 1024)
        milli = int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)
        args += ["--cpu-shares", str(max(2, milli * 1024 // 1000))]
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    for m in c.get("volumeMounts") or []:
        v = volumes[m["name"]]
        if "hostPath" in v:
            src = host_path.get(v["hostPath"]["path"], v["hostPath"]["path"])
        else:
            src = str(volume_dir / m["name"])
        opts = ["ro"] if m.get("readOnly") else ["rw"]
        if m.get("mountPropagation") == "HostToContainer":
            opts.append("rslave")
        args += ["--volume", f"{src}:{m['mountPath']}:{','.join(opts)}"]
    if c.get("command"):
        args += ["--entrypoint", json.dumps(c["command"])]
    args.append(c["image"])
    args += c.get("args") or []
    return args


def http_in_netns(netns: str, url: str) -> int:
    from agent.core.netns import run_in_netns_thread

    def get() -> int:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status
        except OSError:
            return 0
    return run_in_netns_thread(netns, get)


class Node:
    """The test's host side: dirs, node netns, podman config, cleanup in reverse."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="ds", dir="/tmp"))
        self.suffix = secrets.token_hex(3)
        self.netns = f"dsnode{self.suffix}"
        self.cleanups: list = []

    def later(self, fn, *args, **kwargs) -> None:
        self.cleanups.append((fn, args, kwargs))

    def close(self) -> None:
        for fn, args, kwargs in reversed(self.cleanups):
            try:
                fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - clean up the rest regardless
                print(f"cleanup {fn}: {e}")
        shutil.rmtree(self.root, ignore_errors=True)


def _shared_dir(node: Node, path: str) -> None:
    """A host dir shared with the container (DirectoryOrCreate); refuse one in use. A dir
    that was there already is put back as it was at the end: what the test's agent added
    is removed, the files it rewrote get their old bytes back."""
    p = Path(path)
    if p.exists():
        if any(f.is_socket() for f in p.iterdir()):
            pytest.skip(f"{path} is in use on this host (sockets present)")
        node.later(_restore_dir, p, _dir_contents(p))
        return
    p.mkdir(parents=True)
    node.later(shutil.rmtree, str(p), True)


def _dir_contents(root: Path) -> dict[Path, bytes | None]:
    """Every entry under ``root``: a regular file's bytes, None for anything else. A
    file that is a mount point (a network namespace someone else bound under
    ``/var/run/netns``: reading it is EINVAL) is not the test's to read or rewrite."""
    out: dict[Path, bytes | None] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            out[Path(d, name)] = None
        for name in files:
            f = Path(d, name)
            regular = f.is_file() and not f.is_symlink() and not os.path.ismount(f)
            out[f] = f.read_bytes() if regular else None
    return out


def _restore_dir(root: Path, before: dict[Path, bytes | None]) -> None:
    """Remove what is under ``root`` and not in ``before`` (deepest first); rewrite the
    regular files of ``before`` whose bytes changed."""
    for entry in sorted(_dir_contents(root), key=lambda e: len(e.parts), reverse=True):
        if entry in before:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    for entry, data in before.items():
        if data is not None and entry.is_file() and entry.read_bytes() != data:
            entry.write_bytes(data)


def _ipt_rules(netns_path: str) -> str:
    from agent.core.netns import run_in_netns_thread
    return run_in_netns_thread(netns_path, lambda: subprocess.run(
        ["iptables-save"], capture_output=True, text=True).stdout)


@pytest.mark.root
@pytest.mark.podman
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (podman, netns)")
@pytest.mark.skipif(not podman.available(), reason="needs podman and runc")
async def test_daemonset_pod_spec_on_podman():
    from pyroute2 import netns as pr_netns

    from agent.demo.examples import pod_manifest
    from agent.demo.fake_ztunnel import FakeZtunnel

    ds, cm = manifests()
    spec = ds["spec"]["template"]["spec"]
    container = spec["containers"][0]
    image = container["image"]
    host = podman.Podman(None)
    if not host.image_exists(image):
        if os.environ.get("CI"):
            pytest.fail(f"{image} missing: .ci/run must run scripts/build-image.sh first")
        pytest.skip(f"{image} missing: run bash scripts/build-image.sh")
    node = Node()
    try:
        await _run(node, ds, cm, spec, container, pr_netns, pod_manifest, FakeZtunnel)
    finally:
        node.close()


async def _run(node, ds, cm, spec, container, pr_netns, pod_manifest, FakeZtunnel):
    root = node.root
    # --- the node: dirs, netns, podman's CNI config ---
    for d in ("opt/cni/bin", "etc/cni/net.d", "config", "ipam"):
        (root / d).mkdir(parents=True)
    host_path = {"/opt/cni/bin": str(root / "opt/cni/bin"),
                 "/etc/cni/net.d": str(root / "etc/cni/net.d")}
    hostpaths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    for p in sorted(hostpaths - set(host_path) - {"/proc"}):
        _shared_dir(node, p)
    await asyncio.to_thread(pr_netns.create, node.netns)
    node.later(pr_netns.remove, node.netns)
    node_ns = f"/var/run/netns/{node.netns}"
    subprocess.run(["ip", "-n", node.netns, "link", "set", "lo", "up"], check=True)
    conf = root / "containers.conf"
    podman.write_containers_conf(conf, [root / "opt/cni/bin", "/usr/lib/cni"],
                                 root / "etc/cni/net.d")
    pm = podman.Podman(conf)
    bridge, net = f"dsbr{node.suffix}", f"dsnet{node.suffix}"
    (root / "etc/cni/net.d" / f"50-{net}.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": net, "plugins": [
            {"type": "bridge", "bridge": bridge, "isGateway": True,
             "ipam": {"type": "host-local", "dataDir": str(root / "ipam"),
                      "ranges": [[{"subnet": f"10.{70 + secrets.randbelow(40)}."
                                             f"{secrets.randbelow(250)}.0/24"}]]}}]}))
    node.later(subprocess.run, ["ip", "link", "del", bridge], capture_output=True)
    # --- the ConfigMap volume: the DaemonSet's, on the files source ---
    settings = yaml.safe_load(cm["data"]["config.yaml"])
    state_dir = settings.get("state_dir", "/var/run/ambient-agent")
    settings.update(config_source="files", config_dir=f"{state_dir}/cluster")
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(settings))
    for v in spec["volumes"]:
        if "emptyDir" in v:
            (root / v["name"]).mkdir()
    config_mount = next(m for m in container["volumeMounts"]
                        if "configMap" in next(v for v in spec["volumes"]
                                               if v["name"] == m["name"]))
    os.rename(root / "config", root / config_mount["name"])
    cluster = Path(state_dir) / "cluster"
    if not cluster.exists():
        cluster.mkdir(mode=0o700)
        node.later(shutil.rmtree, str(cluster), True)
    if not (cluster / "namespaces.yaml").exists():
        node.later((cluster / "namespaces.yaml").unlink, missing_ok=True)
    shutil.copy(EXAMPLES / "namespaces.yaml", cluster / "namespaces.yaml")
    busybox = f"localhost/ds-busybox:{node.suffix}"
    await asyncio.to_thread(pm.import_busybox, busybox)
    node.later(pm.run, "rmi", "-f", busybox, check=False)

    # --- the agent's container, from the DaemonSet ---
    name = f"ds-agent-{node.suffix}"
    argv = podman_run_args(ds, name, socket.gethostname(), f"ns:{node_ns}", host_path, root)
    node.later(pm.run, "rm", "-f", "-t", "5", "--ignore", name, check=False)
    started = time.monotonic()
    await asyncio.to_thread(pm.run, *argv)
    probe = container["readinessProbe"]["httpGet"]
    ready_url = f"http://127.0.0.1:{probe['port']}{probe['path']}"

    async def until(what, predicate, timeout=90.0):
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(predicate):
            if time.monotonic() > deadline:
                logs = pm.run("logs", name, check=False)
                raise AssertionError(f"timed out waiting for {what}; agent logs:\n{logs[-6000:]}")
            await asyncio.sleep(0.2)

    await until("readiness", lambda: http_in_netns(node_ns, ready_url) == 200)
    ready_s = time.monotonic() - started
    conflist = root / "etc/cni/net.d" / f"50-{net}.conflist"

    def chained() -> bool:
        plugins = json.loads(conflist.read_text())["plugins"]
        return any(p.get("type") == "istio-cni" for p in plugins)
    await until("istio-cni chained by the in-container install", chained)
    plugin = root / "opt/cni/bin/istio-cni"
    assert plugin.exists() and (root / "opt/cni/bin/istio-cni.d").is_dir()
    assert "/istio-cni.d/" in plugin.read_text()  # the standalone build, not a venv

    # --- the reference ztunnel on the shared ZDS socket ---
    zds_path = settings.get("ztunnel_uds_address", "/var/run/ztunnel/ztunnel.sock")
    zt = FakeZtunnel(zds_path, open_listeners=True)
    zt_task = asyncio.create_task(zt.run())
    node.later(zt.stop)
    await zt.wait_snapshot(timeout=30)

    # --- two pods through CNI, each with its Pod object first ---
    pods = []
    # The host's state dir is shared: remove the Pod objects written into it, after the
    # containers (cleanups run in reverse).
    pod_files: list[Path] = []
    node.later(lambda: [f.unlink(missing_ok=True) for f in pod_files])
    for i in range(2):
        pname = f"ds-pod{i}-{node.suffix}"
        cid = await asyncio.to_thread(pm.create, pname, net, busybox, "/bin/busybox",
                                      "sleep", "3600")
        node.later(pm.remove, cid)
        manifest = pod_manifest(pname, POD_NAMESPACE, cid, "", socket.gethostname(),
                                "default", {"app": pname}, ready=False)
        manifest["status"] = {"phase": "Pending"}
        pod_file = cluster / f"pod-{cid[:12]}.yaml"
        pod_files.append(pod_file)
        pod_file.write_text(yaml.safe_dump(manifest))
        await asyncio.sleep(1.0)  # the files source picks it up (watch + debounce)
        await asyncio.to_thread(pm.start, cid)
        netns_path, ip = await asyncio.to_thread(pm.netns_and_ip, cid, net)
        pods.append((cid, netns_path, ip))
        await zt.wait_for_pod(cid, timeout=30)
        assert ":ISTIO_OUTPUT" in await asyncio.to_thread(_ipt_rules, netns_path)

    # pod0 -> pod1: captured in pod0 and handed to the reference ztunnel's outbound
    from agent.core.netns import run_in_netns_thread

    def dial():
        try:
            with socket.create_connection((pods[1][2], APP_PORT), timeout=3):
                pass
        except OSError:
            pass
    await asyncio.to_thread(run_in_netns_thread, pods[0][1], dial)
    hit = await asyncio.wait_for(zt.accepted.get(), 10)
    assert (hit.uid, hit.port) == (pods[0][0], 15001), hit
    assert hit.original_dst[:2] == (pods[1][2], APP_PORT), hit

    # --- stop the agent: pods stay meshed, the plugin stays and says "try again" ---
    grace = str(spec.get("terminationGracePeriodSeconds", 30))
    await asyncio.to_thread(pm.run, "stop", "-t", grace, name)
    for cid, netns_path, _ in pods:
        assert ":ISTIO_OUTPUT" in await asyncio.to_thread(_ipt_rules, netns_path), cid
    assert chained() and plugin.exists(), "istio-cni must stay installed across a stop"
    # the chained config exactly as libcni hands it to our plugin (with prevResult)
    entry = next(p for p in json.loads(conflist.read_text())["plugins"]
                 if p["type"] == "istio-cni")
    entry = {**entry, "cniVersion": "1.0.0", "name": net,
             "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.1.2.3/24"}]}}

    def plugin_add(container_id: str) -> tuple[int, dict]:
        r = subprocess.run([str(plugin)], input=json.dumps(entry).encode(),
                           capture_output=True, env={
                               "CNI_COMMAND": "ADD", "CNI_CONTAINERID": container_id,
                               "CNI_NETNS": "/var/run/netns/none", "CNI_IFNAME": "eth0",
                               "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=x",
                               "CNI_PATH": "/usr/lib/cni", "PATH": "/usr/bin:/bin"})
        return r.returncode, json.loads(r.stdout)
    # a sandbox re-created for an enrolled (ambient) pod: "try again" until an agent is
    # back (the agent's enablement snapshot says ambient)
    code, answer = plugin_add(pods[0][0])
    assert code == 1 and answer["code"] == 11, answer
    # a pod the agent never saw, no Kubernetes namespace: not ambient, let through
    code, answer = plugin_add("f" * 64)
    assert code == 0 and answer["ips"][0]["address"] == "10.1.2.3/24", answer

    # --- start it again: both pods re-snapshotted to ztunnel ---
    snapshots = zt.snapshots
    await asyncio.to_thread(pm.run, "start", name)
    await until("readiness after restart", lambda: http_in_netns(node_ns, ready_url) == 200)
    await zt.wait_snapshot(timeout=60, count=snapshots + 1)
    assert {cid for cid, _, _ in pods} <= zt.snapshot_set, zt.snapshot_set
    zt.stop()
    await asyncio.wait_for(zt_task, 10)
    print(f"agent container ready in {ready_s:.1f}s")


def _image_or_skip() -> str:
    ds, _ = manifests()
    image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
    if not podman.Podman(None).image_exists(image):
        if os.environ.get("CI"):
            pytest.fail(f"{image} missing: .ci/run must run scripts/build-image.sh first")
        pytest.skip(f"{image} missing: run bash scripts/build-image.sh")
    return image


@pytest.mark.root
@pytest.mark.podman
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (podman)")
@pytest.mark.skipif(not podman.available(), reason="needs podman and runc")
async def test_image_version_and_in_container_install_runs_on_a_bare_node(tmp_path):
    """``podman run <image> ambient-agent version``; then ``ambient-agent cni install``
    in the image with the host CNI dirs mounted where the DaemonSet mounts them (paths
    and settings read from daemonset.yaml and configmap.yaml), and the plugin it leaves
    in the host bin dir answers VERSION and ADD in a chroot holding only glibc and
    busybox (tests/cni/test_plugin_bundle.py ``check_in_glibc_busybox_chroot``)."""
    from tests.cni.standalone import missing_chroot_tools
    from tests.cni.test_plugin_bundle import check_in_glibc_busybox_chroot

    image = _image_or_skip()
    conf = tmp_path / "containers.conf"
    podman.write_containers_conf(conf, ["/usr/lib/cni"], tmp_path / "unused-net.d")
    pm = podman.Podman(conf)
    from agent.cli import version_string
    out = await asyncio.to_thread(pm.run, "run", "--rm", "--network", "none", image,
                                  "ambient-agent", "version")
    assert out == f"ambient-agent {version_string()}", out

    ds, cm = manifests()
    spec = ds["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    vols = {v["hostPath"]["path"]: v["name"] for v in spec["volumes"] if "hostPath" in v}
    settings = yaml.safe_load(cm["data"]["config.yaml"])
    host_bin, host_conf = tmp_path / "host-bin", tmp_path / "host-net.d"
    host_bin.mkdir()
    host_conf.mkdir()
    (host_conf / "10-br.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": "br", "plugins": [{"type": "bridge"}]}))
    out = await asyncio.to_thread(
        pm.run, "run", "--rm", "--network", "none",
        "--volume", f"{host_bin}:{mounts[vols['/opt/cni/bin']]}",
        "--volume", f"{host_conf}:{mounts[vols['/etc/cni/net.d']]}",
        image, "ambient-agent", "cni", "install",
        "--conf-dir", settings["cni_conf_dir"], "--bin-dir", settings["cni_bin_dir"],
        "--config-file", os.devnull)
    assert "chained into" in out, out
    assert (host_bin / "istio-cni").exists()
    assert any(p["type"] == "istio-cni" for p in
               json.loads((host_conf / "10-br.conflist").read_text())["plugins"])
    why = missing_chroot_tools()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="cr", dir="/tmp"))
    try:
        await check_in_glibc_busybox_chroot(host_bin, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
