"""ztunnel's DaemonSet (deploy/ztunnel/ztunnel.yaml) beside the agent's, both pod specs run
with rootful podman as a kubelet would (:func:`tests.deploy.test_daemonset_podman.podman_run_args`:
image, command, env with fieldRefs and ``$(VAR)`` expansion, security context, mounts,
all READ from the manifests).

The node: a scratch netns stands in for the node's network (the agent's hostNetwork);
ztunnel's pod gets its own netns joined to it by a veth pair, the node side's address
being the node IP (``status.hostIP``) and the pod side's the pod IP (``status.podIP``),
as a pod network would. What the test plays, and why:

- the agent's ConfigMap: the DaemonSet's, with ``config_source: files`` (no API server
  here) and a ``tokens_file`` holding one random token for ``istio-system/ztunnel``;
- ztunnel's volumes: the projected ``istio-token`` is that token (no trailing newline, as
  kubelet writes a projected token); the ``istio-ca-root-cert`` ConfigMap holds the root
  the agent published (``mesh_root_file``), which is what the ConfigMap's publisher puts
  there; the ZDS socket dir is the shared hostPath ``/var/run/ztunnel``.

Checked without a ztunnel binary (:mod:`tests.deploy.ztunnel_env_check`, the clients
written from ztunnel's source, run in the pod's netns): with the rendered env, the xDS
address at the node IP answers ztunnel's delta xDS stream (server verified against the
mounted root under ``ALT_XDS_HOSTNAME``, the mounted token accepted), and the CA address
signs the identity of a pod on this node for ztunnel (``ImpersonatedIdentity``, as in
shared proxy mode) with a chain to that root. With ``AMBIENT_TEST_ZTUNNEL`` (a
ztunnel binary; it is run in the agent's image, which has the C libraries it links, with
the pod spec of ztunnel.yaml otherwise as written: env, mounts, user, capabilities):
ztunnel's readiness ``:15021/healthz/ready`` answers 200 in its pod netns and the agent
counts it as an xDS client and a ZDS connection.

Requires root, podman + runc and the agent's image (``bash scripts/build-image.sh``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agent.demo import podman
from tests.deploy.test_daemonset_podman import (Node, _shared_dir, container_env,
                                                http_in_netns, manifests, podman_run_args)

ROOT = Path(__file__).resolve().parents[2]
ZTUNNEL_YAML = ROOT / "deploy" / "ztunnel" / "ztunnel.yaml"
ZTUNNEL = os.environ.get("AMBIENT_TEST_ZTUNNEL", "")

pytestmark = [pytest.mark.root, pytest.mark.podman, pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (podman, netns)"),
              pytest.mark.skipif(not podman.available(), reason="needs podman and runc")]


def ztunnel_daemonset() -> dict:
    return next(d for d in yaml.safe_load_all(ZTUNNEL_YAML.read_text())
                if d and d["kind"] == "DaemonSet")


def _veth(node: Node, pod_netns: str) -> tuple[str, str]:
    """A veth pair node netns <-> pod netns: (node IP, pod IP)."""
    a, b = secrets.randbelow(200) + 20, secrets.randbelow(60) * 4
    host_ip, pod_ip = f"10.{a}.{b // 256}.{b % 256 + 1}", f"10.{a}.{b // 256}.{b % 256 + 2}"
    nv, pv = f"ztn{node.suffix}", f"ztp{node.suffix}"
    run = lambda *a: subprocess.run(["ip", *a], check=True)  # noqa: E731
    run("link", "add", nv, "netns", node.netns, "type", "veth", "peer", "name", pv,
        "netns", pod_netns)
    run("-n", node.netns, "addr", "add", f"{host_ip}/30", "dev", nv)
    run("-n", node.netns, "link", "set", nv, "up")
    run("-n", pod_netns, "addr", "add", f"{pod_ip}/30", "dev", pv)
    run("-n", pod_netns, "link", "set", pv, "up")
    run("-n", pod_netns, "link", "set", "lo", "up")
    run("-n", pod_netns, "route", "add", "default", "via", host_ip)
    return host_ip, pod_ip


async def test_ztunnel_pod_spec_reaches_the_node_local_agent():
    from pyroute2 import netns as pr_netns

    ds, cm = manifests()
    spec = ds["spec"]["template"]["spec"]
    image = spec["containers"][0]["image"]
    if not podman.Podman(None).image_exists(image):
        if os.environ.get("CI"):
            pytest.fail(f"{image} missing: .ci/run must run scripts/build-image.sh first")
        pytest.skip(f"{image} missing: run bash scripts/build-image.sh")
    if ZTUNNEL and not os.access(ZTUNNEL, os.X_OK):
        pytest.fail(f"AMBIENT_TEST_ZTUNNEL={ZTUNNEL} is not an executable")
    node = Node()
    try:
        await _run(node, ds, cm, spec, pr_netns)
    finally:
        node.close()


async def _run(node: Node, ds: dict, cm: dict, spec: dict, pr_netns) -> None:
    root = node.root
    for d in ("opt/cni/bin", "etc/cni/net.d", "config", "ipam"):
        (root / d).mkdir(parents=True)
    host_path = {"/opt/cni/bin": str(root / "opt/cni/bin"),
                 "/etc/cni/net.d": str(root / "etc/cni/net.d")}
    zds = ztunnel_daemonset()
    zspec = zds["spec"]["template"]["spec"]
    hostpaths = {v["hostPath"]["path"] for s in (spec, zspec) for v in s["volumes"]
                 if "hostPath" in v}
    for p in sorted(hostpaths - set(host_path) - {"/proc"}):
        _shared_dir(node, p)
    await asyncio.to_thread(pr_netns.create, node.netns)
    node.later(pr_netns.remove, node.netns)
    pod_netns = f"dszt{node.suffix}"
    await asyncio.to_thread(pr_netns.create, pod_netns)
    node.later(pr_netns.remove, pod_netns)
    node_ns, pod_ns = f"/var/run/netns/{node.netns}", f"/var/run/netns/{pod_netns}"
    subprocess.run(["ip", "-n", node.netns, "link", "set", "lo", "up"], check=True)
    host_ip, pod_ip = _veth(node, pod_netns)
    # a primary CNI network for the agent's in-container install to chain into
    net = f"dsnet{node.suffix}"
    (root / "etc/cni/net.d" / f"50-{net}.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": net, "plugins": [
            {"type": "bridge", "bridge": f"dsbr{node.suffix}", "isGateway": True,
             "ipam": {"type": "host-local", "dataDir": str(root / "ipam"),
                      "ranges": [[{"subnet": "10.99.0.0/24"}]]}}]}))

    # --- the agent, from its DaemonSet, with a token for ztunnel's account ---
    token = secrets.token_urlsafe(24)
    settings = yaml.safe_load(cm["data"]["config.yaml"])
    state_dir = settings.get("state_dir", "/var/run/ambient-agent")
    config_mount = next(m for m in spec["containers"][0]["volumeMounts"]
                        if "configMap" in next(v for v in spec["volumes"]
                                               if v["name"] == m["name"]))
    settings.update(config_source="files", config_dir=f"{state_dir}/cluster-zt",
                    tokens_file=f"{config_mount['mountPath']}/tokens.yaml")
    cfg_dir = root / config_mount["name"]
    os.rename(root / "config", cfg_dir)
    (cfg_dir / "config.yaml").write_text(yaml.safe_dump(settings))
    (cfg_dir / "tokens.yaml").write_text(f"{token}: istio-system/ztunnel\n")
    os.chmod(cfg_dir / "tokens.yaml", 0o600)
    for v in spec["volumes"]:
        if "emptyDir" in v:
            (root / v["name"]).mkdir()
    cluster = Path(state_dir) / "cluster-zt"
    cluster.mkdir(mode=0o700, exist_ok=True)
    node.later(shutil.rmtree, str(cluster), True)
    # one ambient pod on this node: the identity ztunnel asks the CA for on its behalf
    from agent.demo.examples import pod_manifest
    hostname = socket.gethostname()
    shutil.copy(ROOT / "examples" / "cluster" / "namespaces.yaml", cluster / "namespaces.yaml")
    (cluster / "pod.yaml").write_text(yaml.safe_dump(pod_manifest(
        f"app-{node.suffix}", "demo", f"uid-{node.suffix}", "10.99.0.9", hostname, "app")))
    pod_identity = "spiffe://cluster.local/ns/demo/sa/app"
    conf = root / "containers.conf"
    podman.write_containers_conf(conf, [root / "opt/cni/bin", "/usr/lib/cni"],
                                 root / "etc/cni/net.d")
    pm = podman.Podman(conf)
    agent = f"ds-agent-{node.suffix}"
    argv = podman_run_args(ds, agent, hostname, f"ns:{node_ns}", host_path, root,
                           fields={"status.hostIP": host_ip, "status.podIP": host_ip})
    node.later(pm.run, "rm", "-f", "-t", "5", "--ignore", agent, check=False)
    await asyncio.to_thread(pm.run, *argv)
    probe = spec["containers"][0]["readinessProbe"]["httpGet"]
    ready_url = f"http://127.0.0.1:{probe['port']}{probe['path']}"

    async def until(what, predicate, timeout=90.0, logs_of=(agent,)):
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(predicate):
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}:\n{pm.run('logs', n, check=False)[-5000:]}"
                                 for n in logs_of)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            await asyncio.sleep(0.3)
    await until("agent readiness", lambda: http_in_netns(node_ns, ready_url) == 200)
    mesh_root = Path(settings.get("mesh_root_file",
                                  f"{state_dir}/mesh-root/root-cert.pem"))
    await until("the published mesh root", mesh_root.exists)

    # --- ztunnel's volumes, as kubelet would fill them ---
    zc = zspec["containers"][0]
    zvols = {v["name"]: v for v in zspec["volumes"]}
    zroot = root / "ztunnel"
    mounts: dict[str, str] = {}
    for m in zc["volumeMounts"]:
        v = zvols[m["name"]]
        d = zroot / m["name"]
        if "hostPath" in v:
            mounts[m["mountPath"]] = v["hostPath"]["path"]
            continue
        d.mkdir(parents=True)
        mounts[m["mountPath"]] = str(d)
        if "configMap" in v:
            assert v["configMap"]["name"] == "istio-ca-root-cert"
            shutil.copy(mesh_root, d / "root-cert.pem")
        elif "projected" in v:
            [src] = v["projected"]["sources"]
            sat = src["serviceAccountToken"]
            assert sat["audience"] == "istio-ca"
            (d / sat["path"]).write_text(token)  # no newline, as kubelet writes it
    fields = {"status.hostIP": host_ip, "status.podIP": pod_ip}
    env = container_env(zds, hostname, fields)
    assert env["XDS_ADDRESS"] == f"https://{host_ip}:15012", env

    if not ZTUNNEL:
        # the env and volumes resolve against the running agent, as ztunnel would use them
        r = await asyncio.to_thread(
            subprocess.run, ["ip", "netns", "exec", pod_netns, sys.executable, "-m",
                             "tests.deploy.ztunnel_env_check"],
            input=json.dumps({"env": env, "mounts": mounts, "identity": pod_identity}),
            capture_output=True,
            text=True, timeout=120, cwd=str(ROOT))
        assert r.returncode == 0, (r.stdout, r.stderr[-3000:],
                                   pm.run("logs", agent, check=False)[-4000:])
        out = json.loads(r.stdout)
        print(f"ztunnel env check: {out}")
        assert out["ca_identity"] == pod_identity, out
        assert any(t.endswith("istio.workload.Address") for t in out["xds_types"]), out
        return

    # --- the real ztunnel, its pod spec as written, the binary mounted into the agent's
    # image (ztunnel's own image is not pullable here) ---
    zname = f"ds-ztunnel-{node.suffix}"
    zds = json.loads(json.dumps(zds))
    zc = zds["spec"]["template"]["spec"]["containers"][0]
    zc["image"] = spec["containers"][0]["image"]
    zc["command"] = ["/usr/local/bin/ztunnel"]
    zargv = podman_run_args(zds, zname, hostname, f"ns:{pod_ns}", {}, zroot, fields=fields)
    zargv[zargv.index("--name"):zargv.index("--name")] = [
        "--volume", f"{os.path.realpath(ZTUNNEL)}:/usr/local/bin/ztunnel:ro"]
    node.later(pm.run, "rm", "-f", "-t", "5", "--ignore", zname, check=False)
    await asyncio.to_thread(pm.run, *zargv)
    zprobe = zc["readinessProbe"]["httpGet"]
    zready = f"http://127.0.0.1:{zprobe['port']}{zprobe['path']}"
    await until("ztunnel readiness", lambda: http_in_netns(pod_ns, zready) == 200,
                timeout=120, logs_of=(agent, zname))
    status = await asyncio.to_thread(pm.run, "exec", agent, "ambient-agent", "status",
                                     "-o", "json", check=False)
    assert "spiffe://cluster.local/ns/istio-system/sa/ztunnel" in status, status[-3000:]
