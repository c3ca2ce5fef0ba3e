"""Writes the waypoint status of :mod:`ambient.waypoint.status` to the API server, as
istiod's gateway status writer does, from one agent per cluster.

Who writes: the holder of the Lease :data:`LEASE_NAME` in ``system_namespace``
(:class:`agent.core.kubelease.LeaseElection`, the election the root ConfigMap publisher
uses too). Every agent stands aside while istiod's gateway status election is held: the
per-revision Lease ``istio-gateway-status-leader-<revision>`` or the older ConfigMap lock
``istio-gateway-status-leader`` (``pilot/pkg/leaderelection``: ``GatewayStatusController``;
``pilot/pkg/bootstrap/configcontroller.go`` runs the writer under it). So istiod and the
agents never write the same status at once.

What: for each Gateway of class ``istio-waypoint``, ``status.conditions``, ``addresses``
and ``listeners``; for each Service asking for a waypoint (``istio.io/use-waypoint``),
the ``istio.io/WaypointBound`` condition istiod's ambient index writes
(:func:`ambient.waypoint.status.service_waypoint_condition`; other conditions kept, ours
removed when the Service no longer asks; not while istiod's own ambient status writer
holds its Lease ``istio-status-leader[-<revision>]``); for each route attached to a
Service, the ``status.parents`` entries whose ``controllerName`` is
``istio.io/gateway-controller`` (entries of other controllers are kept as they are;
ours for parents no longer referenced are removed, as istiod's ``createRouteStatus``
does). A condition whose ``status`` did not change keeps its
``lastTransitionTime``; a changed or new one gets the current time
(``metav1.Condition`` semantics).

How: the desired status is compared with the object's current status as the config store
holds it (the Kubernetes source's watch keeps it current) and nothing is sent when they
are equal, so an unchanged object keeps its ``resourceVersion``. A change is one JSON merge
patch of the ``status`` subresource carrying the ``resourceVersion`` it was computed from:
when someone else changed the object meanwhile the API server answers 409 Conflict and the
writer re-reads the object and decides again (at most :data:`CONFLICT_ATTEMPTS` times), so
it never overwrites what it has not seen. Other failures are retried with the agent's
:class:`agent.core.backoff.Backoff` (0.5 s doubling to 30 s); a vanished object (404) is
skipped. Recomputation follows the store: any change of a kind the status depends on marks
the status dirty (EndpointSlices only when they belong to a Service named as a Gateway)
and a pass runs after :data:`DEBOUNCE` seconds; a full pass also runs
every ``resync`` seconds and whenever this agent becomes the leader.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import logging
from typing import Any, Callable

from agent.core import kubecall
from agent.core.backoff import Backoff
from agent.core.kubecall import KubeError
from agent.core.kubelease import IstiodLock, LeaseElection
from agent.core.lifecycle import AgentContext, Component
from ambient.objects import meta
from ambient.store import ObjectStore
from ambient.waypoint import status as wstatus

log = logging.getLogger(__name__)

LEASE_NAME = "ambient-agent-gateway-status"
ISTIOD_LOCK = IstiodLock(configmap="istio-gateway-status-leader",
                         lease_prefix="istio-gateway-status-leader")
#: istiod's ambient status writer (``AMBIENT_ENABLE_STATUS``, ``pilot/pkg/bootstrap/
#: configcontroller.go``: the ``StatusController`` Lease election), which writes the
#: Services' ``istio.io/WaypointBound``: while it is held the agent writes no Service
AMBIENT_STATUS_LOCK = IstiodLock(lease_prefix="istio-status-leader")
GATEWAY_API = "/apis/gateway.networking.k8s.io"
#: key of :func:`ambient.waypoint.status.statuses` -> (kind, API path prefix, plural)
WRITTEN: dict[str, tuple[str, str, str]] = {
    "gateways": ("Gateway", f"{GATEWAY_API}/v1", "gateways"),
    "httproutes": ("HTTPRoute", f"{GATEWAY_API}/v1", "httproutes"),
    "grpcroutes": ("GRPCRoute", f"{GATEWAY_API}/v1", "grpcroutes"),
    "tcproutes": ("TCPRoute", f"{GATEWAY_API}/v1alpha2", "tcproutes"),
    "services": ("Service", "/api/v1", "services"),
}
#: kinds whose change can change a status
WATCHED = frozenset({"Gateway", "HTTPRoute", "GRPCRoute", "TCPRoute", "Service", "Namespace",
                     "EndpointSlice"})
DEBOUNCE = 0.5           # s between a store change and the pass it triggers (bounds the
                         # leader's recomputation under endpoint churn)
CONFLICT_ATTEMPTS = 3    # re-reads after a 409 before the object waits for the next pass
REQUEST_TIMEOUT = 10.0   # s for one API call


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _with_times(new: list[dict], old: Any, now: str) -> list[dict]:
    """``new`` conditions with ``lastTransitionTime``: kept from ``old`` (same type and
    status), else ``now``."""
    before = {c.get("type"): c for c in old if isinstance(c, dict)} if isinstance(
        old, list) else {}
    out = []
    for c in new:
        prev = before.get(c["type"])
        t = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        out.append({**c, "lastTransitionTime": t or now})
    return out


def merged_gateway_status(current: Any, desired: dict, now: str) -> dict:
    """The Gateway ``status`` to hold: ``current`` with our conditions, addresses and
    listeners (transition times kept where the status did not change)."""
    cur = current if isinstance(current, dict) else {}
    out = copy.deepcopy(cur)
    out["conditions"] = _with_times(desired["conditions"], cur.get("conditions"), now)
    if desired["addresses"]:
        out["addresses"] = desired["addresses"]
    else:
        out.pop("addresses", None)
    old_listeners = {x.get("name"): x for x in cur.get("listeners") or [] if isinstance(x, dict)}
    out["listeners"] = [{**x, "conditions": _with_times(
        x["conditions"], (old_listeners.get(x["name"]) or {}).get("conditions"), now)}
        for x in desired["listeners"]]
    return out


def merged_service_status(current: Any, desired: dict, now: str) -> dict:
    """The Service ``status`` to hold: everything of ``current`` (``loadBalancer``, other
    conditions) with our ``istio.io/WaypointBound`` condition replaced by
    ``desired["conditions"]`` (none: removed, as istiod prunes it)."""
    cur = current if isinstance(current, dict) else {}
    out = copy.deepcopy(cur)
    old = [c for c in cur.get("conditions") or [] if isinstance(c, dict)]
    theirs = [c for c in old if c.get("type") != wstatus.WAYPOINT_BOUND]
    mine = _with_times(desired["conditions"], old, now)
    if theirs or mine:
        out["conditions"] = theirs + mine
    else:
        out.pop("conditions", None)
    return out


def _ref_key(ref: Any) -> str:
    return json.dumps(ref, sort_keys=True) if isinstance(ref, dict) else ""


def merged_route_status(current: Any, desired: dict, now: str) -> dict:
    """The route ``status`` to hold: other controllers' ``parents`` entries unchanged, ours
    replaced by ``desired["parents"]`` (transition times kept)."""
    cur = current if isinstance(current, dict) else {}
    out = copy.deepcopy(cur)
    theirs, ours = [], {}
    for p in cur.get("parents") or []:
        if not isinstance(p, dict):
            continue
        if p.get("controllerName") == wstatus.CONTROLLER:
            ours[_ref_key(p.get("parentRef"))] = p
        else:
            theirs.append(p)
    mine = [{**p, "conditions": _with_times(
        p["conditions"], (ours.get(_ref_key(p["parentRef"])) or {}).get("conditions"), now)}
        for p in desired["parents"]]
    out["parents"] = theirs + mine
    return out


class StatusWriter(Component):
    """Keeps the API server's waypoint status equal to :func:`status.statuses` of ``store``
    while this agent leads (module docstring).

    ``api`` returns the config source's ``ApiClient``; ``namespace`` the system namespace;
    ``identity`` the holder identity (node name). ``writes`` counts ``patched``,
    ``unchanged`` (compared equal, nothing sent), ``conflicts``, ``gone`` and ``errors``.
    """

    name = "waypoint-status"

    def __init__(self, store: ObjectStore, api: Callable[[], Any], namespace: str,
                 identity: str, *, domain: str = "cluster.local", lease_seconds: int = 15,
                 resync: float = 300.0):
        self.store, self._api, self.domain, self.resync = store, api, domain, resync
        self.namespace = namespace
        self.election = LeaseElection(api, namespace, LEASE_NAME, identity,
                                      on_lead=self._lead, on_lose=self._step_down,
                                      istiod=ISTIOD_LOCK, lease_seconds=lease_seconds,
                                      what="writing waypoint Gateway and route status")
        self.writes = {"patched": 0, "unchanged": 0, "conflicts": 0, "gone": 0, "errors": 0}
        self.passes = 0
        self._dirty = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._failing: dict[str, str] = {}  # "Kind ns/name" -> the last error's reason

    # --- lifecycle ---

    async def start(self) -> None:
        self._unsubscribe = self.store.subscribe(self._on_events)
        await self.election.start()

    async def stop(self, grace: float = 0.0) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        await self.election.stop()
        await self._step_down()

    def ready(self) -> tuple[bool, str]:
        return True, ""

    @property
    def leading(self) -> bool:
        return self.election.leading

    def _on_events(self, events: list) -> None:
        if not self.leading or self._dirty.is_set():
            return
        for e in events:
            if e.kind == "EndpointSlice":
                # only a waypoint's own endpoints change a status (its Programmed)
                obj = e.new or e.old or {}
                svc = (meta(obj).get("labels") or {}).get(wstatus.SERVICE_NAME_LABEL)
                if svc and self.store.get("Gateway", e.namespace, svc) is not None:
                    self._dirty.set()
                    return
            elif e.kind in WATCHED:
                self._dirty.set()
                return

    def _lead(self) -> None:
        self._dirty.set()
        self._worker = asyncio.get_running_loop().create_task(self._run(),
                                                              name="waypoint-status-writer")

    async def _step_down(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None

    async def _run(self) -> None:
        retry = Backoff(0.5, 30.0, jitter=(0.8, 1.2))
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), timeout=self.resync)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(DEBOUNCE)
            self._dirty.clear()
            failed = await self.sync()
            if failed:
                self._dirty.set()
                await retry.wait()
            else:
                retry.reset()

    # --- one pass ---

    async def sync(self) -> int:
        """Write every status that differs; returns how many objects failed (retried by
        the caller). Only call while leading."""
        self.passes += 1
        desired = wstatus.statuses(self.store, self.domain)
        # routes that still carry our entries but no longer name a Service: ours go
        for key, (kind, _, _) in WRITTEN.items():
            if key == "gateways" or key not in desired:
                continue
            for obj in self.store.list(kind):
                nsname = f"{meta(obj).get('namespace')}/{meta(obj).get('name')}"
                parents = (obj.get("status") or {}).get("parents") or []
                if nsname not in desired[key] and any(
                        isinstance(p, dict) and p.get("controllerName") == wstatus.CONTROLLER
                        for p in parents):
                    desired[key][nsname] = {"parents": []}
        # Services that still carry our WaypointBound condition but ask for no waypoint
        for svc in self.store.list("Service"):
            nsname = f"{meta(svc).get('namespace')}/{meta(svc).get('name')}"
            conds = (svc.get("status") or {}).get("conditions") or []
            if nsname not in desired.setdefault("services", {}) and any(
                    isinstance(c, dict) and c.get("type") == wstatus.WAYPOINT_BOUND
                    for c in conds):
                desired["services"][nsname] = {"conditions": []}
        if desired["services"] and await self._istiod_writes_services():
            del desired["services"]
        failed = 0
        for key, objects in desired.items():
            if key not in WRITTEN:
                continue
            kind = WRITTEN[key][0]
            for nsname, want in objects.items():
                ns, name = nsname.split("/", 1)
                where = f"{kind} {ns}/{name}"
                try:
                    await self._write(key, ns, name, want, self.store.get(kind, ns, name))
                    self._failing.pop(where, None)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - one object never stops the pass
                    failed += 1
                    self.writes["errors"] += 1
                    reason = str(getattr(e, "reason", None) or e)
                    # one WARNING per object and reason; the retries after it at DEBUG
                    level = logging.DEBUG if self._failing.get(where) == reason else \
                        logging.WARNING
                    self._failing[where] = reason
                    log.log(level, "writing status of %s: %s (retried)", where, reason)
        return failed

    async def _istiod_writes_services(self) -> bool:
        """True while istiod's ambient status Lease (:data:`AMBIENT_STATUS_LOCK`) is held,
        or when that cannot be read (an API error: no Service is written this pass rather
        than racing istiod)."""
        api = self._api()
        if api is None:
            return True
        try:
            return await AMBIENT_STATUS_LOCK.held(api, self.namespace)
        except Exception as e:  # noqa: BLE001 - decided again on the next pass
            log.debug("reading istiod's ambient status lock: %s", e)
            return True

    def _merge(self, key: str, current: Any, want: dict) -> dict:
        if key == "gateways":
            return merged_gateway_status(current, want, _now())
        if key == "services":
            return merged_service_status(current, want, _now())
        return merged_route_status(current, want, _now())

    async def _write(self, key: str, ns: str, name: str, want: dict, obj: dict | None) -> None:
        for _ in range(CONFLICT_ATTEMPTS):
            if obj is None:
                self.writes["gone"] += 1
                return
            current = obj.get("status")
            status = self._merge(key, current, want)
            if status == (current or {}):
                self.writes["unchanged"] += 1
                return
            rv = str(meta(obj).get("resourceVersion") or "")
            # a merge patch leaves absent keys alone: a key we dropped is sent as null
            dropped = {k: None for k in (current or {}) if k not in status}
            body: dict[str, Any] = {"status": {**status, **dropped}}
            if rv:
                body["metadata"] = {"resourceVersion": rv}
            try:
                await self._request("PATCH", self._path(key, ns, name, "/status"), body)
            except KubeError as e:
                if e.not_found:
                    self.writes["gone"] += 1
                    return
                if not e.conflict:
                    raise
                self.writes["conflicts"] += 1
                obj = await self._read(key, ns, name)
                continue
            self.writes["patched"] += 1
            log.info("wrote status of %s %s/%s: %s", WRITTEN[key][0], ns, name, "; ".join(
                wstatus.summary(p["conditions"]) for p in want.get("parents") or [want]))
            return
        log.info("status of %s %s/%s changed under us %d times: left for the next pass",
                 WRITTEN[key][0], ns, name, CONFLICT_ATTEMPTS)

    def _path(self, key: str, ns: str, name: str, sub: str = "") -> str:
        _, prefix, plural = WRITTEN[key]
        return f"{prefix}/namespaces/{ns}/{plural}/{name}{sub}"

    async def _read(self, key: str, ns: str, name: str) -> dict | None:
        try:
            return await self._request("GET", self._path(key, ns, name))
        except KubeError as e:
            if e.not_found:
                return None
            raise

    async def _request(self, method: str, path: str, body: Any = None) -> dict:
        api = self._api()
        if api is None:
            raise RuntimeError("no Kubernetes API client (config source not started)")
        out: dict = await kubecall.call(
            api, method, path, body=body, timeout=REQUEST_TIMEOUT,
            content_type=kubecall.MERGE_PATCH if method == "PATCH" else kubecall.JSON)
        return out

    def debug_state(self) -> dict:
        return {**self.election.debug_state(), "passes": self.passes, **self.writes}


def build(ctx: AgentContext, store: ObjectStore,
          kube_api: Callable[[], Any]) -> StatusWriter | None:
    """The writer in Kubernetes mode with ``waypoint_status_write`` on; else None."""
    cfg = ctx.config
    if cfg.config_source != "kubernetes" or not cfg.waypoint_status_write:
        return None
    return StatusWriter(store, kube_api, cfg.system_namespace, cfg.node_name)
