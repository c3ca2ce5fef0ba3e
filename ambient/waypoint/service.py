"""The waypoint configurations the xDS server hands out: built per Gateway from the index
and the store, cached until the next change, and the waypoints' own certificates.

- :meth:`WaypointConfigs.config` returns a :class:`Config` (resources by type URL and name,
  each with its version, a hash of what it is made of) for one Gateway and :class:`~.resources.Options`;
  the cache is dropped by :meth:`WaypointConfigs.invalidate` (the server calls it on
  every index change) and by store events of the kinds the configuration reads that the
  index does not announce (AuthorizationPolicies with ``targetRefs``, Gateway annotations).
- Problems (unsupported fields, a Gateway that does not exist) are logged at WARNING once
  per distinct text, never raised: the configuration is always one Envoy accepts.
- :meth:`WaypointConfigs.secrets` issues the SDS secrets ``default``/``ROOTCA`` for one
  SPIFFE ID from the CA (:class:`CertificateIssuer`, the ``sds`` component in the agent),
  cached and reissued at half their lifetime.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from cryptography import x509
from google.protobuf.message import Message

from ambient.api import AmbientIndex, IndexChange, ObjectStore
from ambient.waypoint.options import XFCC_ANNOTATION, AccessLog, Options

if TYPE_CHECKING:  # loaded by _resources() with the first build
    from ambient.waypoint import resources
    from ambient.waypoint.model import ModelState

log = logging.getLogger(__name__)

WATCHED_KINDS = frozenset({"AuthorizationPolicy", "Gateway", "Service", "ServiceEntry",
                           "HTTPRoute", "GRPCRoute", "TCPRoute"})
ROUTE_KINDS = frozenset({"HTTPRoute", "GRPCRoute", "TCPRoute"})


class CertificateIssuer(Protocol):
    """What the waypoints' SDS uses of the CA (``agent.sds.server.SdsServer`` has it)."""

    def root_pem(self) -> bytes:
        """The mesh root bundle (PEM)."""

    async def certificate_for(self, sans: list[str], algorithm: str = "ECDSA",
                              ttl: float | None = None) -> Any:
        """A fresh bundle with ``chain``, ``key`` and ``root`` PEM for ``sans``."""


def _resources() -> Any:
    """``ambient.waypoint.resources``, imported on first use: its Envoy message types
    (~0.1-0.2 s of imports) wait for the first waypoint, off a cold start's path to
    its first Address push (issue 28)."""
    from ambient.waypoint import resources
    return resources


def version_of(msg: Message) -> str:
    """:func:`ambient.waypoint.resources.version_of`."""
    return _resources().version_of(msg)


@dataclasses.dataclass
class Config:
    """One waypoint's resources: ``resources[type_url][name] = (version, message)``."""

    resources: dict[str, dict[str, tuple[str, Message]]]
    generation: int
    found: bool


@dataclasses.dataclass
class _Issued:
    resources: dict[str, tuple[str, Message]]
    renew_at: float


class WaypointConfigs:
    """Shared by all waypoint streams of one xDS server. ``store`` is the config store
    (read, and subscribed to when it has ``subscribe``); ``issuer`` the CA, or None (no
    secrets are served then, with a warning); ``access_log`` the file access log every
    waypoint gets (meshConfig ``accessLogFile`` and its encoding/format; None: none)."""

    def __init__(self, store: ObjectStore, index: AmbientIndex, *,
                 issuer: CertificateIssuer | None = None, trust_domain: str = "cluster.local",
                 root_namespace: str = "istio-system", clock: Callable[[], float] = time.time,
                 access_log: AccessLog | None = None):
        self.store, self.index, self.issuer = store, index, issuer
        self.access_log = access_log
        self.trust_domain, self.root_namespace = trust_domain, root_namespace
        self.clock = clock
        self.generation = 0
        self._cache: dict[tuple[str, str, str, bool], Config] = {}
        self._warned: dict[str, None] = {}
        self._issued: dict[str, _Issued] = {}
        self._issuing: dict[str, asyncio.Task] = {}
        self._listeners: list[Callable[[], None]] = []
        self._unsubscribe: Callable[[], None] | None = None
        self.builds = 0
        self._parse_cache: resources.ParseCache | None = None  # made with the first build
        self._states: dict[tuple[str, str], ModelState] = {}
        self._assemblers: dict[tuple, resources.Assembler] = {}
        #: per assembler: the service keys changed since it last built (None: all)
        self._pending: dict[tuple, set[str] | None] = {}
        # builds run here, one at a time (the ParseCache is not thread-safe), so a large
        # first build does not hold the event loop (json_format parsing is pure Python)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ change feed
    def start(self) -> None:
        subscribe = getattr(self.store, "subscribe", None)
        if subscribe is not None and self._unsubscribe is None:
            self._unsubscribe = subscribe(self._on_store_events)

    def stop(self) -> None:
        if self._unsubscribe:
            self._unsubscribe()
            self._unsubscribe = None
        for task in self._issuing.values():
            task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after a store change the index does not announce."""
        self._listeners.append(listener)

    def _on_store_events(self, events: list[Any]) -> None:
        watched = [ev for ev in events if getattr(ev, "kind", "") in WATCHED_KINDS]
        if not watched:
            return
        self.generation += 1
        self._cache.clear()
        for ev in watched:
            for state in self._states.values():
                if ev.kind == "AuthorizationPolicy":
                    state.mark_policies()
                elif ev.kind in ROUTE_KINDS:
                    state.mark_routes()
                elif ev.kind == "Service":
                    # port names and appProtocols are read from the object itself
                    state.mark([f"{ev.namespace}/{ev.name}.{ev.namespace}.svc.{state.domain}"])
                    state.mark_routes()
                else:  # a Gateway (annotations, existence), a ServiceEntry (hosts)
                    state.mark_all()
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                log.exception("waypoint change listener failed")

    def invalidate(self, change: IndexChange | None = None) -> None:
        """Drop the cached configurations. ``change`` (the index's) names what changed, so
        the next build re-reads only that; without it everything is re-read."""
        self.generation += 1
        self._cache.clear()
        for state in self._states.values():
            if change is None:
                state.mark_all()
            else:
                state.mark(change.addresses_changed)
                state.mark(change.addresses_removed)

    # ------------------------------------------------------------ resources
    @property
    def parse_cache(self) -> resources.ParseCache:
        """The prototypes' parse cache all of this server's assemblers share."""
        if self._parse_cache is None:
            self._parse_cache = _resources().ParseCache()
        return self._parse_cache

    def config(self, namespace: str, name: str, opts: Options) -> Config:
        """The configuration of Gateway ``namespace/name`` (built here when
        :meth:`prepare_config` did not already)."""
        key = (namespace, name, opts.bind, opts.xfcc)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        model, changed, opts, akey = self._model(namespace, name, opts)
        return self._store(key, model, *self._assembler(akey, opts).update(model, changed))

    async def prepare_config(self, namespace: str, name: str, opts: Options) -> None:
        """Build the configuration off the event loop unless it is cached (the model is
        read on the loop: the store and index change there)."""
        key = (namespace, name, opts.bind, opts.xfcc)
        loop = asyncio.get_running_loop()
        while key not in self._cache:
            generation = self.generation
            model, changed, model_opts, akey = self._model(namespace, name, opts)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="waypoint-config")
            built, problems = await loop.run_in_executor(
                self._pool, self._assembler(akey, model_opts).update, model, changed)
            if generation == self.generation:  # else: changed meanwhile, build again
                self._store(key, model, built, problems)

    def _assembler(self, akey: tuple[str, str, str, bool], opts: Options
                   ) -> resources.Assembler:
        """The assembler of one Gateway and options (bounded: 64, oldest out)."""
        asm = self._assemblers.get(akey)
        if asm is None:
            if len(self._assemblers) >= 64:
                old = next(iter(self._assemblers))
                self._assemblers.pop(old)
                self._pending.pop(old, None)
            asm = self._assemblers[akey] = _resources().Assembler(opts, self.parse_cache)
        return asm

    def _model(self, namespace: str, name: str, opts: Options
               ) -> tuple[Any, set[str] | None, Options, tuple[str, str, str, bool]]:
        """The Gateway's model, the service keys changed since the assembler for these
        options last built (None: build all), the options the model implies, and that
        assembler's key."""
        self.builds += 1
        state = self._states.get((namespace, name))
        if state is None:
            from ambient.waypoint.model import ModelState
            state = self._states[(namespace, name)] = ModelState(
                self.store, self.index, namespace, name, trust_domain=self.trust_domain,
                root_namespace=self.root_namespace)
        model, changed = state.refresh()
        # each assembler of this Gateway has to see every change: keep the union of what
        # changed since each one last built (None: everything)
        if changed is None or changed:
            for other, pending in list(self._pending.items()):
                if other[:2] == (namespace, name):
                    self._pending[other] = None if (pending is None or changed is None) \
                        else pending | changed
        if model.annotations.get(XFCC_ANNOTATION, "").lower() == "true":
            opts = dataclasses.replace(opts, xfcc=True)
        if self.access_log is not None and opts.access_log is None:
            opts = dataclasses.replace(opts, access_log=self.access_log)
        akey = (namespace, name, opts.bind, opts.xfcc)
        if akey not in self._assemblers:
            self._pending[akey] = set()
            return model, None, opts, akey
        pending = self._pending.get(akey)
        self._pending[akey] = set()
        return model, pending, opts, akey

    def _store(self, key: tuple[str, str, str, bool], model: Any,
               built: resources.Versioned, problems: list[str]) -> Config:
        for problem in problems:
            self.warn(f"waypoint {model.namespace}/{model.name}: {problem}")
        config = Config(built, self.generation, model.found)
        self._cache[key] = config
        return config

    def warn(self, text: str) -> None:
        """Log ``text`` at WARNING the first time (bounded memory: 1000 texts)."""
        if text in self._warned:
            return
        if len(self._warned) >= 1000:
            self._warned.pop(next(iter(self._warned)))
        self._warned[text] = None
        log.warning("%s", text)

    # ------------------------------------------------------------ secrets
    def secrets(self, spiffe_id: str) -> dict[str, tuple[str, Message]]:
        """The issued secrets for ``spiffe_id`` ({} until :meth:`ensure_secrets` got them)."""
        issued = self._issued.get(spiffe_id)
        return issued.resources if issued else {}

    def secrets_due(self, spiffe_id: str) -> bool:
        issued = self._issued.get(spiffe_id)
        return issued is None or self.clock() >= issued.renew_at

    async def ensure_secrets(self, spiffe_id: str) -> bool:
        """Issue (or reissue, at half the lifetime) ``spiffe_id``'s certificate. True when
        new secrets were issued. CA failures are logged and leave the old secrets."""
        if self.issuer is None:
            self.warn("waypoint: no CA is configured here: waypoints get no certificates "
                      "(SDS default/ROOTCA stay unanswered)")
            return False
        if not self.secrets_due(spiffe_id):
            return False
        task = self._issuing.get(spiffe_id)
        if task is None:
            task = asyncio.ensure_future(self._issue(spiffe_id))
            self._issuing[spiffe_id] = task
            task.add_done_callback(lambda _t: self._issuing.pop(spiffe_id, None))
        try:
            return await asyncio.shield(task)
        except Exception as e:  # the CA is down or refused: keep serving the old secrets
            self.warn(f"waypoint: cannot issue a certificate for {spiffe_id}: {e}")
            return False

    async def _issue(self, spiffe_id: str) -> bool:
        assert self.issuer is not None
        bundle = await self.issuer.certificate_for([spiffe_id], "ECDSA")
        chain, key = _b(bundle.chain), _b(bundle.key)
        root = self.issuer.root_pem() or _b(bundle.root)
        cert = x509.load_pem_x509_certificate(chain)
        start = cert.not_valid_before_utc.timestamp()
        end = cert.not_valid_after_utc.timestamp()
        made = _resources().secrets(chain, key, root)
        self._issued[spiffe_id] = _Issued({n: (version_of(m), m) for n, m in made.items()},
                                          start + (end - start) / 2)
        log.info("waypoint: issued a certificate for %s (valid until %s)", spiffe_id,
                 cert.not_valid_after_utc.isoformat())
        return True

    def next_renewal(self) -> float | None:
        return min((i.renew_at for i in self._issued.values()), default=None)

    def status_view(self) -> dict:
        """The status istiod would write for the waypoint Gateways and the HTTPRoutes
        attached to Services (:func:`ambient.waypoint.status.statuses`)."""
        from ambient.waypoint import status as waypoint_status
        return waypoint_status.statuses(self.store)

    def debug_state(self) -> dict:
        return {"generation": self.generation, "builds": self.builds,
                "parse_cache": {"hits": self._parse_cache.hits if self._parse_cache else 0,
                                "misses": self._parse_cache.misses if self._parse_cache
                                else 0},
                "cached": sorted("/".join(k[:2]) for k in self._cache),
                "certificates": {k: v.renew_at for k, v in self._issued.items()}}


def _b(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
