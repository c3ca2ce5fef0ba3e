"""`ambient-agent run --config-source kubernetes` started while the real kube-apiserver is
stopped (``apiserver-stop``), as a DaemonSet pod is when the control plane is down:

- the health port answers ``/healthz`` 200 within seconds of the process start, while
  ``/readyz`` is 503 naming the config source (kubelet's liveness probe, 6 x 10 s, would
  otherwise restart the pod after 60 s; readiness must stay false);
- the unreachable API server is logged once per backoff step, not once per kind per
  step: every WARNING line names the kinds it covers and the reason; in 20 s at most one
  line per step of the 0.5 s-doubling backoff (+ the "not synced" line), where the agent
  used to write one per kind per step (66 with 11 kinds);
- once the API server is back (``apiserver-start``) the agent becomes ready and says so
  in one INFO line.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from agent.demo.envoy import free_port
from ambient.source_kube import RESOURCES
from tests.kube import cluster as kc

pytestmark = pytest.mark.timeout(240)

DOWN_SECONDS = 20.0  # s after /healthz first answers


@pytest.fixture
def node_netns():
    """A scratch netns for the agent's host probe rules (never this machine's own)."""
    from pyroute2 import netns

    if os.geteuid() != 0:
        pytest.skip("needs root (a netns for the host probe rules)")
    name = "tdown" + os.urandom(3).hex()
    netns.create(name)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        netns.remove(name)


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status, await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0, ""


async def test_liveness_from_start_and_one_warning_per_backoff_step_while_apiserver_down(
        kube_cluster, agent_kubeconfig, tmp_path, node_netns):
    node = kc.unique("node")
    state = tmp_path / "state"
    health_port = free_port()
    argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(state),
            "--config-source", "kubernetes", "--kubeconfig", agent_kubeconfig,
            "--node-name", node, "--xds-port", str(free_port()), "--xds-tls-port", "0",
            "--status-port", str(free_port()), "--health-port", str(health_port), "--monitoring-port", "0",
            "--host-rules-netns", node_netns, "--log-level", "info"]
    env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(state / "ztunnel" / "ztunnel.sock"))
    env.pop("KUBECONFIG", None)
    log_path = tmp_path / "agent.log"
    base = f"http://127.0.0.1:{health_port}"
    kube_cluster.apiserver_stop()
    down = True
    proc = None
    try:
        with open(log_path, "w") as log:
            started = time.monotonic()
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        async with aiohttp.ClientSession() as http:
            while (await _get(http, f"{base}/healthz"))[0] != 200:
                assert proc.poll() is None, log_path.read_text()
                # kubelet restarts after 6 x 10 s of failed probes; the process start
                # itself (imports) takes seconds on a loaded machine
                assert time.monotonic() - started < 45, \
                    f"/healthz not answering 45 s after start:\n{log_path.read_text()}"
                await asyncio.sleep(0.1)
            live_after = time.monotonic() - started
            # down for the window: alive, never ready, reason named
            live = time.monotonic()
            while time.monotonic() - live < DOWN_SECONDS:
                assert (await _get(http, f"{base}/healthz"))[0] == 200
                status, text = await _get(http, f"{base}/readyz")
                assert status == 503, (status, text)
                assert "config-source" in text or "status" in text, text
                assert proc.poll() is None, log_path.read_text()
                await asyncio.sleep(1.0)
            down_log = log_path.read_text()
            kube_cluster.apiserver_start()
            down = False
            deadline = time.monotonic() + 90
            while (await _get(http, f"{base}/readyz"))[0] != 200:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                await asyncio.sleep(0.3)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if down:  # the session's API server, for the tests after this one
            kube_cluster.apiserver_start()
    print(f"/healthz answered {live_after:.1f}s after the process started")
    out = log_path.read_text()
    warnings = [line for line in down_log.splitlines() if " WARNING " in line]
    retry_lines = [w for w in warnings if "kubernetes API:" in w]
    assert retry_lines, down_log
    # 0.5, 1, 2, 4, 8, 16 s (jittered up to 1.2x): at most 6 steps fit in 20 s, +1 for the
    # first line (gathered before the other kinds' first failure was counted), +1 "not synced"
    assert len(warnings) <= 8, "\n".join(warnings)
    for w in retry_lines:
        assert "retrying in" in w and "failed (" in w, w
    # the kinds are named together, not one line each
    assert any(f"{len(RESOURCES)} kinds failed" in w for w in retry_lines), "\n".join(warnings)
    assert "kubernetes API answers again" in out, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
