"""Where the Secret for one SDS resource name comes from, for one caller identity.

Upstream: ``istio/istio:security/pkg/nodeagent/cache/secretcache.go``
(``GenerateSecret`` → ``generateFileSecret``, then the cache / CA). In order:

1. ``file-cert:<cert>~<key>`` / ``file-root:<path>`` names (:mod:`agent.sds.files`):
   read from disk and watched. Served only with a fixed identity (setting
   ``service_account``): an attested pod naming a file would read any file the agent can.
2. The workload certificates directory (``workload_certs_dir``, fixed identity only):
   ``root-cert.pem`` answers ``ROOTCA``, ``cert-chain.pem`` + ``key.pem`` answer every
   other name, when non-empty; watched, as upstream's well-known mounted files are.
3. The secret cache (:class:`agent.sds.cache.SecretCache`): ``ROOTCA`` is the identity's
   root bundle, any other name its workload certificate.

Watching goes through the component's :class:`~agent.sds.files.FileWatcher`: file
names are watched under their own resource name, the mounted files under the tokens
:data:`MOUNTED_WORKLOAD` and :data:`MOUNTED_ROOT`, which the component turns into pushes.
"""

from __future__ import annotations

import os
from typing import Any, Awaitable, Callable

from envoy.extensions.transport_sockets.tls.v3 import secret_pb2

from agent.core.spiffe import Identity
from agent.sds import files, keys
from agent.sds.ca_istio import CAClientError
from agent.sds.cache import ROOTCA, CacheError, SecretCache
from agent.sds.service import GenerateError, root_secret, tls_secret

MOUNTED_WORKLOAD = "@workload"  # watcher tokens for workload_certs_dir files
MOUNTED_ROOT = "@root"


def is_workload_name(name: str) -> bool:
    """True for a name the cache's workload certificate answers (not ``ROOTCA``, not a
    file name)."""
    return name != ROOTCA and files.parse(name) is None


class SecretResolver:
    """Resolves ``(name, identity)`` to a Secret (module docstring).

    ``fixed`` is the fixed identity (None in attested mode); ``workload_certs_dir`` the
    mounted certificates directory ("" for none); ``run_blocking`` runs file reads off the
    event loop. :attr:`file_failures` counts file-backed inputs that failed to read
    (upstream's ``num_file_secret_failures_total``).
    """

    def __init__(self, cache: SecretCache, watcher: files.FileWatcher,
                 run_blocking: Callable[..., Awaitable[Any]], fixed: Identity | None,
                 workload_certs_dir: str = ""):
        self.cache = cache
        self.watcher = watcher
        self._run = run_blocking
        self.fixed = fixed
        self.workload_certs_dir = workload_certs_dir
        self.file_failures = 0

    async def secret(self, name: str, identity: Identity) -> secret_pb2.Secret:
        """One Secret for ``name`` as seen by ``identity``. Raises :class:`GenerateError`
        (a file that can't be read, a cache or CA failure; the message names the path or
        the CA's answer, never key bytes)."""
        try:
            fr = files.parse(name)
            if fr is not None:
                return await self._file_secret(fr)
            if name == ROOTCA:
                mounted = self._mounted("root-cert.pem")
                if mounted:
                    bundle = await self._run(files.read_root, mounted)
                    self.watcher.watch(mounted, MOUNTED_ROOT)
                    return root_secret(name, keys.merge_trust(bundle, self.cache.extra_trust))
                return root_secret(name, await self.cache.root_bundle(identity.spiffe_id))
            cert, key = self._mounted("cert-chain.pem"), self._mounted("key.pem")
            if cert and key:
                chain, key_pem = await self._run(files.read_pair, cert, key)
                self.watcher.watch(cert, MOUNTED_WORKLOAD)
                return tls_secret(name, chain, key_pem)
            item = await self.cache.workload(identity.spiffe_id)
            return tls_secret(name, item.chain, item.key)
        except files.FileSecretError as e:
            self.file_failures += 1
            raise GenerateError(str(e)) from None
        except (CacheError, CAClientError) as e:
            raise GenerateError(str(e)) from None

    async def _file_secret(self, fr: files.FileResource) -> secret_pb2.Secret:
        if not self.fixed:
            raise GenerateError("file-cert:/file-root: names are served only with a fixed "
                                "identity (service_account set), not to attested pods",
                                retry=False)
        # Watched before reading: a file that does not exist yet is pushed when it appears.
        self.watcher.watch(fr.cert, fr.name)
        if fr.kind == "cert":
            chain, key = await self._run(files.read_pair, fr.cert, fr.key)
            return tls_secret(fr.name, chain, key)
        return root_secret(fr.name, await self._run(files.read_root, fr.cert))

    def _mounted(self, filename: str) -> str:
        """A non-empty file in ``workload_certs_dir`` (fixed mode only), else ""."""
        if not self.fixed or not self.workload_certs_dir:
            return ""
        path = os.path.join(self.workload_certs_dir, filename)
        try:
            return path if os.path.getsize(path) > 0 else ""
        except OSError:
            return ""
