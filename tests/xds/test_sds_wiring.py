"""The mTLS listener wired to the real `sds` component (embedded CA): the server's
certificate comes from it and a client certificate from the same CA is accepted."""

from __future__ import annotations

import pytest

from agent.core import config
from agent.core.lifecycle import AgentContext
from ambient.xds.client import ClientTls, DeltaXdsClient
from ambient.xds.server import XdsServer
from ambient.xds.tls import sds_tls_provider

sds_server = pytest.importorskip("agent.sds.server")


async def test_mtls_with_certificate_from_sds(index, state_dir):
    cfg = config.load({"state_dir": str(state_dir)}, env={})
    ctx = AgentContext(cfg)
    sds = ctx.add(sds_server.build(ctx, None, None))
    await sds.start()
    server = None
    try:
        provider = sds_tls_provider(sds)
        server = XdsServer(index, port=0, tls_address="127.0.0.1", tls_port=0,
                           tls_provider=provider, registry=ctx.registry)
        await server.start()
        bundle = await sds.certificate_for(["spiffe://cluster.local/ns/istio-system/sa/ztunnel"])
        client = DeltaXdsClient(f"127.0.0.1:{server.tls_port}", tls=ClientTls(
            sds.root_pem(), bundle.chain, bundle.key, server_name="istiod.istio-system.svc"))
        await client.connect()
        try:
            await client.wait_synced()
            [c] = server.debug_state()["clients"]
            assert c["identity"] == "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
        finally:
            await client.close()
    finally:
        if server:
            await server.stop(0.5)
        await sds.stop(0.5)
        ctx.executor.shutdown(wait=False)
