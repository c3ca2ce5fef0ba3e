"""An on-demand key that resolves to nothing, answered the way ztunnel expects.

What ztunnel does (src/state.rs, src/proxy/outbound.rs, src/xds/client.rs, src/xds.rs):
an outbound connection to an address it does not hold demands ``<network>/<IP>`` twice
(``build_request``'s service check and ``fetch_upstream``); each demand subscribes the key
and waits until a response names it in ``resources[].name`` or ``removed_resources``
(there is no timeout); a removed name that is neither a workload uid nor a held service
is logged "tried to remove service, but it was not found". istiod answers a miss with
the key in ``removed_resources`` (``AddressInformation`` returns it as removed;
``generateDeltasOndemand``), and so does the agent: one removal per demand and nothing
else, so ztunnel's log has one line per demand — the same against istiod — and no
response outside a demand ever removes a key the client never held. The client here is
the faithful one of :mod:`ambient.xds.client` (ztunnel's demand rules); the warnings are
counted with the rules of ztunnel's ``remove_internal``.
"""

from __future__ import annotations

import asyncio

from tests.xds.fake_index import pod
from tests.xds.test_on_demand_waypoint import ztunnel_warnings


async def test_each_demand_of_a_missing_address_gets_exactly_one_removal(connect, index):
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    start = len(client.responses)
    for _ in range(2):  # build_request, then fetch_upstream
        assert await client.request("/10.9.9.7") == []
    answers = client.responses[start:]
    assert [list(r.removed_resources) for r in answers] == [["/10.9.9.7"], ["/10.9.9.7"]]
    assert all(not r.resources for r in answers)
    warnings = [w for r in answers for w in ztunnel_warnings(r, set(), set())]
    assert warnings == ["/10.9.9.7: tried to remove service, but it was not found"] * 2
    # unrelated changes afterwards never remove the never-held key again
    n = len(client.responses)
    index.put(pod("other", ip="10.0.0.77", node="node9"))
    index.put(pod("mine", ip="10.0.0.78", node="nodeX"))
    await client.wait_for("Kubernetes//Pod/default/mine")
    await asyncio.sleep(0.05)
    assert all("/10.9.9.7" not in r.removed_resources for r in client.responses[n:])


async def test_a_uid_or_cidr_shaped_miss_makes_ztunnel_log_nothing(connect):
    """Keys whose hostname part holds a "/" are not taken for services by ztunnel."""
    client = await connect(on_demand=True, metadata={"NODE_NAME": "nodeX"})
    await client.wait_synced()
    assert await client.request("Kubernetes//Pod/default/gone") == []
    resp = client.responses[-1]
    assert list(resp.removed_resources) == ["Kubernetes//Pod/default/gone"]
    assert ztunnel_warnings(resp, set(), set()) == []
