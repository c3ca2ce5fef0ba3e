"""ztunnel's delta xDS client, reproduced from ztunnel's source for tests.

Written from istio/ztunnel ``src/xds/client.rs`` (``Config``, ``AdsClient``,
``HandlerWrapper``), ``src/state.rs`` (which types it watches) and ``src/config.rs``
(environment), not from ``ambient/xds/client.py``:

- **Transport**: :class:`tests.ztunnel_exact.tls.ControlPlaneTunnel` (TLS 1.3, ALPN h2,
  no client certificate, webpki-style verification against ``XDS_ROOT_CA``), one
  ``DeltaAggregatedResources`` call per connection, ``max_decoding_message_size`` 200 MiB,
  HTTP/2 keepalive PINGs every 30 s with a 10 s timeout while the stream is open (hyper
  ``http2_keep_alive_interval(30s)``, ``http2_keep_alive_timeout(10s)``; hyper's
  ``keep_alive_while_idle`` stays false, so no pings without a stream).
- **Headers**: ``authorization: Bearer <token>`` + ``clusterid`` (``AuthSource``), plus
  ``XDS_HEADER_*`` extras.
- **Node** (``Config::node``): ``id = ztunnel~<INSTANCE_IP or 1.1.1.1>~<POD_NAME>.<POD_NAMESPACE>~
  <POD_NAMESPACE>.svc.cluster.local``; metadata ``NAME``, ``NAMESPACE``, ``INSTANCE_IPS``,
  ``NODE_NAME`` plus the proxy metadata (``ISTIO_META_*`` without the prefix, e.g.
  ``CLUSTER_ID``), all string values.
- **Initial requests**, in this order, on every (re)connect: ``Address`` then
  ``Authorization`` (``state.rs``), each with the node and ``initial_resource_versions``
  of what is held. With ``XDS_ON_DEMAND`` the Address request subscribes and unsubscribes
  ``*`` in one message ("subscribe to nothing"); Authorization never goes on-demand.
- **Responses**: resources decoded (``istio.workload.Address`` /
  ``istio.security.Authorization``); failures are collected as ``"<name>: <reason>"`` and
  joined with ``"; "`` into a NACK's ``error_detail.message``, valid resources are still
  applied; removals after updates; every response is answered ``{type_url,
  response_nonce[, error_detail]}``. Rejected resources are not remembered as held.
- **On demand** (``Demander::demand``): ``{type_url, resource_names_subscribe: [name]}``
  with no nonce; the waiter wakes only when a response names the key in ``resources[].name``
  or ``removed_resources`` (``notify_on_demand``); the key is held with version ``""``.
- **Ready** when the first response of every non-on-demand initial type was ACKed.
- **Reconnect** (``run_loop``): backoff starts at 10 ms, doubles, at most 15 s; reset
  after a clean end or a "transport is closing"/GOAWAY-type termination. Every
  termination is recorded in :attr:`ZtunnelXdsClient.terminations`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from ambient import authorization_pb2, workload_pb2
from tests.ztunnel_exact.tls import ControlPlaneTunnel, auth_headers

log = logging.getLogger("tests.ztunnel_exact.xds")

ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE = "type.googleapis.com/istio.security.Authorization"
MESSAGES = {ADDRESS_TYPE: workload_pb2.Address, AUTHORIZATION_TYPE: authorization_pb2.Authorization}
INITIAL_BACKOFF, MAX_BACKOFF = 0.010, 15.0
KEEPALIVE_INTERVAL_MS, KEEPALIVE_TIMEOUT_MS = 30_000, 10_000


def grpc_channel_options(keepalive_ms: int = KEEPALIVE_INTERVAL_MS,
                         while_idle: bool = False) -> list[tuple[str, int]]:
    """grpcio options closest to ztunnel's hyper client: PING every ``keepalive_ms`` with
    a 10 s timeout, no limit on pings without data (hyper has none), ``while_idle`` as
    hyper's ``keep_alive_while_idle`` (false in ztunnel), 200 MiB messages."""
    return [("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1 if while_idle else 0),
            ("grpc.max_receive_message_length", 200 * 1024 * 1024),
            # one connection per client, as hyper's pool for one authority
            ("grpc.use_local_subchannel_pool", 1)]


@dataclasses.dataclass
class ZtunnelEnv:
    """The environment ztunnel reads for its xDS client (``src/config.rs`` names)."""

    xds_address: str                       # XDS_ADDRESS
    xds_root_ca: bytes                      # XDS_ROOT_CA (file content)
    token: str | None = None                # AUTH_TOKEN (file content or static token)
    cluster_id: str = "Kubernetes"          # CLUSTER_ID / ISTIO_META_CLUSTER_ID
    alt_xds_hostname: str | None = None     # ALT_XDS_HOSTNAME
    instance_ip: str = "1.1.1.1"            # INSTANCE_IP (ztunnel's default)
    pod_name: str = ""                      # POD_NAME
    pod_namespace: str = ""                 # POD_NAMESPACE
    node_name: str = ""                     # NODE_NAME
    on_demand: bool = False                 # XDS_ON_DEMAND
    proxy_metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # ISTIO_META_*
    xds_headers: dict[str, str] = dataclasses.field(default_factory=dict)     # XDS_HEADER_*


def load_token(path: str) -> str:
    """``load_token``: the file's bytes as they are (no trimming); empty is an error, and
    a byte hyper's HeaderValue refuses (e.g. a trailing newline) fails the request."""
    data = open(path, "rb").read()
    if not data:
        raise ValueError("token file exists, but was empty")
    if any(b < 0x20 and b != 0x09 for b in data) or 0x7f in data:
        raise ValueError("failed to parse header value (token file has control characters, "
                         "e.g. a trailing newline)")
    return data.decode()


class ZtunnelXdsClient:
    """See the module docstring. ``now`` is the TLS verifier's clock."""

    def __init__(self, env: ZtunnelEnv, now=None):
        self.env = env
        self.tunnel = ControlPlaneTunnel(env.xds_address, env.xds_root_ca,
                                         alt_hostname=env.alt_xds_hostname,
                                         **({"now": now} if now else {}))
        self.known: dict[str, dict[str, str]] = {}          # type -> name -> version
        self.resources: dict[str, dict[str, object]] = {ADDRESS_TYPE: {}, AUTHORIZATION_TYPE: {}}
        self.types_to_expect = {t for t, on_demand in self._initial_types() if not on_demand}
        self.ready = asyncio.Event()
        self.requests_sent: list[discovery_pb2.DeltaDiscoveryRequest] = []
        self.responses: list[discovery_pb2.DeltaDiscoveryResponse] = []
        self.nacks: list[str] = []
        self.terminations: list[tuple[str, str]] = []  # (status code name, details)
        self.connections = 0
        self.established = asyncio.Event()
        self._pending: dict[tuple[str, str], asyncio.Future] = {}
        self._demand: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    # ---------------------------------------------------------------- requests
    def _initial_types(self) -> list[tuple[str, bool]]:
        return [(ADDRESS_TYPE, self.env.on_demand), (AUTHORIZATION_TYPE, False)]

    def node(self) -> base_pb2.Node:
        e = self.env
        meta = struct_pb2.Struct()
        for k, v in {"NAME": e.pod_name, "NAMESPACE": e.pod_namespace,
                     "INSTANCE_IPS": e.instance_ip, "NODE_NAME": e.node_name,
                     **e.proxy_metadata}.items():
            meta.fields[k].string_value = v
        return base_pb2.Node(id=f"ztunnel~{e.instance_ip}~{e.pod_name}.{e.pod_namespace}~"
                                f"{e.pod_namespace}.svc.cluster.local", metadata=meta)

    def initial_requests(self) -> list[discovery_pb2.DeltaDiscoveryRequest]:
        node = self.node()
        out = []
        for type_url, on_demand in self._initial_types():
            req = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, node=node)
            if on_demand:
                req.resource_names_subscribe.append("*")
                req.resource_names_unsubscribe.append("*")
            req.initial_resource_versions.update(self.known.get(type_url, {}))
            out.append(req)
        return out

    def metadata(self) -> list[tuple[str, str]]:
        return auth_headers(self.env.token, self.env.cluster_id) + list(
            self.env.xds_headers.items())

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> "ZtunnelXdsClient":
        await self.tunnel.start()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self.tunnel.close()

    async def _run(self) -> None:
        backoff = INITIAL_BACKOFF
        while True:
            code, details = await self._run_once()
            self.terminations.append((code, details))
            reconnect_fast = code in ("OK", "UNKNOWN", "CANCELLED", "DEADLINE_EXCEEDED") or (
                code == "UNAVAILABLE" and ("transport is closing" in details
                                           or "received prior goaway" in details
                                           or "GOAWAY" in details))
            backoff = INITIAL_BACKOFF if reconnect_fast else min(MAX_BACKOFF, backoff * 2)
            self._changed.set()
            await asyncio.sleep(backoff)

    async def _run_once(self) -> tuple[str, str]:
        self.connections += 1
        outbox: asyncio.Queue = asyncio.Queue()
        for req in self.initial_requests():
            outbox.put_nowait(req)
        channel = grpc.aio.insecure_channel(self.tunnel.target, options=grpc_channel_options())
        try:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            call = stub.DeltaAggregatedResources(metadata=self.metadata())
            writer = asyncio.create_task(self._write(call, outbox))
            demander = asyncio.create_task(self._demands(outbox))
            try:
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        return "OK", ""
                    self.established.set()
                    self._handle(resp, outbox)
            except grpc.RpcError as e:
                return e.code().name, e.details() or ""
            finally:
                writer.cancel()
                demander.cancel()
                call.cancel()
        finally:
            await channel.close()

    async def _write(self, call, outbox: asyncio.Queue) -> None:
        with contextlib.suppress(Exception):
            while True:
                req = await outbox.get()
                self.requests_sent.append(req)
                await call.write(req)

    async def _demands(self, outbox: asyncio.Queue) -> None:
        while True:
            type_url, name = await self._demand.get()
            self.known.setdefault(type_url, {}).setdefault(name, "")
            outbox.put_nowait(discovery_pb2.DeltaDiscoveryRequest(
                type_url=type_url, resource_names_subscribe=[name]))

    # ---------------------------------------------------------------- responses
    def _handle(self, resp: discovery_pb2.DeltaDiscoveryResponse, outbox: asyncio.Queue) -> None:
        self.responses.append(resp)
        type_url = resp.type_url
        cls = MESSAGES.get(type_url)
        rejects: list[str] = []
        rejected: set[str] = set()
        held = self.resources.setdefault(type_url, {})
        if cls is not None:
            for res in resp.resources:
                if not res.HasField("resource"):
                    rejects.append(f"{res.name}: missing resource")
                    rejected.add(res.name)
                    continue
                msg = cls()
                try:
                    msg.ParseFromString(res.resource.value)
                except Exception as e:  # noqa: BLE001 - prost decode error
                    rejects.append(f"{res.name}: failed to decode: {e}")
                    rejected.add(res.name)
                    continue
                held[res.name] = msg
            for name in resp.removed_resources:
                held.pop(name, None)
        known = self.known.setdefault(type_url, {})
        for name in resp.removed_resources:
            known.pop(name, None)
            self._notify((type_url, name))
        for res in resp.resources:
            self._notify((type_url, res.name))
            if res.name not in rejected:
                known[res.name] = res.version
        ack = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, response_nonce=resp.nonce)
        if rejects:
            ack.error_detail.message = "; ".join(rejects)
            self.nacks.append(ack.error_detail.message)
        outbox.put_nowait(ack)
        if not rejects and type_url in self.types_to_expect:
            self.types_to_expect.discard(type_url)
            if not self.types_to_expect:
                self.ready.set()
        self._changed.set()

    def _notify(self, key: tuple[str, str]) -> None:
        fut = self._pending.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # ---------------------------------------------------------------- API
    async def demand(self, name: str, type_url: str = ADDRESS_TYPE, timeout: float = 5.0) -> None:
        """Ask for one resource on demand and wait for ztunnel's wake-up condition."""
        fut = asyncio.get_running_loop().create_future()
        self._pending[(type_url, name)] = fut
        self._demand.put_nowait((type_url, name))
        await asyncio.wait_for(fut, timeout)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Until ztunnel would be ready; raises the last termination if the stream failed."""
        async def until():
            while not self.ready.is_set():
                if self.terminations:
                    code, details = self.terminations[-1]
                    raise ConnectionError(f"xDS stream ended: {code} {details}")
                self._changed.clear()
                await self._changed.wait()
        await asyncio.wait_for(until(), timeout)

    async def wait_terminated(self, timeout: float = 10.0) -> tuple[str, str]:
        async def until():
            while not self.terminations:
                self._changed.clear()
                await self._changed.wait()
            return self.terminations[-1]
        return await asyncio.wait_for(until(), timeout)
