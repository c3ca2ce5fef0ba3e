"""The Kubernetes config source: list+watch per kind through kubernetes_asyncio's ApiClient.

Per kind one task runs the standard reflector loop (Kubernetes API conventions, "Efficient
detection of changes"; client-go's reflector): LIST (remembering ``metadata.resourceVersion``),
then WATCH from that version with ``allowWatchBookmarks=true`` and a server timeout;
ADDED/MODIFIED become upserts, DELETED deletes, BOOKMARK only advances the version. When a
watch ends normally it is resumed from the last version; ``410 Gone`` (the version is older
than what the API server or etcd still holds: a compaction, an API server restart) triggers a
fresh LIST whose result *replaces* what the store held for that kind, so changes and deletes
missed while away are neither lost nor repeated (unchanged objects produce no store event).
Other errors back off exponentially (0.5 s doubling to 30 s, never less than a 429's
``Retry-After``). A long backoff does not outlast an outage: while a kind waits more than
``PROBE_INTERVAL`` after the API server could not be reached (a connection error, a
timeout, a 5xx), one probe per source asks ``/readyz`` every ``PROBE_INTERVAL`` seconds
(jittered); once the server answers it 200, every such wait ends and the kinds list
again at once, so the source resumes within about
``PROBE_INTERVAL`` x 1.2 + one LIST of the server answering again (:meth:`_sleep_until_up`;
``WAKE_SPACING`` bounds the early retries when the server answers /readyz but not the
kinds). A wait after an answer (401, 403, 429) is not cut short. Every kind fails
alike while the API server is unreachable, so the
failures are logged per reason, not per kind (:class:`RetryLog`): one WARNING per backoff
step naming the kinds, the reason and the next delay, and one INFO when every kind is
listed again. A kind whose API is not served (404: Istio or Gateway API CRDs not
installed) counts as empty and synced, is logged once at WARNING, and is asked for again
every ``MISSING_RETRY`` seconds; when its CRD appears, its objects are listed.

Bounds: a LIST must complete within ``LIST_TIMEOUT``; a watch with no byte for
``watch_timeout + WATCH_IDLE_GRACE`` seconds (the API server sends a bookmark about every
minute and ends the watch at ``timeoutSeconds``) is a dead connection and is reconnected; one
watch event larger than ``MAX_EVENT_BYTES`` ends the watch as malformed.

What the API server sent is counted per kind (:class:`KindStats`: objects and bytes listed,
events and bytes watched, bookmarks, relists), for ``/debug`` and the API-load benchmark.

Every agent watches *all* pods (and every other kind) cluster-wide: the workload xDS it
serves holds the cluster-wide address set; its own node's pods are picked from the same
store (``spec.nodeName``), never with a second, node-filtered watch (docs/ambient.md, "API
load").

Credentials: ``kubeconfig`` when set, else in-cluster (service account token).
``patch_pod_annotations`` patches ``pods/status`` with a JSON merge patch, as istio-cni
does (its RBAC grants ``patch`` on ``pods/status`` only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import Any, Callable

import aiohttp
from kubernetes_asyncio import client as kclient

from agent.core import gcpause, jsondecode, kubecall
from agent.core.backoff import Backoff
from agent.core.kubecall import KubeError
from agent.core.kubeclient import client_configuration
from agent.core.uptime import process_age
from ambient.store import CLUSTER_KINDS, ObjectStore

log = logging.getLogger(__name__)

# kind -> (apiVersion, group, version, plural); group "" = core (/api/v1)
RESOURCES: dict[str, tuple[str, str, str, str]] = {
    "Namespace": ("v1", "", "v1", "namespaces"),
    "Node": ("v1", "", "v1", "nodes"),
    "Pod": ("v1", "", "v1", "pods"),
    "Service": ("v1", "", "v1", "services"),
    "EndpointSlice": ("discovery.k8s.io/v1", "discovery.k8s.io", "v1", "endpointslices"),
    "ServiceEntry": ("networking.istio.io/v1", "networking.istio.io", "v1", "serviceentries"),
    "WorkloadEntry": ("networking.istio.io/v1", "networking.istio.io", "v1", "workloadentries"),
    "AuthorizationPolicy": ("security.istio.io/v1", "security.istio.io", "v1",
                            "authorizationpolicies"),
    "PeerAuthentication": ("security.istio.io/v1", "security.istio.io", "v1",
                           "peerauthentications"),
    "Gateway": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io", "v1", "gateways"),
    "GatewayClass": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io", "v1",
                     "gatewayclasses"),
    # read by the waypoints' Envoy config (docs/waypoint.md)
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io", "v1",
                  "httproutes"),
    # the versions istiod watches (pkg/config/schema/metadata.yaml: v1, aliases v1alpha2)
    "GRPCRoute": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io", "v1",
                  "grpcroutes"),
    "TCPRoute": ("gateway.networking.k8s.io/v1", "gateway.networking.k8s.io", "v1",
                 "tcproutes"),
}
BACKOFF_START, BACKOFF_MAX = 0.5, 30.0
MISSING_RETRY = 30.0        # s between asks for a kind that is not served (404)
LIST_TIMEOUT = 60.0         # s for one LIST, connect to last byte
CONNECT_TIMEOUT = 10.0      # s to connect (TCP + TLS)
WATCH_IDLE_GRACE = 60.0     # s of silence beyond the server's watch timeout = dead stream
MAX_EVENT_BYTES = 16 << 20  # one watch event (etcd refuses objects over 1.5 MiB by default)
MIN_WATCH_SECONDS = 1.0     # a watch that ends sooner is followed by the backoff delay
PROBE_INTERVAL = 1.0        # s between /readyz probes while kinds wait out an outage
PROBE_TIMEOUT = 2.0         # s for one probe, connect to last byte
WAKE_SPACING = 10.0         # s between wakes when no probe saw the server down


@dataclasses.dataclass
class KindStats:
    """What the API server sent for one kind since start (bytes = HTTP body bytes)."""

    lists: int = 0
    listed_objects: int = 0
    listed_bytes: int = 0
    watches: int = 0
    watch_events: int = 0
    watch_reads: int = 0  # reads of watch bodies: watch_events / watch_reads events per read
    watch_bytes: int = 0
    bookmarks: int = 0


class MalformedStream(ValueError):
    """A watch stream line that is not a watch event (bad JSON, missing type/object)."""


class RetryLog:
    """Summarises the reflectors' failures: one WARNING per reason per backoff step.

    :meth:`failed` records that ``kind``'s ``verb`` (list/watch) failed with ``reason``
    and retries in ``delay`` seconds. The first failure of a reason is logged after
    ``gather`` seconds (the other kinds' failures of the same outage arrive meanwhile and
    are named in the same line); later ones of that reason are held until the longest
    delay announced in the last line has passed (+ ``gather``: the retries of that step,
    jittered, all fail by then), then logged as one line with every kind that failed
    meanwhile. So an outage writes one line per backoff step, however many kinds retry.
    :meth:`recovered` writes a held line at once (every failure is logged, also one the
    next attempt already cured), and one INFO when the last failing kind succeeds again.
    ``clock`` is monotonic seconds (default: the running loop's).
    """

    def __init__(self, logger: logging.Logger, gather: float = 0.25,
                 clock: Any = None) -> None:
        self.log = logger
        self.gather = gather
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.failing: dict[str, str] = {}          # kind -> reason of its last failure
        self._pending: dict[str, dict[str, tuple[str, float]]] = {}  # reason -> kind -> (verb, delay)
        self._quiet_until: dict[str, float] = {}   # reason -> no new line before this
        self._scheduled: set[str] = set()
        self.lines = 0                             # WARNING lines written (for tests)
        self.since: float | None = None            # when the current outage began

    def failed(self, kind: str, verb: str, reason: str, delay: float) -> None:
        now = self.clock()
        if self.since is None:
            self.since = now
        self.failing[kind] = reason
        self._pending.setdefault(reason, {})[kind] = (verb, delay)
        if reason in self._scheduled:
            return
        wait = max(self._quiet_until.get(reason, now) - now, 0.0) + self.gather
        self._scheduled.add(reason)
        asyncio.get_running_loop().call_later(wait, self._flush, reason)

    def _flush(self, reason: str) -> None:
        self._scheduled.discard(reason)
        pending = self._pending.pop(reason, {})
        if not pending:
            return
        delays = [d for _, d in pending.values()]
        verbs = sorted({v for v, _ in pending.values()})
        self.log.warning("kubernetes API: %s of %d kind%s failed (%s): %s; retrying in %s",
                         "/".join(verbs), len(pending), "" if len(pending) == 1 else "s",
                         ", ".join(sorted(pending)), reason,
                         f"{min(delays):.1f}s" if max(delays) - min(delays) < 0.05
                         else f"{min(delays):.1f}-{max(delays):.1f}s")
        self.lines += 1
        self._quiet_until[reason] = self.clock() + max(delays)

    def recovered(self, kind: str) -> None:
        reason = self.failing.pop(kind, None)
        if reason is None:
            return
        if kind in self._pending.get(reason, {}):
            self._flush(reason)  # a failure not logged yet is logged before the recovery
        if self.failing:
            return
        took = self.clock() - self.since if self.since is not None else 0.0
        self.log.info("kubernetes API answers again: every kind listed (failures for %.1fs)",
                      took)
        self.since = None
        self._quiet_until.clear()


#: the Pod ``spec`` fields the agent reads (besides the containers' ports): istiod's
#: ``StripPodUnusedFields`` keeps these (``serviceAccount``, the deprecated alias of
#: ``serviceAccountName``, too: SDS attestation falls back to it)
POD_SPEC_KEPT = ("serviceAccountName", "serviceAccount", "nodeName", "hostNetwork",
                 "hostname", "subdomain")
#: the Node ``status`` fields istiod's ``StripNodeUnusedFields`` drops (the agent reads a
#: Node's labels only: locality)
NODE_STATUS_DROPPED = ("allocatable", "capacity", "images", "conditions")
PROXY_OVERRIDES_ANNOTATION = "proxy.istio.io/overrides"


def strip_unused(obj: dict, kind: str = "") -> dict:
    """``obj`` (of ``kind``) without what nothing in the agent reads, in place; returns
    it. As istiod's informers store objects (its default transform
    ``stripUnusedFields``, and ``StripPodUnusedFields`` / ``StripNodeUnusedFields`` for
    Pods and Nodes):

    - every kind: no ``metadata.managedFields`` (one entry per field manager, one
      nested dict per field path: ~60 % of the dicts and lists of a small Pod);
    - Pod: ``spec`` keeps :data:`POD_SPEC_KEPT`, the containers that have ports (their
      ``name`` and ``ports``) and the native-sidecar init containers that have ports
      (``restartPolicy: Always``); ``status`` loses the container statuses; the
      ``proxy.istio.io/overrides`` annotation (a whole container spec) goes;
    - Node: no annotations or ownerReferences, and no ``status`` allocatable, capacity,
      images or conditions.

    Why: every dict and list a stored object holds is walked again and again by the
    cyclic collector while the object lives (issue 28: CPU per change burst) and held
    in memory. A field of the wrong type is left as it is, so the translator still
    rejects the object naming that field."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    if kind == "Pod":
        _strip_pod(obj, meta if isinstance(meta, dict) else {})
    elif kind == "Node":
        if isinstance(meta, dict):
            meta.pop("annotations", None)
            meta.pop("ownerReferences", None)
        status = obj.get("status")
        if isinstance(status, dict):
            for key in NODE_STATUS_DROPPED:
                status.pop(key, None)
    return obj


def _strip_pod(pod: dict, meta: dict) -> None:
    annotations = meta.get("annotations")
    if isinstance(annotations, dict):
        annotations.pop(PROXY_OVERRIDES_ANNOTATION, None)
    spec = pod.get("spec")
    if isinstance(spec, dict):
        kept = {k: spec[k] for k in POD_SPEC_KEPT if k in spec}
        for key, native_only in (("containers", False), ("initContainers", True)):
            value = spec.get(key)
            if not isinstance(value, list):
                if value is not None:
                    kept[key] = value  # the translator names it
                continue
            chosen = []
            for c in value:
                if not isinstance(c, dict) or not c.get("ports"):
                    continue  # the translator reads only containers with ports
                if native_only and c.get("restartPolicy") != "Always":
                    continue
                slim = {"name": c.get("name"), "ports": c["ports"]}
                if native_only:
                    slim["restartPolicy"] = "Always"
                chosen.append(slim)
            kept[key] = chosen
        pod["spec"] = kept
    status = pod.get("status")
    if isinstance(status, dict):
        status.pop("containerStatuses", None)
        status.pop("initContainerStatuses", None)


class KubernetesSource:
    """Fills an :class:`ObjectStore` from the Kubernetes API.

    ``api_client`` may be given (tests); otherwise one is built from ``kubeconfig`` or
    in-cluster credentials at :meth:`start`. ``watch_timeout`` is the server-side watch
    timeout in seconds; ``sync_timeout`` how long :meth:`start` waits for the first LIST of
    every kind.
    """

    def __init__(self, store: ObjectStore, kubeconfig: str = "",
                 api_client: kclient.ApiClient | None = None, kinds: list[str] | None = None,
                 watch_timeout: int = 300, sync_timeout: float = 30.0):
        self.store = store
        self.kubeconfig = kubeconfig
        self.api = api_client
        self._own_client = api_client is None
        self.kinds = kinds or list(RESOURCES)
        self.watch_timeout = watch_timeout
        self.sync_timeout = sync_timeout
        self.synced: dict[str, asyncio.Event] = {k: asyncio.Event() for k in self.kinds}
        self.resource_versions: dict[str, str] = {}
        self.relists: dict[str, int] = {k: 0 for k in self.kinds}
        self.errors: dict[str, str] = {}
        self.missing: set[str] = set()  # kinds whose API answered 404 at the last ask
        self.stats: dict[str, KindStats] = {k: KindStats() for k in self.kinds}
        self.retry_log = RetryLog(log)
        self._tasks: list[asyncio.Task] = []
        # the outage probe (_sleep_until_up): set when the server answers again
        self._back = asyncio.Event()
        self._probe: asyncio.Task | None = None
        self._last_wake = float("-inf")  # loop time of the probe's last wake
        self._waiting = 0                # kinds in a wait the probe may end
        self.probes = 0        # /readyz probes sent
        self.next_retry: dict[str, float] = {}  # kind -> loop time of its next attempt
        # called (on the loop) once the API client exists and every LIST is under way;
        # the agent begins its CA Secret read there (issue 28)
        self.on_connected: list[Callable[[], None]] = []

    # --- lifecycle ---

    async def begin(self) -> None:
        """Build the API client (credentials as in the class docstring; their errors
        raise here) and start every reflector, without waiting for any LIST; then call
        the ``on_connected`` callbacks. Idempotent: once begun, a second call does
        nothing. The agent calls it before it builds its other components, so the LISTs
        (reads only) are under way while the rest of the agent is imported (issue 28)."""
        if self._tasks:
            return
        if self.api is None:
            cfg = await client_configuration(self.kubeconfig)
            self.api = kclient.ApiClient(cfg)
        self._tasks = [asyncio.create_task(self._reflect(kind), name=f"kube-{kind}")
                       for kind in self.kinds]
        for callback in self.on_connected:
            self._call(callback)

    def when_connected(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the API client exists and the LISTs are under way:
        at :meth:`begin`, or at once when it has begun already."""
        self.on_connected.append(callback)
        if self._tasks:
            self._call(callback)

    @staticmethod
    def _call(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:  # a consumer's bug must not stop the source
            log.exception("kubernetes source: on_connected callback failed")

    async def start(self) -> None:
        """:meth:`begin` (if not done yet), then wait (up to ``sync_timeout``) for every
        kind's first LIST."""
        await self.begin()
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.synced.values())),
                                   timeout=self.sync_timeout)
            log.debug("kubernetes source: every kind listed %.3fs after the process started",
                      process_age())
        except asyncio.TimeoutError:
            log.warning("kubernetes source not synced after %.0fs (still retrying): %s",
                        self.sync_timeout, self.unsynced())

    def is_synced(self) -> bool:
        return all(e.is_set() for e in self.synced.values())

    def unsynced(self) -> str:
        """The kinds not listed yet grouped by their last error, ``Pod, Service:
        ClientConnectorError: ...; Node: 403 Forbidden`` (``no answer yet`` for a kind
        whose first LIST is still out); "" when every kind is synced."""
        by_reason: dict[str, list[str]] = {}
        for k, e in self.synced.items():
            if not e.is_set():
                by_reason.setdefault(self.errors.get(k, "no answer yet"), []).append(k)
        return "; ".join(f"{', '.join(kinds)}: {reason}" for reason, kinds in by_reason.items())

    async def stop(self) -> None:
        tasks = self._tasks + ([self._probe] if self._probe is not None else [])
        self._probe = None
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self.api is not None and self._own_client:
            await self.api.close()

    def debug_state(self) -> dict[str, Any]:
        """Per kind: resourceVersion, relists, error, missing, and :class:`KindStats`."""
        return {kind: {"resource_version": self.resource_versions.get(kind, ""),
                       "synced": self.synced[kind].is_set(), "relists": self.relists[kind],
                       "error": self.errors.get(kind, ""), "missing": kind in self.missing,
                       **dataclasses.asdict(self.stats[kind])} for kind in self.kinds}

    # --- API calls ---

    def _path(self, kind: str) -> str:
        _, group, version, plural = RESOURCES[kind]
        return f"/api/{version}/{plural}" if not group else f"/apis/{group}/{version}/{plural}"

    def _client(self, what: str) -> kclient.ApiClient:
        """The ApiClient; RuntimeError naming ``what`` before :meth:`start`."""
        if self.api is None:
            raise RuntimeError(f"cannot {what}: the kubernetes source is not started")
        return self.api

    async def list_objects(self, kind: str) -> tuple[list[dict], str]:
        """One LIST: (objects with kind/apiVersion filled in, resourceVersion)."""
        path = self._path(kind)
        data = await kubecall.read(self._client(f"GET {path}"), "GET", path,
                                   timeout=aiohttp.ClientTimeout(total=LIST_TIMEOUT,
                                                                 sock_connect=CONNECT_TIMEOUT))
        with gcpause.paused():  # a LIST is millions of objects at once (agent/core/gcpause.py)
            body = jsondecode.loads(data)
        if not isinstance(body, dict):
            raise MalformedStream(f"LIST {kind}: body is not an object")
        api_version = RESOURCES[kind][0]
        items = []
        for item in body.get("items") or []:
            if isinstance(item, dict):
                strip_unused(item, kind)
                item.setdefault("kind", kind)
                item.setdefault("apiVersion", api_version)
                items.append(item)
        st = self.stats[kind]
        st.lists += 1
        st.listed_objects += len(items)
        st.listed_bytes += len(data)
        return items, str((body.get("metadata") or {}).get("resourceVersion") or "")

    # --- reflector ---

    async def _reflect(self, kind: str) -> None:
        origin = f"kubernetes:{kind}"
        backoff = Backoff(BACKOFF_START, BACKOFF_MAX, jitter=(1.0, 1.2))
        rv = ""
        while True:
            try:
                if not rv:
                    items, rv = await self.list_objects(kind)
                    self.relists[kind] += 1
                    self.store.replace_origin(origin, [(o, f"list {kind}") for o in items])
                    self.synced[kind].set()
                    if kind in self.missing:
                        self.missing.discard(kind)
                        log.info("%s is served now: listed %d", kind, len(items))
                self.resource_versions[kind] = rv
                self.errors.pop(kind, None)
                self.retry_log.recovered(kind)
                began = asyncio.get_running_loop().time()
                rv = await self._watch_once(kind, origin, rv)
                if asyncio.get_running_loop().time() - began < MIN_WATCH_SECONDS:
                    # a server that ends watches at once must not get a tight request loop
                    await backoff.wait()
                else:
                    backoff.reset()
            except asyncio.CancelledError:
                raise
            except KubeError as e:
                if e.gone:
                    log.info("watch %s: resourceVersion %s is gone (%s); relisting", kind, rv,
                             e.reason)
                    rv = ""
                    continue
                self.errors[kind] = f"{e.status} {e.reason}"
                if e.not_found:
                    # the kind's API is not installed (a CRD missing): empty, not an error
                    # that keeps the agent unready; asked for again, without log noise
                    self.store.replace_origin(origin, [])
                    self.synced[kind].set()
                    if kind not in self.missing:
                        log.warning("%s is not served by the API server (%s %s); treating it "
                                    "as empty, asking again every %.0fs", kind, e.status,
                                    e.reason, MISSING_RETRY)
                    self.missing.add(kind)
                    rv = ""
                    # jittered, so a fleet of agents started together does not ask in step
                    await asyncio.sleep(MISSING_RETRY * random.uniform(0.8, 1.2))
                    continue
                delay = backoff.next()
                if e.too_many_requests:  # the server's Retry-After is a floor, jittered alike
                    delay = max(delay, e.retry_after * backoff.rand(*backoff.jitter))
                self.retry_log.failed(kind, "watch" if rv else "list",
                                      f"{e.status} {e.reason}", delay)
                # 5xx: the server (or a proxy before it) is not serving; the probe may end
                # the wait. An answer (401, 403, 429) is waited out.
                await self._retry_after(kind, delay, wakeable=e.status >= 500)
            except Exception as e:  # connection refused/reset, timeout, malformed stream...
                self.errors[kind] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                delay = backoff.next()
                self.retry_log.failed(kind, "watch" if rv else "list", self.errors[kind],
                                      delay)
                # a malformed stream is an answer (nonsense): waited out like one
                await self._retry_after(kind, delay,
                                        wakeable=not isinstance(e, MalformedStream))

    # --- outage probe ---

    async def _retry_after(self, kind: str, delay: float, wakeable: bool) -> None:
        """Wait ``delay`` s before ``kind``'s next attempt (``next_retry`` says when, in
        loop time); ``wakeable``: the server could not be reached, so the wait ends
        early when it answers again (:meth:`_sleep_until_up`)."""
        self.next_retry[kind] = asyncio.get_running_loop().time() + delay
        try:
            if wakeable:
                await self._sleep_until_up(delay)
            else:
                await asyncio.sleep(delay)
        finally:
            self.next_retry.pop(kind, None)

    async def _sleep_until_up(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or less when the API server is ready again: a delay
        longer than ``PROBE_INTERVAL`` starts the probe (one per source,
        :meth:`_probe_until_up`) if none runs, and ends when it reports the server back."""
        if delay <= PROBE_INTERVAL:
            await asyncio.sleep(delay)
            return
        back = self._back
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_until_up(back), name="kube-probe")
        self._waiting += 1
        try:
            await asyncio.wait_for(back.wait(), delay)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiting -= 1

    async def _probe_until_up(self, back: asyncio.Event) -> None:
        """GET ``/readyz`` every ``PROBE_INTERVAL`` s (x 0.8-1.2) while some kind waits
        in :meth:`_sleep_until_up`, until the API server answers it 200 with the agent's
        credentials; then set ``back`` (every such wait ends; a fresh event replaces it
        for the next outage). Anything else is "not back yet": no connection, a timeout,
        a 5xx (not ready), and also a 401/403: a restarted server answers 403 until its
        RBAC caches are filled, and a kind woken then would get the same 403 and wait
        its whole backoff (``/readyz`` is granted to every authenticated user by the
        default ``system:public-info-viewer`` binding; where it is not, the probe never
        wakes anyone and the backoff runs as without it). After a probe that was not
        answered 200 the wake is at once; when the first probe is answered (the failure
        that started it was a blip, or the server is ready but fails the LISTs) not
        before ``WAKE_SPACING`` s since the last wake, so a server that keeps failing
        the kinds gets no request loop: at most one early retry per kind per
        ``WAKE_SPACING``. Ends, waking nobody, once no kind waits any more."""
        loop = asyncio.get_running_loop()
        seen_down = False
        while True:
            await asyncio.sleep(PROBE_INTERVAL * random.uniform(0.8, 1.2))
            if not self._waiting:
                return  # every wait ran out meanwhile (or the server was never ready)
            self.probes += 1
            try:
                await kubecall.read(self._client("GET /readyz"), "GET", "/readyz",
                                    timeout=aiohttp.ClientTimeout(
                                        total=PROBE_TIMEOUT, sock_connect=PROBE_TIMEOUT))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - refused, reset, timeout, any non-2xx answer
                seen_down = True
                continue
            if seen_down:
                log.info("kubernetes API server is ready again: retrying every kind now")
            else:
                await asyncio.sleep(max(self._last_wake + WAKE_SPACING - loop.time(), 0.0))
            self._last_wake = loop.time()
            self._back = asyncio.Event()
            back.set()
            return

    async def _watch_once(self, kind: str, origin: str, rv: str) -> str:
        """Follow one watch from ``rv`` until the server ends it; returns the last
        resourceVersion seen (events and bookmarks). Raises KubeError (an error answer, or
        an ERROR event: 410 for a version that is gone), MalformedStream, aiohttp/timeout
        errors."""
        query = [("watch", "true"), ("allowWatchBookmarks", "true"), ("resourceVersion", rv),
                 ("timeoutSeconds", self.watch_timeout)]
        path = self._path(kind)
        st = self.stats[kind]
        async with kubecall.stream(self._client(f"GET {path}"), path, query=query,
                                   timeout=aiohttp.ClientTimeout(
                                       sock_connect=CONNECT_TIMEOUT,
                                       sock_read=self.watch_timeout + WATCH_IDLE_GRACE)) as resp:
            st.watches += 1
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                st.watch_bytes += len(chunk)
                st.watch_reads += 1
                buf += chunk
                start = 0
                lines: list[bytes] = []
                while (end := buf.find(b"\n", start)) >= 0:
                    if end - start > MAX_EVENT_BYTES:
                        break
                    line = bytes(buf[start:end])
                    start = end + 1
                    if line.strip():
                        lines.append(line)
                del buf[:start]
                if lines:
                    rv = self._events(kind, origin, lines, rv)
                if len(buf) > MAX_EVENT_BYTES:
                    raise MalformedStream(f"watch {kind}: event larger than {MAX_EVENT_BYTES} "
                                          "bytes")
            if bytes(buf).strip():
                rv = self._events(kind, origin, [bytes(buf)], rv)
        return rv

    def _events(self, kind: str, origin: str, lines: list[bytes], rv: str) -> str:
        """Apply the watch event lines of one read, in order; returns the resourceVersion
        after them. Consecutive ADDED/MODIFIED events go to the store as one transaction
        (the index then recomputes and announces once for them: under a burst of changes
        one read carries several events); a DELETED event, and a malformed line or an
        ERROR event (which raise), first apply the upserts before them."""
        pending: list[tuple[dict, str]] = []
        try:
            for line in lines:
                rv = self._event(kind, origin, line, rv, pending)
        finally:
            if pending:
                self.store.apply(pending, origin=origin)
        return rv

    def _event(self, kind: str, origin: str, line: bytes, rv: str,
               pending: list[tuple[dict, str]]) -> str:
        """Decode one watch event line; an ADDED/MODIFIED object is appended to
        ``pending`` (the caller applies it), anything else is applied now, after
        ``pending``. Returns the resourceVersion after it."""
        try:
            event = jsondecode.loads(line)
        except ValueError as e:
            raise MalformedStream(f"watch {kind}: not JSON ({e})") from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise MalformedStream(f"watch {kind}: not a watch event")
        etype, obj = event["type"], event.get("object")
        if etype == "ERROR":
            raise KubeError.from_status(obj)
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        new_rv = str(meta.get("resourceVersion") or "") if isinstance(meta, dict) else ""
        if etype == "BOOKMARK":
            self.stats[kind].bookmarks += 1
        elif not isinstance(obj, dict) or not isinstance(meta, dict):
            self.store.reject("invalid", f"watch {kind}", f"{etype} event object {obj!r:.200}")
        else:
            self.stats[kind].watch_events += 1
            strip_unused(obj, kind)
            obj.setdefault("kind", kind)
            obj.setdefault("apiVersion", RESOURCES[kind][0])
            if etype in ("ADDED", "MODIFIED"):
                pending.append((obj, f"watch {kind}"))
            elif etype == "DELETED":
                if pending:
                    self.store.apply(pending, origin=origin)
                    pending.clear()
                ns = "" if kind in CLUSTER_KINDS else str(meta.get("namespace") or "")
                self.store.apply(deletes=[(kind, ns, str(meta.get("name")))])
            else:
                self.store.reject("invalid", f"watch {kind}", f"unknown event type {etype!r}")
        if new_rv:
            rv = new_rv
            self.resource_versions[kind] = rv
        return rv

    # --- writes ---

    async def patch_pod_annotations(self, namespace: str, name: str,
                                    annotations: dict[str, str | None]) -> dict:
        """Merge-patch ``metadata.annotations`` of a pod through ``pods/status``.

        A value of None removes the annotation. Returns the patched Pod. Raises
        :class:`agent.core.kubecall.KubeError` (a kubernetes_asyncio ``ApiException``) on
        API errors and RuntimeError before :meth:`start`.
        """
        api = self._client(f"patch pod {namespace}/{name}")
        body = {"metadata": {"annotations": annotations}}
        pod: dict = await kubecall.call(
            api, "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", body=body,
            content_type=kubecall.MERGE_PATCH,
            timeout=aiohttp.ClientTimeout(total=LIST_TIMEOUT, sock_connect=CONNECT_TIMEOUT))
        return pod
