"""`ambient-agent run` as a real process: starts on defaults, SIGTERM exits 0 and leaves
no socket files behind."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from agent.envoy import free_port
from tests.netns.toolkit import is_root

EXPECTED_SOCKETS = {"pluginevent.sock", "workload-spiffe-uds/socket", "ztunnel/ztunnel.sock"}


@pytest.fixture
def node_netns():
    """A scratch netns for the agent's host probe rules: the tests' agents must never
    leave their fixed-name SNAT chain and probe sets in this machine's own netns."""
    if not is_root():
        pytest.skip("needs root: creates a network namespace")
    from pyroute2 import netns

    name = "tnode" + os.urandom(3).hex()
    netns.create(name)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        netns.remove(name)


def sockets_under(root: str) -> set[str]:
    found = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                found.add(os.path.relpath(p, root))
    return found


@pytest.mark.skipif(not is_root(), reason="needs root: the agent enters netns and binds :15020-style ports")
def test_sigterm_leaves_no_sockets(tmp_path, node_netns):
    state = tmp_path / "state"
    env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(state / "ztunnel" / "ztunnel.sock"))
    argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(state),
            "--status-port", str(free_port()), "--health-port", str(free_port()),
            "--xds-port", str(free_port()), "--xds-tls-port", "0", "--host-rules-netns", node_netns,
            "--log-level", "info"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if EXPECTED_SOCKETS <= sockets_under(str(state)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        assert EXPECTED_SOCKETS <= sockets_under(str(state)), sockets_under(str(state))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert sockets_under(str(state)) == set(), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not is_root(), reason="needs root: the agent enters netns and binds ports")
@pytest.mark.parametrize("taken", ["--xds-port", "--status-port"])
def test_port_in_use_is_one_clear_line(tmp_path, taken, node_netns):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = {"--status-port": str(free_port()), "--health-port": str(free_port()),
                 "--xds-port": str(free_port())}
        ports[taken] = str(busy.getsockname()[1])
        env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(tmp_path / "z.sock"))
        argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(tmp_path / "s"),
                "--xds-tls-port", "0", "--host-rules-netns", node_netns,
                "--log-level", "none"]
        for flag, port in ports.items():
            argv += [flag, port]
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and ports[taken] in lines[0], r.stderr
    assert sockets_under(str(tmp_path / "s")) == set()


@pytest.mark.skipif(not is_root(), reason="needs root: the agent enters netns and binds ports")
def test_second_agent_on_same_state_dir_is_refused_and_harmless(tmp_path, node_netns):
    state = tmp_path / "state"
    env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(state / "ztunnel" / "ztunnel.sock"))
    argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(state),
            "--status-port", str(free_port()), "--health-port", str(free_port()),
            "--xds-port", str(free_port()), "--xds-tls-port", "0", "--host-rules-netns", node_netns,
            "--log-level", "warn"]
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not EXPECTED_SOCKETS <= sockets_under(str(state)):
            time.sleep(0.2)
        before = sockets_under(str(state))
        assert EXPECTED_SOCKETS <= before
        second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "another ambient-agent" in lines[0], second.stderr
        assert f"pid {first.pid}" in lines[0]
        assert sockets_under(str(state)) == before  # nothing of the first agent's touched
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=30)
        assert first.returncode == 0, out
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
