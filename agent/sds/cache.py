"""The secret cache: one workload certificate per SPIFFE ID, minted via a CSR, rotated early.

Upstream: ``istio/istio:security/pkg/nodeagent/cache/secretcache.go`` (``docs/sds.md``).
What we keep and what we deliberately do differently:

- Double-checked locking per identity so a burst of streams makes one CSR.
- Rotation time = ``expire - clamp(ratio ± jitter) * lifetime`` (:func:`rotate_delay`,
  same formula and test vectors as upstream).
- Rotation is **eager**, not lazy: when the timer fires and someone watches the identity
  we mint the replacement first and only then push it. Upstream clears the cache first,
  so a CA outage at rotation time makes new SDS requests fail although the old
  certificate is still valid; like ztunnel we keep serving the cached
  certificate until it expires and retry with backoff (500 ms x1.5, ±50 %, at most 60 s,
  never past expiry). An expired certificate is never served: at expiry the item is
  dropped and watchers are told, so their next generation fails loudly instead.
- Identities nobody watches any more are dropped at their rotation time, not renewed.
- A CA answer that is not yet valid (NotBefore more than 5 min ahead) or already expired
  is refused with a "clock skew" error naming both times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import random
import time
from typing import Awaitable, Callable

from agent.core.backoff import Backoff
from agent.sds import keys
from agent.sds.ca_istio import CAClient, CAClientError

log = logging.getLogger(__name__)

ROOTCA = "ROOTCA"
DEFAULT = "default"
CLOCK_SKEW_TOLERANCE = 300.0
Notify = Callable[[str | None, str], None]


class CacheError(Exception):
    """A certificate could not be produced; the message says why (never key material)."""


@dataclasses.dataclass
class SecretItem:
    """One workload certificate. Times are epoch seconds; PEMs are bytes."""

    spiffe_id: str
    chain: bytes
    key: bytes
    root: bytes
    created: float
    expire: float
    serial: int

    def valid(self, now: float) -> bool:
        return now < self.expire


def rotate_delay(created: float, expire: float, ratio: float, jitter: float, now: float,
                 rand: Callable[[], float] = random.random) -> float:
    """Seconds from ``now`` until rotation (upstream ``rotateTime``), never negative.

    ``jitter`` is a ratio amplitude (upstream ``SECRET_GRACE_PERIOD_RATIO_JITTER``, 0.01):
    the grace ratio becomes ``clamp(ratio ± U[0,1)*jitter, 0, 1)``.
    """
    j = rand() * jitter * (1 if rand() < 0.5 else -1)
    grace = min(max(ratio + j, 0.0), 1.0)
    lifetime = expire - created
    return max(expire - grace * lifetime - now, 0.0)


class SecretCache:
    """Workload certificates by SPIFFE ID.

    ``ca`` signs CSRs; ``run_blocking`` runs key generation off the loop; ``algorithm``
    is ``"RSA"`` or ``"ECDSA"``; ``ttl`` seconds requested; ``grace_ratio`` as
    ``SECRET_GRACE_PERIOD_RATIO``. Subscribe to changes with :meth:`subscribe`: the
    callback gets ``(spiffe_id, resource_name)``; ``spiffe_id`` None means every identity
    (a root change).
    """

    def __init__(self, ca: CAClient, run_blocking: Callable[..., Awaitable],
                 algorithm: str = "RSA", ttl: float = 86400.0, grace_ratio: float = 0.5,
                 jitter: float = 0.01, clock: Callable[[], float] = time.time,
                 max_retry_interval: float = 60.0):
        if not 0.0 <= grace_ratio <= 1.0:
            raise ValueError(f"secret_grace_ratio={grace_ratio!r}: must be between 0 and 1")
        self.ca = ca
        self._run = run_blocking
        self.algorithm = algorithm
        self.ttl = ttl
        self.grace_ratio = grace_ratio
        self.jitter = jitter
        self.clock = clock
        self.max_retry_interval = max_retry_interval
        self.items: dict[str, SecretItem] = {}
        self.watchers: dict[str, int] = {}
        self.last_root: bytes = b""
        self.extra_trust: bytes = b""
        self.csr_count = 0
        self.csr_failures = 0  # CSRs the CA did not answer with a usable certificate
        self.failures: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._timers: dict[str, asyncio.Task] = {}
        self._subscribers: list[Notify] = []
        self._closed = False

    # --- subscribers and watch counts -------------------------------------------------
    def subscribe(self, callback: Notify) -> Callable[[], None]:
        """Call ``callback(spiffe_id | None, resource_name)`` on every change."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def _notify(self, spiffe_id: str | None, name: str) -> None:
        for cb in list(self._subscribers):
            try:
                cb(spiffe_id, name)
            except Exception:  # noqa: BLE001 - one bad subscriber must not stop rotation
                log.exception("secret update subscriber failed")

    def watch(self, spiffe_id: str) -> None:
        """A stream started watching ``spiffe_id``'s workload certificate."""
        self.watchers[spiffe_id] = self.watchers.get(spiffe_id, 0) + 1

    def unwatch(self, spiffe_id: str) -> None:
        n = self.watchers.get(spiffe_id, 0) - 1
        if n > 0:
            self.watchers[spiffe_id] = n
        else:
            self.watchers.pop(spiffe_id, None)

    # --- generation ------------------------------------------------------------------
    async def workload(self, spiffe_id: str) -> SecretItem:
        """The valid cached certificate for ``spiffe_id`` or a freshly minted one.

        Raises :class:`CacheError` "failed to generate workload certificate: ..." when the
        CA fails and nothing valid is cached.
        """
        item = self.items.get(spiffe_id)
        if item and item.valid(self.clock()):
            return item
        lock = self._locks.setdefault(spiffe_id, asyncio.Lock())
        async with lock:
            item = self.items.get(spiffe_id)  # another stream may have minted meanwhile
            if item and item.valid(self.clock()):
                return item
            try:
                item = await self._mint(spiffe_id)
            except (CAClientError, CacheError, ValueError) as e:
                self.failures[spiffe_id] = str(e)
                raise CacheError(f"failed to generate workload certificate: {e}") from None
            self._install(item)
            return item

    async def root_bundle(self, spiffe_id: str) -> bytes:
        """The trust bundle (``ROOTCA``): the CA's root merged with extra anchors.

        Mints ``spiffe_id``'s certificate first when no root is known yet, as upstream does.
        """
        if not self.last_root:
            await self.workload(spiffe_id)
        return keys.merge_trust(self.last_root, self.extra_trust)

    def set_extra_trust(self, bundle: bytes) -> None:
        """Extra trust anchors (upstream ``UpdateConfigTrustBundle``): push ROOTCA when the
        set of certificates changed. Compared after :func:`keys.merge_trust`, so the same
        certificates reordered, repeated or re-wrapped push nothing (upstream compares raw
        bytes: its input is re-serialised by istiod, ours is a file an operator edits)."""
        if keys.merge_trust(bundle) != keys.merge_trust(self.extra_trust):
            self.extra_trust = bundle
            self._notify(None, ROOTCA)

    def renew_all(self) -> int:
        """Renew every watched certificate now, the eager way (mint first, keep serving
        the old one on CA failure), e.g. after the CA's root file changed. The renewed
        certificates are pushed; ROOTCA too when the CA answers with another root.
        Returns how many renewals were started."""
        started = 0
        for sid, item in list(self.items.items()):
            if not self.watchers.get(sid) or self._closed:
                continue
            old = self._timers.pop(sid, None)
            if old is not None and old is not asyncio.current_task():
                old.cancel()
            self._timers[sid] = asyncio.get_running_loop().create_task(
                self._rotate(item, 0.0), name=f"renew {sid}")
            started += 1
        return started

    async def _mint(self, spiffe_id: str) -> SecretItem:
        """Key + CSR + signature by the CA client (:meth:`agent.sds.ca_istio.CAClient.issue`:
        each client does them where they are cheapest), then the validity checks."""
        sent = self.csr_count

        def on_csr() -> None:
            self.csr_count += 1
        try:
            key_pem, chain, validity = await self.ca.issue(spiffe_id, self.algorithm,
                                                           int(self.ttl), self._run, on_csr)
            return self._item(spiffe_id, key_pem, chain, validity)
        except Exception:
            if self.csr_count != sent:  # the CSR went out and no certificate came of it
                self.csr_failures += 1
            raise

    def _item(self, spiffe_id: str, key_pem: bytes, chain: list[str],
              validity: keys.Validity) -> SecretItem:
        now = self.clock()
        not_before, not_after, serial = validity
        if not_before.timestamp() > now + CLOCK_SKEW_TOLERANCE:
            raise CacheError(f"clock skew: certificate from the CA is not valid before "
                             f"{not_before.isoformat()} but local time is "
                             f"{dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat()}")
        if not_after.timestamp() <= now:
            raise CacheError(f"clock skew: certificate from the CA expired at "
                             f"{not_after.isoformat()}, local time is "
                             f"{dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat()}")
        return SecretItem(spiffe_id=spiffe_id, chain=keys.concat_certs(chain).encode(),
                          key=key_pem, root=chain[-1].encode(), created=now,
                          expire=not_after.timestamp(), serial=serial)

    def _install(self, item: SecretItem) -> None:
        """Cache ``item``, schedule its rotation and announce a root change."""
        self.items[item.spiffe_id] = item
        self.failures.pop(item.spiffe_id, None)
        self._schedule(item)
        if item.root != self.last_root:
            first = not self.last_root
            self.last_root = item.root
            if not first:
                log.info("CA root changed; pushing ROOTCA")
            self._notify(None, ROOTCA)

    def _schedule(self, item: SecretItem) -> None:
        old = self._timers.pop(item.spiffe_id, None)
        if old and old is not asyncio.current_task():
            old.cancel()
        if self._closed:
            return
        delay = rotate_delay(item.created, item.expire, self.grace_ratio, self.jitter, self.clock())
        self._timers[item.spiffe_id] = asyncio.get_running_loop().create_task(
            self._rotate(item, delay), name=f"rotate {item.spiffe_id}")

    async def _rotate(self, item: SecretItem, delay: float) -> None:
        """Renew ``item`` after ``delay``; on CA failure keep it until expiry, retrying."""
        await asyncio.sleep(delay)
        sid = item.spiffe_id
        cap = self.max_retry_interval
        backoff = Backoff(min(0.5, cap), cap, factor=1.5, jitter=(0.5, 1.5))
        while self.items.get(sid) is item:
            if not self.watchers.get(sid):
                log.debug("dropping unwatched certificate for %s", sid)
                self.items.pop(sid, None)
                self._timers.pop(sid, None)
                return
            try:
                async with self._locks.setdefault(sid, asyncio.Lock()):
                    new = await self._mint(sid)
            except Exception as e:  # noqa: BLE001 - an unexpected error must not end rotation
                self.failures[sid] = str(e)
                left = item.expire - self.clock()
                if left <= 0:
                    log.warning("certificate for %s expired while the CA is failing (%s)", sid, e)
                    self.items.pop(sid, None)
                    self._timers.pop(sid, None)
                    self._notify(sid, DEFAULT)
                    return
                wait = min(backoff.next(), self.max_retry_interval, left)
                log.warning("renewing certificate for %s failed, serving the cached one "
                            "(expires in %.0fs), retry in %.1fs: %s", sid, left, wait, e)
                await asyncio.sleep(wait)
                continue
            log.info("rotated certificate for %s: serial %x", sid, new.serial)
            self._install(new)
            self._notify(sid, DEFAULT)
            return

    async def close(self) -> None:
        """Cancel rotation timers (the cached items stay readable)."""
        self._closed = True
        timers, self._timers = list(self._timers.values()), {}
        for t in timers:
            t.cancel()
        await asyncio.gather(*timers, return_exceptions=True)

    def debug_state(self) -> dict:
        """Each cached certificate: SPIFFE ID, serial (hex), expiry (RFC 3339), watchers."""
        return {
            "csr_count": self.csr_count,
            "certificates": [
                {"spiffe_id": i.spiffe_id, "serial": format(i.serial, "x"),
                 "expires": dt.datetime.fromtimestamp(i.expire, dt.timezone.utc).isoformat(),
                 "watchers": self.watchers.get(i.spiffe_id, 0)}
                for i in self.items.values()],
            "failures": dict(self.failures),
        }
