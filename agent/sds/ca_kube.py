"""One trust root per cluster: the embedded CA's signing material from a Kubernetes Secret.

With ``config_source: kubernetes`` (and ``ca_kubernetes_secret``, the default) every node's
agent signs with the same key, read from a Secret in ``system_namespace`` in the formats
istiod uses (upstream ``security/pkg/pki/ca/ca.go``, ``pilot/pkg/bootstrap/istio_ca.go``):

- ``cacerts`` (the plug-in CA): ``ca-cert.pem`` (signing certificate), ``ca-key.pem``,
  ``root-cert.pem`` (the root bundle, possibly several roots) and ``cert-chain.pem`` (the
  chain sent after the leaf), or the ``kubernetes.io/tls`` form ``tls.crt``/``tls.key``/
  ``ca.crt``. A ``cacerts`` holding some of those keys but not the signing certificate, key
  and root is refused, as istiod refuses an incomplete bundle. It wins when present.
- else ``istio-ca-secret`` (istiod's self-signed CA, type ``istio.io/ca-root``):
  ``ca-cert.pem`` and ``ca-key.pem``; istiod also writes ``root-cert.pem`` (the same
  certificate) and empty ``cert-chain.pem``/``key.pem``. The root bundle is
  ``root-cert.pem`` when non-empty, else ``ca-cert.pem``.
- neither: the agents bootstrap ``istio-ca-secret`` race-free, as istiod does: generate a
  self-signed root (:func:`agent.sds.ca_embedded.create_root`), *create* the Secret (never
  update); on ``409 AlreadyExists`` read the winner's. Two agents starting at the same
  instant end with one root.

Checks (:func:`agent.sds.ca_embedded.check_signing_material`): the key matches the
certificate, the certificate is a CA, it chains to the root bundle, and everything on the
way is valid now. Material that fails them is never used: before any material was loaded
the CA refuses to sign (INTERNAL ``CA is not ready: Secret <ns>/<name> key <key>: <why>``)
and the ``sds`` component is not ready with that text; there is no fallback to a root of
the agent's own. Refused material that arrives while good material is in use is logged
(once per distinct error) and the loaded key is kept (istiod keeps its bundle when a
reload fails). The Secret deleted while running: the loaded key is kept, one warning.

Rotation (a Secret whose root bundle gains a root the agent did not trust): the trust
bundle becomes old + new roots at once (published to ``mesh_root_file``, SDS ``ROOTCA``,
the ``istio-ca-root-cert`` ConfigMaps, every CA response), signing stays on the old key for
``ca_root_overlap``, then switches to the new key; the old roots stay in the bundle until
the last certificate signed with the old key has expired. An intermediate or key change
under roots already trusted is used at once. A certificate the CA service signed before the new root
and due for renewal (at half its span, as ztunnel renews) only after the switch gets one
warning naming ``ca_root_overlap``: its holder trusts the old roots alone until then.

Watching: one watch per Secret name (``fieldSelector=metadata.name=<name>``, which RBAC
``resourceNames`` allows for list/watch), each event re-reads both Secrets; plus a full
re-read every :data:`RESYNC` seconds.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import hashlib
import logging
import time
from typing import Any, Awaitable, Callable

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from kubernetes_asyncio import client as kclient
from kubernetes_asyncio.client.exceptions import ApiException

from agent.core import kubewatch
from agent.core.backoff import Backoff
from agent.sds import keys
from agent.sds.ca_embedded import CAKey, EmbeddedCA, MaterialError, check_signing_material, create_root

log = logging.getLogger(__name__)

CACERTS = "cacerts"
ISTIO_CA_SECRET = "istio-ca-secret"
CA_CERT, CA_KEY, ROOT_CERT, CERT_CHAIN = "ca-cert.pem", "ca-key.pem", "root-cert.pem", "cert-chain.pem"
TLS_CERT, TLS_KEY, TLS_CA = "tls.crt", "tls.key", "ca.crt"
ISTIO_GENERATED = "istio-generated"  # a cacerts written by istiod for its self-signed CA
SECRET_TYPE = "istio.io/ca-root"
RESYNC = 60.0
REQUEST_TIMEOUT = 10.0


class CASecretError(Exception):
    """A CA Secret that must not sign. ``secret`` is ``<ns>/<name>``, ``key`` the data key
    at fault; ``str()`` is ``Secret <ns>/<name> key <key>: <reason>``."""

    def __init__(self, secret: str, key: str, reason: str):
        super().__init__(f"Secret {secret} key {key}: {reason}")
        self.secret, self.key, self.reason = secret, key, reason


@dataclasses.dataclass(frozen=True)
class Material:
    """Checked signing material from one Secret. ``roots`` is the canonical root bundle
    (:func:`agent.sds.keys.merge_trust`), ``chain`` the PEM sent between leaf and roots,
    ``digest`` identifies the content (a re-written identical Secret is no change)."""

    secret: str
    cert: x509.Certificate
    key: CAKey
    chain: bytes
    roots: bytes
    digest: str

    def root_ders(self) -> set[bytes]:
        return {c.public_bytes(serialization.Encoding.DER) for c in keys.load_certs(self.roots)}


def _decoded(data: dict[str, str] | None) -> dict[str, bytes]:
    out = {}
    for k, v in (data or {}).items():
        try:
            out[k] = base64.b64decode(v or "")
        except ValueError:
            out[k] = b"\0invalid base64"
    return out


def material_from_secret(namespace: str, name: str, data: dict[str, bytes],
                         now: dt.datetime) -> Material:
    """Parse and check one Secret's decoded ``data`` (key -> bytes). Raises
    :class:`CASecretError` naming the Secret and the key. Blocking (parsing, signature
    checks)."""
    where = f"{namespace}/{name}"
    if name == CACERTS and data.get(TLS_CERT):
        cert_key, key_key, root_key, chain_key = TLS_CERT, TLS_KEY, TLS_CA, TLS_CA
    else:
        cert_key, key_key, root_key, chain_key = CA_CERT, CA_KEY, ROOT_CERT, CERT_CHAIN
    required = [cert_key, key_key] + ([root_key] if name == CACERTS else [])
    for k in required:
        if not data.get(k, b"").strip():
            raise CASecretError(where, k, "missing or empty (required: " + ", ".join(required) + ")")
    try:
        signing = keys.load_certs(data[cert_key], cert_key)
    except ValueError as e:
        raise CASecretError(where, cert_key, f"not a PEM certificate ({e})") from None
    cert = signing[0]
    try:
        key = keys.load_private_key(data[key_key])
    except keys.InconsistentKey as e:
        raise CASecretError(where, key_key, str(e)) from None
    except (ValueError, TypeError) as e:  # never the bytes: a private key
        raise CASecretError(where, key_key, f"not a PEM private key ({type(e).__name__})") from None
    if not isinstance(key, (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey)):
        raise CASecretError(where, key_key, f"an RSA or ECDSA key is required, not "
                                            f"{type(key).__name__}")
    root_bytes = data.get(root_key, b"")
    if not root_bytes.strip():
        root_bytes = data[cert_key]  # istio-ca-secret: the CA is its own root
        root_key = cert_key
    try:
        roots = keys.load_certs(root_bytes, root_key)
    except ValueError as e:
        raise CASecretError(where, root_key, f"not PEM certificates ({e})") from None
    chain_bytes = data.get(chain_key, b"") if chain_key != root_key else b""
    try:
        chain_certs = keys.load_certs(chain_bytes, chain_key) if chain_bytes.strip() else []
    except ValueError as e:
        raise CASecretError(where, chain_key, f"not PEM certificates ({e})") from None
    try:
        check_signing_material(cert, key, signing[1:] + chain_certs, roots, now,
                               (cert_key, key_key, chain_key, root_key))
    except MaterialError as e:
        raise CASecretError(where, e.part, e.reason) from None
    der = cert.public_bytes(serialization.Encoding.DER)
    root_ders = {r.public_bytes(serialization.Encoding.DER) for r in roots}
    if chain_certs or len(signing) > 1:
        chain = data[cert_key] if not chain_bytes.strip() else chain_bytes
    elif der not in root_ders:
        chain = data[cert_key]  # an intermediate signer with no cert-chain.pem: send it
    else:
        chain = b""
    digest = hashlib.sha256(b"\0".join([data[cert_key], data[key_key], root_bytes,
                                        chain_bytes])).hexdigest()
    return Material(where, cert, key, chain, keys.merge_trust(root_bytes), digest)


def self_signed_secret(namespace: str, trust_domain: str) -> dict[str, Any]:
    """A new ``istio-ca-secret`` as istiod's ``BuildSecret`` writes it: ``ca-cert.pem`` =
    ``root-cert.pem`` = the new root, ``ca-key.pem`` its key, ``cert-chain.pem`` and
    ``key.pem`` empty, type ``istio.io/ca-root``. Blocking (RSA key generation)."""
    cert, key = create_root(trust_domain)
    pem = cert.public_bytes(serialization.Encoding.PEM)

    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()

    return {"apiVersion": "v1", "kind": "Secret", "type": SECRET_TYPE,
            "metadata": {"name": ISTIO_CA_SECRET, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "ambient-agent"}},
            "data": {CA_CERT: b64(pem), CA_KEY: b64(keys.key_pem(key)), ROOT_CERT: b64(pem),
                     CERT_CHAIN: "", "key.pem": ""}}


class KubeCASecret:
    """Loads the cluster's CA Secret into ``ca`` and follows it (module docstring).

    ``api`` returns the config source's ``ApiClient`` (None until it has one);
    ``on_roots_changed()`` is called (on the loop) whenever ``ca.root_pem`` changed;
    ``clock`` is epoch seconds; ``run_blocking`` runs parsing and key generation.
    """

    def __init__(self, api: Callable[[], Any], namespace: str, trust_domain: str,
                 ca: EmbeddedCA, run_blocking: Callable[..., Awaitable[Any]],
                 on_roots_changed: Callable[[], None], overlap: float,
                 clock: Callable[[], float] = time.time, resync: float = RESYNC):
        self._api = api
        self.namespace = namespace
        self.trust_domain = trust_domain
        self.ca = ca
        self._run = run_blocking
        self._on_roots_changed = on_roots_changed
        self.overlap = overlap
        self.clock = clock
        self.resync = resync
        self.loaded: Material | None = None  # what signs now
        self.pending: Material | None = None  # a rotation's next material, in its overlap
        self.switch_at = 0.0  # when pending starts signing
        self.retired: list[tuple[bytes, float]] = []  # (old roots, drop after epoch s)
        self.error = ""  # why the current Secret content is refused ("" when it is not)
        self.source = ""  # the Secret the loaded material came from
        self.bootstrapped = False  # this agent created istio-ca-secret
        self._deleted_warned = False
        self._logged: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.loads = 0

    # --- lifecycle ---

    async def start(self, first_timeout: float = 30.0) -> None:
        """Read (or bootstrap) the Secret once, within ``first_timeout`` seconds, then
        follow it in the background. Never raises for a bad or unreadable Secret: the CA
        stays refusing and :attr:`error` says why."""
        await self.first_read(first_timeout)
        self.follow()

    async def first_read(self, first_timeout: float = 30.0) -> None:
        """The read (or bootstrap) of :meth:`start`, bounded by ``first_timeout`` seconds,
        without the background following; the agent begins it while the config source
        still lists (issue 28: it used to run after the first index build). Never raises
        for a bad or unreadable Secret (as :meth:`start`)."""
        try:
            await asyncio.wait_for(self.sync(), first_timeout)
        except asyncio.TimeoutError:
            self._refuse_start(f"Secret {self.namespace}/{CACERTS} or {ISTIO_CA_SECRET}: not "
                               f"read within {first_timeout:g}s (API server unreachable?)")

    def follow(self) -> None:
        """Follow the Secrets in the background (resync loop and watches) after
        :meth:`first_read`; :meth:`stop` ends it."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop(), name="ca-secret-sync"),
                       *(loop.create_task(self._watch(n), name=f"ca-secret-watch-{n}")
                         for n in (CACERTS, ISTIO_CA_SECRET))]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def ready(self) -> tuple[bool, str]:
        if self.loaded is None:
            return False, self.error or "CA Secret not loaded yet"
        return True, ""

    # --- reading ---

    def _core(self) -> kclient.CoreV1Api:
        api = self._api()
        if api is None:
            raise RuntimeError("no Kubernetes API client (config source not started)")
        return kclient.CoreV1Api(api)

    async def _get(self, name: str) -> dict | None:
        try:
            secret = await self._core().read_namespaced_secret(
                name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return {"data": secret.data or {}, "rv": secret.metadata.resource_version}

    async def sync(self) -> None:
        """Read the Secrets once and act (load, rotate, keep, bootstrap). API errors are
        logged and leave everything as it is (retried by the loop)."""
        try:
            await self._sync()
        except (ApiException, OSError, RuntimeError, asyncio.TimeoutError) as e:
            why = (f"reading Secret {self.namespace}/{CACERTS}|{ISTIO_CA_SECRET}: "
                   f"{getattr(e, 'status', '') or ''} {getattr(e, 'reason', '') or e}".strip())
            if self.loaded is None:
                self._refuse_start(why)
            else:
                self._log_once(logging.WARNING, why)

    async def _sync(self) -> None:
        self._advance()
        prefetched: asyncio.Task | None = None
        if self.loaded is None:
            # the first read is on the cold start's path: both GETs at once (one round
            # trip, not two, on a slow API server); later resyncs ask for the second
            # Secret only when cacerts is not the one used (half the API load)
            prefetched = asyncio.ensure_future(self._get(ISTIO_CA_SECRET))
        try:
            cacerts = await self._get(CACERTS)
        except BaseException:
            if prefetched is not None:
                prefetched.cancel()
                await asyncio.gather(prefetched, return_exceptions=True)
            raise
        use_cacerts = cacerts is not None and ISTIO_GENERATED not in cacerts["data"]
        chosen, name = (cacerts, CACERTS) if use_cacerts else (None, "")
        if chosen is not None and prefetched is not None:
            await asyncio.gather(prefetched, return_exceptions=True)  # not needed
        if chosen is None:
            secret = await (prefetched if prefetched is not None
                            else self._get(ISTIO_CA_SECRET))
            if secret is not None:
                chosen, name = secret, ISTIO_CA_SECRET
            elif cacerts is not None:  # istiod's USE_CACERTS_FOR_SELF_SIGNED_CA form
                chosen, name = cacerts, CACERTS
        if chosen is None:
            if self.loaded is not None:
                if not self._deleted_warned:
                    self._deleted_warned = True
                    log.warning("CA Secret %s was deleted: keeping the loaded signing key and "
                                "root (nothing is re-created while it is loaded)", self.source)
                return
            chosen, name = await self._bootstrap(), ISTIO_CA_SECRET
        self._deleted_warned = False
        now = dt.datetime.fromtimestamp(self.clock(), dt.timezone.utc)
        try:
            material = await self._run(material_from_secret, self.namespace, name,
                                       _decoded(chosen["data"]), now)
        except CASecretError as e:
            if self.loaded is None:
                self._refuse_start(str(e))
            else:
                self.error = str(e)
                self._log_once(logging.ERROR, f"{e}; refused, keeping the loaded CA from "
                                              f"{self.source}")
            return
        self.error = ""
        self._accept(material)

    async def _bootstrap(self) -> dict:
        """Create ``istio-ca-secret``; on 409 read the winner's. Returns its ``{data, rv}``."""
        body = await self._run(self_signed_secret, self.namespace, self.trust_domain)
        try:
            created = await self._core().create_namespaced_secret(
                self.namespace, body, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as e:
            if e.status != 409:
                raise
            log.info("CA Secret %s/%s was created by another agent first: using it",
                     self.namespace, ISTIO_CA_SECRET)
            winner = await self._get(ISTIO_CA_SECRET)
            if winner is None:
                raise RuntimeError(f"Secret {self.namespace}/{ISTIO_CA_SECRET}: AlreadyExists "
                                   "on create, then not found") from None
            return winner
        self.bootstrapped = True
        log.info("created CA Secret %s/%s with a new self-signed mesh root (no cacerts or "
                 "istio-ca-secret existed)", self.namespace, ISTIO_CA_SECRET)
        return {"data": created.data or {}, "rv": created.metadata.resource_version}

    # --- acting ---

    def _refuse_start(self, why: str) -> None:
        self.error = why
        self.ca.refusal = why
        self._log_once(logging.ERROR, f"embedded CA refuses to sign: {why}")

    def _log_once(self, level: int, text: str) -> None:
        if text not in self._logged:
            self._logged.add(text)
            log.log(level, "%s", text)

    def _accept(self, m: Material) -> None:
        cur = self.pending or self.loaded
        if cur is not None and cur.digest == m.digest:
            return
        self.loads += 1
        if self.loaded is None:
            self.loaded, self.source = m, m.secret
            self.ca.install(m.cert, m.key, m.roots, m.chain)
            log.info("embedded CA signs with Secret %s (serial %x, root bundle of %d)",
                     m.secret, m.cert.serial_number, len(m.root_ders()))
            self._on_roots_changed()
            return
        old = self.loaded
        self.source = m.secret
        if m.root_ders() <= self._trusted_ders():
            # Roots already trusted everywhere (an intermediate or key change, or roots
            # dropped on purpose): sign with it now.
            self.pending = None
            self._install_now(m, keys.merge_trust(m.roots, *self._retired_roots()))
            log.info("CA Secret %s changed under trusted roots: signing with serial %x now",
                     m.secret, m.cert.serial_number)
            return
        # A new root: trust old + new first, switch signing after the overlap.
        self.pending = m
        self.switch_at = self.clock() + self.overlap
        bundle = keys.merge_trust(old.roots, m.roots, *self._retired_roots())
        self.ca.set_roots(bundle)
        log.info("CA Secret %s has a new root: the trust bundle carries the old and new roots "
                 "now, signing switches to serial %x in %.0fs", m.secret, m.cert.serial_number,
                 self.overlap)
        self._warn_short_overlap(old)
        self._on_roots_changed()
        self._wake.set()

    def _warn_short_overlap(self, old: Material) -> None:
        """Warn when a certificate the CA service signed before the new root is renewed (at
        half its span, as ztunnel renews) only after signing switches: its holder trusts the
        old roots alone until then and refuses every certificate of the new key. The switch is
        not delayed: the other nodes' agents switch on their own clocks, and what their
        peers hold is not known here, so only a long enough ``ca_root_overlap`` is safe."""
        ski = x509.SubjectKeyIdentifier.from_public_key(old.key.public_key()).digest
        renew_by = self.ca.max_peer_renew_by.get(ski, 0.0)
        if renew_by > self.switch_at:
            log.warning("root rotation: ca_root_overlap %.0fs is too short: a certificate "
                        "signed before the new root is renewed only at %s, %.0fs after "
                        "signing switches; until then its holder trusts the old root only "
                        "and refuses certificates of the new key. Keep ca_root_overlap above "
                        "half of the longest certificate lifetime (ztunnel's SECRET_TTL/2)",
                        self.overlap, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(renew_by)),
                        renew_by - self.switch_at)

    def _trusted_ders(self) -> set[bytes]:
        return {c.public_bytes(serialization.Encoding.DER)
                for c in keys.load_certs(self.ca.root_pem)} if self.ca.root_pem else set()

    def _retired_roots(self) -> list[bytes]:
        return [r for r, _ in self.retired]

    def _install_now(self, m: Material, bundle: bytes) -> None:
        before = self.ca.root_pem
        self.loaded = m
        self.ca.install(m.cert, m.key, bundle, m.chain)
        if self.ca.root_pem != before:
            self._on_roots_changed()

    def _advance(self) -> None:
        """Time-driven steps: the switch at the end of an overlap, and dropping old roots
        once nothing they signed is still valid."""
        now = self.clock()
        if self.pending is not None and now >= self.switch_at and self.loaded is not None:
            old, new = self.loaded, self.pending
            self.pending = None
            ski = x509.SubjectKeyIdentifier.from_public_key(old.key.public_key()).digest
            last = max(self.ca.max_not_after.get(ski, 0.0), now)
            if not (old.root_ders() <= new.root_ders()):
                self.retired.append((old.roots, last))
            self._install_now(new, keys.merge_trust(new.roots, *self._retired_roots()))
            log.info("root rotation: signing with the new CA (serial %x) from %s; the old "
                     "roots stay trusted until %s", new.cert.serial_number, new.secret,
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last)))
        if self.retired and self.pending is None and self.loaded is not None:
            keep = [(r, t) for r, t in self.retired if t > now]
            if len(keep) != len(self.retired):
                self.retired = keep
                self._install_now(self.loaded, keys.merge_trust(self.loaded.roots,
                                                                *self._retired_roots()))
                log.info("root rotation: old roots dropped from the trust bundle (nothing "
                         "they signed is valid any more)")

    def next_step_in(self) -> float:
        """Seconds until the next time-driven step (the resync interval when none)."""
        now = self.clock()
        times = [self.switch_at] if self.pending is not None else []
        times += [t for _, t in self.retired]
        return max(0.05, min([self.resync] + [t - now for t in times]))

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.next_step_in())
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.sync()

    async def _watch(self, name: str) -> None:
        """Re-read on any event of Secret ``name`` (watched by field selector)."""
        retry = Backoff(1.0, 30.0, jitter=(0.8, 1.2))
        while True:
            try:
                core = self._core()
                listed = await core.list_namespaced_secret(
                    self.namespace, field_selector=f"metadata.name={name}",
                    _request_timeout=REQUEST_TIMEOUT)
                rv = listed.metadata.resource_version
                async with kubewatch.Watch(self._api()) as w:  # the client core uses
                    async for _event in w.stream(core.list_namespaced_secret, self.namespace,
                                                 field_selector=f"metadata.name={name}",
                                                 resource_version=rv, timeout_seconds=300):
                        retry.reset()
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a watch failure never stops the CA
                delay = retry.next()
                log.debug("watching Secret %s/%s: %s; again in %.1fs", self.namespace, name,
                          e, delay)
                await asyncio.sleep(delay)

    def debug_state(self) -> dict:
        return {"secret": self.source or None, "error": self.error or None,
                "serial": f"{self.loaded.cert.serial_number:x}" if self.loaded else None,
                "rotation_pending": (f"{self.pending.cert.serial_number:x}"
                                     if self.pending else None),
                "switch_at": self.switch_at if self.pending else None,
                "retired_roots": len(self.retired), "bootstrapped": self.bootstrapped}
