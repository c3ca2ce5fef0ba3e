"""Starting the demo's pods the way a runtime does: the Pod object first (no IP, as the
API server has it before the kubelet calls CNI), then CNI ADD through podman or through
:class:`agent.demo.cni_runtime.CniRuntime` on a named netns, then the Pod object with
its IP; and waiting until every pod's workload is in the ztunnel's xDS view.
"""

from __future__ import annotations

import asyncio
import os
import time

import yaml

from agent.demo.model import LOOPBACK_CONF, POD_COMMAND, DEMO_LABEL, DemoError, DemoPod
from agent.demo.state import DemoState
from agent.demo.traffic import create_netns


class DemoPods(DemoState):
    def write_pod(self, pod: DemoPod) -> None:
        from agent.demo.examples import pod_manifest

        labels = {"app": pod.name, **pod.labels}
        manifest = pod_manifest(pod.name, pod.namespace, pod.uid, pod.ip, self.config.node_name,
                                pod.service_account, labels, ready=bool(pod.ip))
        if not pod.ip:  # scheduled, not started: the API server has no IP yet
            manifest["status"] = {"phase": "Pending"}
        path = self.cluster_dir / f"pod-{pod.namespace}-{pod.name}.yaml"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(manifest, sort_keys=False))
        os.replace(tmp, path)  # atomic: the watcher never reads half a file

    async def start_pod(self, pod: DemoPod) -> None:
        if self.runtime_kind == "podman":
            await self.start_pod_podman(pod)
        else:
            await self.start_pod_netns(pod)

    async def publish_pod(self, pod: DemoPod) -> None:
        """Write the Pod object (no IP yet) and wait until the agent's store has it."""
        self.write_pod(pod)
        store = self.component("config-source").store
        await self.wait_until(f"pod {pod.name} in the config source",
                              lambda: store.pod_by_uid(pod.uid) is not None, 10)

    async def start_pod_podman(self, pod: DemoPod) -> None:
        """create → Pod object with uid = container ID → start (CNI ADD; the agent
        enrolls before podman start returns) → netns path and IP → Pod object with IP."""
        from agent.demo.podman import PodmanError

        self.chained_conflist()  # podman would start the pod unmeshed without our plugin
        name = f"ambdemo-{pod.name}-{self.suffix}"
        try:
            cid = await asyncio.to_thread(self.podman.create, name, self.network, self.image,
                                          *POD_COMMAND, labels={DEMO_LABEL: str(self.root)})
        except PodmanError as e:
            raise DemoError(f"creating the container of pod {pod.name}: {e}") from None
        self.on_cleanup(f"podman container {name}", lambda: self.podman.remove(cid))
        pod.uid = pod.container_id = cid
        await self.publish_pod(pod)
        try:
            await asyncio.to_thread(self.podman.start, cid)
            pod.netns_path, pod.ip = await asyncio.to_thread(self.podman.netns_and_ip, cid,
                                                             self.network)
        except PodmanError as e:  # shown to the user with the plugin's reason
            raise DemoError(f"starting pod {pod.name} with podman failed: {e}") from None
        self.write_pod(pod)

    async def start_pod_netns(self, pod: DemoPod) -> None:
        from pyroute2 import netns

        netns_name = f"ambdemo-{pod.name}-{self.suffix}"
        await asyncio.to_thread(create_netns, netns_name)
        pod.netns_path = f"/var/run/netns/{netns_name}"
        self.on_cleanup(f"netns {netns_name}", lambda: netns.remove(netns_name))
        await self.publish_pod(pod)
        conflist = self.chained_conflist()
        args = {"K8S_POD_NAMESPACE": pod.namespace, "K8S_POD_NAME": pod.name,
                "K8S_POD_INFRA_CONTAINER_ID": pod.container_id, "K8S_POD_UID": pod.uid}
        self.on_cleanup(f"CNI DEL {pod.name}", lambda: self.runtime.delete(
            conflist, pod.container_id, pod.netns_path, "eth0", args))
        try:
            # A runtime brings up the pod's loopback first (CRI's and podman's "lo"
            # network); the in-pod rules need it (routes on lo, 127.0.0.1 listeners).
            await asyncio.to_thread(self.runtime.exec_plugin, "ADD", LOOPBACK_CONF,
                                    pod.container_id, pod.netns_path, "lo", args)
            result = await asyncio.to_thread(self.runtime.add, conflist, pod.container_id,
                                             pod.netns_path, "eth0", args)
        except Exception as e:  # noqa: BLE001 - shown to the user with the plugin's reason
            raise DemoError(f"CNI ADD of pod {pod.name} failed: {e}") from None
        pod.ip = result["ips"][0]["address"].split("/")[0]
        self.write_pod(pod)

    def chained_conflist(self) -> dict:
        from agent.demo.cni_runtime import load_conflist

        path = self.conf_dir / "10-ambient-demo.conflist"
        conflist = load_conflist(str(path))
        types = [p.get("type") for p in conflist["plugins"]]
        if "istio-cni" not in types:
            raise DemoError(f"the agent's installer did not chain istio-cni into {path} "
                            f"(plugins: {types})")
        return conflist

    async def wait_workloads(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            # a real ztunnel is asked over HTTP (off the loop); the reference client's state
            # lives on the loop
            check = lambda: all(self.workload_for(p) for p in self.pods)  # noqa: E731
            found = await asyncio.to_thread(check) if self.ztunnel is not None else check()
            if found:
                return
            if time.monotonic() > deadline:
                raise DemoError("timed out after 15s waiting for every pod's workload (with its "
                                "IP) in xDS")
            await asyncio.sleep(0.1)
