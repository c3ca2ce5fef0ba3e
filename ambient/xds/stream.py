"""Per-stream state of the workload xDS server and the response algorithms.

One :class:`XdsStream` per gRPC stream. It holds the client's node (parsed from the
node id and metadata, ``docs/xds.md``), and per type URL a
:class:`TypeState`: the subscription (wildcard or explicit names/on-demand keys),
what the client holds (name -> version), the last nonce sent, ACK/NACK history.

The methods are synchronous and never await: a request or a push is turned into the
responses to send while the state is updated in the same step, so the state always
matches what went out (the server yields the responses right after).

Rules implemented (with lessons from go-control-plane's delta server):
- the first request of every type is answered, even with nothing in it;
- ``initial_resource_versions`` (first request of a type only): resources the client
  already holds at the same version are skipped, names it holds that no longer exist
  are sent as removed;
- an ACK without a subscription change gets no response; a NACK is recorded with its
  detail and nothing is resent; a nonce that is not the last one sent is stale and ignored
  (a nonce on the first request of a type, e.g. after a server restart, is accepted);
- on-demand keys (``network/IP``, ``namespace/hostname``, uid) are resolved with the
  index lookup, as istiod's ``generateDeltasOndemand``: a found key is answered with
  the resources (the key among their aliases) and never listed in
  ``removed_resources``; a key that resolves to nothing is answered as removed; every
  explicit request is answered, also for a key asked before (ztunnel asks again
  only when it lacks the address, so held versions are not skipped); a key that
  resolves later (a new pod with that IP) is pushed to every stream that asked for it;
- waking ztunnel's on-demand waiter: ztunnel (``src/xds/client.rs``) wakes a waiter
  only when a response names its key in ``resources[].name`` or ``removed_resources``
  (aliases are not matched), and removing a ``network/IP`` key makes it log "tried to
  remove service, but it was not found" (``src/xds.rs`` ``remove_internal``). So when a
  found key is not itself a resource name, the answer also carries a copy of the
  resource *named by the key* (ztunnel stores the payload by its own uid/hostname,
  and it already tracks the key, with an empty version, since it asked);
- waypoint clients (node type ``waypoint``) see only ``index.waypoint_resources``.

No I/O and no gRPC here: the server (:mod:`ambient.xds.server`) feeds requests and
pushes through the stream's inbox (:mod:`ambient.xds.connection`) and sends what comes
back; the client's node is parsed by :mod:`ambient.xds.node`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Iterable, TypeAlias

from envoy.service.discovery.v3 import discovery_pb2

from agent.core.yamlsafe import short_text
from ambient.api import AmbientIndex, IndexChange
from ambient.xds.generators import AUTHORIZATION_TYPE, Generator
from ambient.xds.node import NodeInfo, RequestError, parse_node

_NACK_HISTORY = 10
# Bounds on what one client can make a stream hold (issue 28: a fuzzed client grew the
# agent's RSS by 250 MB). Far above what real clients send: ztunnel subscribes on demand
# to a handful of names at a time and reconnects with one initial_resource_versions entry
# per resource it holds (tens of thousands at 20k pods); Envoy waypoints use wildcards.
MAX_NAMES_PER_REQUEST = 200_000  # in each name list / map of one request
MAX_NAMES_PER_STREAM = 200_000  # explicitly subscribed names, per type URL of a stream
MAX_NAME_LENGTH = 1024  # characters of one resource name (hostnames are <= 253)
MAX_NODE_ID_LENGTH = 1024  # characters of Node.id (type~ip~pod.ns~ns.svc.domain)


@dataclasses.dataclass
class TypeState:
    """What one stream has for one type URL."""

    wildcard: bool = True
    names: set[str] = dataclasses.field(default_factory=set)  # explicit names / on-demand keys
    held: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> version sent
    last_nonce: str = ""
    sent: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # nonce -> names
    responses: int = 0
    acks: int = 0
    stale: int = 0
    nacks: list[dict] = dataclasses.field(default_factory=list)
    nack_count: int = 0
    sotw_version: int = 0
    #: waypoint delta streams: nonce -> {name: (version sent, version held before)} of the
    #: last SENT_HISTORY responses, and name -> the version the client NACKed
    sent_versions: dict[str, dict[str, tuple[str, str | None]]] = dataclasses.field(
        default_factory=dict)
    rejected: dict[str, str] = dataclasses.field(default_factory=dict)

    def debug(self) -> dict:
        return {"wildcard": self.wildcard, "subscribed": len(self.names),
                "subscribed_sample": sorted(self.names)[:20], "held": len(self.held),
                "last_nonce": self.last_nonce, "responses": self.responses, "acks": self.acks,
                "stale_nonces": self.stale, "nacks": self.nack_count,
                "last_nacks": self.nacks[-3:], "rejected": len(self.rejected)}


@dataclasses.dataclass(frozen=True)
class PreparedResponse:
    """An already serialized DeltaDiscoveryResponse (the server's serializer passes it
    through); ``count`` is the number of resources in it."""

    data: bytes
    type_url: str
    nonce: str
    count: int

    def parse(self) -> discovery_pb2.DeltaDiscoveryResponse:
        return discovery_pb2.DeltaDiscoveryResponse.FromString(self.data)


# what a stream takes and gives (envoy's discovery messages; xds-protos ships no stubs)
DeltaResponse: TypeAlias = discovery_pb2.DeltaDiscoveryResponse
SotwResponse: TypeAlias = discovery_pb2.DiscoveryResponse
Request: TypeAlias = "discovery_pb2.DeltaDiscoveryRequest | discovery_pb2.DiscoveryRequest"
Response: TypeAlias = "DeltaResponse | SotwResponse | PreparedResponse"


_ids = itertools.count(1)


#: resource names kept (and logged) per NACK
MAX_NACK_NAMES = 5
#: responses per type whose resource versions a waypoint delta stream remembers
SENT_HISTORY = 16


def nacked_names(sent: Iterable[str], message: str) -> list[str]:
    """The names of ``sent`` (the resources of the NACKed response) that the NACK's
    ``message`` names: Envoy's text is ``Error adding/updating cluster(s) <name>: ...``
    or ``<name>: <reason>`` per resource, ztunnel's ``name: reason; ...``; a name counts
    when it is followed by ``:``, ``,``, a space or the end. When it names none of them
    (another wording), all of ``sent``: the client rejected that response as a whole.
    Sorted."""
    sent = sorted(sent)
    found = [n for n in sent if n and any(
        f"{n}{end}" in message for end in (":", ",", " ")) or (n and message.endswith(n))]
    return found or sent


_PROTO_VALIDATION = "Proto constraint validation failed ("


def nack_reason(message: str) -> str:
    """The innermost cause of an Envoy NACK detail, ``""`` when it has none to find.
    Envoy words a resource its validation refuses as ``Proto constraint validation failed
    (<Type>ValidationError.<Field>: embedded message failed validation | caused by ... |
    caused by RetryBackOffValidationError.BaseInterval: value must be greater than 0s):
    <the resource as text>``; the resource's text runs to kilobytes, and a detail cut to
    its first few hundred characters lost the one clause that says what is wrong."""
    start = message.find(_PROTO_VALIDATION)
    if start < 0:
        return ""
    inner = message[start + len(_PROTO_VALIDATION):]
    end = inner.find("): ")
    inner = inner[:end] if end >= 0 else inner
    return inner.rsplit(" | caused by ", 1)[-1].strip()


def nack_detail(message: str, limit: int) -> str:
    """``message`` cut to ``limit`` characters for a log line or ``/debug``, its
    :func:`nack_reason` first when it has one."""
    reason = nack_reason(message)
    return short_text(f"{reason} (in: {message})" if reason else message, limit)


def check_bounds(req: Request) -> None:
    """Refuse a request whose ``node.id`` is longer than MAX_NODE_ID_LENGTH, naming more
    than MAX_NAMES_PER_REQUEST resources in one list, or a name longer than
    MAX_NAME_LENGTH: RequestError naming the field and the cap (the stream is closed with
    INVALID_ARGUMENT)."""
    if len(req.node.id) > MAX_NODE_ID_LENGTH:
        raise RequestError("node.id", short_text(req.node.id, 60),
                           f"{len(req.node.id)} characters; at most "
                           f"{MAX_NODE_ID_LENGTH} (MAX_NODE_ID_LENGTH)")
    if isinstance(req, discovery_pb2.DeltaDiscoveryRequest):
        lists = {"resource_names_subscribe": req.resource_names_subscribe,
                 "resource_names_unsubscribe": req.resource_names_unsubscribe,
                 "initial_resource_versions": req.initial_resource_versions}
    else:
        lists = {"resource_names": req.resource_names}
    for field, names in lists.items():
        if len(names) > MAX_NAMES_PER_REQUEST:
            raise RequestError(field, f"<{len(names)} names>",
                               f"at most {MAX_NAMES_PER_REQUEST} names per request "
                               "(MAX_NAMES_PER_REQUEST)")
        for name in names:
            if len(name) > MAX_NAME_LENGTH:
                raise RequestError(field, short_text(name, 60),
                                   f"a name of {len(name)} characters; at most "
                                   f"{MAX_NAME_LENGTH} (MAX_NAME_LENGTH)")


def check_subscribed(type_url: str, count: int) -> None:
    """Refuse a stream holding more than MAX_NAMES_PER_STREAM names of one type."""
    if count > MAX_NAMES_PER_STREAM:
        raise RequestError("resource_names_subscribe", f"<{count} names on {type_url}>",
                           f"at most {MAX_NAMES_PER_STREAM} subscribed names per type on a "
                           "stream (MAX_NAMES_PER_STREAM)")


class XdsStream:
    """State and algorithms of one delta (or SotW, ``delta=False``) ADS stream.

    ``generators`` is the server's registry (type URL -> :class:`Generator`);
    ``index`` serves the waypoint scope. ``identity`` is the caller's SPIFFE ID (mTLS)
    or None; ``peer`` the gRPC peer string.
    """

    def __init__(self, generators: dict[str, Generator], index: AmbientIndex, *,
                 peer: str = "", identity: str | None = None, delta: bool = True):
        self.id = next(_ids)
        self.generators = generators
        self.index = index
        self.peer, self.identity, self.delta = peer, identity, delta
        self.node: NodeInfo | None = None
        self.types: dict[str, TypeState] = {}
        self.connected_at = time.time()
        self.push_version = 0

    # ---------------------------------------------------------------- views
    def _generator(self, type_url: str) -> Generator:
        gen = self.generators.get(type_url)
        if gen is None:
            raise RequestError("type_url", type_url,
                               "unsupported; this server speaks " + ", ".join(self.generators))
        return gen

    def _scope(self, type_url: str) -> set[str] | None:
        """Names this client may see for a type, or None for everything."""
        node = self.node
        if node is not None and node.proxy_type == "waypoint" and type_url != AUTHORIZATION_TYPE:
            return set(self.index.waypoint_resources(node.namespace, node.waypoint_name()))
        return None

    def _new_nonce(self) -> str:
        return f"{self.push_version}-{uuid.uuid4().hex[:12]}"

    # ---------------------------------------------------------------- requests
    def handle_request(self, req: Request) -> list[Response]:
        """Apply one DeltaDiscoveryRequest (or DiscoveryRequest when ``delta`` is
        False); return the responses to send (possibly none). Raises RequestError."""
        check_bounds(req)
        if self.node is None:
            self.node = parse_node(req.node)
        gen = self._generator(req.type_url)
        held_state = self.types.get(req.type_url)
        first = held_state is None
        ts = self.types[req.type_url] = held_state or TypeState()
        if not self.delta:
            assert isinstance(req, discovery_pb2.DiscoveryRequest)
            return self._sotw_request(gen, ts, req, first)
        assert isinstance(req, discovery_pb2.DeltaDiscoveryRequest)
        nonce = req.response_nonce
        if nonce and not first:
            if nonce != ts.last_nonce:
                ts.stale += 1
                return []
            sent = ts.sent.pop(nonce, [])
            if req.error_detail.code or req.error_detail.message:
                self._record_nack(ts, nonce, req.error_detail.message, sent)
            else:
                ts.acks += 1
        subscribe, unsubscribe = list(req.resource_names_subscribe), list(req.resource_names_unsubscribe)
        if first:
            return self._initial(gen, ts, subscribe, unsubscribe, dict(req.initial_resource_versions))
        if not subscribe and not unsubscribe:
            return []
        return self._resubscribe(gen, ts, subscribe, unsubscribe)

    def _record_nack(self, ts: TypeState, nonce: str, message: str, sent: list[str]) -> None:
        ts.nack_count += 1
        names = nacked_names(sent, message)
        ts.nacks.append({"nonce": nonce, "detail": nack_detail(message, 1000), "at": time.time(),
                         "names": names[:MAX_NACK_NAMES], "count": len(names)})
        del ts.nacks[:-_NACK_HISTORY]
        # ztunnel does not remember rejected resources as held: forget the names
        # its detail ("name: reason; ...") mentions, so a later change resends them.
        for name in sent:
            if f"{name}:" in message:
                ts.held.pop(name, None)

    def _initial(self, gen: Generator, ts: TypeState, subscribe: list[str],
                 unsubscribe: list[str], initial: dict[str, str]) -> list[Response]:
        ts.held = dict(initial)
        explicit = set(subscribe) - {"*"} - set(unsubscribe)
        # Istio: wildcard if "*" subscribed (and not unsubscribed) or no name at all.
        ts.wildcard = ("*" in subscribe and "*" not in unsubscribe) or (
            not subscribe and not unsubscribe)
        ts.names = explicit
        if ts.wildcard:
            return [self._full_wildcard(gen, ts)]
        if gen.on_demand and self.node and self.node.node_name:
            # node-local warm-up: the workloads on this client's node
            ts.names |= self.index.node_workloads(self.node.node_name)
        keys = ts.names | set(initial)
        return [self._answer_keys(gen, ts, keys)]

    def _resubscribe(self, gen: Generator, ts: TypeState, subscribe: list[str],
                     unsubscribe: list[str]) -> list[Response]:
        became_wildcard = "*" in subscribe and not ts.wildcard
        if "*" in unsubscribe:
            ts.wildcard = False
        if "*" in subscribe:
            ts.wildcard = True
        for name in unsubscribe:
            ts.names.discard(name)
            ts.held.pop(name, None)  # the client forgets it; no removal is sent
        asked = set(subscribe) - {"*"}
        check_subscribed(gen.type_url, len(ts.names | asked))
        ts.names |= asked
        if became_wildcard:
            return [self._full_wildcard(gen, ts)]
        if not asked:
            return []
        # every explicit request is answered, names asked before too (istiod answers
        # req.Delta.Subscribed): ztunnel asks again only when it lacks the resource
        return [self._answer_keys(gen, ts, asked, resend=True)]

    # ---------------------------------------------------------------- responses
    def _response(self, gen: Generator, ts: TypeState, resources: list[discovery_pb2.Resource],
                  removed: Iterable[str]) -> DeltaResponse:
        resp = discovery_pb2.DeltaDiscoveryResponse(
            type_url=gen.type_url, system_version_info=str(self.push_version),
            nonce=self._new_nonce())
        resp.resources.extend(resources)
        resp.removed_resources.extend(sorted(removed))
        for r in resources:
            ts.held[r.name] = r.version
        for name in resp.removed_resources:
            ts.held.pop(name, None)
        ts.last_nonce = resp.nonce
        ts.sent = {resp.nonce: [r.name for r in resources]}
        ts.responses += 1
        return resp

    def _full_wildcard(self, gen: Generator, ts: TypeState) -> DeltaResponse | PreparedResponse:
        """All resources in view, minus those held at the same version; removed = held
        names no longer in view (client request)."""
        scope = self._scope(gen.type_url)
        if scope is None and not ts.held:
            return self._snapshot_response(gen, ts)
        names = gen.names() if scope is None else [n for n in scope if gen.resource(n)]
        held = ts.held
        resources, present = [], set()
        for name in names:
            res = gen.resource(name)
            if res is None:
                continue
            present.add(name)
            if held.get(name) != res.version:
                resources.append(res)
        removed = [n for n in held if n not in present]
        return self._response(gen, ts, resources, removed)

    def _snapshot_response(self, gen: Generator, ts: TypeState) -> "PreparedResponse":
        """A client holding nothing gets the generator's shared pre-serialized snapshot."""
        snap = gen.snapshot()
        tail = discovery_pb2.DeltaDiscoveryResponse(
            type_url=gen.type_url, system_version_info=str(self.push_version),
            nonce=self._new_nonce())
        ts.held = dict(snap.versions)
        ts.last_nonce = tail.nonce
        ts.sent = {tail.nonce: list(snap.versions)}
        ts.responses += 1
        return PreparedResponse(snap.payload + tail.SerializeToString(), gen.type_url,
                                tail.nonce, len(snap.versions))

    def _answer_keys(self, gen: Generator, ts: TypeState, keys: Iterable[str],
                     resend: bool = False) -> DeltaResponse:
        """Resolve subscribed names / on-demand keys and grow the subscription by
        the names returned. Found: each resource with its aliases (the key among them),
        plus, for a key that is not a resource name, a copy named by the key (wakes
        ztunnel's waiter, see the module docstring). Not found: the key is removed.
        ``resend``: send resources even when the client holds them at that version (an
        explicit request); otherwise held versions are skipped (the initial request's
        ``initial_resource_versions``)."""
        scope = self._scope(gen.type_url)
        out: dict[str, discovery_pb2.Resource] = {}
        removed: set[str] = set()
        for key in keys:
            names = [n for n in gen.lookup(key) if scope is None or n in scope]
            if not names:
                removed.add(key)
                continue
            for name in names:
                ts.names.add(name)
                if name in out:
                    continue
                res = gen.resource_with_aliases(name, extra=() if key in names else (key,))
                if res is not None and (resend or ts.held.get(name) != res.version):
                    out[name] = res
            if key not in names and key not in out:
                twin = gen.resource_named(names[0], key)
                if twin is not None and (resend or ts.held.get(key) != twin.version):
                    out[key] = twin
        resources = list(out.values())
        removed -= set(out)
        return self._response(gen, ts, resources, removed)

    # ---------------------------------------------------------------- pushes
    def handle_push(self, change: IndexChange) -> list[Response]:
        """Responses for an index change (one per type whose view changed)."""
        self.push_version += 1
        out: list[Response] = []
        for type_url, ts in self.types.items():
            gen = self.generators[type_url]
            resp: Response | None
            if not self.delta:
                resp = self._sotw_push(gen, ts, change)
            else:
                resp = self._delta_push(gen, ts, change)
            if resp is not None:
                out.append(resp)
        return out

    def _delta_push(self, gen: Generator, ts: TypeState, change: IndexChange
                    ) -> DeltaResponse | None:
        changed, removed = gen.touched(change)
        if not changed and not removed:
            return None
        held = ts.held
        scope = self._scope(gen.type_url)
        candidates: set[str]
        if ts.wildcard:
            candidates = set(changed | removed)
            if scope is not None:
                # names that left the waypoint's view are removed for this client
                gone = [n for n in held if n not in scope]
                candidates = (candidates & scope) | set(gone)
        else:
            candidates = set((changed | removed) & ts.names)
            candidates |= self._additional(gen, ts, changed - ts.names)
            if scope is not None:
                candidates = {n for n in candidates if n in scope or n in held}
        # on-demand answers carry aliases (istiod's generateDeltasOndemand), pushes too
        fetch = (gen.resource_with_aliases if gen.on_demand and not ts.wildcard
                 else gen.resource)
        resources, gone_names = [], []
        for name in candidates:
            res = fetch(name) if (scope is None or name in scope) else None
            if res is None:
                if name in held:
                    gone_names.append(name)
            elif held.get(name) != res.version:
                resources.append(res)
        if not resources and not gone_names:
            return None
        return self._response(gen, ts, resources, gone_names)

    def _additional(self, gen: Generator, ts: TypeState, names: Iterable[str]) -> set[str]:
        """On-demand streams also get (and subscribe to) changed workloads on their node
        or behind a subscribed service, and any
        changed address one of whose aliases (``network/IP``) the client asked for
        before: a key answered "removed" is pushed once it resolves."""
        if not gen.on_demand:
            return set()
        node = self.node.node_name if self.node else ""
        extra = set()
        for name in names:
            if any(alias in ts.names for alias in gen.aliases(name)):
                extra.add(name)
                continue
            wl = gen.workload(name)
            if wl is None:
                continue
            if (node and wl.node == node) or any(s in ts.names for s in wl.services):
                extra.add(name)
        ts.names |= extra
        return extra

    # ---------------------------------------------------------------- state of the world
    def _sotw_current(self, gen: Generator, ts: TypeState) -> list[discovery_pb2.Resource]:
        scope = self._scope(gen.type_url)
        if ts.wildcard:
            names = gen.names() if scope is None else scope
        else:
            names = set()
            for key in ts.names:
                names.update(gen.lookup(key))
            if scope is not None:
                names &= scope
        out = []
        for name in sorted(names):
            res = gen.resource(name)
            if res is not None:
                out.append(res)
        return out

    def _sotw_response(self, gen: Generator, ts: TypeState) -> SotwResponse:
        current = self._sotw_current(gen, ts)
        ts.held = {r.name: r.version for r in current}
        ts.sotw_version += 1
        resp = discovery_pb2.DiscoveryResponse(
            type_url=gen.type_url, version_info=str(ts.sotw_version), nonce=self._new_nonce())
        resp.resources.extend(r.resource for r in current)
        ts.last_nonce = resp.nonce
        ts.responses += 1
        return resp

    def _sotw_request(self, gen: Generator, ts: TypeState, req: discovery_pb2.DiscoveryRequest,
                      first: bool) -> list[Response]:
        names = set(req.resource_names) - {"*"}
        wildcard = not req.resource_names or "*" in req.resource_names
        if not first and req.response_nonce:
            if req.response_nonce != ts.last_nonce:
                ts.stale += 1
                return []
            if req.error_detail.code or req.error_detail.message:
                self._record_nack(ts, req.response_nonce, req.error_detail.message, [])
            else:
                ts.acks += 1
            if wildcard == ts.wildcard and names == ts.names:
                return []
        ts.wildcard, ts.names = wildcard, names
        return [self._sotw_response(gen, ts)]

    def _sotw_push(self, gen: Generator, ts: TypeState, change: IndexChange
                   ) -> SotwResponse | None:
        changed, removed = gen.touched(change)
        if not changed and not removed:
            return None
        current = {r.name: r.version for r in self._sotw_current(gen, ts)}
        if current == ts.held:
            return None
        return self._sotw_response(gen, ts)

    # ---------------------------------------------------------------- debug
    def debug(self) -> dict:
        node = self.node
        return {"stream": self.id, "peer": self.peer, "identity": self.identity,
                "protocol": "delta" if self.delta else "sotw",
                "node_id": node.id if node else None,
                "proxy_type": node.proxy_type if node else None,
                "node_name": node.node_name if node else None,
                "connected_at": self.connected_at,
                "types": {t: s.debug() for t, s in self.types.items()}}
