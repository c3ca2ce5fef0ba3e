"""Kubelet app probes rewritten to the status server: parse ``ISTIO_KUBE_APP_PROBERS`` and run them.

The injector rewrites a container's httpGet/tcpSocket/grpc probes to
``GET :15020/app-health/<container>/<livez|readyz|startupz>`` (and lifecycle hooks to
``/app-lifecycle/<container>/<prestopz|poststartz>``) and stores the originals as JSON
in ``ISTIO_KUBE_APP_PROBERS`` (``docs/status.md``). The status server runs
the original probe against the app and answers kubelet with the mapped status:

- httpGet: the app's status and up to 10 KiB of its body; a final 3xx → 200 (the
  ``Location`` header is not forwarded); transport error or timeout → 500. Redirects are
  followed only to the same host, at most 10; a redirect to another host returns 200.
- tcpSocket: connect → 200, failure → 500.
- grpc: ``grpc.health.v1.Health/Check`` SERVING → 200, anything else → 500.

Differences from upstream, on purpose (documented in docs/status.md): HTTP/2 probing via
ALPN is not offered (aiohttp speaks HTTP/1.1 only); a missing or zero ``timeoutSeconds``
is kubelet's default of 1 s for gRPC (upstream builds a zero deadline that always fails)
and :data:`MAX_UNBOUNDED_TIMEOUT` for HTTP/TCP (upstream: none) so a hung app can't pin
a task forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
import struct
from typing import Mapping
from urllib.parse import urljoin, urlsplit

import aiohttp

from agent.core.appprobes import AppProbe

log = logging.getLogger(__name__)

BODY_CAP = 10240  # bytes of the app's body returned to kubelet (upstream's cap)
MAX_REDIRECTS = 10
MAX_UNBOUNDED_TIMEOUT = 60.0  # seconds, stands in for "no timeout" on HTTP/TCP probes
GRPC_DEFAULT_TIMEOUT = 1.0  # seconds, kubelet's default timeoutSeconds
# Headers that describe the kubelet→agent hop, not the agent→app one.
_HOP_HEADERS = frozenset(h.lower() for h in (
    "Host", "Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "Upgrade",
    "TE", "Trailer", "Content-Length", "Accept-Encoding"))


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the status server answers kubelet: HTTP ``status`` and ``body`` bytes."""

    status: int
    body: bytes = b""


# --- execution ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProbeTarget:
    """Where probes go: ``host`` (pod IP, or ``localhost``), source addresses to bind
    (empty = let the kernel choose), and the status port (for the Host-header rule)."""

    host: str = "127.0.0.1"
    source_ip: str = "127.0.0.6"
    source_ip6: str = ""
    status_port: int = 15020
    keepalive: bool = False

    def is_ipv6(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).version == 6
        except ValueError:
            return False

    def hostport(self, port: int) -> str:
        """``host:port`` with IPv6 bracketed (a pre-bracketed host stays invalid, as upstream)."""
        return f"[{self.host}]:{port}" if self.is_ipv6() else f"{self.host}:{port}"

    def source(self) -> str:
        return self.source_ip6 if self.is_ipv6() else self.source_ip


def _effective_timeout(probe: AppProbe) -> float:
    return probe.timeout if probe.timeout > 0 else MAX_UNBOUNDED_TIMEOUT


def _linger_socket(addr_info: tuple) -> socket.socket:
    """aiohttp socket factory: SO_LINGER {on, 1 s} so probes leave no TIME_WAIT pile-up."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 1))
    return sock


def _forward_headers(incoming: Mapping[str, str], target: ProbeTarget, app_port: int
                     ) -> dict[str, str]:
    """Copy kubelet's headers (it already added the probe's httpHeaders), fixing Host.

    Host stays the incoming one unless it names the status port, which the app does not
    listen on; then it becomes ``<host>:<appPort>``.
    """
    headers = {k: v for k, v in incoming.items() if k.lower() not in _HOP_HEADERS}
    host = incoming.get("Host", "")
    if host:
        name, sep, port = host.rpartition(":")
        if sep and port == str(target.status_port):
            host = f"{name}:{app_port}"
        headers["Host"] = host
    headers["Connection"] = "keep-alive" if target.keepalive else "close"
    return headers


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    buf = bytearray()
    while len(buf) < cap:
        chunk = await resp.content.read(cap - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


async def run_http(probe: AppProbe, target: ProbeTarget, headers: Mapping[str, str]
                   ) -> ProbeResult:
    """Run an httpGet probe. Never raises: errors become 500."""
    url = f"{probe.scheme}://{target.hostport(probe.port)}{probe.path}"
    source = target.source()
    connector = aiohttp.TCPConnector(
        ssl=False, force_close=not target.keepalive, local_addr=(source, 0) if source else None,
        socket_factory=_linger_socket, use_dns_cache=False)
    timeout = aiohttp.ClientTimeout(total=_effective_timeout(probe))
    send_headers = _forward_headers(headers, target, probe.port)
    origin_host = urlsplit(url).hostname
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         auto_decompress=False, skip_auto_headers=(
                                             "User-Agent", "Accept-Encoding")) as session:
            for _ in range(MAX_REDIRECTS + 1):
                async with session.get(url, headers=send_headers, allow_redirects=False) as resp:
                    if 300 <= resp.status < 400:
                        location = resp.headers.get("Location")
                        if not location:
                            return ProbeResult(200)
                        next_url = urljoin(url, location)
                        if urlsplit(next_url).hostname != origin_host:
                            # Another host: stop here; 3xx counts as success (Location isn't forwarded).
                            return ProbeResult(200)
                        url = next_url
                        continue
                    return ProbeResult(resp.status, await _read_capped(resp, BODY_CAP))
            log.info("probe %s: more than %d redirects", probe.path, MAX_REDIRECTS)
            return ProbeResult(500)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        log.debug("http probe %s failed: %s", url, e)
        return ProbeResult(500)


async def run_tcp(probe: AppProbe, target: ProbeTarget) -> ProbeResult:
    """Run a tcpSocket probe: 200 when a connection opens within the timeout, else 500."""
    source = target.source()
    host = target.host
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, probe.port,
                                    local_addr=(source, 0) if source else None),
            _effective_timeout(probe))
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        log.debug("tcp probe %s:%d failed: %s", host, probe.port, e)
        return ProbeResult(500)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 1))
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return ProbeResult(200)


async def run_grpc(probe: AppProbe, target: ProbeTarget, user_agent: str = "") -> ProbeResult:
    """Run a grpc probe: ``grpc.health.v1.Health/Check`` SERVING → 200, else 500."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.primary_user_agent", user_agent)] if user_agent else []
    timeout = probe.timeout if probe.timeout > 0 else GRPC_DEFAULT_TIMEOUT
    try:
        async with grpc.aio.insecure_channel(target.hostport(probe.port), options=options) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=probe.service), timeout=timeout)
    except grpc.RpcError as e:
        log.debug("grpc probe %s failed: %s", probe.port, e.code() if hasattr(e, "code") else e)
        return ProbeResult(500)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return ProbeResult(200)
    return ProbeResult(500)


async def run_probe(probe: AppProbe, target: ProbeTarget, headers: Mapping[str, str]
                    ) -> ProbeResult:
    """Dispatch on the probe kind. Never raises for app failures (those are 500)."""
    if probe.kind == "httpGet":
        return await run_http(probe, target, headers)
    if probe.kind == "tcpSocket":
        return await run_tcp(probe, target)
    return await run_grpc(probe, target, headers.get("User-Agent", ""))
