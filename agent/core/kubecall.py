"""One raw Kubernetes API call through kubernetes_asyncio's ``ApiClient``, and one mapping
of the API server's error answers.

The agent's own requests (a LIST's bytes, a watch stream, a merge patch of a status
subresource, an Event) go through ``ApiClient.call_api`` with ``_preload_content=False``:
the client adds the host, TLS and the bearer token (``auth_settings=["BearerToken"]``) but
neither decodes the body nor checks the status. This module does both, the same way for
every caller:

- :func:`call` sends one request and returns the decoded JSON body (None when empty);
  :func:`read` returns the body's bytes (a LIST whose size is counted and whose parse is
  timed by its caller); :func:`stream` yields the open response of a watch, released on
  exit.
- A status outside 2xx raises :class:`KubeError`: the HTTP status, the reason phrase, the
  ``message`` and ``reason`` of the ``Status`` object the API server sends with every error
  (Kubernetes API conventions, "Response Status Kind"), the response headers and the
  body bytes; named predicates for the statuses callers decide on (404, 403, 409, 410,
  429) and :attr:`KubeError.retry_after` (the ``Retry-After`` header of a 429).
  :meth:`KubeError.from_status` maps a watch stream's ``ERROR`` event (a ``Status``
  object inside a 200 response, e.g. 410 Expired for a compacted resourceVersion) to the
  same type.

:class:`KubeError` subclasses kubernetes_asyncio's ``ApiException``, so code that handles
the generated API classes' errors (``except ApiException``, ``e.status``, ``e.body``)
handles these alike. Its ``reason`` is what the callers log: the Status ``message`` when
the server sent one, else the HTTP reason phrase. ``str()`` is one line (status and
reason); nothing of the request (its Authorization header) is ever part of the error.

Connection failures (``aiohttp.ClientError``, ``OSError``) and timeouts
(``asyncio.TimeoutError``) are not mapped: they propagate as raised, and each caller
decides what a failure of the connection means to it.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient
    from multidict import CIMultiDictProxy

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"

#: a request timeout: seconds for the whole request, an ``aiohttp.ClientTimeout`` (connect
#: and read bounds), or None for none (tests and benchmarks, which bound their own runs)
Timeout = float | aiohttp.ClientTimeout | None


class KubeError(ApiException):
    """A non-2xx answer of the API server (or a watch ``ERROR`` event).

    ``status``: the HTTP status (int); ``phrase``: the HTTP reason phrase (``"Not Found"``);
    ``message``: the Status object's ``message`` (``""`` when the body was not a Status);
    ``status_reason``: its machine-readable ``reason`` (``"NotFound"``, ``"AlreadyExists"``,
    ``"Expired"``...); ``reason``: ``message`` or else ``phrase`` (the one-line detail to
    log); ``headers``: the response's headers (case-insensitive; None for a watch
    event); ``body``: the body's bytes (``ApiException``'s types)."""

    status: int
    reason: str

    def __init__(self, status: int, phrase: str = "", message: str = "",
                 status_reason: str = "", headers: CIMultiDictProxy | None = None,
                 body: bytes = b""):
        super().__init__(status=status, reason=message or phrase)
        self.phrase = phrase
        self.message = message
        self.status_reason = status_reason
        self.headers = headers
        self.body = body

    @classmethod
    def from_response(cls, status: int, phrase: str, headers: CIMultiDictProxy | None,
                      body: bytes) -> "KubeError":
        """The error for an answer with ``status`` and raw ``body`` (a Status object as JSON,
        or anything else: then only the status and phrase are known)."""
        message = status_reason = ""
        try:
            decoded = json.loads(body.decode("utf-8", "replace"))
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            message = str(decoded.get("message") or "")
            status_reason = str(decoded.get("reason") or "")
        return cls(status, phrase, message, status_reason, headers=headers, body=body)

    @classmethod
    def from_status(cls, status: Any) -> "KubeError":
        """The error a watch stream's ``ERROR`` event carries: its object is a Status
        (``code``, ``reason``, ``message``); a missing ``code`` counts as 500, one that is
        not a number raises ValueError. ``reason``
        is the Status ``message``, else its ``reason``."""
        obj = status if isinstance(status, dict) else {}
        code = int(obj.get("code") or 500)  # a code that is no number: ValueError
        status_reason = str(obj.get("reason") or "")
        return cls(code, status_reason, str(obj.get("message") or ""), status_reason,
                   body=json.dumps(obj).encode())

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def forbidden(self) -> bool:
        return self.status == 403

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def gone(self) -> bool:
        """410: a watch's resourceVersion is older than what the server still holds."""
        return self.status == 410

    @property
    def too_many_requests(self) -> bool:
        return self.status == 429

    @property
    def retry_after(self) -> float:
        """Seconds of the ``Retry-After`` header (its delta-seconds form; the API server
        sends it with a 429), 0.0 when absent or not a number."""
        value = self.headers.get("Retry-After", 0) if self.headers is not None else 0
        try:
            return max(0.0, float(value))
        except (TypeError, ValueError):
            return 0.0

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.reason}" if self.reason else f"HTTP {self.status}"


def _timeout(timeout: Timeout) -> aiohttp.ClientTimeout:
    if isinstance(timeout, aiohttp.ClientTimeout):
        return timeout
    # the client's own default for no timeout given is an unbounded ClientTimeout() too
    return aiohttp.ClientTimeout(total=timeout)


async def _open(api: ApiClient, method: str, path: str, query: Sequence[tuple[str, Any]],
                body: Any, content_type: str, accept: str,
                timeout: Timeout) -> aiohttp.ClientResponse:
    """The 2xx response, not read; anything else is read, released and raised."""
    resp = await api.call_api(
        path, method, query_params=list(query), body=body,
        header_params={"Content-Type": content_type, "Accept": accept},
        auth_settings=["BearerToken"], _preload_content=False,
        _request_timeout=_timeout(timeout))
    if 200 <= resp.status <= 299:
        return resp
    try:
        data = await resp.read()
    finally:
        resp.release()
    raise KubeError.from_response(resp.status, resp.reason or "", resp.headers, data)


async def read(api: ApiClient, method: str, path: str, *, timeout: Timeout,
               query: Sequence[tuple[str, Any]] = (), body: Any = None,
               content_type: str = JSON, accept: str = JSON) -> bytes:
    """Send one request with ``api`` (a kubernetes_asyncio ``ApiClient``); return the body
    of its 2xx answer as bytes.

    ``path`` is the API path (``/api/v1/namespaces/ns/pods``), ``query`` its query
    parameters, ``body`` a JSON-serialisable object sent as ``content_type`` (e.g.
    :data:`MERGE_PATCH`), ``timeout`` see :data:`Timeout`. Raises :class:`KubeError` for
    any other status; connection errors and timeouts propagate."""
    resp = await _open(api, method, path, query, body, content_type, accept, timeout)
    try:
        return await resp.read()
    finally:
        resp.release()


async def call(api: ApiClient, method: str, path: str, *, timeout: Timeout,
               query: Sequence[tuple[str, Any]] = (), body: Any = None,
               content_type: str = JSON) -> Any:
    """As :func:`read`, returning the decoded JSON body (None when the body is empty).
    A 2xx body that is not JSON raises ValueError."""
    data = await read(api, method, path, timeout=timeout, query=query, body=body,
                      content_type=content_type)
    return json.loads(data) if data else None


@contextlib.asynccontextmanager
async def stream(api: ApiClient, path: str, *, timeout: Timeout,
                 query: Sequence[tuple[str, Any]] = ()) -> AsyncIterator[aiohttp.ClientResponse]:
    """GET ``path`` and yield its open 2xx response (read ``resp.content`` as it arrives:
    a watch); released on exit. Raises :class:`KubeError` before yielding for any other
    status. A watch's own ``ERROR`` events are the caller's to map
    (:meth:`KubeError.from_status`)."""
    resp = await _open(api, "GET", path, query, None, JSON, JSON, timeout)
    try:
        yield resp
    finally:
        resp.release()
