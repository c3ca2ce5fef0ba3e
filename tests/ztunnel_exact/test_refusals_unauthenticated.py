"""Issue 27: a refused call on the TLS port (xDS and CA) always reaches the client as
UNAUTHENTICATED with the reason, never as ``INTERNAL: Internal error from Core``.

Clients: ztunnel's own CA and xDS clients reproduced from ztunnel's source
(tests/ztunnel_exact), many refused calls in a row, each on its own connection as
ztunnel makes them."""

from __future__ import annotations

import collections

import grpc

from tests.ztunnel_exact.conftest import LEDGER_ID
from tests.ztunnel_exact.test_ca import ca_client
from tests.ztunnel_exact.test_xds import env_for
from tests.ztunnel_exact.xds import ZtunnelXdsClient

ROUNDS = 30


async def test_refused_ca_calls_are_all_unauthenticated(make_agent):
    agent = await make_agent()
    seen = collections.Counter()
    for i in range(ROUNDS):
        client = await ca_client(agent, token=None if i % 2 else "not-listed").start()
        try:
            try:
                await client.fetch_certificate(LEDGER_ID)
            except grpc.RpcError as e:
                seen[(e.code().name, "tokens_file" in e.details() or "no client" in e.details())] += 1
        finally:
            await client.close()
    assert seen == {("UNAUTHENTICATED", True): ROUNDS}, seen


async def test_refused_xds_streams_are_all_unauthenticated(make_agent):
    agent = await make_agent()
    seen = collections.Counter()
    for i in range(ROUNDS):
        client = await ZtunnelXdsClient(env_for(agent, token=None if i % 2 else "nope")).start()
        try:
            code, details = await client.wait_terminated()
            seen[(code, "tokens_file" in details or "no client" in details)] += 1
        finally:
            await client.close()
    assert seen == {("UNAUTHENTICATED", True): ROUNDS}, seen
