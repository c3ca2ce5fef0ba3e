"""xDS client connects and disconnects are logged at INFO with the client's node and
identity (the reference delta xDS client over the plaintext port)."""

from __future__ import annotations

import logging

from tests.helpers import eventually


async def test_connect_and_disconnect_logged(connect, server, caplog):
    caplog.set_level(logging.INFO, logger="ambient.xds.server")
    client = await connect(node_id="ztunnel~10.0.0.9~zt-1.istio-system~istio-system.svc."
                                   "cluster.local")
    await client.wait_synced()
    connected = [r for r in caplog.records if "client connected" in r.getMessage()]
    assert len(connected) == 1 and connected[0].levelno == logging.INFO
    assert "node ztunnel~10.0.0.9~zt-1.istio-system" in connected[0].getMessage()
    assert "(ztunnel)" in connected[0].getMessage()
    await client.close()
    await eventually(lambda: any("client disconnected" in r.getMessage()
                                 for r in caplog.records), what="disconnect log line")
    gone = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(gone) == 1 and "ztunnel~10.0.0.9" in gone[0].getMessage()
