"""The ADS stream of a waypoint Envoy: LDS, CDS, EDS, RDS and SDS, state of the world or
delta, as Envoy asks (``docs/waypoint.md``).

A stream becomes a :class:`WaypointStream` on its first request when the node id says
``waypoint~`` and the type URL is one of Envoy's (:data:`ambient.waypoint.resources.ENVOY_TYPES`);
a waypoint asking for the workload types keeps the :class:`ambient.xds.stream.XdsStream`.
The interface is the same (``handle_request``, ``handle_push``, ``debug``, ``types``), so
the server's loop, bounds and slow-client handling apply unchanged, and each stream runs
in its own handler: a waypoint that NACKs or stops reading holds back only itself.

Rules (istiod's and Envoy's xDS protocol):
- the first request of every type is answered, empty or not; the Gateway is the node's
  (:meth:`ambient.xds.node.NodeInfo.waypoint_name`) in the node's namespace;
- SotW: LDS and CDS are wildcard, EDS/RDS/SDS named; an ACK with unchanged names gets
  nothing; a NACK is recorded (``nack_count``, detail, the names) and nothing is resent
  until the configuration changes; a stale nonce is ignored;
- delta: per-resource versions (content hashes), ``initial_resource_versions`` honoured,
  removals sent for held names no longer present. A NACK of one of the last
  ``SENT_HISTORY`` responses (also one that is no longer the newest: Envoy NACKs each
  delta response on its own) marks the rejected resources (those its detail names, else
  all of that response, :func:`~ambient.xds.stream.nacked_names`): the stream again
  holds, for them, the version the client had before, and remembers the rejected
  version. A later push sends a rejected resource as soon as its version differs from the
  rejected one (the fix, or a revert to an earlier version), never the same rejected
  version again (no NACK loop); an explicit subscription resends it;
- pushes go in the order CDS, EDS, LDS, RDS, SDS; a changed cluster's endpoints are sent
  again after it (Envoy re-warms an updated EDS cluster);
- SDS ``default``/``ROOTCA`` carry the certificate of ``identity`` (the caller's SPIFFE ID),
  issued before the request is handled (:meth:`prepare`).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Iterable

from envoy.service.discovery.v3 import discovery_pb2

from ambient.api import IndexChange
from ambient.waypoint import options as wr
from ambient.waypoint.service import WaypointConfigs
from ambient.xds.node import NodeInfo, RequestError, parse_node
from ambient.xds.stream import (_NACK_HISTORY, MAX_NACK_NAMES, SENT_HISTORY, Request,
                                Response, TypeState, XdsStream, check_bounds,
                                check_subscribed, nack_detail, nacked_names)

WILDCARD_TYPES = (wr.LISTENER_TYPE, wr.CLUSTER_TYPE)
BIND_METADATA = "AMBIENT_HBONE_BIND_ADDRESS"


def is_waypoint_request(req: Request) -> bool:
    return req.type_url in wr.ENVOY_TYPES and req.node.id.startswith("waypoint~")


class WaypointStream:
    """State of one waypoint Envoy's ADS stream (takes over ``previous``'s id and peer)."""

    def __init__(self, configs: WaypointConfigs, previous: XdsStream, node: NodeInfo, *,
                 secret_identity: str | None):
        self.configs = configs
        self.id, self.peer, self.identity = previous.id, previous.peer, previous.identity
        self.delta = previous.delta
        self.node: NodeInfo | None = node
        self.secret_identity = secret_identity
        self.types: dict[str, TypeState] = {}
        self.connected_at = time.time()
        self.push_version = 0
        bind = str(node.metadata.get(BIND_METADATA, "") or "")
        if bind and not wr.valid_ip(bind):
            configs.warn(f"waypoint node {node.id}: metadata {BIND_METADATA}={bind!r} is not "
                         f"an IP address: listening on 0.0.0.0")
            bind = ""
        ann = node.metadata.get("ANNOTATIONS")
        xfcc = isinstance(ann, dict) and str(ann.get(wr.XFCC_ANNOTATION, "")).lower() == "true"
        self.options = wr.Options(bind=bind or "0.0.0.0", xfcc=xfcc)
        self.gateway = (node.namespace, node.waypoint_name())

    # ---------------------------------------------------------------- current view
    def _current(self, type_url: str) -> dict[str, tuple[str, object]]:
        if type_url == wr.SECRET_TYPE:
            if self.secret_identity is None:
                self.configs.warn(f"waypoint node {self.node.id if self.node else '-'}: no "
                                  f"identity to issue a certificate for (use the TLS port, or "
                                  f"set xds_token_file on the plaintext port)")
                return {}
            return self.configs.secrets(self.secret_identity)
        cfg = self.configs.config(*self.gateway, self.options)
        return cfg.resources.get(type_url, {})

    async def prepare(self) -> bool:
        """Before a request or push is handled: build this waypoint's configuration off
        the event loop if it is not cached, and issue or renew its certificate. True when
        the secrets changed."""
        await self.configs.prepare_config(*self.gateway, self.options)
        if self.secret_identity is None:
            return False
        return await self.configs.ensure_secrets(self.secret_identity)

    def _nonce(self) -> str:
        return f"{self.push_version}-{uuid.uuid4().hex[:12]}"

    # ---------------------------------------------------------------- requests
    def handle_request(self, req: Request) -> list[Response]:
        check_bounds(req)
        if req.type_url not in wr.ENVOY_TYPES:
            raise RequestError("type_url", req.type_url,
                               "a waypoint stream serves " + ", ".join(wr.ENVOY_TYPES))
        if req.node.id and req.node.id != (self.node.id if self.node else ""):
            self.node = parse_node(req.node)
        first = req.type_url not in self.types
        ts = self.types.setdefault(req.type_url, TypeState())
        if self.delta:
            assert isinstance(req, discovery_pb2.DeltaDiscoveryRequest)
            return self._delta_request(ts, req, first)
        assert isinstance(req, discovery_pb2.DiscoveryRequest)
        return self._sotw_request(ts, req, first)

    def _ack_or_nack(self, ts: TypeState, nonce: str, detail: Request) -> bool:
        """Apply a response nonce; False when stale (ignore the request; a delta NACK of a
        recent response still marks its rejected resources, see the module docstring)."""
        nack = bool(detail.error_detail.code or detail.error_detail.message)
        sent = ts.sent_versions.pop(nonce, None)
        newest = nonce == ts.last_nonce
        if nack and (newest or sent is not None):
            if sent is not None:
                self._reject(ts, sent, detail.error_detail.message)
            ts.nack_count += 1
            names = nacked_names(sent, detail.error_detail.message) if sent else \
                sorted(ts.held)
            ts.nacks.append({"nonce": nonce, "detail": nack_detail(detail.error_detail.message, 1000),
                             "at": time.time(), "names": names[:MAX_NACK_NAMES],
                             "count": len(names)})
            del ts.nacks[:-_NACK_HISTORY]
        elif newest:
            ts.acks += 1
        if not newest:
            ts.stale += 1
            return False
        return True

    @staticmethod
    def _reject(ts: TypeState, sent: dict[str, tuple[str, str | None]], message: str) -> None:
        """The client rejected (some of) ``sent``: for each rejected name still held at the
        rejected version, hold again what it had before and remember the rejected version."""
        for name in nacked_names(sent, message):
            version, before = sent[name]
            if ts.held.get(name) != version:
                continue  # sent again since: that response decides
            ts.rejected[name] = version
            if before is None:
                ts.held.pop(name, None)
            else:
                ts.held[name] = before

    def _sotw_request(self, ts: TypeState, req: discovery_pb2.DiscoveryRequest,
                      first: bool) -> list[Response]:
        names = set(req.resource_names) - {"*"}
        wildcard = req.type_url in WILDCARD_TYPES and (not names or "*" in req.resource_names)
        if not first and req.response_nonce:
            if not self._ack_or_nack(ts, req.response_nonce, req):
                return []
            if wildcard == ts.wildcard and names == ts.names:
                return []
        ts.wildcard, ts.names = wildcard, names
        return [self._sotw_response(req.type_url, ts)]

    def _sotw_view(self, type_url: str, ts: TypeState) -> dict[str, tuple[str, object]]:
        current = self._current(type_url)
        if ts.wildcard:
            return current
        return {n: current[n] for n in ts.names if n in current}

    def _sotw_response(self, type_url: str, ts: TypeState) -> discovery_pb2.DiscoveryResponse:
        view = self._sotw_view(type_url, ts)
        ts.held = {n: v for n, (v, _m) in view.items()}
        version = hashlib.blake2b(repr(sorted(ts.held.items())).encode(),
                                  digest_size=8).hexdigest()
        resp = discovery_pb2.DiscoveryResponse(type_url=type_url, version_info=version,
                                               nonce=self._nonce())
        for name in sorted(view):
            resp.resources.add().Pack(view[name][1])
        ts.last_nonce = resp.nonce
        ts.responses += 1
        return resp

    def _delta_request(self, ts: TypeState, req: discovery_pb2.DeltaDiscoveryRequest,
                       first: bool) -> list[Response]:
        if req.response_nonce and not first:
            if not self._ack_or_nack(ts, req.response_nonce, req):
                return []
        subscribe, unsubscribe = set(req.resource_names_subscribe), set(req.resource_names_unsubscribe)
        if first:
            ts.held = dict(req.initial_resource_versions)
            ts.wildcard = req.type_url in WILDCARD_TYPES and (
                "*" in subscribe or not subscribe) and "*" not in unsubscribe
            ts.names = subscribe - {"*"} - unsubscribe
            return [self._delta_response(req.type_url, ts, self._delta_names(req.type_url, ts),
                                         removed_ok=True)]
        for name in unsubscribe:
            ts.names.discard(name)
            ts.held.pop(name, None)
        if "*" in unsubscribe:
            ts.wildcard = False
        asked = subscribe - {"*"}
        check_subscribed(req.type_url, len(ts.names | asked))
        ts.names |= asked
        if "*" in subscribe and req.type_url in WILDCARD_TYPES and not ts.wildcard:
            ts.wildcard = True
            return [self._delta_response(req.type_url, ts, self._delta_names(req.type_url, ts))]
        if not asked:
            return []
        return [self._delta_response(req.type_url, ts, asked, resend=True)]

    def _delta_names(self, type_url: str, ts: TypeState) -> set[str]:
        current = self._current(type_url)
        return set(current) if ts.wildcard else set(ts.names)

    def _delta_response(self, type_url: str, ts: TypeState, names: Iterable[str], *,
                        resend: bool = False, removed_ok: bool = True
                        ) -> discovery_pb2.DeltaDiscoveryResponse:
        current = self._current(type_url)
        resp = discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, nonce=self._nonce(),
                                                    system_version_info=str(self.push_version))
        sent: dict[str, tuple[str, str | None]] = {}
        for name in sorted(names):
            entry = current.get(name)
            if entry is None:
                continue
            version, msg = entry
            if not resend and ts.held.get(name) == version:
                continue
            res = resp.resources.add(name=name, version=version)
            res.resource.Pack(msg)
            sent[name] = (version, ts.held.get(name))
            ts.held[name] = version
            ts.rejected.pop(name, None)
        self._remember(ts, resp.nonce, sent)
        visible = set(current) if ts.wildcard else ts.names
        gone = sorted(n for n in ts.held if n not in current or n not in visible)
        if removed_ok:
            resp.removed_resources.extend(gone)
            for n in gone:
                ts.held.pop(n, None)
        ts.last_nonce = resp.nonce
        ts.responses += 1
        return resp

    @staticmethod
    def _remember(ts: TypeState, nonce: str, sent: dict[str, tuple[str, str | None]]) -> None:
        """Keep what response ``nonce`` carried (bounded: the last SENT_HISTORY)."""
        ts.sent_versions[nonce] = sent
        while len(ts.sent_versions) > SENT_HISTORY:
            ts.sent_versions.pop(next(iter(ts.sent_versions)))

    # ---------------------------------------------------------------- pushes
    def handle_push(self, change: IndexChange) -> list[Response]:
        """Responses for whatever of this waypoint's configuration changed (the change's
        contents are not needed: the configuration is rebuilt from the index and store)."""
        self.push_version += 1
        out: list[Response] = []
        changed_clusters: set[str] = set()
        for type_url in wr.ENVOY_TYPES:
            ts = self.types.get(type_url)
            if ts is None:
                continue
            if self.delta:
                resp = self._delta_push(type_url, ts, changed_clusters)
            else:
                resp = self._sotw_push(type_url, ts, bool(changed_clusters))
            if resp is not None:
                out.append(resp)
                if type_url == wr.CLUSTER_TYPE:
                    changed_clusters = self._eds_clusters(resp)
        return out

    def _eds_clusters(self, resp: Response) -> set[str]:
        if isinstance(resp, discovery_pb2.DeltaDiscoveryResponse):
            return {r.name for r in resp.resources} or {"*"}
        return {"*"}

    def _sotw_push(self, type_url: str, ts: TypeState, clusters_changed: bool
                   ) -> discovery_pb2.DiscoveryResponse | None:
        view = self._sotw_view(type_url, ts)
        held = {n: v for n, (v, _m) in view.items()}
        if held == ts.held and not (type_url == wr.ENDPOINT_TYPE and clusters_changed):
            return None
        return self._sotw_response(type_url, ts)

    def _delta_push(self, type_url: str, ts: TypeState, changed_clusters: set[str]
                    ) -> discovery_pb2.DeltaDiscoveryResponse | None:
        current = self._current(type_url)
        names = set(current) if ts.wildcard else set(ts.names)
        resend = set()
        if type_url == wr.ENDPOINT_TYPE and changed_clusters:
            resend = names if "*" in changed_clusters else names & changed_clusters
        for name in [n for n in ts.rejected if n not in current]:
            del ts.rejected[name]  # gone from the configuration: nothing to remember
        # a rejected version is not sent again (the client would NACK it again)
        pending = {n for n in names if n in current and ts.held.get(n) != current[n][0]
                   and ts.rejected.get(n) != current[n][0]}
        visible = set(current) if ts.wildcard else ts.names
        gone = [n for n in ts.held if n not in current or n not in visible]
        if not pending and not gone and not resend:
            return None
        resp = self._delta_response(type_url, ts, pending | resend, resend=False)
        extra = ts.sent_versions.setdefault(resp.nonce, {})
        for name in sorted(resend - pending):
            entry = current.get(name)
            if entry is not None:
                res = resp.resources.add(name=name, version=entry[0])
                res.resource.Pack(entry[1])
                extra[name] = (entry[0], ts.held.get(name))
                ts.held[name] = entry[0]
                ts.rejected.pop(name, None)
        return resp

    # ---------------------------------------------------------------- debug
    def debug(self) -> dict:
        node = self.node
        return {"stream": self.id, "peer": self.peer, "identity": self.identity,
                "protocol": "delta" if self.delta else "sotw",
                "node_id": node.id if node else None, "proxy_type": "waypoint",
                "node_name": node.node_name if node else None,
                "gateway": "/".join(self.gateway), "secret_identity": self.secret_identity,
                "connected_at": self.connected_at,
                "types": {t: s.debug() for t, s in self.types.items()}}
