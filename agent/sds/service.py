"""Envoy's ``SecretDiscoveryService``: StreamSecrets, DeltaSecrets and FetchSecrets.

StreamSecrets follows istio-agent's per-stream state machine
(``docs/sds.md``; upstream ``pkg/xds/server.go`` +
``security/pkg/nodeagent/sds/sdsservice.go``):

- the first message must carry ``node.id`` → else INVALID_ARGUMENT "missing node
  information" (a first ``istio.v1.HealthInformation`` message is skipped);
- ``error_detail`` set → NACK: logged, nothing sent;
- empty ``resource_names`` → unsubscribe, nothing sent;
- empty nonce **or** no watch yet → (re)initialise the watch, answer every name. This
  is what makes a reconnect after our restart work: Envoy replays its old
  version/nonce on a fresh stream, and the nonce is only checked once this stream has
  sent one (SPIRE issue #813);
- a nonce other than the last one sent → stale, ignored;
- matching nonce → ACK; answer only the names added;
- ``version_info`` is ``<local RFC 3339 time>/<process-wide counter>``, nonce a UUIDv4.
- pushes (rotation, root change, file change) regenerate only the pushed names the
  stream watches, as a one-resource response; requests are handled in arrival order
  with pushes interleaved so neither starves.
- each name stands alone (deliberately unlike upstream, whose ``generate`` aborts the
  whole stream with UNKNOWN "failed to generate secret for <name>" when any one name
  fails): a response carries the names that resolved; a name that did not is logged,
  counted (``generate_failures`` by resource kind) and retried on the stream with
  backoff (0.5 s doubling to 30 s, ±20 %) until it resolves or is unsubscribed. The
  stream stays open. A failure that cannot heal on this stream (``GenerateError`` with
  ``retry=False``, e.g. a file name asked for by an attested pod) is not retried.

Unlike upstream (which answers UNIMPLEMENTED) DeltaSecrets and FetchSecrets work:
Delta keeps per-resource versions (a content hash, so ``initial_resource_versions``
on reconnect suppresses unchanged resources); Fetch answers the names that resolve and
fails (UNKNOWN, naming every cause) only when none does.

An unknown ``type_url`` is refused with INVALID_ARGUMENT naming it; an empty one is
taken as the Secret type (grpcurl and hand-written clients often omit it). A request
naming more than :data:`MAX_NAMES` distinct secrets (or a delta stream subscribed to more)
is refused with INVALID_ARGUMENT naming the count and the cap: a proxy needs a handful
(``default``, ``ROOTCA``, a few file names), and 5,000 names made a 20 MB response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import itertools
import logging
import uuid
from typing import AsyncIterator, Awaitable, Callable, Collection, NoReturn, TypeAlias, TypeVar

import grpc
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.secret.v3 import sds_pb2, sds_pb2_grpc
from google.protobuf import any_pb2

from agent.core.backoff import Backoff
from agent.core.grpc_closed import CLOSED_STREAM_ERRORS
from agent.core.grpc_decode import UndecodableRequest, add_service, decoding
from agent.core.spiffe import Identity
from agent.core.yamlsafe import MAX_LOGGED, short_repr, short_text

log = logging.getLogger(__name__)

SDS_SERVICE = sds_pb2.DESCRIPTOR.services_by_name["SecretDiscoveryService"].full_name


class _StreamEnded(Exception):
    """A write found the stream's call already ended (see agent.core.grpc_closed)."""

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
HEALTH_TYPE = "type.googleapis.com/istio.v1.HealthInformation"
MAX_NAMES = 100
MAX_NAME_LENGTH = 10_000  # characters of one secret name (file-cert:<cert>~<key>: two PATH_MAX paths fit)
MAX_NODE_ID_LENGTH = 1024  # characters of Node.id (Envoy's are type~ip~pod.ns~ns.svc.domain)
_version_counter = itertools.count(1)
_connection_ids = itertools.count(1)


class IdentityError(Exception):
    """The caller has no identity we may serve (→ PERMISSION_DENIED)."""


class GenerateError(Exception):
    """A secret could not be generated; message is the cause (no key material).

    ``retry`` False: asking again on the same stream cannot succeed (a policy refusal),
    so the stream does not retry the name."""

    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


RETRY_FIRST = 0.5   # seconds before a failed name is generated again on its stream
RETRY_MAX = 30.0    # cap of the doubling backoff


def resource_kind(name: str) -> str:
    """The bounded label for a resource name: ``default`` (any workload certificate
    name), ``ROOTCA``, ``file-cert`` or ``file-root``."""
    if name == "ROOTCA":
        return name
    if name.startswith("file-cert:"):
        return "file-cert"
    if name.startswith("file-root:"):
        return "file-root"
    return "default"


# generate(name, identity) -> Secret ; identify(context) -> Identity
Context: TypeAlias = grpc.aio.ServicerContext  # one SDS call's context
Request = TypeVar("Request", discovery_pb2.DiscoveryRequest, discovery_pb2.DeltaDiscoveryRequest)
Generate = Callable[[str, Identity], Awaitable[secret_pb2.Secret]]
Identify = Callable[[grpc.aio.ServicerContext], Identity]


def next_version() -> str:
    """``<local time RFC 3339>/<global counter>`` (upstream format)."""
    now = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"{now}/{next(_version_counter)}"


def tls_secret(name: str, chain: bytes, key: bytes) -> secret_pb2.Secret:
    return secret_pb2.Secret(name=name, tls_certificate=common_pb2.TlsCertificate(
        certificate_chain=base_pb2.DataSource(inline_bytes=chain),
        private_key=base_pb2.DataSource(inline_bytes=key)))


def root_secret(name: str, bundle: bytes) -> secret_pb2.Secret:
    return secret_pb2.Secret(name=name, validation_context=common_pb2.CertificateValidationContext(
        trusted_ca=base_pb2.DataSource(inline_bytes=bundle)))


def _pack(secret: secret_pb2.Secret) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(secret)
    return a


@dataclasses.dataclass
class Connection:
    """One SDS stream's state (also what ``debug_state`` shows)."""

    id: int
    peer: str
    identity: Identity
    kind: str = "sotw"
    node_id: str = ""
    names: set[str] | None = None
    nonce_sent: str = ""
    nonce_acked: str = ""
    version_sent: str = ""
    last_nack: str = ""
    versions: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> content hash
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    failed: dict[str, GenerateError] = dataclasses.field(default_factory=dict)  # unresolved
    retry: Backoff = dataclasses.field(  # doubling, ±20 %, per stream
        default_factory=lambda: Backoff(RETRY_FIRST, RETRY_MAX, jitter=(0.8, 1.2)))
    retry_timer: asyncio.TimerHandle | None = None

    def debug(self) -> dict:
        return {"id": self.id, "peer": self.peer, "kind": self.kind, "node": self.node_id,
                "identity": self.identity.spiffe_id,
                "resource_names": sorted(self.names or ()),
                "version_sent": self.version_sent, "nonce_sent": self.nonce_sent,
                "nonce_acked": self.nonce_acked, "last_nack": self.last_nack,
                "resource_versions": dict(self.versions),
                "unresolved": {n: str(e) for n, e in sorted(self.failed.items())}}


class SdsService(sds_pb2_grpc.SecretDiscoveryServiceServicer):
    """The servicer. ``identify(context)`` names the caller (raises :class:`IdentityError`);
    ``generate(name, identity)`` builds one Secret (raises :class:`GenerateError`);
    ``on_watch(identity)`` / ``on_unwatch(identity)`` (once per stream) let the cache count
    watchers.
    """

    def __init__(self, identify: Identify, generate: Generate,
                 on_watch: Callable[[Identity], None] = lambda i: None,
                 on_unwatch: Callable[[Identity], None] = lambda i: None):
        self.identify = identify
        self.generate = generate
        self.on_watch = on_watch
        self.on_unwatch = on_unwatch
        self.connections: dict[int, Connection] = {}
        self.nacks = 0
        self.generate_failures: dict[str, int] = {}  # resource_kind() -> failed generations

    # --- pushes ----------------------------------------------------------------------
    def push(self, names: Callable[[Connection], set[str]], spiffe_id: str | None = None) -> int:
        """Queue a push of ``names(conn)`` on every stream of ``spiffe_id`` (None: all).

        Returns the number of streams notified. Non-blocking: the stream task regenerates.
        """
        n = 0
        for conn in list(self.connections.values()):
            if spiffe_id is not None and conn.identity.spiffe_id != spiffe_id:
                continue
            wanted = names(conn) & (conn.names or set())
            if wanted:
                conn.queue.put_nowait(("push", wanted))
                n += 1
        return n

    # --- helpers ---------------------------------------------------------------------
    async def _identify(self, context: Context) -> Identity:
        try:
            return self.identify(context)
        except IdentityError as e:
            log.warning("SDS caller %s denied: %s", context.peer(), e)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"caller not attested: {e}")
            raise  # abort() raises; should it return, the caller is still not identified

    async def _secrets(self, names: list[str], identity: Identity,
                       known: dict[str, GenerateError] | None = None
                       ) -> tuple[list[secret_pb2.Secret], dict[str, GenerateError]]:
        """Generate each name on its own: ``(secrets that resolved, {name: error})``.

        Every failure is counted; it is logged at WARNING unless ``known`` (the stream's
        earlier failures) already holds the same cause for that name (then DEBUG, so a
        retrying stream does not flood the log)."""
        out, failed = [], {}
        for name in names:
            try:
                out.append(await self.generate(name, identity))
            except GenerateError as e:
                failed[name] = e
                kind = resource_kind(name)
                self.generate_failures[kind] = self.generate_failures.get(kind, 0) + 1
                old = (known or {}).get(name)
                level = logging.DEBUG if old is not None and str(old) == str(e) else \
                    logging.WARNING
                log.log(level, "failed to generate secret for %s (%s): %s", name, identity, e)
        return out, failed

    def _track_failures(self, conn: Connection, names: list[str],
                        failed: dict[str, GenerateError]) -> None:
        """Record which of ``names`` failed on ``conn`` and (re)arm its retry timer."""
        for name in names:
            if name in failed:
                conn.failed[name] = failed[name]
            else:
                conn.failed.pop(name, None)
        watched = conn.names or set()
        for name in [n for n in conn.failed if n not in watched]:
            del conn.failed[name]  # unsubscribed meanwhile
        retry = {n for n, e in conn.failed.items() if e.retry}
        if not retry:
            conn.retry.reset()
            if conn.retry_timer is not None:
                conn.retry_timer.cancel()
                conn.retry_timer = None
            return
        if conn.retry_timer is not None:
            return  # one timer per stream; it retries everything unresolved when it fires
        delay = conn.retry.next()

        def fire() -> None:
            conn.retry_timer = None
            pending = {n for n, e in conn.failed.items() if e.retry}
            if pending:
                conn.queue.put_nowait(("push", pending))

        conn.retry_timer = asyncio.get_running_loop().call_later(delay, fire)

    @staticmethod
    async def _check_count(names: Collection[str], context: Context,
                           what: str = "resource_names") -> None:
        if len(names) > MAX_NAMES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{what}: {len(names)} secret names, at most {MAX_NAMES} are "
                                "served per request")
        for name in names:
            if len(name) > MAX_NAME_LENGTH:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{what}: a secret name of {len(name)} characters "
                                    f"({short_text(name, 60)!r}), at most {MAX_NAME_LENGTH} "
                                    "(MAX_NAME_LENGTH)")

    async def _check_type(self, type_url: str, context: Context) -> None:
        if type_url and type_url != SECRET_TYPE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"type_url {type_url!r} is not served here; SDS serves {SECRET_TYPE}")

    def _register(self, conn: Connection) -> None:
        self.connections[conn.id] = conn

    def _unregister(self, conn: Connection, watched: bool) -> None:
        self.connections.pop(conn.id, None)
        if conn.retry_timer is not None:
            conn.retry_timer.cancel()
            conn.retry_timer = None
        if watched:
            self.on_unwatch(conn.identity)

    @staticmethod
    async def _read_into(context: Context, queue: asyncio.Queue) -> None:
        try:
            while True:
                req = await context.read()
                if req is grpc.aio.EOF:
                    break
                if isinstance(req, UndecodableRequest):
                    queue.put_nowait(("undecodable", req))
                    return  # nothing after it is read: the stream ends with this
                queue.put_nowait(("req", req))
        except Exception as e:  # noqa: BLE001 - a reset stream just ends
            log.debug("SDS stream read ended: %s", e)
        queue.put_nowait(("eof", None))

    # --- the stream loop both protocols share ----------------------------------------
    async def _serve(self, conn: Connection, context: Context,
                     first_request: Callable[[Request], Awaitable[bool]],
                     on_request: Callable[[Request], Awaitable[None]],
                     on_push: Callable[[set[str]], Awaitable[None]]) -> None:
        """Drive one stream: requests and rotation pushes arrive on ``conn.queue`` in
        order. ``first_request(req)`` vets the first one (False: skip it and wait for the
        next); every request's type is checked, the identity is watched from the first
        valid request on, then ``on_request(req)``; ``on_push(names)`` answers a push."""
        reader = asyncio.get_running_loop().create_task(self._read_into(context, conn.queue))
        watched = False
        self._register(conn)
        try:
            first = True
            while True:
                kind, item = await conn.queue.get()
                if kind == "eof":
                    return
                if kind == "push":
                    await on_push(item)
                    continue
                if kind == "undecodable":
                    await self._refuse_undecodable(conn.peer, item, context)
                if first:
                    if not await first_request(item):
                        continue
                    first = False
                await self._check_type(item.type_url, context)
                if not watched:
                    self.on_watch(conn.identity)
                    watched = True
                await on_request(item)
        except _StreamEnded as e:
            log.debug("SDS stream %d from %s ended while a response was being written: %r",
                      conn.id, conn.peer, e.__cause__)
        finally:
            reader.cancel()
            self._unregister(conn, watched)

    @staticmethod
    async def _refuse_undecodable(peer: str, request: UndecodableRequest,
                                  context: Context) -> NoReturn:
        """End the call ``INVALID_ARGUMENT`` for bytes that are not the method's message,
        with one WARNING (grpcio's default would log a traceback and end the stream OK).
        Raises what ``context.abort`` raises."""
        log.warning("SDS: call from %s refused: %s", short_text(peer, MAX_LOGGED), request)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        raise AssertionError("context.abort returned")  # not reached: abort raises

    @staticmethod
    async def _send(conn: Connection, context: Context,
                    resp: discovery_pb2.DiscoveryResponse | discovery_pb2.DeltaDiscoveryResponse
                    ) -> None:
        """``context.write(resp)``; raises :class:`_StreamEnded` when the call is already
        over (the client cancelled): the end of that stream, not an error."""
        try:
            await context.write(resp)
        except CLOSED_STREAM_ERRORS as e:
            raise _StreamEnded(conn.id) from e

    async def _first_request(self, conn: Connection,
                             req: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest,
                             context: Context) -> bool:
        """Node id required on a stream's first request (set_node_on_first_message_only)."""
        if not req.node.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing node information")
        if len(req.node.id) > MAX_NODE_ID_LENGTH:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"node.id: {len(req.node.id)} characters, at most "
                                f"{MAX_NODE_ID_LENGTH} (MAX_NODE_ID_LENGTH)")
        conn.node_id = req.node.id
        return True

    # --- StreamSecrets (SotW) --------------------------------------------------------
    async def StreamSecrets(  # noqa: N802 - gRPC name
            self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
            context: Context) -> None:
        identity = await self._identify(context)
        conn = Connection(next(_connection_ids), context.peer(), identity)

        async def first(req: discovery_pb2.DiscoveryRequest) -> bool:
            if req.type_url == HEALTH_TYPE:
                return False
            return await self._first_request(conn, req, context)

        async def push(names: set[str]) -> None:
            if conn.names is not None:
                await self._respond(conn, [n for n in sorted(names) if n in conn.names],
                                    context, only_changed=True)

        await self._serve(conn, context, first,
                          lambda req: self._handle_request(conn, req, context), push)

    async def _handle_request(self, conn: Connection, req: discovery_pb2.DiscoveryRequest,
                              context: Context) -> None:
        names = list(dict.fromkeys(req.resource_names))
        await self._check_count(names, context)
        if req.HasField("error_detail"):
            self.nacks += 1
            conn.last_nack = short_text(req.error_detail.message, MAX_LOGGED * 2)
            log.warning("SDS NACK from %s (stream %d) for %s version %s: %s",
                        short_text(conn.node_id, MAX_LOGGED), conn.id, short_repr(names),
                        short_text(req.version_info, MAX_LOGGED), conn.last_nack)
            return
        if not names:
            conn.names = None  # SDS is not a wildcard type: empty means unsubscribe
            return
        if not req.response_nonce or conn.names is None:
            conn.names = set(names)
            await self._respond(conn, names, context)
            return
        if req.response_nonce != conn.nonce_sent:
            log.debug("stale nonce %s on stream %d (sent %s)", req.response_nonce, conn.id,
                      conn.nonce_sent)
            return
        added = [n for n in names if n not in conn.names]
        conn.names = set(names)
        conn.nonce_acked = req.response_nonce
        if added:
            await self._respond(conn, added, context)

    async def _respond(self, conn: Connection, names: list[str], context: Context,
                       only_changed: bool = False) -> None:
        """Send ``names``; for pushes (``only_changed``) skip secrets this stream already
        has byte for byte (e.g. the first root announcement racing the first answer)."""
        if not names:
            return
        packed = [body for _, body, _ in await self._versioned(conn, names, context,
                                                               only_changed)]
        if not packed:
            return
        resp = discovery_pb2.DiscoveryResponse(
            type_url=SECRET_TYPE, version_info=next_version(), nonce=str(uuid.uuid4()),
            resources=packed)
        await self._send(conn, context, resp)
        conn.nonce_sent, conn.version_sent = resp.nonce, resp.version_info

    async def _versioned(self, conn: Connection, names: list[str], context: Context,
                         skip_unchanged: bool) -> list[tuple[str, any_pb2.Any, str]]:
        """Generate ``names`` as ``(name, packed Secret, version)``; the version is a
        content hash, recorded in ``conn.versions``. With ``skip_unchanged`` a secret the
        stream already has byte for byte is left out."""
        out = []
        secrets, failed = await self._secrets(names, conn.identity, conn.failed)
        self._track_failures(conn, names, failed)
        for secret in secrets:
            body = _pack(secret)
            version = hashlib.sha256(body.value).hexdigest()[:16]
            if skip_unchanged and conn.versions.get(secret.name) == version:
                continue
            conn.versions[secret.name] = version
            out.append((secret.name, body, version))
        return out

    # --- DeltaSecrets ----------------------------------------------------------------
    async def DeltaSecrets(  # noqa: N802 - gRPC name
            self, request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
            context: Context) -> None:
        identity = await self._identify(context)
        conn = Connection(next(_connection_ids), context.peer(), identity, kind="delta")
        conn.names = set()

        async def first(req: discovery_pb2.DeltaDiscoveryRequest) -> bool:
            await self._first_request(conn, req, context)
            conn.versions.update(req.initial_resource_versions)
            return True

        async def push(names: set[str]) -> None:
            await self._delta_respond(conn, sorted(names & (conn.names or set())), context)

        await self._serve(conn, context, first,
                          lambda req: self._handle_delta_request(conn, req, context), push)

    async def _handle_delta_request(self, conn: Connection,
                                    req: discovery_pb2.DeltaDiscoveryRequest,
                                    context: Context) -> None:
        if req.HasField("error_detail"):
            self.nacks += 1
            conn.last_nack = short_text(req.error_detail.message, MAX_LOGGED * 2)
            log.warning("SDS delta NACK from %s (stream %d): %s", short_text(conn.node_id, MAX_LOGGED),
                        conn.id, conn.last_nack)
        names = conn.names
        if names is None:  # a delta stream holds a set from its start (DeltaSecrets)
            names = conn.names = set()
        for name in req.resource_names_unsubscribe:
            names.discard(name)
            conn.versions.pop(name, None)
        added = [n for n in dict.fromkeys(req.resource_names_subscribe)
                 if n not in names and n != "*"]
        await self._check_count(names | set(added), context,
                                "resource_names_subscribe (subscribed on this stream)")
        names.update(added)
        if req.response_nonce:
            conn.nonce_acked = req.response_nonce
        await self._delta_respond(conn, added, context)

    async def _delta_respond(self, conn: Connection, names: list[str], context: Context
                             ) -> None:
        # Unchanged ones are left out: the client already has exactly those (reconnect).
        resources = [discovery_pb2.Resource(name=name, version=version, resource=body)
                     for name, body, version in await self._versioned(conn, names, context,
                                                                      True)]
        if not resources:
            return
        resp = discovery_pb2.DeltaDiscoveryResponse(
            type_url=SECRET_TYPE, system_version_info=next_version(), nonce=str(uuid.uuid4()),
            resources=resources)
        await self._send(conn, context, resp)
        conn.nonce_sent, conn.version_sent = resp.nonce, resp.system_version_info

    # --- FetchSecrets ----------------------------------------------------------------
    async def FetchSecrets(  # noqa: N802 - gRPC name
            self, request: discovery_pb2.DiscoveryRequest, context: Context
            ) -> discovery_pb2.DiscoveryResponse:
        if isinstance(request, UndecodableRequest):
            await self._refuse_undecodable(context.peer(), request, context)
        identity = await self._identify(context)
        await self._check_type(request.type_url, context)
        names = list(dict.fromkeys(request.resource_names))
        await self._check_count(names, context)
        if not names:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "resource_names: at least one secret name is required")
        secrets, failed = await self._secrets(names, identity)
        if failed and not secrets:
            await context.abort(grpc.StatusCode.UNKNOWN, "; ".join(
                f"failed to generate secret for {n}: {e}" for n, e in failed.items()))
        return discovery_pb2.DiscoveryResponse(
            type_url=SECRET_TYPE, version_info=next_version(), nonce=str(uuid.uuid4()),
            resources=[_pack(s) for s in secrets])

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the three methods on ``server`` as generated code does, with
        :func:`~agent.core.grpc_decode.decoding` as the request deserializer."""
        add_service(server, SDS_SERVICE, {
            "StreamSecrets": grpc.stream_stream_rpc_method_handler(
                self.StreamSecrets,
                request_deserializer=decoding(discovery_pb2.DiscoveryRequest),
                response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString),
            "DeltaSecrets": grpc.stream_stream_rpc_method_handler(
                self.DeltaSecrets,
                request_deserializer=decoding(discovery_pb2.DeltaDiscoveryRequest),
                response_serializer=discovery_pb2.DeltaDiscoveryResponse.SerializeToString),
            "FetchSecrets": grpc.unary_unary_rpc_method_handler(
                self.FetchSecrets,
                request_deserializer=decoding(discovery_pb2.DiscoveryRequest),
                response_serializer=discovery_pb2.DiscoveryResponse.SerializeToString)})

    def debug_state(self) -> list[dict]:
        return [c.debug() for c in self.connections.values()]
