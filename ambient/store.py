"""The object store every config source fills and the ambient index reads.

Objects are Kubernetes-shaped plain dicts (``apiVersion``, ``kind``, ``metadata``,
``spec``, ``status``) keyed by ``(kind, namespace, name)``; ``namespace`` is ``""``
for cluster-scoped kinds (Namespace, Node, GatewayClass). A source changes the store in
*transactions* (:meth:`ObjectStore.apply`, :meth:`ObjectStore.replace_origin`); after each
one every listener gets the list of :class:`StoreEvent` it produced, so the index never
knows whether a change came from a file or from the Kubernetes API (one config store
interface with interchangeable backends).

Bad objects never raise out of the store: :func:`validate` names the problem, the object
is skipped, a log line names origin/kind/name and ``ambient_agent_config_objects_rejected_total``
counts it.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import logging
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.core.yamlsafe import short_repr, short_text

log = logging.getLogger(__name__)

# Kinds the index consumes. The Local* kinds carry entries of ztunnel's local-config
# format (``docs/ambient.md``), see ambient.localconfig.
NAMESPACED_KINDS = frozenset({
    "Pod", "Service", "EndpointSlice", "ServiceEntry", "WorkloadEntry", "AuthorizationPolicy",
    "PeerAuthentication", "Gateway", "LocalWorkload", "LocalService", "LocalPolicy",
    "HTTPRoute", "GRPCRoute", "TCPRoute"})
CLUSTER_KINDS = frozenset({"Namespace", "Node", "GatewayClass"})
KINDS = NAMESPACED_KINDS | CLUSTER_KINDS

_GATEWAY_API = ("gateway.networking.k8s.io", ("v1", "v1beta1", "v1alpha2"))
#: kind -> (API group, the versions of it taken): what the Kubernetes API server serves
#: for the kind (Istio's CRDs: v1, v1beta1, v1alpha3; Gateway API: v1, v1beta1, v1alpha2,
#: as istiod watches them). Another group's kind of the same name (Istio's ingress
#: ``networking.istio.io`` Gateway) is refused, never read as the one the index uses.
API_VERSIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{k: ("", ("v1",)) for k in ("Namespace", "Node", "Pod", "Service")},
    "EndpointSlice": ("discovery.k8s.io", ("v1",)),
    **{k: ("networking.istio.io", ("v1", "v1beta1", "v1alpha3"))
       for k in ("ServiceEntry", "WorkloadEntry")},
    **{k: ("security.istio.io", ("v1", "v1beta1"))
       for k in ("AuthorizationPolicy", "PeerAuthentication")},
    **{k: _GATEWAY_API for k in ("Gateway", "GatewayClass", "HTTPRoute", "GRPCRoute",
                                 "TCPRoute")},
    **{k: ("ztunnel.local", ("v1",)) for k in ("LocalWorkload", "LocalService",
                                               "LocalPolicy")},
}

Key = tuple[str, str, str]  # (kind, namespace, name)


@dataclasses.dataclass(frozen=True)
class StoreEvent:
    """One object change: ``old`` is None for an add, ``new`` is None for a delete."""

    kind: str
    namespace: str
    name: str
    old: dict | None
    new: dict | None


Listener = Callable[[list[StoreEvent]], object]  # the return value is ignored


class InvalidObject(ValueError):
    """An object the store refuses; the message names the field and the value."""


def validate(obj: object) -> Key:
    """Check the fields every object needs and return its key.

    Fills ``metadata.namespace`` with ``"default"`` for namespaced kinds that omit it
    (as ``kubectl apply`` does). Raises :class:`InvalidObject` naming the bad field.
    """
    if not isinstance(obj, dict):
        raise InvalidObject(f"object must be a mapping, got {type(obj).__name__}")
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind:
        raise InvalidObject(f"field 'kind' must be a non-empty string, got {short_repr(kind)}")
    if kind not in KINDS:
        raise InvalidObject(f"kind {short_repr(kind)} is not one the ambient index uses")
    _check_api_version(kind, obj.get("apiVersion"))
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        raise InvalidObject(f"field 'metadata' must be a mapping, got {short_repr(meta)}")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidObject(f"field 'metadata.name' must be a non-empty string, got {short_repr(name)}")
    if kind in CLUSTER_KINDS:
        namespace = ""
    else:
        namespace = meta.setdefault("namespace", "default")
        if not isinstance(namespace, str) or not namespace:
            raise InvalidObject(f"field 'metadata.namespace' must be a non-empty string, "
                                f"got {short_repr(namespace)}")
    for field in ("labels", "annotations"):
        value = meta.get(field)
        if value is None:
            continue
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise InvalidObject(f"field 'metadata.{field}' must map strings to strings, "
                                f"got {short_repr(value)}")
    uid = meta.get("uid")
    if uid is not None and not isinstance(uid, str):
        raise InvalidObject(f"field 'metadata.uid' must be a string, got {short_repr(uid)}")
    for field in ("spec", "status"):
        value = obj.get(field)
        if value is not None and not isinstance(value, dict):
            raise InvalidObject(f"field {field!r} must be a mapping, got {short_repr(value)}")
    return kind, namespace, name


def _check_api_version(kind: str, api_version: object) -> None:
    """Refuse an ``apiVersion`` that is not one of ``kind``'s (:data:`API_VERSIONS`).
    Left out, it is taken as the kind's (the files source's own objects may omit it)."""
    if api_version is None:
        return
    group, versions = API_VERSIONS[kind]
    wanted = [f"{group}/{v}" if group else v for v in versions]
    if api_version not in wanted:
        raise InvalidObject(f"field 'apiVersion' {short_repr(api_version)} is not an API of "
                            f"kind {kind} (expected {' or '.join(wanted)})")


class ObjectStore:
    """In-memory implementation of :class:`ambient.api.ObjectStore` with change events.

    Thread-affinity: mutate only from the event loop (sources parse off-loop and apply
    on-loop); reads are plain dict lookups.
    """

    def __init__(self, registry: CollectorRegistry | None = None, source: str = "files"):
        self.source = source
        # by kind, then by (kind, namespace): no third map of every key (~60 bytes an object)
        self._by_kind: dict[str, dict[Key, dict]] = {k: {} for k in KINDS}
        self._by_ns: dict[tuple[str, str], dict[Key, dict]] = {}
        self._by_uid: dict[str, Key] = {}
        self._origin: dict[Key, str] = {}
        self._by_origin: dict[str, set[Key]] = {}
        # the copies refused as "already defined by" another origin: key -> origin ->
        # (object, where), first refused first. When the owner stops defining the key,
        # the first of them takes its place, as a restart would load it.
        self._shadows: dict[Key, dict[str, tuple[dict, str]]] = {}
        self._listeners: list[Listener] = []
        registry = registry if registry is not None else CollectorRegistry()
        self.rejected = Counter("ambient_agent_config_objects_rejected", "config objects skipped "
                                "because they are malformed or conflict", ["source", "reason"],
                                registry=registry)
        self._count = Gauge("ambient_agent_config_objects", "objects held by the config source",
                            ["kind"], registry=registry)
        self._count_of = functools.cache(self._count.labels)  # kind -> its child, once

    # --- read side (ambient.api.ObjectStore) ---

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        by_kind = self._by_kind.get(kind)
        return by_kind.get((kind, namespace, name)) if by_kind is not None else None

    def list(self, kind: str, namespace: str | None = None) -> Iterable[dict]:
        if namespace is None:
            return list(self._by_kind.get(kind, {}).values())
        return list(self._by_ns.get((kind, namespace), {}).values())

    def pod_by_uid(self, uid: str) -> dict | None:
        key = self._by_uid.get(uid)
        return self._by_kind["Pod"].get(key) if key and key[0] == "Pod" else None

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_kind.values())

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self._by_kind.items() if v}

    # --- change feed ---

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(events)`` after every transaction. Returns an unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    # --- write side (used by sources) ---

    def reject(self, reason: str, where: str, detail: str) -> None:
        """Log and count one skipped object; ``where`` names its origin (file#doc, watch)."""
        self.rejected.labels(self.source, reason).inc()
        log.warning("skipping object from %s: %s", short_text(where, 400), short_text(detail))

    def apply(self, upserts: Iterable[tuple[dict, str]] = (), deletes: Iterable[Key] = (),
              origin: str = "") -> builtins.list[StoreEvent]:
        """One transaction: upsert ``(object, where)`` pairs and delete keys; notify listeners.

        Invalid objects and duplicate UIDs are skipped (logged with ``where``, counted).
        Returns the events produced (objects that did not change produce none).
        """
        events: list[StoreEvent] = []
        for key in deletes:
            ev = self._delete_or_promote(key)
            if ev:
                events.append(ev)
        for obj, where in upserts:
            ev = self._upsert(obj, where, origin)
            if ev:
                events.append(ev)
        self._notify(events)
        return events

    def replace_origin(self, origin: str, objects: Iterable[tuple[dict, str]]
                       ) -> builtins.list[StoreEvent]:
        """Make ``objects`` the complete set owned by ``origin`` (a file path, a watch).

        Objects the origin held before and no longer lists are deleted; objects another
        origin already owns are skipped with a logged conflict.
        """
        before = set(self._by_origin.get(origin, ()))
        events: list[StoreEvent] = []
        seen: set[Key] = set()
        for obj, where in objects:
            ev = self._upsert(obj, where, origin, seen)
            if ev:
                events.append(ev)
        for key in [k for k, copies in self._shadows.items() if origin in copies]:
            if key not in seen:  # this origin no longer defines its refused copy
                self._drop_shadow(key, origin)
        for key in before - seen:
            ev = self._delete_or_promote(key)
            if ev:
                events.append(ev)
        self._notify(events)
        return events

    def objects_of_origin(self, origin: str) -> int:
        """How many objects ``origin`` currently owns."""
        return len(self._by_origin.get(origin, ()))

    def origin_of(self, key: Key) -> str | None:
        """The origin (file path, ``kubernetes:<Kind>``) that owns ``key``, or None."""
        return self._origin.get(key)

    # --- internals ---

    def _upsert(self, obj: dict, where: str, origin: str,
                seen: set[Key] | None = None) -> StoreEvent | None:
        try:
            key = validate(obj)
        except InvalidObject as e:
            kind = obj.get("kind") if isinstance(obj, dict) else None
            self.reject("invalid", where, f"{kind or 'object'}: {e}")
            return None
        kind, namespace, name = key
        label = f"{kind} {namespace + '/' if namespace else ''}{name}"
        if seen is not None:
            if key in seen:
                self.reject("duplicate", where, f"{label} is defined twice; keeping the first")
                return None
            seen.add(key)
        owner = self._origin.get(key)
        if owner is not None and owner != origin:
            copies = self._shadows.setdefault(key, {})
            if copies.get(origin, (None,))[0] != obj:  # a copy refused once is not re-logged
                self.reject("conflict", where, f"{label} is already defined by {owner}")
            copies[origin] = (obj, where)
            return None
        self._drop_shadow(key, origin)
        uid = obj["metadata"].get("uid")
        if uid:
            other = self._by_uid.get(uid)
            if other is not None and other != key:
                self.reject("duplicate-uid", where, f"{label} has uid {short_repr(uid)} already used by "
                            f"{other[0]} {other[1]}/{other[2]}")
                return None
        old = self._by_kind[kind].get(key)
        if old == obj:
            return None
        if old is not None:
            old_uid = old["metadata"].get("uid")
            if old_uid and self._by_uid.get(old_uid) == key:
                del self._by_uid[old_uid]
        self._by_kind[kind][key] = obj
        self._by_ns.setdefault((kind, namespace), {})[key] = obj
        self._origin[key] = origin
        self._by_origin.setdefault(origin, set()).add(key)
        if uid:
            self._by_uid[uid] = key
        return StoreEvent(kind, namespace, name, old, obj)

    def _drop_shadow(self, key: Key, origin: str) -> None:
        copies = self._shadows.get(key)
        if copies is not None and copies.pop(origin, None) is not None and not copies:
            del self._shadows[key]

    def _delete_or_promote(self, key: Key) -> StoreEvent | None:
        """Delete ``key``; if another origin's copy of it was refused as a conflict, that
        copy (the first refused) takes its place: one update event, not a delete."""
        gone = self._delete(key)
        copies = self._shadows.pop(key, None)
        if gone is None or not copies:
            if copies:
                self._shadows[key] = copies
            return gone
        origin, (obj, where) = next(iter(copies.items()))
        del copies[origin]
        if copies:
            self._shadows[key] = copies
        came = self._upsert(obj, where, origin)
        if came is None:
            return gone
        log.info("%s %s now comes from %s (the origin that defined it no longer does)",
                 key[0], f"{key[1]}/{key[2]}" if key[1] else key[2], short_text(where, 400))
        return StoreEvent(key[0], key[1], key[2], gone.old, came.new)

    def _delete(self, key: Key) -> StoreEvent | None:
        by_kind = self._by_kind.get(key[0])
        old = by_kind.pop(key, None) if by_kind is not None else None
        if old is None:
            return None
        bucket = self._by_ns.get((key[0], key[1]))
        if bucket is not None:
            bucket.pop(key, None)
            if not bucket:
                del self._by_ns[(key[0], key[1])]
        origin = self._origin.pop(key, None)
        if origin is not None:
            keys = self._by_origin.get(origin)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_origin[origin]
        uid = old["metadata"].get("uid")
        if uid and self._by_uid.get(uid) == key:
            del self._by_uid[uid]
        return StoreEvent(key[0], key[1], key[2], old, None)

    def _notify(self, events: builtins.list[StoreEvent]) -> None:
        if not events:
            return
        # the per-kind gauge once per transaction and kind, not per object: a labelled
        # child lookup per object was ~18 % of a 5k-pod cold start (py-spy)
        # (and each kind's child looked up once: a watch's transaction is one event)
        for kind in {ev.kind for ev in events}:
            self._count_of(kind).set(len(self._by_kind.get(kind, ())))
        for listener in list(self._listeners):
            try:
                listener(events)
            except Exception:  # a broken consumer must not break the source
                log.exception("store listener failed")
