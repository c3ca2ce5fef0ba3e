"""Helpers for SDS tests: an agent config in a tmp state dir, an SDS stream client."""

from __future__ import annotations

import asyncio

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import secret_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2_grpc

from agent.core import config as agent_config
from agent.sds.service import SECRET_TYPE


def make_config(state_dir, **overrides) -> agent_config.Config:
    """Defaults, state under ``state_dir``, no config file, plus ``overrides``."""
    cfg = agent_config.load(flags={"state_dir": str(state_dir)}, env={})
    overrides.setdefault("workload_certs_dir", str(state_dir / "no-certs"))
    return cfg.replace(**overrides)


def request(names, nonce="", version="", node="sidecar~1.2.3.4~x.ns~ns.svc.cluster.local",
            type_url=SECRET_TYPE, error=None) -> discovery_pb2.DiscoveryRequest:
    req = discovery_pb2.DiscoveryRequest(resource_names=list(names), response_nonce=nonce,
                                         version_info=version, type_url=type_url)
    if node:
        req.node.CopyFrom(base_pb2.Node(id=node))
    if error:
        req.error_detail.message = error
    return req


def secrets_of(resp) -> dict[str, secret_pb2.Secret]:
    out = {}
    for any_ in resp.resources:
        s = secret_pb2.Secret()
        any_.Unpack(s)
        out[s.name] = s
    return out


class Stream:
    """A bidi StreamSecrets call driven by hand: send() requests, recv() responses."""

    def __init__(self, channel: grpc.aio.Channel, method: str = "StreamSecrets"):
        stub = sds_pb2_grpc.SecretDiscoveryServiceStub(channel)
        self.call = getattr(stub, method)()

    async def send(self, req) -> None:
        await self.call.write(req)

    async def recv(self, timeout: float = 10.0):
        """The next response; one that arrived while :meth:`silent` watched comes first."""
        peek, self._peek_task = getattr(self, "_peek_task", None), None
        if peek is not None:
            return await asyncio.wait_for(peek, timeout)
        return await asyncio.wait_for(self.call.read(), timeout)

    async def silent(self, within: float = 0.2) -> bool:
        """True when nothing arrives within ``within`` seconds (a response that arrives
        later is kept for :meth:`recv`; gRPC allows one read at a time)."""
        if getattr(self, "_peek_task", None) is None:
            self._peek_task = asyncio.ensure_future(self.call.read())
        try:
            await asyncio.wait_for(asyncio.shield(self._peek_task), within)
        except asyncio.TimeoutError:
            return True
        return False

    def cancel(self) -> None:
        self.call.cancel()


class SwitchableCA:
    """Fault injection around a *real* CA client: while ``down`` is True, ``sign`` fails
    with UNAVAILABLE exactly like an unreachable Istio CA after its retries."""

    def __init__(self, inner):
        self.inner = inner
        self.down = False
        self.calls = 0
        self.failures = 0

    async def sign(self, csr_pem, ttl_seconds, identity=""):
        self.calls += 1
        if self.down:
            from agent.sds.ca_istio import CAClientError
            self.failures += 1
            raise CAClientError("UNAVAILABLE", "connection refused (CA down)")
        return await self.inner.sign(csr_pem, ttl_seconds, identity)

    async def issue(self, identity, algorithm, ttl_seconds, run_blocking, on_csr):
        # through sign, so the fault applies to every issuance (a remote CA's path)
        from agent.sds.ca_istio import issue_by_csr
        return await issue_by_csr(self.sign, identity, algorithm, ttl_seconds, run_blocking,
                                  on_csr)

    async def close(self):
        await self.inner.close()


def executor_runner():
    """A ``run_blocking`` like AgentContext's, with its own small pool."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="test-blocking")

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    run.pool = pool
    return run
