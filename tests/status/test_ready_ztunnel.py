"""``/healthz/ready`` reflects what a new ambient pod needs: while no ztunnel has said hello
on the ZDS socket, an ambient CNI ADD would block, so the agent is not ready and says why;
once the reference ZDS client (ztunnel's side of the protocol) connects it is ready."""

from __future__ import annotations

import aiohttp

from agent.enrollment_zds import ZdsServerChannel
from cni.enrollment import Enrollment
from tests.status.conftest import running_status
from tests.zds.helpers import running_client, running_server


async def test_not_ready_without_ztunnel(tmp_path):
    async with running_server(ztunnel_wait=3) as zds:
        async with running_status(tmp_path, components=[zds], enrollment=lambda ctx: Enrollment(
                ctx, zds=ZdsServerChannel(zds))) as (ctx, server):
            enrollment = ctx.components["enrollment"]
            enrollment._started = True  # started without host rules: readiness only
            url = f"http://127.0.0.1:{server.port}/healthz/ready"
            async with aiohttp.ClientSession() as http:
                async with http.get(url) as resp:
                    body = await resp.text()
                    assert resp.status == 503
                assert "no ztunnel connected on" in body and "would wait up to" in body
                async with running_client(zds.path) as client:
                    await client.wait_snapshot(timeout=3)

                    async def ready():
                        async with http.get(url) as r:
                            return r.status == 200
                    for _ in range(200):
                        if await ready():
                            break
                    assert await ready()
