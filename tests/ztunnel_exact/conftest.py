"""An agent as ``ambient-agent run`` wires it (the daemon's own builders, in its start
order) with the parts ztunnel's control plane needs: config source (YAML directory),
ambient index, ``authn``, ``sds`` (embedded CA) and ``xds`` (plaintext + the TLS port
serving xDS and the CA). CNI, ZDS and the status server are left out: they need root or
are covered elsewhere. ``clock`` injects the agent's wall clock (:class:`FakeClock`)."""

from __future__ import annotations

import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from agent.core import config as agent_config
from agent.demo.envoy import free_port
from agent.core.lifecycle import AgentContext, Supervisor

NODE = "node-a"
ZTUNNEL_TOKEN = "tok-ztunnel-3f9a1c"  # listed in the tokens file as istio-system/ztunnel
ZTUNNEL_ID = "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
LEDGER_ID = "spiffe://cluster.local/ns/bank/sa/ledger"
CLUSTER = textwrap.dedent("""\
    apiVersion: v1
    kind: Namespace
    metadata: {name: bank, labels: {istio.io/dataplane-mode: ambient}}
    ---
    apiVersion: v1
    kind: Pod
    metadata: {name: ledger-0, namespace: bank, uid: uid-ledger-0, labels: {app: ledger}}
    spec: {nodeName: node-a, serviceAccountName: ledger, containers: [{name: c}]}
    status: {podIP: 10.1.0.7, podIPs: [{ip: 10.1.0.7}], phase: Running,
             conditions: [{type: Ready, status: "True"}]}
    ---
    apiVersion: v1
    kind: Pod
    metadata: {name: far-0, namespace: bank, uid: uid-far-0}
    spec: {nodeName: node-b, serviceAccountName: far, containers: [{name: c}]}
    status: {podIP: 10.1.1.9, podIPs: [{ip: 10.1.1.9}], phase: Running}
    """)


class FakeClock:
    """A wall clock that starts at real time and moves only when told (``advance``)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class AgentStack:
    def __init__(self, cfg: agent_config.Config, clock=None):
        self.ctx = AgentContext(cfg, clock=clock)
        self.supervisor = Supervisor(self.ctx)

    async def start(self) -> "AgentStack":
        """The components ztunnel talks to, wired as ``agent.daemon.build`` wires them:
        config source, index, authn, SDS (with the embedded CA) and xDS."""
        from agent.daemon import mount_ca
        from agent.sds import server as sds_server
        from agent.tlsport import authn as tls_authn
        from ambient import index as ambient_index, source as ambient_source
        from ambient.xds import server as xds_server

        ctx = self.ctx
        source = ctx.add(ambient_source.build(ctx))
        index = ctx.add(ambient_index.build(ctx, source.store))
        authn = ctx.add(tls_authn.build(ctx))
        self.sds = ctx.add(sds_server.build(ctx, source.store, authn.authenticator,
                                            kube_api=source.kube_api))
        self.xds = ctx.add(xds_server.build(ctx, index.index, self.sds, authn.authenticator,
                                            tls_services=mount_ca(self.sds)))
        await self.supervisor.start()
        return self

    async def stop(self) -> None:
        await self.supervisor.stop(0.5)
        self.ctx.executor.shutdown(wait=False)

    @property
    def root_pem(self) -> bytes:
        return Path(self.ctx.config.mesh_root_file).read_bytes()


@pytest.fixture
def agent_dir():
    # Short: Unix socket paths under the state dir must stay below 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="zx-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def make_agent(agent_dir):
    stacks: list[AgentStack] = []

    async def make(clock=None, extra_objects: str = "", **overrides) -> AgentStack:
        """``extra_objects``: more YAML documents for the config source, beside CLUSTER."""
        state = agent_dir / f"s{len(stacks)}"
        state.mkdir(mode=0o700)
        cluster = agent_dir / f"c{len(stacks)}"
        cluster.mkdir()
        (cluster / "cluster.yaml").write_text(CLUSTER)
        if extra_objects:
            (cluster / "extra.yaml").write_text(extra_objects)
        tokens = agent_dir / "tokens.yaml"
        tokens.write_text(f"{ZTUNNEL_TOKEN}: istio-system/ztunnel\n")
        tokens.chmod(0o600)
        values = {"state_dir": str(state), "config_dir": str(cluster),
                  "node_name": NODE, "tokens_file": str(tokens),
                  "xds_port": str(free_port()), "xds_tls_port": str(free_port()),
                  "xds_tls_address": "0.0.0.0", "workload_certs_dir": str(state / "no-certs")}
        values.update({k: str(v) for k, v in overrides.items()})
        cfg = agent_config.load(values, env={})
        stack = AgentStack(cfg, clock)
        stacks.append(stack)
        return await stack.start()

    try:
        yield make
    finally:
        for s in stacks:
            await s.stop()
