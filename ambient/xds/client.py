"""A reference delta xDS client that behaves like ztunnel's (``docs/xds.md``; upstream
``istio/ztunnel:src/xds/client.rs``): used by the tests, the ``ambient-agent xds dump`` CLI and
the demo as
"the reference ztunnel's" xDS side.

Behavior copied from ztunnel:
- one initial request per type on every (re)connect, carrying the node and
  ``initial_resource_versions`` (name -> version of everything held);
- wildcard by default; ``on_demand=True`` makes the Address request
  ``subscribe=["*"], unsubscribe=["*"]`` (subscribed to nothing), and :meth:`request`
  sends ``{type_url, resource_names_subscribe: [key]}`` without a nonce, then waits until a
  response names that key in ``resources[].name`` or ``removed_resources`` (the key is not
  matched against aliases, exactly like ztunnel);
- each response: updates applied first, then removals, then ACK ``{type_url,
  response_nonce}``; if the ``validator`` rejects resources, the valid ones are still
  applied and a NACK carries ``error_detail.message = "name: reason; ..."``;
- caches are never reset on reconnect.

API (all async, one event loop)::

    client = DeltaXdsClient("127.0.0.1:15010", node_id=..., metadata={"NODE_NAME": "n1"})
    await client.connect()                      # wildcard Address + Authorization
    await client.wait_synced()                  # first response of every type applied
    await client.wait_for("Kubernetes//Pod/demo/client")     # until present
    client.resources(ADDRESS_TYPE)              # {name: istio.workload.Address}
    await client.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from ambient import authorization_pb2, workload_pb2
from ambient.xds.generators import ADDRESS_TYPE, AUTHORIZATION_TYPE, WORKLOAD_TYPE

log = logging.getLogger(__name__)

MESSAGE_TYPES = {ADDRESS_TYPE: workload_pb2.Address, WORKLOAD_TYPE: workload_pb2.Workload,
                 AUTHORIZATION_TYPE: authorization_pb2.Authorization}
DEFAULT_NODE_ID = "ztunnel~127.0.0.1~ztunnel-ref.istio-system~istio-system.svc.cluster.local"

Validator = Callable[[str, str, object], "str | None"]


@dataclasses.dataclass
class ClientTls:
    """PEM bytes for an mTLS connection: the mesh root, our chain and key."""
    root_pem: bytes
    cert_chain_pem: bytes | None = None
    key_pem: bytes | None = None
    server_name: str | None = None


class DeltaXdsClient:
    """See the module docstring. ``target`` is ``host:port``; ``token`` is sent as
    ``authorization: Bearer``; ``validator(type_url, name, message)`` returns a reason
    to reject a resource (NACK) or None."""

    def __init__(self, target: str, *, node_id: str = DEFAULT_NODE_ID,
                 metadata: dict[str, str] | None = None, tls: ClientTls | None = None,
                 token: str | None = None, validator: Validator | None = None,
                 types: Iterable[str] = (ADDRESS_TYPE, AUTHORIZATION_TYPE),
                 on_demand: bool = False, headers: dict[str, str] | None = None):
        self.target, self.node_id, self.tls, self.token = target, node_id, tls, token
        self.metadata = dict(metadata or {})
        self.validator = validator
        self.types = list(types)
        self.on_demand = on_demand
        self.headers = dict(headers or {})
        self._resources: dict[str, dict[str, object]] = {t: {} for t in self.types}
        self.versions: dict[str, dict[str, str]] = {t: {} for t in self.types}
        self.responses: list[discovery_pb2.DeltaDiscoveryResponse] = []
        self.nacks_sent: list[str] = []
        self.synced: set[str] = set()
        self.error: grpc.RpcError | None = None
        self._changed = asyncio.Condition()
        self._channel: grpc.aio.Channel | None = None
        self._outbox: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    # ---------------------------------------------------------------- connection
    def _node(self) -> base_pb2.Node:
        md = struct_pb2.Struct()
        md.update(self.metadata)
        return base_pb2.Node(id=self.node_id, metadata=md)

    def _open_channel(self) -> grpc.aio.Channel:
        options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length",
                                                 200 * 1024 * 1024)]
        if self.tls is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        creds = grpc.ssl_channel_credentials(self.tls.root_pem, self.tls.key_pem,
                                             self.tls.cert_chain_pem)
        return grpc.aio.secure_channel(self.target, creds, options=options)

    async def connect(self) -> "DeltaXdsClient":
        """Open the stream and send the initial request of every type (with
        ``initial_resource_versions`` of what is held)."""
        await self.close()
        self._channel = self._open_channel()
        self._outbox = asyncio.Queue()
        self.synced = set()
        self.error = None
        node = self._node()
        for type_url in self.types:
            req = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, node=node)
            req.initial_resource_versions.update(self.versions[type_url])
            if self.on_demand and type_url != AUTHORIZATION_TYPE:
                req.resource_names_subscribe.append("*")
                req.resource_names_unsubscribe.append("*")
            self._outbox.put_nowait(req)
        metadata = list(self.headers.items())
        if self.token:
            metadata.append(("authorization", f"Bearer {self.token}"))
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel)
        call = stub.DeltaAggregatedResources(metadata=metadata or None)
        self._task = asyncio.create_task(self._run(call, self._outbox))
        return self

    async def reconnect(self) -> "DeltaXdsClient":
        """Close and connect again, keeping the caches (like ztunnel)."""
        return await self.connect()

    async def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "DeltaXdsClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @staticmethod
    async def _write(call: Any, outbox: asyncio.Queue) -> None:
        # Explicit writes (not a request iterator): when the server ends the stream, a
        # failing write must not mask the server's status, which the reader reports.
        with contextlib.suppress(Exception):
            while True:
                req = await outbox.get()
                if req is None:
                    await call.done_writing()
                    return
                await call.write(req)

    async def _run(self, call: Any, outbox: asyncio.Queue) -> None:
        writer = asyncio.create_task(self._write(call, outbox))
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                await self._apply(resp)
        except grpc.RpcError as e:
            self.error = e
        finally:
            writer.cancel()
            call.cancel()
            async with self._changed:
                self._changed.notify_all()

    async def _apply(self, resp: discovery_pb2.DeltaDiscoveryResponse) -> None:
        type_url = resp.type_url
        store = self._resources.setdefault(type_url, {})
        versions = self.versions.setdefault(type_url, {})
        cls = MESSAGE_TYPES.get(type_url)
        errors = []
        for res in resp.resources:
            if cls is None:
                continue  # unknown types: logged and ACKed
            msg = cls()
            try:
                msg.ParseFromString(res.resource.value)
            except Exception as e:  # a malformed resource is rejected, the rest applied
                errors.append(f"{res.name}: {e}")
                continue
            reason = self.validator(type_url, res.name, msg) if self.validator else None
            if reason:
                errors.append(f"{res.name}: {reason}")
                continue
            store[res.name] = msg
            versions[res.name] = res.version
        for name in resp.removed_resources:
            store.pop(name, None)
            versions.pop(name, None)
        self.responses.append(resp)
        ack = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, response_nonce=resp.nonce)
        if errors:
            ack.error_detail.message = "; ".join(errors)
            self.nacks_sent.append(ack.error_detail.message)
        if self._outbox is not None:
            self._outbox.put_nowait(ack)
        self.synced.add(type_url)
        async with self._changed:
            self._changed.notify_all()

    # ---------------------------------------------------------------- API
    def resources(self, type_url: str = ADDRESS_TYPE) -> dict[str, object]:
        """Current resources of a type: ``{name: message}`` (a copy of the dict)."""
        return dict(self._resources.get(type_url, {}))

    async def wait(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until ``predicate()`` holds after some response. Raises TimeoutError,
        or the stream's grpc.RpcError if it failed."""
        async def until() -> None:
            async with self._changed:
                while not predicate():
                    if self.error is not None:
                        raise self.error
                    await self._changed.wait()
        await asyncio.wait_for(until(), timeout)

    async def wait_synced(self, timeout: float = 5.0) -> None:
        """Until the first response of every type (ztunnel's readiness condition)."""
        await self.wait(lambda: self.synced >= set(self.types), timeout)

    async def wait_for(self, name: str, type_url: str = ADDRESS_TYPE, timeout: float = 5.0,
                       present: bool = True) -> object | None:
        """Until resource ``name`` is present (or absent with ``present=False``)."""
        await self.wait(lambda: (name in self._resources.get(type_url, {})) == present, timeout)
        return self._resources.get(type_url, {}).get(name)

    async def next_response(self, type_url: str | None = None, timeout: float = 5.0,
                            after: int | None = None) -> discovery_pb2.DeltaDiscoveryResponse:
        """The first response (of ``type_url`` if given) received after index ``after``
        (default: now) in :attr:`responses`."""
        start = len(self.responses) if after is None else after

        def found() -> bool:
            return any(type_url in (None, r.type_url) for r in self.responses[start:])
        await self.wait(found, timeout)
        return next(r for r in self.responses[start:] if type_url in (None, r.type_url))

    async def request(self, key: str, type_url: str = ADDRESS_TYPE,
                      timeout: float = 5.0) -> list[str]:
        """On-demand lookup like ztunnel's: subscribe ``key`` (no nonce) and wait until a
        response names it in resources or removed_resources. Returns the names of the
        resources in that response (empty when the key was not found)."""
        start = len(self.responses)
        self.send(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url,
                                                      resource_names_subscribe=[key]))

        def mentioned() -> bool:
            return any(r.type_url == type_url and (key in r.removed_resources
                                                   or any(x.name == key for x in r.resources))
                       for r in self.responses[start:])
        await self.wait(mentioned, timeout)
        resp = next(r for r in self.responses[start:] if r.type_url == type_url and (
            key in r.removed_resources or any(x.name == key for x in r.resources)))
        return [r.name for r in resp.resources]

    def send(self, req: discovery_pb2.DeltaDiscoveryRequest) -> None:
        """Send a raw request on the stream (tests: stale nonces, resubscriptions).
        Raises RuntimeError before :meth:`connect`."""
        if self._outbox is None:
            raise RuntimeError("xds client: not connected")
        self._outbox.put_nowait(req)
