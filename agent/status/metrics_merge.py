"""Merged Prometheus metrics for ``/stats/prometheus`` and ``/metrics`` (``docs/status.md``).

One scrape returns, in this order: the agent's own registry, Envoy's ``/stats/prometheus``
(when an Envoy admin port is configured) and the application's targets from
``ISTIO_PROMETHEUS_ANNOTATIONS``, always with HTTP 200: a failing source is logged, counted
in ``istio_agent_scrape_failures_total{type}`` and left out. Upstream
(pilot/cmd/pilot-agent/status/server.go ``handleStats``) concatenates the bodies as they
come; that breaks the scrape whenever formats differ or names repeat. Here:

- the format is upstream's choice (OpenMetrics only when every successful app target
  answered OpenMetrics in one version, else text 0.0.4), and *every* part is made valid
  for it: Envoy's text and text app bodies are converted to OpenMetrics, OpenMetrics app
  bodies to text, by :mod:`agent.status.exposition` (prometheus-client's parsers and
  writers, sample names kept, only types a Prometheus text parser accepts as well);
  exactly one ``# EOF``, at the end, and only for an OpenMetrics response;
- the first source to use a metric name keeps it (agent, then Envoy, then apps in target
  order); a later family using it is dropped whole and counted in
  ``ambient_agent_metrics_merge_dropped_families_total{source}``;
- an app body that does not parse is dropped and counted as a failed source (it would
  make Prometheus reject the whole scrape);
- a protobuf ``Accept`` is never forwarded (``filter_accept``), Envoy is asked for text only.

Envoy's body is streamed through in text mode (line-aligned chunks; only metadata lines
are looked at, by :mod:`agent.status.familygate`), so a multi-megabyte stats page costs
little more than fetching it. Application bodies are buffered up to :data:`APP_BODY_CAP` each (read
cap+1 to detect overflow; larger → dropped and counted), also for a single target
(upstream streams one target uncapped; we cap for memory safety), and parsed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from agent.core.scrapetargets import ScrapeTarget
from agent.status import exposition as ex
from agent.status.familygate import FamilyGate, LineAligned

log = logging.getLogger(__name__)

APP_BODY_CAP = 10 * 1024 * 1024  # bytes per application target (upstream's cap)
SOURCE_READ_BUFSIZE = 1024 * 1024  # bytes buffered per source read before pausing the socket
DEFAULT_SOURCE_TIMEOUT = 10.0  # seconds, when Prometheus sends no scrape-timeout header
TEXT_DEFAULT = "text/plain;version=0.0.4"
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OM_CONTENT_TYPE = "application/openmetrics-text; version={}; charset=utf-8"
ENVOY_ACCEPT = ("text/plain", "text/*")
APP_ACCEPT = ("text/plain", "text/*", "application/openmetrics-text")
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_MEDIA_RE = re.compile(rf"^({_TOKEN})(?:/({_TOKEN}))?$")
_COPIED_HEADERS = ("User-Agent", "X-Prometheus-Scrape-Timeout-Seconds")


def _parse_media_range(part: str) -> tuple[str, str] | None:
    """``(type, params without q)`` or None when the range does not parse."""
    pieces = [p.strip() for p in part.split(";")]
    m = _MEDIA_RE.match(pieces[0])
    if not m:
        return None
    mtype = pieces[0].lower() if m.group(2) else m.group(1)
    params = []
    for p in pieces[1:]:
        key, sep, val = p.partition("=")
        if not sep or not key.strip():
            return None
        if key.strip().lower() != "q":
            params.append(f"{key.strip()}={val.strip()}")
    return mtype, ";".join(params)


def filter_accept(header: str | None, allowed: tuple[str, ...]) -> str:
    """The ``Accept`` to send upstream: only ``allowed`` media types.

    Any unparsable range, or an empty header, gives ``text/plain;version=0.0.4``;
    ``*``/``*/*`` become that text type (once), ``application/*`` becomes OpenMetrics
    0.0.1 (once, if allowed); protobuf and everything else not allowed is dropped. Kept
    ranges are re-weighted ``q=0.<n-i>`` in their original order. Pure: no shared state
    (upstream's version races on a shared default object).
    """
    if not header or not header.strip():
        return TEXT_DEFAULT
    kept: list[str] = []
    star = app_star = False
    for part in header.split(","):
        parsed = _parse_media_range(part)
        if parsed is None:
            return TEXT_DEFAULT
        mtype, params = parsed
        if mtype in ("*", "*/*"):
            if not star:
                kept.append(TEXT_DEFAULT)
                star = True
        elif mtype == "application/*":
            if "application/openmetrics-text" in allowed and not app_star:
                kept.append("application/openmetrics-text;version=0.0.1")
                app_star = True
        elif mtype in allowed:
            kept.append(f"{mtype};{params}" if params else mtype)
    if not kept:
        return TEXT_DEFAULT
    n = len(kept)
    return ",".join(f"{k};q=0.{n - i}" for i, k in enumerate(kept))


def body_format(content_type: str | None) -> str:
    """``"text"``, ``"om-1.0.0"`` or ``"om-0.0.1"`` from an app's ``Content-Type``."""
    if not content_type:
        return "text"
    media, _, rest = content_type.partition(";")
    if media.strip().lower() != "application/openmetrics-text":
        return "text"
    version = "0.0.1"
    for p in rest.split(";"):
        key, _, val = p.partition("=")
        if key.strip().lower() == "version" and val.strip():
            version = val.strip()
    if version == "1.0.0":
        return "om-1.0.0"
    return "om-0.0.1" if version == "0.0.1" else "text"


def source_session() -> aiohttp.ClientSession:
    """The client session for metrics sources: keep-alive connections reused across
    scrapes (no per-scrape TCP handshake to Envoy's admin), bodies passed through
    undecoded, and a :data:`SOURCE_READ_BUFSIZE` read buffer so a multi-megabyte body
    arrives in a few large chunks instead of many 64 KiB ones (aiohttp's default pauses
    the socket every 128 KiB). Call inside a running event loop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, use_dns_cache=False),
        auto_decompress=False, skip_auto_headers=("User-Agent",),
        read_bufsize=SOURCE_READ_BUFSIZE)


@dataclasses.dataclass
class _AppBody:
    body: bytes
    fmt: str
    url: str = ""


def _own_body(registry: CollectorRegistry, claims: ex.Claims) -> bytes:
    lower = ex.for_openmetrics if claims.om else ex.for_text
    return ex.render(claims.admit(lower(registry.collect()), "agent"), claims.om)


def _envoy_openmetrics(body: bytes, claims: ex.Claims) -> bytes:
    """Envoy's text as OpenMetrics (see :mod:`agent.status.exposition`), a family it
    emits in two groups merged into one (:func:`ex.merge_groups`). Raises ValueError."""
    fams = ex.merge_groups(ex.parse_text(body))
    return ex.render(claims.admit(ex.for_openmetrics(fams), "envoy"), True)


def _app_part(app: _AppBody, claims: ex.Claims) -> bytes:
    """One app body in the response's format, families other sources hold left out.

    A text body in a text response that loses nothing is passed through byte for byte
    (as upstream); otherwise the admitted families are rendered. Raises ValueError when
    the body does not parse in the format its Content-Type names."""
    fams = ex.parse_text(app.body) if app.fmt == "text" else ex.parse_openmetrics(app.body)
    lowered = (ex.for_openmetrics if claims.om else ex.for_text)(fams)
    kept = claims.admit(lowered, "application")
    if not claims.om and app.fmt == "text" and len(kept) == len(lowered):
        return ex.strip_eof(app.body)
    return ex.render(kept, claims.om)


class MetricsMerger:
    """Serves one merged scrape. Built once by the status server.

    ``registry`` is the agent's registry (the merger registers
    ``istio_agent_scrapes_total`` and ``istio_agent_scrape_failures_total{type}`` in it);
    ``envoy_url`` the Envoy stats URL or None; ``app_targets`` from
    :func:`agent.core.scrapetargets.parse_annotations`; ``app_host`` where the app
    listens; ``run_blocking`` runs CPU-bound conversions off the loop.
    """

    def __init__(self, registry: CollectorRegistry, envoy_url: str | None,
                 app_targets: list[ScrapeTarget], app_host: str,
                 run_blocking: Callable[..., Awaitable[Any]]):
        self.registry = registry
        self.envoy_url = envoy_url
        self.app_targets = app_targets
        self.app_host = f"[{app_host}]" if ":" in app_host else app_host
        self.run_blocking = run_blocking
        self.scrapes = Counter("istio_agent_scrapes_total", "Scrapes of the merged metrics "
                               "endpoint", registry=registry)
        self.failures = Counter("istio_agent_scrape_failures_total", "Merged-metrics sources "
                                "that failed, by type (envoy, application)", ["type"],
                                registry=registry)
        for kind in ("envoy", "application"):
            self.failures.labels(kind)
        self.dropped = Counter("ambient_agent_metrics_merge_dropped_families",
                               "Metric families left out of a merged scrape because an earlier "
                               "source (agent, then Envoy, then apps) already used the name, "
                               "by source", ["source"], registry=registry)
        for kind in ("envoy", "application"):
            self.dropped.labels(kind)
        self._reported_drops: frozenset = frozenset()
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = source_session()

    async def close(self) -> None:
        if self.session:
            await self.session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("MetricsMerger.start() was not called")
        return self.session

    def _upstream(self, request: web.Request, allowed: tuple[str, ...]
                  ) -> tuple[dict[str, str], aiohttp.ClientTimeout]:
        headers = {h: request.headers[h] for h in _COPIED_HEADERS if h in request.headers}
        headers["Accept"] = filter_accept(request.headers.get("Accept"), allowed)
        headers["Accept-Encoding"] = "identity"
        try:
            deadline = float(request.headers.get("X-Prometheus-Scrape-Timeout-Seconds", ""))
        except ValueError:
            deadline = DEFAULT_SOURCE_TIMEOUT
        if not deadline > 0:
            deadline = DEFAULT_SOURCE_TIMEOUT
        return headers, aiohttp.ClientTimeout(total=deadline)

    async def _fetch_app(self, request: web.Request, target: ScrapeTarget) -> _AppBody | None:
        headers, timeout = self._upstream(request, APP_ACCEPT)
        url = f"http://{self.app_host}:{target.port}{target.path}"
        try:
            async with self._client().get(url, headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                body = await resp.content.read(APP_BODY_CAP + 1)
                while len(body) <= APP_BODY_CAP and not resp.content.at_eof():
                    more = await resp.content.read(APP_BODY_CAP + 1 - len(body))
                    if not more:
                        break
                    body += more
                if len(body) > APP_BODY_CAP:
                    raise ValueError(f"body larger than {APP_BODY_CAP} bytes")
                return _AppBody(body, body_format(resp.headers.get("Content-Type")), url)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.warning("scraping application metrics %r failed: %s", url, e)
            self.failures.labels("application").inc()
            return None

    async def _open_envoy(self, request: web.Request, envoy_url: str
                          ) -> aiohttp.ClientResponse | None:
        headers, timeout = self._upstream(request, ENVOY_ACCEPT)
        url = envoy_url + (("?" + request.query_string) if request.query_string else "")
        try:
            resp = await self._client().get(url, headers=headers, timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.warning("scraping Envoy metrics failed: %s", e)
            self.failures.labels("envoy").inc()
            return None
        if resp.status != 200:
            log.warning("scraping Envoy metrics failed: HTTP %d", resp.status)
            resp.release()
            self.failures.labels("envoy").inc()
            return None
        return resp

    @staticmethod
    def _final_format(apps: list[_AppBody | None]) -> str:
        formats = [a.fmt for a in apps if a is not None]
        if not formats or any(f != formats[0] for f in formats):
            return "text"
        return formats[0]

    async def serve(self, request: web.Request) -> web.StreamResponse:
        """Write one merged scrape to ``request``'s response. Always 200."""
        self.scrapes.inc()
        envoy_task = (asyncio.ensure_future(self._open_envoy(request, self.envoy_url))
                      if self.envoy_url else None)
        try:
            apps = list(await asyncio.gather(*(self._fetch_app(request, t)
                                               for t in self.app_targets)))
            fmt = self._final_format(apps)
            om = fmt != "text"
            claims = ex.Claims(om)
            response = web.StreamResponse(status=200)
            response.content_type = "application/openmetrics-text" if om else "text/plain"
            response.headers["Content-Type"] = (OM_CONTENT_TYPE.format(fmt[3:]) if om
                                                else TEXT_CONTENT_TYPE)
            if "gzip" in request.headers.get("Accept-Encoding", ""):
                response.enable_compression()
            await response.prepare(request)
            await response.write(_own_body(self.registry, claims))
            if envoy_task is not None:
                envoy, envoy_task = await envoy_task, None
                if envoy is not None:
                    await self._write_envoy(envoy, response, claims)
            for app in apps:
                if app is None:
                    continue
                try:
                    part = await self.run_blocking(_app_part, app, claims)
                except ValueError as e:
                    log.warning("application metrics %r dropped: not valid %s: %s", app.url,
                                "text" if app.fmt == "text" else "OpenMetrics", e)
                    self.failures.labels("application").inc()
                    continue
                await response.write(part)
            if om:
                await response.write(b"# EOF\n")
            await response.write_eof()
            self._count_drops(claims)
            return response
        finally:
            if envoy_task is not None:  # the scrape failed before Envoy's body was used
                _discard_envoy(envoy_task)

    def _count_drops(self, claims: ex.Claims) -> None:
        for source, n in claims.dropped.items():
            self.dropped.labels(source).inc(n)
        shape = frozenset(claims.dropped.items())
        if shape != self._reported_drops:  # log a change, not every scrape
            self._reported_drops = shape
            if shape:
                log.warning("merged metrics: families dropped because an earlier source "
                            "uses their names (first source wins): %s",
                            ", ".join(f"{s}={n}" for s, n in sorted(shape)))

    async def _write_envoy(self, resp: aiohttp.ClientResponse,
                           response: web.StreamResponse, claims: ex.Claims) -> None:
        try:
            if claims.om:
                body = await resp.read()
                await response.write(await self.run_blocking(_envoy_openmetrics, body, claims))
                return
            lines = LineAligned(FamilyGate(claims, "envoy"))
            async for chunk in resp.content.iter_any():
                for part in lines.feed(chunk):
                    await response.write(part)
            for part in lines.close():
                await response.write(part)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.warning("reading Envoy metrics failed: %s", e)
            self.failures.labels("envoy").inc()
        finally:
            resp.release()


def _discard_envoy(task: "asyncio.Future[aiohttp.ClientResponse | None]") -> None:
    """Cancel an unfinished Envoy request, or release its response, so a scrape whose
    client went away does not keep a pooled admin connection checked out."""
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is None:
        resp = task.result()
        if resp is not None:
            resp.release()
