"""The CNI plugin against upstream's Go ``istio-cni`` plugin (issue 28; needs root and Go).

Upstream's binary is built from the pinned istio.io/istio module by
scripts/istio-cni-test.sh (the same version scripts/istiod-test.sh builds istiod from;
cached, ~40 s the first time). Ours is the standalone build the image ships
(:func:`benchmarks.bench_cni.plugin_bundle`, installed by the real installer). Both are
exec'd as a runtime does, alternately, each against an agent that answers at once, so the
figure is the plugin's own cost: ours against the real CNI event server
(``cni.eventserver.CniEventServer`` on ``<run dir>/pluginevent.sock``, an enroller that
returns at once); upstream's against :class:`UpstreamEvents`, a listener written from
upstream's node agent (``cni/pkg/nodeagent/cni-watcher.go``: same socket name, ``POST
/cmdadd``, decode the ``CNIPluginAddEvent`` JSON, 200 once handled), because the two
plugins' event bodies differ (ours carries ``command``, ``container_id`` and the pod's
``ips`` as strings; upstream's ``Netns``, ``PodName``, ``PodNamespace``, ``IPs`` as
``IPConfig``) and our event server rejects upstream's (400, missing ``command``). Our
server does more per event (validation, the enablement decision) than that listener:
the comparison charges ours for it.

- **VERSION**: ``CNI_COMMAND=VERSION``, stdin ``{"cniVersion": "1.0.0"}``.
- **ADD** of an ambient pod (namespace ``demo`` labelled ``istio.io/dataplane-mode=ambient``,
  pod ``web-0``), each plugin doing what its ADD does: upstream's reads the kubeconfig the
  node agent leaves (``<run dir>/istio-cni-kubeconfig``), GETs the Pod and the Namespace
  from a real kube-apiserver (scripts/kube-test-apiserver.sh) to decide "ambient" with the
  chart's default enablement selectors, then POSTs the event; ours POSTs the event and the
  agent decides from its watch cache. Both end with the event answered and the prevResult
  printed. That is the comparable path: the work each design needs per ADD, with the same
  agent and the same socket (an absent agent would make upstream's ADD time its API
  retries, ours its connect error, neither a real start).

Figures: median wall ms of 60 execs each, interleaved; ratio ours / upstream, target
<= 1.0. Not in CI's default run (``python -m benchmarks --only cni_upstream``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess

from benchmarks.bench_cni import _interleaved_ms, plugin_bundle
from benchmarks.bench_kube import _available, on_private_api_server
from benchmarks.common import Result, ratio_result
from tests.kube import cluster as kc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "istio-cni-test.sh")
N = 60
SELECTORS = [
    {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
    {"podSelector": {"matchExpressions": [{"key": "istio.io/dataplane-mode",
                                           "operator": "NotIn", "values": ["none"]}]},
     "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}]


class UpstreamEvents:
    """See the module docstring: upstream's ``/cmdadd`` handler as far as a plugin can see
    it (HTTP/1.1 on ``<run dir>/pluginevent.sock``; 400 on a body that is not a JSON object
    with ``PodName``, ``PodNamespace``, ``Netns``; else 200 and the event counted)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, "pluginevent.sock")
        self.events: list[dict] = []
        self.runner = None

    async def start(self) -> "UpstreamEvents":
        from aiohttp import web

        async def cmdadd(request):
            try:
                body = json.loads(await request.read())
                if not isinstance(body, dict) or not all(
                        isinstance(body.get(k), str) for k in ("PodName", "PodNamespace",
                                                                "Netns")):
                    raise ValueError(f"not a CNIPluginAddEvent: {body!r:.200}")
            except ValueError as e:
                return web.Response(status=400, text=str(e))
            self.events.append(body)
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/cmdadd", cmdadd)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.UnixSite(self.runner, self.path).start()
        os.chmod(self.path, 0o600)
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def build_upstream() -> str:
    from tests.oracle.harness import script_env
    out = subprocess.run(["bash", SCRIPT, "build"], check=True, capture_output=True, text=True,
                         env=script_env(), timeout=1800)
    return out.stdout.strip().splitlines()[-1]


async def measure(cluster: kc.KubeCluster, tmp: str, upstream: str) -> list[Result]:
    from cni.install import Installer
    from tests.cni.conftest import cni_env, net_conf, start_agent

    api = await cluster.admin_client()
    try:
        await kc.create_namespace(api, "demo", labels={"istio.io/dataplane-mode": "ambient"})
        await kc.run_pod(api, "web-0", "demo", "node-0", ips=["10.9.8.7"])
    finally:
        await api.close()
    inst = Installer(conf_dir=f"{tmp}/net.d", bin_dir=f"{tmp}/bin", run_dir=f"{tmp}/state",
                     plugin_bundle=plugin_bundle())
    inst.install_binary()
    agent = await start_agent(f"{tmp}/state")
    up_dir = os.path.join(tmp, "upstream-run")
    os.makedirs(up_dir, mode=0o700)
    up_events = await UpstreamEvents(up_dir).start()
    try:
        shutil.copyfile(cluster.kubeconfig, os.path.join(up_dir, "istio-cni-kubeconfig"))
        stdin = json.dumps(net_conf(agent.run_dir, ambient_default=True)).encode()
        up_stdin = json.dumps(net_conf(up_dir, ambient_enabled=True,
                                       enablement_selectors=SELECTORS,
                                       exclude_namespaces=["kube-system"],
                                       plugin_log_level="info")).encode()
        version_in = b'{"cniVersion":"1.0.0"}'
        # one ADD each first: both must succeed, else the figures mean nothing
        for argv, conf in (([inst.binary_path], stdin), ([upstream], up_stdin)):
            proc = await asyncio.to_thread(subprocess.run, argv, input=conf, env=cni_env(),
                                           capture_output=True)
            if proc.returncode:
                raise RuntimeError(f"{argv[0]} ADD failed ({proc.returncode}): "
                                   f"{proc.stdout[-500:]!r} {proc.stderr[-500:]!r}")
        before, up_before = len(agent.enroller.enrolled), len(up_events.events)
        times = await asyncio.to_thread(_interleaved_ms, {
            "ours ADD": ([inst.binary_path], cni_env(), stdin),
            "upstream ADD": ([upstream], cni_env(), up_stdin),
            "ours VERSION": ([inst.binary_path], cni_env("VERSION"), version_in),
            "upstream VERSION": ([upstream], cni_env("VERSION"), version_in),
        }, N)
        events = len(agent.enroller.enrolled) - before
        up_count = len(up_events.events) - up_before
    finally:
        await up_events.stop()
        await agent.server.stop(1)
    if events != N or up_count != N:
        raise RuntimeError(f"ADD events received: ours {events}, upstream {up_count}, "
                           f"expected {N} each")
    note = (f"median of {N} execs each, interleaved; every ADD's event received by its "
            f"agent; upstream: istio.io/istio cni/cmd/istio-cni, Go, static")
    return [
        ratio_result("vs upstream istio-cni: ADD of an ambient pod (ours / Go)",
                     times["ours ADD"], times["upstream ADD"], "ms", 1.0,
                     note + "; upstream GETs Pod + Namespace from the API server, ours does not"),
        ratio_result("vs upstream istio-cni: VERSION (ours / Go)", times["ours VERSION"],
                     times["upstream VERSION"], "ms", 1.0, note),
    ]


async def run() -> list[Result]:
    why = _available()
    if why:
        return [Result("vs upstream istio-cni", float("nan"), "ms", note=f"skipped: {why}")]
    upstream = build_upstream()
    return await on_private_api_server(
        "bench-cni-up-", lambda cluster, tmp: measure(cluster, tmp, upstream))
