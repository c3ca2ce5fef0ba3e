"""The ``sds`` component: the SDS gRPC server on a Unix socket, its secret cache, the CA
(embedded by default, or a remote Istio CA) and, optionally, the embedded CA's own
``IstioCertificateService`` port. Built by :func:`build` (``agent.daemon``).

Who gets which identity (``docs/sds.md``, issue 6):

- **fixed** — ``service_account`` set: every caller is
  ``spiffe://<trust_domain>/ns/<pod_namespace>/sa/<service_account>``, as pilot-agent
  does for its one workload. ``file-cert:``/``file-root:`` names and the
  ``workload_certs_dir`` files are served in this mode only.
- **attested** — otherwise: the caller's PID (``SO_PEERCRED``, via the front door in
  :mod:`agent.sds.attest`) → its pod UID (cgroup) → the Pod in the config source →
  its namespace and service account. A caller that can't be attested gets
  PERMISSION_DENIED, never someone else's certificate. File names are refused in this
  mode: they would let any pod read any file the agent can read.

Other components use :meth:`SdsServer.root_pem` (the mesh root bundle),
:meth:`SdsServer.certificate_for` (a certificate + key for given SANs, e.g. the xDS
server's TLS listener) and :meth:`SdsServer.ca_servicer` (the embedded CA's
``IstioCertificateService``, which the xDS server serves on its TLS port).

The mesh root is published to ``mesh_root_file`` (0644 in a 0755 directory, written
atomically at start and whenever the root changes) so ztunnel can use it as
``XDS_ROOT_CA`` / ``CA_ROOT_CA``; the file stays when the agent stops (ztunnel keeps
verifying the agent across restarts with it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any, Awaitable, Callable

import grpc
from grpc_reflection.v1alpha import reflection

from agent.core import unixsocket
from agent.core.backoff import Backoff
from agent.core.config import Config, ConfigError
from agent.core.lifecycle import AgentContext, Component
from agent.core.spiffe import Identity
from agent.tlsport import frontdoor, servercert
from agent.tlsport.authn import Authenticator
from agent.sds import attest, ca_server, files, keys
from agent.sds.attest import PodStore
from agent.sds.ca_embedded import CAError, EmbeddedCA
from agent.sds.ca_istio import CAClient, CAClientError, EmbeddedCAClient, IstioCAClient
from agent.sds.ca_kube import KubeCASecret
from agent.sds.ca_publish import RootPublisher
from agent.sds.metrics import SdsCollector
from agent.sds.cache import DEFAULT, ROOTCA, SecretCache
from agent.sds.resolve import MOUNTED_ROOT, MOUNTED_WORKLOAD, SecretResolver, is_workload_name
from agent.sds.service import SDS_SERVICE, GenerateError, IdentityError, SdsService
from agent.sds.signer import SignerCAClient, SignerProcess
from agent.sds.trustfiles import publish_root, read_pem_bundle, read_trust_anchors

log = logging.getLogger(__name__)

_TRUST_ANCHORS = "@trust-anchors"  # watcher tokens for trust_anchors_file and ca_root_cert
_CA_ROOT = "@ca-root"


@dataclasses.dataclass
class CertBundle:
    """A certificate for another component: PEM ``chain`` (leaf first), ``key``, ``root``."""

    chain: bytes
    key: bytes
    root: bytes


class SdsServer(Component):
    """The SDS component. ``store_getter`` returns the config source's ObjectStore (or None);
    ``identify`` overrides caller identification (benchmarks); ``authenticator`` returns
    the ``authn`` component's chain (or None) for the CA; ``clock`` (epoch seconds, default
    ``time.time``) drives certificate lifetimes, rotation and the CA."""

    name = "sds"

    def __init__(self, config: Config, run_blocking: Callable[..., Awaitable[Any]],
                 store_getter: Callable[[], PodStore | None] = lambda: None,
                 identify: Callable[[grpc.aio.ServicerContext], Identity] | None = None,
                 authenticator: Callable[[], Authenticator | None] = lambda: None,
                 clock: Callable[[], float] | None = None,
                 kube_api: Callable[[], Any] = lambda: None):
        self.config = config
        self._kube_api = kube_api  # the config source's ApiClient (Kubernetes mode)
        self.kube_ca: KubeCASecret | None = None
        self._ca_read: asyncio.Task | None = None  # the CA Secret's first read (prefetch_ca)
        self.publisher: RootPublisher | None = None
        self._authenticator = authenticator
        self.clock = clock
        self._run = run_blocking
        self._store = store_getter
        self.fixed: Identity | None = (
            Identity(config.trust_domain, config.pod_namespace, config.service_account)
            if config.service_account else None)
        self.algorithm = keys.key_algorithm(config.ecc_signature_algorithm)
        try:
            self.socket_mode = int(str(config.sds_socket_mode), 8)
        except ValueError:
            raise ValueError(f"sds_socket_mode={config.sds_socket_mode!r}: expected an octal "
                             "mode such as 0600") from None
        self._custom_identify = identify
        self.embedded: EmbeddedCA | None = None
        self.ca_client: CAClient | None = None
        self.cache: SecretCache | None = None
        self.resolver: SecretResolver | None = None
        self.service: SdsService | None = None
        self.front_door: attest.FrontDoor | None = None
        self.attestor = attest.PodAttestor(store_getter, config.trust_domain,
                                           config.node_name)
        self.watcher: files.FileWatcher | None = None
        self.ca_port: int = 0
        self._grpc: grpc.aio.Server | None = None
        self._ca_port: ca_server.CaPort | None = None
        self._ca_service: ca_server.CertificateService | None = None
        self._published_root = b""
        self._backend_path = ""
        self._tasks: set[asyncio.Task] = set()
        self.warm_up: asyncio.Task | None = None  # fixed mode: minting before anyone asks
        self._started = False
        self._ca_root_bundle = b""  # canonical ca_root_cert content last acted on
        self._serving_issuer = b""  # remote CA: issuer of the node-local serving certificate
        self._remote_error = ""  # remote CA: why the last check failed ("" = it answered)
        self._remote_ok = False  # remote CA: it signed for us at least once
        self._remote_checks = 0
        self._reload_failures = 0  # trust_anchors_file / ca_root_cert reloads that failed

    @property
    def file_secret_failures(self) -> int:
        """File-backed inputs that failed to read, of any kind (served files, mounted
        certificates, trust anchors, the CA root): upstream's
        ``num_file_secret_failures_total``."""
        served = self.resolver.file_failures if self.resolver is not None else 0
        return served + self._reload_failures

    @property
    def mode(self) -> str:
        return "fixed" if self.fixed else "attested"

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Bring up CA, cache, SDS socket (and CA port). On failure, release what was
        started and raise (RuntimeError/ValueError/OSError naming the setting or path)."""
        try:
            await self._start()
        except BaseException:
            await self.stop(0)
            raise

    async def _start(self) -> None:
        cfg = self.config
        ca_client = await self._start_ca()
        cache = self.cache = SecretCache(ca_client, self._run, self.algorithm, cfg.secret_ttl,
                                         cfg.secret_grace_ratio, clock=self.clock or time.time)
        watcher = self.watcher = files.FileWatcher(self._on_file_change)
        self.resolver = SecretResolver(cache, watcher, self._run, self.fixed,
                                       cfg.workload_certs_dir)
        # The service exists before the first cache update can ask it to push.
        self.service = SdsService(self._identify, self.resolver.secret,
                                  on_watch=lambda i: cache.watch(i.spiffe_id),
                                  on_unwatch=lambda i: cache.unwatch(i.spiffe_id))
        cache.subscribe(self._on_cache_update)
        if cfg.trust_anchors_file:
            cache.set_extra_trust(await self._run(read_trust_anchors, cfg.trust_anchors_file))
            watcher.watch(cfg.trust_anchors_file, _TRUST_ANCHORS)
        if self._ca_root_watched():
            try:
                self._ca_root_bundle = await self._run(read_pem_bundle, cfg.ca_root_cert)
            except (OSError, ValueError) as e:  # the CA client reports it at the first CSR
                log.warning("ca_root_cert=%r: %s", cfg.ca_root_cert, e)
            watcher.watch(cfg.ca_root_cert, _CA_ROOT)
        await self._start_sds()
        if self.embedded:
            await self._publish_root()
        if self.kube_ca is not None and cfg.ca_root_publish:
            self.publisher = RootPublisher(self._kube_api, cfg.system_namespace, cfg.node_name,
                                           self.root_pem, clock=self.clock or time.time)
            await self.publisher.start()
        if cfg.ca_port and self.ca_servicer() is not None:
            await self._start_ca_port()
        if isinstance(self.ca_client, IstioCAClient):
            self._track(asyncio.get_running_loop().create_task(self._check_remote(),
                                                               name="sds remote CA check"))
        if self.fixed:
            self.warm_up = asyncio.get_running_loop().create_task(self._warm_up(self.fixed))
            self._track(self.warm_up)
        self._started = True
        log.info("SDS serving on %s (%s identity, CA %s)", cfg.sds_socket, self.mode,
                 cfg.ca_addr or "embedded")

    def prefetch_ca(self) -> None:
        """Begin the cluster CA Secret's first read now (on the loop), so that start()
        only awaits it: the agent calls this once the config source has its API client,
        and the read overlaps the LISTs and the first index build instead of following
        them (issue 28). A no-op unless the CA comes from that Secret; ``start`` reports
        its result as it always did (the read never raises: the CA stays refusing)."""
        cfg = self.config
        if (self._ca_read is None and not cfg.ca_addr and self.kube_mode
                and not cfg.ca_signer_process and self._kube_api() is not None):
            self._begin_ca_read()

    def _begin_ca_read(self) -> asyncio.Task:
        """The CA Secret's first read as a task (made once)."""
        if self._ca_read is not None:
            return self._ca_read
        cfg = self.config
        embedded = self.embedded = EmbeddedCA.pending("CA Secret not read yet",
                                                      clock=self.clock or time.time)
        self.kube_ca = KubeCASecret(self._kube_api, cfg.system_namespace, cfg.trust_domain,
                                    embedded, self._run, self._on_ca_roots_changed,
                                    cfg.ca_root_overlap, clock=self.clock or time.time)
        self._ca_read = asyncio.get_running_loop().create_task(
            self.kube_ca.first_read(), name="ca-secret-first-read")
        return self._ca_read

    async def _start_ca(self) -> CAClient:
        """The CA client the cache signs with (also :attr:`ca_client`): a remote Istio CA
        when ``ca_addr`` is set, else the embedded CA (loaded or created)."""
        cfg = self.config
        if cfg.ca_addr:
            # Attested mode: the agent authenticates as itself and asks for each pod's
            # identity with ImpersonatedIdentity, as ztunnel does (the remote CA must list
            # <system_namespace>/ambient-agent in its trusted node accounts).
            own = self._own_identity()
            remote = self.ca_client = IstioCAClient(cfg.ca_addr, cfg.ca_root_cert,
                                                    cfg.ca_token_file, cfg.cluster_id,
                                                    own_identity=own)
            return remote
        if self.kube_mode:
            if cfg.ca_signer_process:
                raise RuntimeError("setting ca_signer_process: not available with the "
                                   "cluster's CA Secret (ca_kubernetes_secret); set one of "
                                   "them false")
            await self._begin_ca_read()  # begun by prefetch_ca, or now
            assert self.kube_ca is not None and self.embedded is not None
            self.kube_ca.follow()
            kube = self.ca_client = EmbeddedCAClient(self.embedded, self._run)
            return kube
        try:
            embedded = self.embedded = await self._run(
                EmbeddedCA.load_or_create, cfg.ca_dir, cfg.trust_domain,
                cfg.ca_cert_file, cfg.ca_key_file)
        except CAError as e:
            if not cfg.ca_cert_file:
                raise RuntimeError(f"embedded CA: {e}") from None
            # The operator's own root: name the setting to fix.
            name = "ca_key_file" if str(e).startswith("CA key") else "ca_cert_file"
            raise RuntimeError(f"embedded CA: setting {name}={getattr(cfg, name)!r}: {e}"
                               ) from None
        if self.clock:
            embedded.clock = self.clock
        if cfg.ca_signer_process:
            signer = SignerProcess(*embedded_ca_files(cfg), clock=self.clock or time.time)
            await signer.start()
            child = self.ca_client = SignerCAClient(signer)
            return child
        local = self.ca_client = EmbeddedCAClient(embedded, self._run)
        return local

    @property
    def kube_mode(self) -> bool:
        """The embedded CA signs with the cluster's CA Secret (:mod:`agent.sds.ca_kube`):
        ``config_source: kubernetes``, ``ca_kubernetes_secret``, no ``ca_addr`` and no
        ``ca_cert_file``."""
        cfg = self.config
        return bool(cfg.config_source == "kubernetes" and cfg.ca_kubernetes_secret
                    and not cfg.ca_addr and not cfg.ca_cert_file)

    def _on_ca_roots_changed(self) -> None:
        """The Kubernetes CA's root bundle changed (first load, rotation): publish it and
        renew the watched certificates, so ROOTCA and every chain carry it."""
        if not self._started:
            return
        loop = asyncio.get_running_loop()
        self._track(loop.create_task(self._publish_root(), name="sds publish root"))
        if self.cache is not None:
            self.cache.renew_all()
        if self.publisher is not None:
            self.publisher.root_changed()

    async def _start_sds(self) -> None:
        path = self.config.sds_socket
        _make_traversable(os.path.dirname(path), self.socket_mode)
        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000)])
        assert self.service is not None  # built in _start(), before this is called
        self.service.add_to_server(server)
        reflection.enable_server_reflection((SDS_SERVICE, reflection.SERVICE_NAME), server)
        if self.fixed or self._custom_identify:
            bind = path
        else:
            private = os.path.join(self.config.state_dir, "sds-private")
            os.makedirs(private, mode=0o700, exist_ok=True)
            os.chmod(private, 0o700)
            bind = self._backend_path = os.path.join(private, "backend.sock")
        _unlink(bind)
        if bind == path:
            # gRPC binds the path itself: bound under a temporary name next to it, chmod-ed,
            # then renamed into place, so the socket is never connectable with the umask's
            # wider mode
            unixsocket.publish(path, lambda tmp: server.add_insecure_port("unix:" + tmp),
                               self.socket_mode)
        else:  # in the private 0700 directory: nobody else can reach it
            server.add_insecure_port("unix:" + bind)
            os.chmod(bind, 0o600)
            unixsocket.note_published(bind)
        await server.start()
        self._grpc = server
        if self._backend_path:
            self.front_door = attest.FrontDoor(path, self._backend_path, self.config.proc_dir,
                                               self.socket_mode)
            await self.front_door.start()

    def ca_servicer(self) -> ca_server.CertificateService | None:
        """The ``IstioCertificateService`` servicer, for a component that serves it on its
        own gRPC server (the xDS TLS port, as istiod does): ``servicer.add_to_server(server)``.
        Callers are authenticated by the ``authn`` component's chain. With the embedded CA
        it signs; with a remote Istio CA (``ca_addr``) it is a
        :class:`~agent.sds.ca_server.ForwardingCertificateService`, which checks the caller
        the same way and passes the call on to the remote CA (no key on this node)."""
        cfg = self.config
        if self._ca_service is None and self.embedded is not None:
            self._ca_service = ca_server.CertificateService(
                self.embedded, self._run, cfg.trust_domain, self._authenticator,
                cfg.ca_trusted_node_accounts, self._store, cfg.node_name)
        elif self._ca_service is None and isinstance(self.ca_client, IstioCAClient):
            self._ca_service = ca_server.ForwardingCertificateService(
                self.ca_client, cfg.trust_domain, self._authenticator,
                cfg.ca_trusted_node_accounts, self._store, cfg.node_name)
        return self._ca_service

    async def server_material(self) -> servercert.TlsMaterial:
        """The server certificate of the agent's TLS ports (SANs :meth:`tls_server_sans`),
        with the root client certificates must chain to.

        Embedded CA: issued by it. Remote CA (``ca_addr``): the remote CA signs SPIFFE
        identities only, which ztunnel cannot verify by hostname, so the certificate is a
        node-local one (:func:`agent.tlsport.servercert.node_local_material`: its one-use
        issuer's key is dropped at once, no CA key stays on the node); that issuer is
        published with the mesh root in ``mesh_root_file``, the file ztunnel reads as
        ``XDS_ROOT_CA``/``CA_ROOT_CA``. Raises :class:`CAClientError` (embedded CA not ready)."""
        sans = self.tls_server_sans()
        if self.embedded is not None or self.ca_client is None:
            bundle = await self.certificate_for(sans, "ECDSA")
            return servercert.TlsMaterial(bundle.chain, bundle.key, self.root_pem() or bundle.root)
        names = [n for n in sans if not n.startswith("spiffe://")]
        spiffe = next((n for n in sans if n.startswith("spiffe://")), "")
        now = self.clock() if self.clock else None
        material, issuer = await self._run(
            lambda: servercert.node_local_material(names, spiffe, now=now))
        self._serving_issuer = issuer
        await self._publish_root()
        return dataclasses.replace(material, root_pem=self.root_pem())

    def server_certificate(self, name: str, sans: list[str]) -> servercert.ServerCertificate:
        """A renewing :class:`~agent.tlsport.servercert.ServerCertificate` for a TLS listener named
        ``name`` with ``sans``, issued by this component's CA (not started)."""

        async def provide() -> servercert.TlsMaterial:
            if sans == self.tls_server_sans():
                return await self.server_material()
            bundle = await self.certificate_for(sans, "ECDSA")
            return servercert.TlsMaterial(bundle.chain, bundle.key, self.root_pem() or bundle.root)

        return servercert.ServerCertificate(name, provide, clock=self.clock or time.time)

    def tls_server_sans(self) -> list[str]:
        """SANs of the agent's TLS listeners: ``spiffe://<td>/ns/<system ns>/sa/ambient-agent``
        and :func:`agent.tlsport.servercert.server_names`."""
        cfg = self.config
        return [f"spiffe://{cfg.trust_domain}/ns/{cfg.system_namespace}/sa/ambient-agent",
                *servercert.server_names(cfg.system_namespace, cfg.node_name,
                                         cfg.tls_server_names)]

    async def _start_ca_port(self) -> None:
        cfg = self.config
        authenticator = self._authenticator()
        if authenticator is None:
            raise RuntimeError("ca_port: no caller authentication (component 'authn' missing)")
        service = self.ca_servicer()
        assert service is not None, "the CA port is started with a CA servicer only"
        self._ca_port = ca_server.CaPort(
            service, cfg.ca_listen_address, cfg.ca_port,
            self.server_certificate("ca_port", self.tls_server_sans()),
            frontdoor.private_socket_path(cfg.state_dir, "ca"), authenticator)
        self.ca_port = await self._ca_port.start()
        log.info("embedded CA serving IstioCertificateService on %s:%d (TLS)",
                 cfg.ca_listen_address, self.ca_port)

    async def _publish_root(self) -> None:
        """Write the mesh root to ``mesh_root_file`` when it changed. Errors are logged
        (ztunnel then keeps the previous file), never fatal after start."""
        path = self.config.mesh_root_file
        root = self.published_trust()
        if not path or not root or root == self._published_root:
            return
        try:
            await self._run(publish_root, path, root)
        except OSError as e:
            if not self._started and not self._published_root:
                raise RuntimeError(f"setting mesh_root_file={path!r}: "
                                   f"{e.strerror or e}") from None
            log.warning("mesh_root_file=%s: cannot write the mesh root: %s", path,
                        e.strerror or e)
            return
        self._published_root = root
        log.info("mesh root published at %s", path)

    async def _warm_up(self, identity: Identity) -> None:
        """Fixed mode: mint ``default`` and ``ROOTCA`` for ``identity`` before anyone asks."""
        assert self.resolver is not None
        retry = Backoff(0.5, 60.0, factor=1.5, jitter=(0.5, 1.5))
        while True:
            try:
                await self.resolver.secret(DEFAULT, identity)
                await self.resolver.secret(ROOTCA, identity)
                return
            except GenerateError as e:
                delay = retry.next()
                log.warning("SDS warm-up failed, retry in %.1fs: %s", delay, e)
                await asyncio.sleep(delay)

    async def stop(self, grace: float) -> None:
        self._started = False
        if self.publisher is not None:
            await self.publisher.stop()
        if self._ca_read is not None:
            self._ca_read.cancel()
            await asyncio.gather(self._ca_read, return_exceptions=True)
        if self.kube_ca is not None:
            await self.kube_ca.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.front_door:
            await self.front_door.stop()
        if self._ca_port:
            await self._ca_port.stop(grace)
            self._ca_port = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        _unlink(self.config.sds_socket)
        if self._backend_path:
            _unlink(self._backend_path)
        if self.cache:
            await self.cache.close()
        if self.watcher:
            await self.watcher.close()
        if self.ca_client:
            await self.ca_client.close()

    def _own_identity(self) -> str:
        cfg = self.config
        return (self.fixed.spiffe_id if self.fixed else
                f"spiffe://{cfg.trust_domain}/ns/{cfg.system_namespace}/sa/ambient-agent")

    async def _check_remote(self) -> None:
        """Remote-CA mode: ask the remote CA for the agent's own certificate (through the
        cache, so the mesh root is learnt and published) until it answers once; until then
        the component is not ready and :meth:`ready` says why (unreachable, refused, a
        ``ca_root_cert`` that does not verify it). There is never a local key to fall back
        to. Retried with backoff, 1 s doubling to 30 s."""
        assert self.cache is not None
        retry = Backoff(1.0, 30.0, jitter=(0.9, 1.1))
        own = self._own_identity()
        while not self._remote_ok:
            self._remote_checks += 1
            try:
                await self.cache.root_bundle(own)
            except Exception as e:  # noqa: BLE001 - reported by ready(), retried
                self._remote_error = str(e) or type(e).__name__
                delay = retry.next()
                log.warning("remote CA %s not usable (not ready; retry in %.0fs): %s",
                            self.config.ca_addr, delay, self._remote_error)
                await asyncio.sleep(delay)
                continue
            self._remote_ok, self._remote_error = True, ""
            log.info("remote CA %s signed the agent's certificate: ready", self.config.ca_addr)

    def ready(self) -> tuple[bool, str]:
        if not self._started:
            return False, "SDS server not started"
        if isinstance(self.ca_client, IstioCAClient) and not self._remote_ok:
            return False, (f"remote CA ca_addr={self.config.ca_addr} not usable: "
                           f"{self._remote_error or 'no certificate from it yet'}")
        if self.kube_ca is not None:
            ok, why = self.kube_ca.ready()
            if not ok:
                return False, f"embedded CA not ready: {why}"
        return True, ""

    # --- identity and generation ------------------------------------------------------
    def _track(self, task: asyncio.Task) -> None:
        """Keep a background task until it ends (cancelled at stop)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _identify(self, context: grpc.aio.ServicerContext) -> Identity:
        if self._custom_identify:
            return self._custom_identify(context)
        if self.fixed:
            return self.fixed
        cred = self.front_door.lookup(context.peer()) if self.front_door else None
        if cred is None:
            raise IdentityError("connection did not come through the attested SDS socket")
        try:
            return self.attestor.identify(cred)
        except attest.AttestationError as e:
            raise IdentityError(str(e)) from None

    # --- pushes ----------------------------------------------------------------------
    def _on_cache_update(self, spiffe_id: str | None, name: str) -> None:
        if self.service is None:  # nothing can be watching yet
            return
        if name == ROOTCA:
            self.service.push(lambda c: {ROOTCA}, spiffe_id)
            if self.config.mesh_root_file and self.published_trust() != self._published_root:
                self._track(asyncio.get_running_loop().create_task(self._publish_root()))
        else:
            self.service.push(lambda c: {n for n in (c.names or ()) if is_workload_name(n)},
                              spiffe_id)

    def _on_file_change(self, name: str) -> None:
        if name in (_TRUST_ANCHORS, _CA_ROOT):
            reload = self._reload_trust_anchors if name == _TRUST_ANCHORS else self._reload_ca_root
            self._track(asyncio.get_running_loop().create_task(reload(),
                                                               name=f"sds reload {name}"))
        elif name == MOUNTED_WORKLOAD:
            self._on_cache_update(None, DEFAULT)
        elif name == MOUNTED_ROOT:
            self._on_cache_update(None, ROOTCA)
        elif self.service is not None:
            self.service.push(lambda c: {name})

    def _ca_root_watched(self) -> bool:
        cfg = self.config
        return bool(cfg.ca_addr and cfg.ca_root_cert and isinstance(self.ca_client, IstioCAClient)
                    and not self.ca_client.plaintext)

    async def _reload_trust_anchors(self) -> None:
        """``trust_anchors_file`` changed: merge the new anchors into ROOTCA. The cache
        pushes ROOTCA only when the set of certificates changed (a reordered or
        re-written identical bundle pushes nothing). An unusable file keeps the previous
        anchors (logged, counted)."""
        path = self.config.trust_anchors_file
        try:
            bundle = await self._run(read_trust_anchors, path)
        except ConfigError as e:
            self._reload_failures += 1
            log.error("trust anchors not reloaded, keeping the previous ones: %s", e)
            return
        if self.cache is not None:
            self.cache.set_extra_trust(bundle)

    async def _reload_ca_root(self) -> None:
        """``ca_root_cert`` changed (the remote CA's root was rotated): reconnect to the CA
        with the new root and renew every watched certificate now, so the CA's new root
        reaches ROOTCA (pushed by the cache when it differs) without waiting for the next
        rotation. An equal set of certificates does nothing; an unusable file keeps the
        current connection (logged, counted)."""
        path = self.config.ca_root_cert
        try:
            bundle = await self._run(read_pem_bundle, path)
        except (OSError, ValueError) as e:
            self._reload_failures += 1
            log.error("ca_root_cert=%r changed but is unusable, not reconnecting: %s", path, e)
            return
        if bundle == self._ca_root_bundle:
            return
        self._ca_root_bundle = bundle
        if isinstance(self.ca_client, IstioCAClient):
            await self.ca_client.reload()
        renewed = self.cache.renew_all() if self.cache is not None else 0
        log.info("ca_root_cert changed: reconnected to the CA, renewing %d certificate(s)",
                 renewed)

    # --- API for other components ------------------------------------------------------
    def published_trust(self) -> bytes:
        """What ``mesh_root_file`` holds: the mesh root bundle (:meth:`root_pem`) and, in
        remote-CA mode, the issuer of the node-local serving certificate (so ztunnel, reading
        the file as ``XDS_ROOT_CA``/``CA_ROOT_CA``, verifies the agent's TLS ports). b"" until
        the mesh root is known."""
        root = self.root_pem()
        if not root or not self._serving_issuer:
            return root
        return root.rstrip(b"\n") + b"\n" + self._serving_issuer

    def root_pem(self) -> bytes:
        """The mesh root bundle (PEM): the embedded CA's root, else the last root the
        Istio CA returned merged with extra anchors (b"" before the first certificate)."""
        if self.embedded:
            return self.embedded.root_pem
        return keys.merge_trust(self.cache.last_root, self.cache.extra_trust) if self.cache else b""

    async def certificate_for(self, sans: list[str], algorithm: str = "ECDSA",
                              ttl: float | None = None) -> CertBundle:
        """A fresh certificate for ``sans`` (SPIFFE IDs, DNS names, IPs) and its key.

        With the embedded CA the SANs are used as given; a remote Istio CA decides the
        identity itself (from our token). Raises :class:`CAClientError` on failure.
        """
        ttl = int(ttl or self.config.secret_ttl)
        if self.embedded:
            try:
                chain, key = await self._run(self.embedded.issue, sans, algorithm, ttl)
            except CAError as e:
                raise CAClientError(e.code, str(e)) from None
            return CertBundle(chain, key, self.embedded.root_pem)
        if self.ca_client is None:
            raise CAClientError("UNAVAILABLE", "the sds component has not started")
        key, csr = await self._run(keys.new_key_and_csr, algorithm, sans)
        chain = await self.ca_client.sign(csr, ttl, sans[0] if sans else "")
        return CertBundle(keys.concat_certs(chain).encode(), key, chain[-1].encode())

    def debug_state(self) -> dict:
        """Mode, socket, CA, streams (peer, names, versions, nonces) and cached certificates."""
        return {
            "mode": self.mode,
            "identity": self.fixed.spiffe_id if self.fixed else None,
            "socket": self.config.sds_socket,
            "ca": self.config.ca_addr or "embedded",
            "ca_port": self.ca_port or None,
            "ca_port_tls": self._ca_port.debug_state() if self._ca_port else None,
            "mesh_root_file": self.config.mesh_root_file or None,
            "ca_issued": self._ca_service.issued if self._ca_service else 0,
            "remote_ca": ({"ok": self._remote_ok, "error": self._remote_error or None,
                           "checks": self._remote_checks,
                           "node_local_serving_cert": bool(self._serving_issuer)}
                          if isinstance(self.ca_client, IstioCAClient) else None),
            "ca_secret": self.kube_ca.debug_state() if self.kube_ca else None,
            "root_publisher": self.publisher.debug_state() if self.publisher else None,
            "streams": self.service.debug_state() if self.service else [],
            "nacks": self.service.nacks if self.service else 0,
            **(self.cache.debug_state() if self.cache else {}),
        }


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def embedded_ca_files(cfg: Config) -> tuple[str, str]:
    """``(root certificate, root key)`` paths of the embedded CA: the user's
    ``ca_cert_file``/``ca_key_file``, else the ones in ``ca_dir``."""
    if cfg.ca_cert_file:
        return cfg.ca_cert_file, cfg.ca_key_file
    return os.path.join(cfg.ca_dir, "root-cert.pem"), os.path.join(cfg.ca_dir, "root-key.pem")


def build(ctx: AgentContext, store: PodStore | None,
          authenticator: Authenticator | None,
          kube_api: Callable[[], Any] = lambda: None) -> SdsServer:
    """The ``sds`` component for the daemon (always on): callers attested against the
    config source's ``store`` (None: only a fixed identity is served), callers of the CA
    checked by ``authenticator`` (None: a separate ``ca_port`` refuses to start);
    ``kube_api`` returns the config source's Kubernetes ``ApiClient`` (Kubernetes mode: the
    CA Secret and the root ConfigMaps)."""
    server = SdsServer(ctx.config, ctx.run_blocking, lambda: store,
                       authenticator=lambda: authenticator, clock=ctx.clock, kube_api=kube_api)
    ctx.registry.register(SdsCollector(server))
    return server


def _make_traversable(directory: str, socket_mode: int) -> None:
    """Create the SDS socket's directory (0750) and give it the search bit for whoever
    the socket's mode lets in: with ``sds_socket_mode`` 0666 (upstream's, for Envoy as uid
    1337) others must reach the socket, so the directory gets o+x (0751; not listable).
    Existing bits are never taken away. Blocking; raises OSError."""
    os.makedirs(directory, mode=0o750, exist_ok=True)
    want = (0o010 if socket_mode & 0o060 else 0) | (0o001 if socket_mode & 0o006 else 0)
    mode = os.stat(directory).st_mode & 0o7777
    if want & ~mode:
        os.chmod(directory, mode | want)

