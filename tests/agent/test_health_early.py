"""The health port listens from the start of the process: ``ambient-agent run
--config-source kubernetes`` with a kubeconfig naming a port nothing listens on (no API
server at all) answers ``/healthz`` 200 while ``/readyz`` is 503 naming
the config source, and keeps doing so while it retries (the real API server stopped and
restarted: tests/kube/test_agent_apiserver_down.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from agent.demo.envoy import free_port

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (host rules netns)")]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def test_healthz_answers_while_the_api_server_is_unreachable(tmp_path):
    from pyroute2 import netns

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n"
        f"    server: https://127.0.0.1:{dead}\n    insecure-skip-tls-verify: true\n"
        "users:\n- name: u\n  user:\n    token: x\ncontexts:\n- name: c\n  context:\n"
        "    cluster: c\n    user: u\ncurrent-context: c\n")
    name = "thealth" + os.urandom(3).hex()
    netns.create(name)
    state = tmp_path / "state"
    health = free_port()
    argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(state),
            "--config-source", "kubernetes", "--kubeconfig", str(kubeconfig),
            "--node-name", "n1", "--xds-port", str(free_port()), "--xds-tls-port", "0",
            "--status-port", str(free_port()), "--health-port", str(health), "--monitoring-port", "0",
            "--host-rules-netns", f"/var/run/netns/{name}"]
    env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(state / "zt" / "ztunnel.sock"))
    env.pop("KUBECONFIG", None)
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while _get(f"http://127.0.0.1:{health}/healthz")[0] != 200:
            assert proc.poll() is None, log.read_text()
            # only a hang guard: what proves "before the API server" is /readyz below still
            # naming the config source; a cold interpreter at load ~20 took over 20 s once
            assert time.monotonic() - started < 90, log.read_text()
            time.sleep(0.1)
        for _ in range(3):
            status, text = _get(f"http://127.0.0.1:{health}/readyz")
            assert status == 503 and "config-source" in text, (status, text)
            assert _get(f"http://127.0.0.1:{health}/healthz")[0] == 200
            time.sleep(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        netns.remove(name)
    assert proc.returncode == 0, log.read_text()[-3000:]
