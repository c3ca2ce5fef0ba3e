"""Who is calling the agent's TLS ports: one authenticator chain for xDS and the CA.

istiod authenticates a call on 15012 with a list of authenticators, first success wins
(upstream ``security/pkg/server/ca/authenticate/cert_authenticator.go`` and
``kubeauth/kube_jwt.go``, ``pkg/security`` ``Authenticate``). Ours, in that order:

1. **Client certificate** — the TLS front door verified it against the mesh root; its
   ``spiffe://`` URI SANs are the caller's identities.
2. **Bearer token from the tokens file** (setting ``tokens_file``, for hosts without a
   Kubernetes API server): YAML ``{token: namespace/serviceaccount | SPIFFE ID}``,
   re-read when its mtime changes.
3. **Kubernetes service-account JWT** (``config_source: kubernetes``): a ``TokenReview``
   against the API server with the audiences istiod asks for (``TOKEN_AUDIENCES``,
   default ``istio-ca``, upstream ``pkg/security/security.go``); the user must be in
   ``system:serviceaccounts`` and named ``system:serviceaccount:<ns>:<sa>``; the pod
   name/UID come from the token's ``extra``. A ``clusterid`` header naming another
   cluster is refused, as istiod refuses clusters it has no client for. Results are
   cached for ``cache_ttl`` seconds (failures ``negative_ttl``) keyed by the token's
   SHA-256, never the token.

Nothing matched → :class:`AuthenticationError` whose message says why (no credentials,
unknown token, wrong audience, API unreachable, ...) and never contains a token. Tokens
are never logged.

The component ``authn`` (:func:`build`) owns the chain and, in Kubernetes mode, its API
client. TLS front doors register with it (:meth:`Authenticator.add_front_door`) so one
``authenticate(context)`` works for every gRPC server behind one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import yaml

from agent.core import trusted, yamlsafe
from agent.core.lifecycle import AgentContext, Component
from agent.core.spiffe import Identity

if TYPE_CHECKING:
    import grpc
    from kubernetes_asyncio.client import ApiClient

    from agent.tlsport.frontdoor import TlsPeer

log = logging.getLogger(__name__)

SERVICE_ACCOUNTS_GROUP = "system:serviceaccounts"
POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
POD_UID_KEY = "authentication.kubernetes.io/pod-uid"


class PeerLookup(Protocol):
    """What the chain needs of a TLS front door (:class:`agent.tlsport.frontdoor.TlsFrontDoor`):
    the TLS peer behind a gRPC ``context.peer()`` string, or None."""

    def lookup(self, peer: str) -> TlsPeer | None: ...


class AuthenticationError(Exception):
    """The call is not authenticated; ``str()`` is the reason, safe to send to the caller."""


@dataclasses.dataclass(frozen=True)
class Caller:
    """An authenticated caller: its identities (the first is the primary one), how it was
    authenticated (``"client certificate"``, ``"tokens file"``, ``"TokenReview"``), and
    for a Kubernetes token the pod it was issued to (may be empty)."""

    identities: tuple[Identity, ...]
    source: str
    pod_name: str = ""
    pod_uid: str = ""

    @property
    def identity(self) -> Identity:
        return self.identities[0]

    @property
    def spiffe_id(self) -> str:
        return self.identities[0].spiffe_id


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The token of an ``authorization: Bearer <token>`` header ("" when absent);
    upstream ``security.ExtractBearerToken`` (scheme case-insensitive)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
    return ""


def header(metadata: Iterable[tuple[str, Any]] | None, name: str) -> str:
    for key, value in metadata or ():
        if key.lower() == name:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return ""


class UntrustedFileError(ValueError):
    """The tokens file fails :func:`agent.core.trusted.secret_file_problem`."""


class TokensFile:
    """Bearer tokens → identity from a YAML mapping file (setting ``tokens_file``).

    Values are ``namespace/serviceaccount`` (in ``trust_domain``) or a SPIFFE ID. The file
    is re-read when its mtime changes; an unusable file logs its problem (never a token)
    and accepts nobody until fixed. A file that can't be trusted (owned by neither the
    agent's euid nor root, writable by group/others, readable by others: judged on the
    opened file, so a symlink counts by its target) is refused: at start a
    :class:`agent.core.config.ConfigError`; on a reload one WARN per problem, and the
    previous tokens stay in use until the file is fixed.
    """

    source = "tokens file"

    def __init__(self, path: str, trust_domain: str):
        self.path = path
        self.trust_domain = trust_domain
        self._mtime: float | None = None
        self._tokens: dict[str, Identity] = {}
        self.error = ""

    def lookup(self, token: str) -> Identity | None:
        """Blocking (stat, maybe read). Unknown token or unusable file → None."""
        if not self.path or not token:
            return None
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime != self._mtime:
                self._tokens = self._load()
                self._mtime = mtime
                self.error = ""
        except UntrustedFileError as e:
            # keep what was loaded before; _mtime stays, so each call re-checks the file
            if str(e) != self.error:
                log.warning("tokens_file=%s refused: %s; the previous tokens stay in use",
                            self.path, e)
            self.error = str(e)
        except (OSError, ValueError) as e:
            if str(e) != self.error:
                log.warning("tokens_file=%s unusable: %s", self.path, e)
            self.error = str(e)
            self._tokens, self._mtime = {}, None
            return None
        return self._tokens.get(token)

    def _load(self) -> dict[str, Identity]:
        """The file's tokens. Raises :class:`UntrustedFileError` (checked on the opened
        file, no race with a swap), OSError, or ValueError naming an entry by position."""
        with open(self.path, encoding="utf-8") as f:
            problem = trusted.secret_file_problem(os.fstat(f.fileno()))
            if problem:
                raise UntrustedFileError(problem + ": it holds bearer tokens")
            try:
                data = yamlsafe.load(f.read()) or {}
            except yaml.YAMLError as e:
                # PyYAML's message quotes the offending line, which may hold a token.
                mark = getattr(e, "problem_mark", None)
                where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                why = (f": {e.problem}" if isinstance(e, yamlsafe.AliasBombError)
                       else f": {e}" if isinstance(e, yamlsafe.TooLargeError) else "")
                raise ValueError(f"malformed YAML{where}{why}") from None
        if not isinstance(data, dict):
            raise ValueError("top level must be a mapping of token: namespace/serviceaccount")
        out = {}
        for n, (token, who) in enumerate(data.items(), 1):
            # YAML reads 12345 or yes as a number or a bool: say so instead of str()-ing it.
            if not isinstance(token, str) or not token:
                raise ValueError(f"entry {n}: the token is a {type(token).__name__}, not a "
                                 "string (quote it)")
            if not isinstance(who, str):
                raise ValueError(f"entry {n}: the identity is a {type(who).__name__}, not a "
                                 "string namespace/serviceaccount or SPIFFE ID")
            if who.startswith("spiffe://"):
                try:
                    out[str(token)] = Identity.parse(who)
                except ValueError:
                    raise ValueError(f"entry {n}: {who!r} is not a SPIFFE ID "
                                     "spiffe://<td>/ns/<ns>/sa/<sa>") from None
            elif who.count("/") == 1 and all(who.split("/")):
                ns, sa = who.split("/")
                out[str(token)] = Identity(self.trust_domain, ns, sa)
            else:
                # Name the entry by position, never by its token.
                raise ValueError(f"entry {n}: identity {who!r} is neither "
                                 "namespace/serviceaccount nor a SPIFFE ID")
        return out


class TokenReviewAuthenticator:
    """Kubernetes service-account JWTs checked with a ``TokenReview`` (see module
    docstring). ``api`` is a ``kubernetes_asyncio.client.ApiClient`` (or a zero-argument
    callable returning one, for an API client created at start)."""

    source = "TokenReview"

    def __init__(self, api: ApiClient | Callable[[], ApiClient | None] | None,
                 audiences: Iterable[str], trust_domain: str, cluster_id: str,
                 *, cache_ttl: float = 30.0, negative_ttl: float = 5.0,
                 max_entries: int = 4096, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._api = api
        self.audiences = list(audiences)
        self.trust_domain = trust_domain
        self.cluster_id = cluster_id
        self.cache_ttl, self.negative_ttl = cache_ttl, negative_ttl
        self.max_entries = max_entries
        self.timeout = timeout
        self.clock = clock
        self._cache: collections.OrderedDict[str, tuple[float, Caller | str]] = \
            collections.OrderedDict()
        self.reviews = 0

    def _api_client(self) -> ApiClient | None:
        return self._api() if callable(self._api) else self._api

    async def authenticate(self, token: str, cluster_header: str = "") -> Caller:
        """Raises :class:`AuthenticationError` naming the reason."""
        if cluster_header and cluster_header != self.cluster_id:
            raise AuthenticationError(
                f"client claims to be in cluster {cluster_header!r}, but this agent serves "
                f"cluster {self.cluster_id!r} (clusterid header)")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            if isinstance(hit[1], Caller):
                return hit[1]
            raise AuthenticationError(hit[1])
        try:
            caller = await self._review(token)
        except _Final as e:
            self._remember(key, now + self.negative_ttl, str(e))
            raise AuthenticationError(str(e)) from None
        self._remember(key, now + self.cache_ttl, caller)
        return caller

    def _remember(self, key: str, until: float, value: Caller | str) -> None:
        self._cache[key] = (until, value)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)

    async def _review(self, token: str) -> Caller:
        from kubernetes_asyncio import client as kclient
        from kubernetes_asyncio.client.exceptions import ApiException

        api = self._api_client()
        if api is None:
            raise AuthenticationError("cannot verify the token: no Kubernetes API client")
        body = kclient.V1TokenReview(spec=kclient.V1TokenReviewSpec(
            token=token, audiences=self.audiences or None))
        self.reviews += 1
        try:
            review = await kclient.AuthenticationV1Api(api).create_token_review(
                body, _request_timeout=self.timeout)
        except ApiException as e:
            # Not cached: the agent's own permissions or the API server are at fault.
            log.warning("TokenReview failed: HTTP %s %s", e.status, (e.reason or "")[:200])
            raise AuthenticationError(f"cannot verify the token: TokenReview answered HTTP "
                                      f"{e.status} {e.reason or ''}".strip()) from None
        except (OSError, asyncio.TimeoutError) as e:
            log.warning("TokenReview failed: %s", type(e).__name__)
            raise AuthenticationError("cannot verify the token: the Kubernetes API server is "
                                      f"unreachable ({type(e).__name__})") from None
        except Exception as e:  # noqa: BLE001 - any other failure refuses (fail closed)
            # e.g. aiohttp.ClientPayloadError (a reply cut short), a reply that does not
            # deserialize: not cached, the caller is refused with a reason, never let in
            log.warning("TokenReview failed: %s", type(e).__name__)
            raise AuthenticationError("cannot verify the token: the TokenReview call failed "
                                      f"({type(e).__name__})") from None
        return self._result(review)

    def _result(self, review: Any) -> Caller:
        status = review.status
        error = (getattr(status, "error", None) or "") if status else ""
        if not status or not status.authenticated:
            if "audience" in error.lower():
                log.info("TokenReview: token not for audiences %s: %s", self.audiences,
                         error[:300])
                raise _Final(f"bearer token has the wrong audience (this agent accepts "
                             f"{', '.join(self.audiences) or 'the API server audience'})")
            log.info("TokenReview: token not authenticated: %s", error[:300])
            raise _Final("bearer token rejected by the Kubernetes API (invalid or expired)")
        user = status.user
        groups = list(getattr(user, "groups", None) or [])
        if SERVICE_ACCOUNTS_GROUP not in groups:
            raise _Final("bearer token is not a service account token")
        parts = (getattr(user, "username", "") or "").split(":")
        if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or not all(parts[2:]):
            raise _Final("bearer token's user is not system:serviceaccount:<ns>:<name>")
        extra = getattr(user, "extra", None) or {}

        def first(name: str) -> str:
            values = extra.get(name) or []
            return values[0] if values else ""

        return Caller((Identity(self.trust_domain, parts[2], parts[3]),), self.source,
                      pod_name=first(POD_NAME_KEY), pod_uid=first(POD_UID_KEY))


class _Final(Exception):
    """A TokenReview verdict about the token itself (cached as a failure)."""


class Authenticator:
    """The chain (module docstring). ``tokens`` is a :class:`TokensFile` or None,
    ``token_review`` a :class:`TokenReviewAuthenticator` or None; ``run_blocking`` runs the
    tokens file lookup off the event loop."""

    def __init__(self, trust_domain: str, tokens: TokensFile | None = None,
                 token_review: TokenReviewAuthenticator | None = None,
                 run_blocking: Callable | None = None):
        self.trust_domain = trust_domain
        self.tokens = tokens
        self.token_review = token_review
        self._run = run_blocking
        self._doors: list[PeerLookup] = []
        self.failures = 0

    def add_front_door(self, door: PeerLookup) -> None:
        """Register an :class:`agent.tlsport.frontdoor.TlsFrontDoor` whose peers may call."""
        if door not in self._doors:
            self._doors.append(door)

    def remove_front_door(self, door: PeerLookup) -> None:
        if door in self._doors:
            self._doors.remove(door)

    def tls_peer(self, context: grpc.aio.ServicerContext | None) -> TlsPeer | None:
        """The TLS peer of a gRPC call, or None when it did not come through a front door."""
        peer = context.peer() if context is not None else ""
        for door in self._doors:
            found = door.lookup(peer)
            if found is not None:
                return found
        return None

    async def authenticate(self, context: grpc.aio.ServicerContext | None,
                           require_tls: bool = True) -> Caller:
        """Authenticate a gRPC call. ``require_tls``: refuse calls that did not come
        through a TLS front door. Raises :class:`AuthenticationError`."""
        try:
            return await self._authenticate(context, require_tls)
        except AuthenticationError:
            self.failures += 1
            raise

    async def _authenticate(self, context: grpc.aio.ServicerContext | None,
                            require_tls: bool) -> Caller:
        peer = self.tls_peer(context)
        if peer is None and require_tls:
            raise AuthenticationError("this service is served over TLS only")
        reasons = []
        if peer is not None and peer.cert_der:
            ids = []
            for uri in peer.spiffe_ids:
                try:
                    ids.append(Identity.parse(uri))
                except ValueError:
                    continue
            if ids:
                return Caller(tuple(ids), "client certificate")
            reasons.append("client certificate has no spiffe://<td>/ns/<ns>/sa/<sa> URI SAN")
        metadata = context.invocation_metadata() if context is not None else ()
        token = bearer_token(metadata)
        if not token:
            if not reasons:
                reasons.append("no client certificate and no 'authorization: Bearer' token")
            raise AuthenticationError("; ".join(reasons))
        return await self.authenticate_token(token, header(metadata, "clusterid"), reasons)

    async def authenticate_token(self, token: str, cluster_header: str = "",
                                 reasons: list[str] | None = None) -> Caller:
        """The token part of the chain. Raises :class:`AuthenticationError`."""
        reasons = list(reasons or [])
        if self.tokens is not None:
            who = (await self._run(self.tokens.lookup, token) if self._run
                   else self.tokens.lookup(token))
            if who is not None:
                return Caller((who,), self.tokens.source)
            reasons.append("bearer token is not in tokens_file"
                           + (f" (file unusable: {self.tokens.error})" if self.tokens.error
                              else ""))
        if self.token_review is not None:
            try:
                return await self.token_review.authenticate(token, cluster_header)
            except AuthenticationError as e:
                reasons.append(str(e))
        if self.tokens is None and self.token_review is None:
            reasons.append("bearer tokens are not accepted here (no tokens_file, and "
                           "config_source is not kubernetes)")
        raise AuthenticationError("; ".join(reasons))

    def debug_state(self) -> dict:
        return {"tokens_file": self.tokens.path if self.tokens else None,
                "token_review": ({"audiences": self.token_review.audiences,
                                  "reviews": self.token_review.reviews,
                                  "cached": len(self.token_review._cache)}
                                 if self.token_review else None),
                "failures": self.failures}


class AuthnComponent(Component):
    """Component ``authn``: the :class:`Authenticator` of the agent; in Kubernetes mode it
    creates (at start) and closes (at stop) the API client TokenReviews use."""

    name = "authn"

    def __init__(self, authenticator: Authenticator, kubeconfig: str | None = None):
        self.authenticator = authenticator
        self.kubeconfig = kubeconfig  # None: no API client needed
        self.api: ApiClient | None = None

    async def start(self) -> None:
        """Reads the tokens file once (a malformed one stops start-up with
        :class:`agent.core.config.ConfigError` naming ``tokens_file``; later edits are
        re-read per call), then creates the TokenReview API client when needed."""
        tokens = self.authenticator.tokens
        if tokens is not None:
            try:
                tokens._load()
            except (OSError, ValueError) as e:
                from agent.core.config import ConfigError

                raise ConfigError("tokens_file", tokens.path,
                                  getattr(e, "strerror", None) or str(e)) from None
        if self.kubeconfig is None or self.authenticator.token_review is None:
            return
        from kubernetes_asyncio import client as kclient

        from agent.core.kubeclient import client_configuration
        self.api = kclient.ApiClient(await client_configuration(self.kubeconfig))

    async def stop(self, grace: float) -> None:
        if self.api is not None:
            await self.api.close()
            self.api = None

    def debug_state(self) -> dict:
        return self.authenticator.debug_state()


def build(ctx: AgentContext) -> AuthnComponent:
    """Component ``authn`` from settings ``tokens_file``, ``token_audiences``,
    ``config_source`` (TokenReview when ``kubernetes``), ``kubeconfig``, ``cluster_id``,
    ``trust_domain``."""
    cfg = ctx.config
    tokens = TokensFile(cfg.tokens_file, cfg.trust_domain) if cfg.tokens_file else None
    component: AuthnComponent | None = None
    review = None
    if cfg.config_source == "kubernetes":
        review = TokenReviewAuthenticator(lambda: component.api if component else None,
                                          cfg.token_audiences, cfg.trust_domain, cfg.cluster_id)
    authenticator = Authenticator(cfg.trust_domain, tokens, review, ctx.run_blocking)
    component = AuthnComponent(authenticator,
                               cfg.kubeconfig if cfg.config_source == "kubernetes" else None)
    return component
