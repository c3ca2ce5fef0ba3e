"""Merged Prometheus metrics for ``/stats/prometheus`` and ``/metrics`` (spec ``sds-ca-status.md`` §4.6).

One scrape returns, in this order: the agent's own registry, Envoy's ``/stats/prometheus``
(when an Envoy admin port is configured) and the application's targets from
``ISTIO_PROMETHEUS_ANNOTATIONS``, always with HTTP 200: a failing source is logged, counted
in ``istio_agent_scrape_failures_total{type}`` and left out.

What the merge guarantees beyond upstream (which concatenates blindly):
- exactly one ``# EOF``, at the end, and only for an OpenMetrics response; the agent's own
  part and Envoy's text are rendered as OpenMetrics too in that case (prometheus-client's
  parser and OpenMetrics writer), so the whole body parses as OpenMetrics;
- no ``# HELP``/``# TYPE`` line for a family already declared by an earlier source or
  earlier in the same source (a second one makes Prometheus reject the whole scrape);
- a source whose body lacks a final newline is repaired;
- a protobuf ``Accept`` is never forwarded (``filter_accept``), Envoy is asked for text only.

Envoy's body is streamed through in text mode (line-aligned chunks), so a multi-megabyte
stats page costs little more than fetching it. Application bodies are buffered up to
:data:`APP_BODY_CAP` each (read cap+1 to detect overflow; larger → dropped and counted),
also for a single target (upstream streams one target uncapped; we cap for memory safety).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_latest

log = logging.getLogger("agent.status.metrics")

RESERVED_PORTS = frozenset({15000, 15001, 15004, 15006, 15008, 15020, 15021, 15053, 15090})
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
# Metadata lines are located with bytes.find (memchr) on "#", rare in a stats body and
# ~4x faster than a regex scan of every byte; the keys are then pulled out of just those
# lines by one C-level findall. _META_AT checks one line start (the slow path).
_META_AT = re.compile(rb"# ((?:HELP|TYPE) \S+)")
_META_RE = re.compile(rb"\n# ((?:HELP|TYPE) \S+)")
_EOF_RE = re.compile(rb"(?:^|\n)# EOF[ \t\r\n]*\Z")
_COPIED_HEADERS = ("User-Agent", "X-Prometheus-Scrape-Timeout-Seconds")


class AnnotationsError(ValueError):
    """``ISTIO_PROMETHEUS_ANNOTATIONS`` is unusable; the message names the field and value."""


@dataclasses.dataclass(frozen=True)
class ScrapeTarget:
    """One application metrics endpoint: ``http://<host>:<port><path>``."""

    port: int
    path: str = "/metrics"


def _target_port(value: Any, status_port: int, where: str) -> int:
    """Ports compare numerically, so ``015020`` is the status port too (recursion guard)."""
    text = str(value).strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise AnnotationsError(f"{where}.port={value!r}: must be an integer 1..65535")
    port = int(text)
    if port == status_port or port in RESERVED_PORTS:
        raise AnnotationsError(f"{where}.port={value!r}: port {port} is reserved for the "
                               "agent/Envoy and would scrape itself")
    return port


def parse_annotations(value: Any, status_port: int, given: bool = False) -> list[ScrapeTarget]:
    """Normalise ``ISTIO_PROMETHEUS_ANNOTATIONS`` (a JSON string or decoded object) to targets.

    ``given`` says the variable was set (a set-but-empty value is an error, spec §6).
    Returns [] when app scraping is off (unset, or ``scrape == "false"``). With no
    ``targets`` one target is synthesised from ``port`` (default 80) and ``path``
    (default ``/metrics``). Upstream quirk decided deliberately: when ``targets`` is given
    the targets are scraped, never a differing legacy top-level port. Raises
    :class:`AnnotationsError`.
    """
    if value is None or value == "":
        if given:
            raise AnnotationsError("value is empty: expected a JSON object such as "
                                   '{"scrape":"true","port":"8080","path":"/metrics"}')
        return []
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise AnnotationsError(f"failed to decode JSON: {e}") from None
    if not isinstance(value, dict):
        raise AnnotationsError(f"expected a JSON object, got {type(value).__name__}")
    if str(value.get("scrape", "true")).strip().lower() == "false":
        return []
    raw_targets = value.get("targets")
    if raw_targets in (None, []):
        raw_targets = [{"port": value.get("port") or "80", "path": value.get("path") or ""}]
    if not isinstance(raw_targets, list):
        raise AnnotationsError(f"targets={raw_targets!r}: must be a list of {{port, path}}")
    targets = []
    for i, t in enumerate(raw_targets):
        where = f"targets[{i}]"
        if not isinstance(t, dict):
            raise AnnotationsError(f"{where}={t!r}: must be an object with port and path")
        path = str(t.get("path") or "/metrics")
        if not path.startswith("/"):
            path = "/" + path
        targets.append(ScrapeTarget(_target_port(t.get("port"), status_port, where), path))
    return targets


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
    """The ``Accept`` to send upstream: only ``allowed`` media types (spec §4.6).

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


def strip_eof(body: bytes) -> bytes:
    """Drop a trailing ``# EOF`` line (trailing spaces/tabs/CR/LF tolerated); end with ``\\n``."""
    m = _EOF_RE.search(body)
    if m:
        body = body[:m.start()]
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return body


def _metadata_lines(data: bytes, end: int) -> list[tuple[int, bytes]]:
    """``(offset, b"TYPE <name>" | b"HELP <name>")`` of every metadata line in
    ``data[:end]``, in order."""
    find, match = data.find, _META_AT.match
    found = []
    i = find(b"#", 0, end)
    while i >= 0:
        if i == 0 or data[i - 1] == 0x0A:  # "#" at a line start
            m = match(data, i, end)
            if m:
                found.append((i, m.group(1)))
        i = find(b"#", i + 1, end)
    return found


def _metadata_keys(data: bytes, end: int) -> list[bytes]:
    """``b"TYPE <name>"``/``b"HELP <name>"`` of every metadata line in ``data[:end]``, in
    order. Per ``#`` only two finds and a slice; the matching runs in C."""
    find = data.find
    lines = []
    i = find(b"#", 0, end)
    while i >= 0:
        j = find(b"\n", i, end)
        if j < 0:
            j = end
        # From the byte before "#": "\n# TYPE ..." only when the "#" starts a line.
        lines.append(data[i - 1:j] if i else b"\n" + data[:j])
        i = find(b"#", j, end)
    return _META_RE.findall(b"\n".join(lines)) if lines else []


class MetadataDedup:
    """Drops ``# HELP``/``# TYPE`` lines for families already declared in this response.

    Feed complete lines (chunks ending in ``\\n``). Keys are ``b"TYPE <name>"`` /
    ``b"HELP <name>"``. The fast path (no repeat, the normal case for Envoy's body) costs
    a memchr scan plus a little work per metadata line (not per sample line) and returns
    the chunk uncopied.
    """

    def __init__(self) -> None:
        self.seen: set[bytes] = set()

    def filter(self, data: bytes, end: int | None = None) -> bytes | memoryview:
        """``data[:end]`` without repeated metadata lines: ``data`` itself (or a
        memoryview of its first ``end`` bytes) when nothing repeats, else a new bytes."""
        end = len(data) if end is None else end
        found = _metadata_keys(data, end)
        keys = set(found)
        if len(keys) == len(found) and self.seen.isdisjoint(keys):
            self.seen |= keys
            return data if end == len(data) else memoryview(data)[:end]
        return self._cut_repeats(data, end, _metadata_lines(data, end))

    def _cut_repeats(self, data: bytes, end: int, found: list[tuple[int, bytes]]) -> bytes:
        """The slow path: cut each metadata line whose key was seen before."""
        out, pos = [], 0
        for start, key in found:
            if key in self.seen:
                nl = data.find(b"\n", start, end)
                out.append(data[pos:start])
                pos = end if nl < 0 else nl + 1
            else:
                self.seen.add(key)
        out.append(data[pos:end])
        return b"".join(out)


def text_to_openmetrics(body: bytes) -> bytes:
    """Re-render a Prometheus text body as OpenMetrics (without ``# EOF``).

    Untyped families become ``unknown``; a counter whose samples lack the ``_total``
    suffix OpenMetrics requires (Envoy has some) becomes ``unknown`` too, so sample
    names never change. Raises ValueError when the body does not parse. CPU-bound:
    call off the event loop.
    """
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(body.decode("utf-8")))
    for fam in families:
        if fam.type == "untyped":
            fam.type = "unknown"
        elif fam.type == "counter" and any(
                not s.name.endswith(("_total", "_created")) for s in fam.samples):
            fam.type = "unknown"
            fam.name = fam.samples[0].name if fam.samples else fam.name

    class _Families:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    return strip_eof(om_latest(registry))


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


class MetricsMerger:
    """Serves one merged scrape. Built once by the status server.

    ``registry`` is the agent's registry (the merger registers
    ``istio_agent_scrapes_total`` and ``istio_agent_scrape_failures_total{type}`` in it);
    ``envoy_url`` the Envoy stats URL or None; ``app_targets`` from
    :func:`parse_annotations`; ``app_host`` where the app listens; ``run_blocking`` runs
    CPU-bound conversions off the loop.
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
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = source_session()

    async def close(self) -> None:
        if self.session:
            await self.session.close()

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
            async with self.session.get(url, headers=headers, timeout=timeout) as resp:
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
                return _AppBody(body, body_format(resp.headers.get("Content-Type")))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.warning("scraping application metrics %r failed: %s", url, e)
            self.failures.labels("application").inc()
            return None

    async def _open_envoy(self, request: web.Request) -> aiohttp.ClientResponse | None:
        headers, timeout = self._upstream(request, ENVOY_ACCEPT)
        url = self.envoy_url + (("?" + request.query_string) if request.query_string else "")
        try:
            resp = await self.session.get(url, headers=headers, timeout=timeout)
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
        envoy_task = (asyncio.ensure_future(self._open_envoy(request))
                      if self.envoy_url else None)
        try:
            apps = list(await asyncio.gather(*(self._fetch_app(request, t)
                                               for t in self.app_targets)))
            fmt = self._final_format(apps)
            om = fmt != "text"
            response = web.StreamResponse(status=200)
            response.content_type = "application/openmetrics-text" if om else "text/plain"
            response.headers["Content-Type"] = (OM_CONTENT_TYPE.format(fmt[3:]) if om
                                                else TEXT_CONTENT_TYPE)
            if "gzip" in request.headers.get("Accept-Encoding", ""):
                response.enable_compression()
            await response.prepare(request)
            dedup = MetadataDedup()
            own = strip_eof(om_latest(self.registry)) if om else text_latest(self.registry)
            await response.write(dedup.filter(own))
            if envoy_task is not None:
                envoy, envoy_task = await envoy_task, None
                await self._write_envoy(envoy, response, dedup, om)
            for app in apps:
                if app is not None and app.body:
                    await response.write(dedup.filter(strip_eof(app.body)))
            if om:
                await response.write(b"# EOF\n")
            await response.write_eof()
            return response
        finally:
            if envoy_task is not None:  # the scrape failed before Envoy's body was used
                _discard_envoy(envoy_task)

    async def _write_envoy(self, resp: aiohttp.ClientResponse | None,
                           response: web.StreamResponse, dedup: MetadataDedup, om: bool) -> None:
        if resp is None:
            return
        try:
            if om:
                body = await resp.read()
                await response.write(dedup.filter(
                    await self.run_blocking(text_to_openmetrics, body)))
                return
            tail = b""  # the unfinished last line of the previous chunk
            async for chunk in resp.content.iter_any():
                cut = chunk.rfind(b"\n") + 1
                if not cut:
                    tail += chunk
                    continue
                # One write per chunk: the line split across chunks rides along (a copy of
                # one chunk, far cheaper than an extra small send on the socket).
                if tail:
                    chunk, cut, tail = tail + chunk, cut + len(tail), b""
                await response.write(dedup.filter(chunk, cut))
                tail = chunk[cut:]
            if tail:  # a body without a final newline: repair it
                await response.write(dedup.filter(tail + b"\n"))
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
    elif not task.cancelled() and task.exception() is None and task.result() is not None:
        task.result().release()
