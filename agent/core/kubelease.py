"""One writer per cluster: a ``coordination.k8s.io/v1`` Lease election among the agents,
standing aside while istiod holds its own lock for the same work.

The agents run as a DaemonSet, so every node has one; work that must be done once per
cluster (publishing the root ConfigMap, writing Gateway API status) is done by the holder
of a Lease only. The protocol is client-go's ``leaderelection`` with a ``LeaseLock``:

- the Lease ``name`` in ``namespace`` holds ``holderIdentity``, ``leaseDurationSeconds``
  (``lease_seconds``, default 15), ``acquireTime``, ``renewTime`` and ``leaseTransitions``;
- every ``lease_seconds / 3`` seconds each agent reads it: the holder renews it, anyone
  else takes it over only when it is unheld or not renewed for its duration; writes carry
  the read ``resourceVersion``, so two takeovers at once end with one holder (the other
  gets 409 Conflict and stays a follower);
- :meth:`LeaseElection.stop` gives the Lease up (holder cleared) so another agent takes
  over at its next round instead of after the duration.

istiod does the same work with its own elections (``pilot/pkg/leaderelection``): a ConfigMap
lock whose leader record is the annotation ``control-plane.alpha.kubernetes.io/leader``
(JSON ``holderIdentity``/``renewTime``/``leaseDurationSeconds``), or, per revision, a Lease
``<election>-<revision>``. :class:`IstiodLock` reads those; while one is held (renewed within
its duration) no agent leads, so the two never write the same objects at once.

Each round's calls are plain JSON through :mod:`agent.core.kubecall`: building
kubernetes_asyncio's model objects for a Lease (dateutil parsing its times) held the event
loop a few milliseconds per round, every ``lease_seconds / 3`` per election, and an xDS
change arriving meanwhile waited behind it.

API errors while electing count as "not leading" (an agent that cannot reach the API
server must not keep writing on an old belief) and are retried at the next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
from typing import Any, Awaitable, Callable

from kubernetes_asyncio.client.exceptions import ApiException

from agent.core import kubecall

log = logging.getLogger(__name__)

LEADER_ANNOTATION = "control-plane.alpha.kubernetes.io/leader"
LEASE_SECONDS = 15
REQUEST_TIMEOUT = 10.0  # s for one API call of the election
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def micro_time(t: dt.datetime) -> str:
    """``metav1.MicroTime`` text (RFC 3339, microseconds, UTC)."""
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: Any) -> dt.datetime | None:
    """A ``datetime`` (aware, UTC when naive) from a datetime or RFC 3339 text; None when
    empty or unparsable."""
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def _held(holder: Any, renewed: dt.datetime | None, duration: float) -> bool:
    return bool(holder) and renewed is not None and renewed + dt.timedelta(
        seconds=duration) > _now()


def _dict(value: Any) -> dict:
    """``value`` when it is a JSON object, else an empty one (a field the API server left
    out, or a body of another shape: read as "nothing there", never a crash)."""
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float:
    """A JSON number field (``leaseDurationSeconds``, ``leaseTransitions``); 0 when absent
    or not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else 0.0


def _client(api: Callable[[], Any]) -> Any:
    client = api()
    if client is None:
        raise RuntimeError("no Kubernetes API client (config source not started)")
    return client


@dataclasses.dataclass(frozen=True)
class IstiodLock:
    """istiod's lock for one piece of work, in the system namespace.

    ``configmap``: the name of a ConfigMap lock (leader record in an annotation) or "";
    ``lease_prefix``: Leases named exactly that or ``<prefix>-<revision>`` count (istiod's
    per-revision elections), or "". :meth:`held` is True while any of them is held.
    """

    configmap: str = ""
    lease_prefix: str = ""

    def names(self) -> str:
        """For log lines: ``ConfigMap x, Lease y[-*]``."""
        parts = ([f"ConfigMap {self.configmap}"] if self.configmap else []) + (
            [f"Lease {self.lease_prefix}[-<revision>]"] if self.lease_prefix else [])
        return ", ".join(parts)

    async def held(self, api: Any, namespace: str) -> bool:
        """True while istiod holds one of the locks. Not found / forbidden = not held;
        other API errors raise ``ApiException``."""
        if self.configmap and await self._configmap_held(api, namespace):
            return True
        return bool(self.lease_prefix) and await self._lease_held(api, namespace)

    async def _configmap_held(self, api: Any, namespace: str) -> bool:
        try:
            cm = await kubecall.call(
                api, "GET", f"/api/v1/namespaces/{namespace}/configmaps/{self.configmap}",
                timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status in (404, 403):
                return False
            raise
        record = (_dict(_dict(cm).get("metadata")).get("annotations") or {}).get(
            LEADER_ANNOTATION)
        try:
            rec = json.loads(record) if record else {}
        except ValueError:
            return False
        if not isinstance(rec, dict):
            return False
        return _held(rec.get("holderIdentity"), parse_time(rec.get("renewTime")),
                     float(rec.get("leaseDurationSeconds") or 0))

    async def _lease_held(self, api: Any, namespace: str) -> bool:
        try:
            leases = await kubecall.call(api, "GET", LEASES.format(namespace=namespace),
                                         timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status in (404, 403):
                return False
            raise
        for lease in _dict(leases).get("items") or []:
            name = str(_dict(_dict(lease).get("metadata")).get("name") or "")
            if name != self.lease_prefix and not name.startswith(self.lease_prefix + "-"):
                continue
            spec = _dict(lease.get("spec"))
            if _held(spec.get("holderIdentity"), parse_time(spec.get("renewTime")),
                     _number(spec.get("leaseDurationSeconds"))):
                return True
        return False


class LeaseElection:
    """Elects one agent per cluster with the Lease ``namespace/name`` (module docstring).

    ``api`` returns the Kubernetes ``ApiClient`` (None before the config source started:
    an election round then fails and is retried); ``identity`` is this agent's holder
    identity (its node name); ``istiod``: the lock of istiod's that makes every agent
    stand aside, or None; ``on_lead()`` is called when this agent becomes the leader,
    ``on_lose()`` (awaited) when it stops being one (lost, istiod took over, stop);
    ``what`` names the work for log lines. ``leading`` and ``istiod_active`` are the
    state after the last round.
    """

    def __init__(self, api: Callable[[], Any], namespace: str, name: str, identity: str, *,
                 on_lead: Callable[[], None], on_lose: Callable[[], Awaitable[None]],
                 istiod: IstiodLock | None = None, lease_seconds: int = LEASE_SECONDS,
                 what: str = ""):
        self._api = api
        self.namespace, self.name = namespace, name
        self.identity = identity or "ambient-agent"
        self.istiod = istiod
        self.lease_seconds = lease_seconds
        self.what = what or name
        self._on_lead, self._on_lose = on_lead, on_lose
        self.leading = False
        self.istiod_active = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name=f"lease {self.name}")

    async def stop(self) -> None:
        """Stop electing, step down (``on_lose``) and give the Lease up."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        was = self.leading
        if self.leading:
            self.leading = False
            await self._on_lose()
        if was:
            await self._release()

    # --- one round ---

    def _path(self) -> str:
        return f"{LEASES.format(namespace=self.namespace)}/{self.name}"

    def _body(self, spec: dict, resource_version: str | None = None) -> Any:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version:
            meta["resourceVersion"] = resource_version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": spec}

    async def acquire_or_renew(self) -> bool:
        """One election round; True when this agent holds the Lease afterwards. Raises
        ``ApiException`` / RuntimeError when the API cannot be asked."""
        api = _client(self._api)
        now = _now()
        try:
            lease = _dict(await kubecall.call(api, "GET", self._path(),
                                              timeout=REQUEST_TIMEOUT))
        except ApiException as e:
            if e.status != 404:
                raise
            body = self._body({"holderIdentity": self.identity,
                               "leaseDurationSeconds": self.lease_seconds,
                               "acquireTime": micro_time(now), "renewTime": micro_time(now),
                               "leaseTransitions": 0})
            try:
                await kubecall.call(api, "POST", LEASES.format(namespace=self.namespace),
                                    body=body, timeout=REQUEST_TIMEOUT)
            except ApiException as e2:
                if e2.status == 409:
                    return False  # another agent created it first
                raise
            return True
        spec = _dict(lease.get("spec"))
        holder = str(spec.get("holderIdentity") or "")
        renewed = parse_time(spec.get("renewTime"))
        duration = _number(spec.get("leaseDurationSeconds")) or self.lease_seconds
        if holder != self.identity and _held(holder, renewed, duration):
            return False
        mine = holder == self.identity
        acquired = (parse_time(spec.get("acquireTime")) or now) if mine else now
        body = self._body({
            "holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": micro_time(acquired), "renewTime": micro_time(now),
            "leaseTransitions": int(_number(spec.get("leaseTransitions"))) + (0 if mine else 1)},
            _dict(lease.get("metadata")).get("resourceVersion"))
        try:
            await kubecall.call(api, "PUT", self._path(), body=body, timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status == 409:
                return False  # someone else renewed or took it meanwhile
            raise
        return True

    async def _release(self) -> None:
        try:
            api = _client(self._api)
            lease = _dict(await kubecall.call(api, "GET", self._path(),
                                              timeout=REQUEST_TIMEOUT))
            spec = _dict(lease.get("spec"))
            if spec.get("holderIdentity") != self.identity:
                return
            await kubecall.call(api, "PUT", self._path(), body=self._body(
                {"holderIdentity": "", "leaseDurationSeconds": 1,
                 "leaseTransitions": int(_number(spec.get("leaseTransitions")))},
                _dict(lease.get("metadata")).get("resourceVersion")), timeout=REQUEST_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - best effort at stop; the Lease expires anyway
            log.debug("releasing Lease %s/%s: %s", self.namespace, self.name, e)

    async def _round(self) -> bool:
        try:
            istiod = bool(self.istiod) and await self.istiod.held(  # type: ignore[union-attr]
                _client(self._api), self.namespace)
            if istiod != self.istiod_active:
                self.istiod_active = istiod
                if istiod:
                    log.info("istiod holds %s in %s: not doing %s (istiod does)",
                             self.istiod.names(), self.namespace,  # type: ignore[union-attr]
                             self.what)
            return False if istiod else await self.acquire_or_renew()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - API away: stop writing, keep trying
            log.debug("election %s/%s: %s", self.namespace, self.name, e)
            return False

    async def _run(self) -> None:
        period = max(self.lease_seconds / 3, 0.2)
        while True:
            held = await self._round()
            if held and not self.leading:
                self.leading = True
                log.info("leading %s/%s: %s", self.namespace, self.name, self.what)
                self._on_lead()
            elif not held and self.leading:
                self.leading = False
                log.info("lost %s/%s: no longer %s", self.namespace, self.name, self.what)
                await self._on_lose()
            await asyncio.sleep(period)

    def debug_state(self) -> dict:
        return {"leading": self.leading, "istiod_active": self.istiod_active,
                "lease": f"{self.namespace}/{self.name}", "identity": self.identity}
