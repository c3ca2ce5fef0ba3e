"""Run a real ztunnel binary (built by the operator from istio/ztunnel; never shipped
here) against this agent as its only control plane: ZDS for the pods' netns, workload
xDS and the CA on the agent's TLS port. Used by ``ambient-agent demo --ztunnel PATH`` and
the peer tests that read the binary's path from ``AMBIENT_TEST_ZTUNNEL``.

What ztunnel reads (its ``src/config.rs``; docs/ztunnel.md has the whole table):

- ``XDS_ADDRESS`` / ``CA_ADDRESS``: ``https://localhost:<port>``; both are the agent's
  TLS port (xDS and ``IstioCertificateService`` on one port, as istiod's 15012);
- ``XDS_ROOT_CA`` / ``CA_ROOT_CA``: a PEM file with the mesh root the agent publishes;
- ``AUTH_TOKEN``: a file with the bearer token ztunnel sends (``authorization: Bearer``);
  outside Kubernetes the agent maps it to ``istio-system/ztunnel`` via its tokens file;
- ``CLUSTER_ID``, ``NODE_NAME``, ``INPOD_UDS`` (the agent's ZDS socket);
- ``PROXY_CONFIG``: YAML/JSON with ``proxyAdminPort`` and ``statsPort`` so the admin
  (``/config_dump``) and metrics ports do not collide with the agent's 15020. The
  readiness port is fixed at 15021 (there is no setting for it upstream).

:class:`ZtunnelProcess` starts it, waits for ``:15021/healthz/ready``, reads its
``/config_dump`` and metrics, and stops it. Errors: :class:`ZtunnelError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

READINESS_PORT = 15021  # fixed in ztunnel (config.rs: DEFAULT_READINESS_PORT, no setting)
ZTUNNEL_IDENTITY = "istio-system/ztunnel"


class ZtunnelError(RuntimeError):
    """ztunnel could not start, exited early, or did not become ready in time."""


@dataclass
class ZtunnelSettings:
    """Everything a ztunnel needs to use this agent. ``xds_address`` is ``host:port`` of
    the agent's TLS port; ``root_cert`` the mesh root PEM file; ``token_file`` the bearer
    token file; ``zds_socket`` the agent's ZDS socket; ports are TCP ports on 127.0.0.1."""

    binary: str
    xds_address: str
    root_cert: str
    token_file: str
    zds_socket: str
    node_name: str
    admin_port: int
    stats_port: int
    cluster_id: str = "Kubernetes"
    trust_domain: str = "cluster.local"
    log_level: str = "info"
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The process environment ztunnel is started with (its config.rs names)."""
        url = f"https://{self.xds_address}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "XDS_ADDRESS": url, "CA_ADDRESS": url,
            "XDS_ROOT_CA": self.root_cert, "CA_ROOT_CA": self.root_cert,
            "AUTH_TOKEN": self.token_file,
            "CLUSTER_ID": self.cluster_id, "TRUST_DOMAIN": self.trust_domain,
            "NODE_NAME": self.node_name, "INPOD_UDS": self.zds_socket,
            "PROXY_CONFIG": json.dumps({"proxyAdminPort": self.admin_port,
                                        "statsPort": self.stats_port,
                                        "proxyMetadata": {}}),
            "RUST_LOG": self.log_level,
        }
        env.update(self.extra_env)
        return env


class ZtunnelProcess:
    """One ztunnel process; its stdout+stderr go to ``log_path``."""

    def __init__(self, settings: ZtunnelSettings, log_path: Path):
        self.settings = settings
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start ztunnel (``proxy``). Raises ZtunnelError if the binary is missing."""
        if not os.access(self.settings.binary, os.X_OK):
            raise ZtunnelError(f"ztunnel binary {self.settings.binary!r} is not executable")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen([self.settings.binary, "proxy"], env=self.settings.env(),
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def log(self) -> str:
        """Everything ztunnel logged so far (text)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _get(self, port: int, path: str, timeout: float = 2.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def ready(self) -> bool:
        """True when ztunnel's readiness endpoint answers 200."""
        try:
            return self._get(READINESS_PORT, "/healthz/ready")[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until ready. Raises ZtunnelError (with the log's tail) on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ZtunnelError(f"ztunnel exited with {self.proc.returncode}: "
                                   f"{self.log()[-2000:]}")
            if self.ready():
                return
            time.sleep(0.1)
        raise ZtunnelError(f"ztunnel not ready after {timeout:.0f}s: {self.log()[-2000:]}")

    async def wait_ready_async(self, timeout: float = 30.0) -> None:
        await asyncio.to_thread(self.wait_ready, timeout)

    def config_dump(self) -> dict:
        """ztunnel's ``/config_dump`` (workloads, services, policies, certificates and the
        in-pod ``workloadState``: pod uid → {state: Up|Pending, ...})."""
        status, body = self._get(self.settings.admin_port, "/config_dump", timeout=5)
        if status != 200:
            raise ZtunnelError(f"config_dump answered {status}: {body[:200]}")
        return json.loads(body)

    def pod_states(self) -> dict[str, str]:
        """Pod uid → in-pod proxy state as ztunnel reports it (``Up``, ``Pending``)."""
        dump = self.config_dump()
        states = dump.get("workloadState") or {}
        return {uid: (s or {}).get("state", "") for uid, s in states.items()}

    def metrics(self) -> str:
        """ztunnel's Prometheus text from its stats port."""
        return self._get(self.settings.stats_port, "/metrics", timeout=5)[1]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

