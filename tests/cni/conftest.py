"""Fixtures for the CNI plugin / event server / installer tests.

``cni_agent`` runs the real :class:`cni.eventserver.CniEventServer` (aiohttp on a Unix
socket in a tmp dir) with a :class:`RecordingEnroller` as the ``enrollment`` component:
a small real object implementing ``enroll``/``unenroll`` that records every event (the
real enrollment is another area's component). ``launcher`` is the plugin launcher the
installer writes, in a tmp bin dir; plugin runs exec it as a runtime would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import pytest

from agent.core import config as agent_config
from agent.core.lifecycle import AgentContext, Component
from cni.eventserver import CniEventServer
from cni.install import Installer

from cni.events import EnrollmentError


class RecordingEnroller(Component):
    """``enrollment`` test double with real behavior: records events, can be told to wait
    (``delay`` seconds) or to fail (``fail_with`` message -> EnrollmentError)."""

    name = "enrollment"

    def __init__(self):
        self.enrolled: list = []
        self.unenrolled: list = []
        self.unenrolled_is_delete: list[bool] = []
        self.delay = 0.0
        self.fail_with: str | None = None
        self.active: dict[str, int] = {}
        self.max_concurrent_per_pod = 0
        self.noted: list = []  # non-ambient sandboxes the server told about

    async def enroll(self, event):
        self.active[event.key] = self.active.get(event.key, 0) + 1
        self.max_concurrent_per_pod = max(self.max_concurrent_per_pod, self.active[event.key])
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.fail_with:
                raise EnrollmentError(self.fail_with)
            self.enrolled.append(event)
        finally:
            self.active[event.key] -= 1

    async def unenroll(self, event, is_delete=False):
        self.unenrolled.append(event)
        self.unenrolled_is_delete.append(is_delete)

    def note_sandbox(self, event):
        self.noted.append(event)

    def abort_enroll(self, uid):
        return None  # nothing in flight to cancel: enroll() runs to its end here


class DictStore:
    """An ObjectStore over a dict of Kubernetes-shaped objects (what config sources give)."""

    def __init__(self, objects=()):
        self.objects = list(objects)

    def get(self, kind, namespace, name):
        for o in self.objects:
            m = o["metadata"]
            if o["kind"] == kind and m.get("namespace", "") == namespace and m["name"] == name:
                return o
        return None

    def list(self, kind, namespace=None):
        return [o for o in self.objects if o["kind"] == kind
                and (namespace is None or o["metadata"].get("namespace") == namespace)]

    def pod_by_uid(self, uid):
        for o in self.objects:
            if o["kind"] == "Pod" and o["metadata"].get("uid") == uid:
                return o
        return None


@dataclasses.dataclass
class CniAgent:
    ctx: AgentContext
    server: CniEventServer
    enroller: RecordingEnroller | None
    socket_path: str
    run_dir: str

    def set_store(self, store):
        """The config source's objects the server decides enablement with."""
        self.server.store = store


def make_config(state_dir, **extra):
    cfg = agent_config.load(flags={"state_dir": str(state_dir),
                                   "config_file": os.devnull}, env={})
    return cfg.replace(**extra) if extra else cfg


async def start_agent(state_dir, with_enroller=True, **extra) -> CniAgent:
    ctx = AgentContext(make_config(state_dir, **extra))
    enroller = None
    if with_enroller:
        enroller = RecordingEnroller()
        ctx.add(enroller)
    server = CniEventServer(ctx, ctx.config.cni_event_socket, store=None, enrollment=enroller)
    ctx.add(server)
    await server.start()
    return CniAgent(ctx, server, enroller, ctx.config.cni_event_socket,
                    os.path.dirname(ctx.config.cni_event_socket))


@pytest.fixture
async def cni_agent(state_dir):
    agent = await start_agent(state_dir)
    try:
        yield agent
    finally:
        await agent.server.stop(1.0)
        agent.ctx.executor.shutdown(wait=False)


@pytest.fixture
def launcher(tmp_path):
    bin_dir = tmp_path / "bin"
    inst = Installer(conf_dir=str(tmp_path / "net.d"), bin_dir=str(bin_dir),
                     run_dir=str(tmp_path / "run"))
    inst.install_binary()
    return inst.binary_path


def net_conf(run_dir, version="1.0.0", prev=True, **keys):
    conf = {"cniVersion": version, "name": "testnet", "type": "istio-cni",
            "cni_agent_run_dir": str(run_dir)}
    if prev:
        conf["prevResult"] = {"cniVersion": version, "interfaces": [{"name": "eth0"}],
                              "ips": [{"address": "10.9.8.7/24", "gateway": "10.9.8.1",
                                       "interface": 0}]}
    conf.update(keys)
    return conf


def cni_env(command="ADD", container_id="c0ffee", netns="/var/run/netns/none",
            args="IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-0;K8S_POD_UID=u-1",
            **extra):
    env = {"PATH": "/usr/bin:/bin", "CNI_COMMAND": command, "CNI_CONTAINERID": container_id,
           "CNI_NETNS": netns, "CNI_IFNAME": "eth0", "CNI_PATH": "/usr/lib/cni",
           "CNI_ARGS": args}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


async def run_plugin(launcher, env, stdin) -> tuple[int, dict | None, str]:
    """Exec the plugin like a runtime (without blocking the loop the agent runs on)."""
    if isinstance(stdin, dict):
        stdin = json.dumps(stdin)
    if isinstance(stdin, str):
        stdin = stdin.encode()
    proc = await asyncio.create_subprocess_exec(
        launcher, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(stdin), 30)
    text = out.decode().strip()
    return proc.returncode, (json.loads(text) if text else None), err.decode()
