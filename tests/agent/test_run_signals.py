"""`ambient-agent run` as a real process: starts on defaults, SIGTERM exits 0 and leaves
no socket files behind; SIGHUP/SIGUSR1/SIGUSR2 are ignored; a second SIGTERM exits 128+15 and
leaves nothing behind either (``docs/operating.md`` "Signals")."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from agent.demo.envoy import free_port
from tests.netns.toolkit import is_root

# admin.sock is bound by the status component, which starts last: once it is there, every
# socket the agent makes is (a snapshot taken earlier races the start)
EXPECTED_SOCKETS = {"pluginevent.sock", "workload-spiffe-uds/socket", "ztunnel/ztunnel.sock",
                    "admin.sock"}


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
            try:
                mode = os.lstat(p).st_mode
            except FileNotFoundError:  # a socket bound under a temporary name, renamed since
                continue
            if stat.S_ISSOCK(mode):
                found.add(os.path.relpath(p, root))
    return found


ROOT_ONLY = pytest.mark.skipif(not is_root(),
                               reason="needs root: the agent enters netns and binds ports")


def agent_argv(state, node_netns: str, **ports: str) -> tuple[list[str], dict]:
    """``ambient-agent run`` on free ports (or the given ``--x-port`` values), host probe
    rules in ``node_netns``, ZDS socket under ``state``. Returns (argv, env)."""
    chosen = {"--status-port": str(free_port()), "--health-port": str(free_port()),
              "--xds-port": str(free_port()), "--monitoring-port": "0"}
    chosen.update({"--" + k.replace("_", "-"): v for k, v in ports.items()})
    argv = [sys.executable, "-m", "agent.cli", "run", "--state-dir", str(state),
            "--xds-tls-port", "0", "--host-rules-netns", node_netns, "--log-level", "warn"]
    for flag, port in chosen.items():
        argv += [flag, port]
    env = dict(os.environ, ZTUNNEL_UDS_ADDRESS=str(state / "ztunnel" / "ztunnel.sock"))
    return argv, env


PORT_FLAGS = ("--status-port", "--health-port", "--xds-port", "--monitoring-port")


def start_agent(argv: list[str], env: dict, state) -> subprocess.Popen:
    """Start the agent and wait until its sockets exist; the caller kills it if needed.

    A free port chosen by :func:`agent_argv` may be taken by another process of this
    shared machine before the agent binds it: the agent then refuses to start ("Address
    already in use", nothing touched), and it is started again on fresh ports, written
    into ``argv`` in place (read ports from ``argv`` after this returns)."""
    for attempt in range(3):
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if EXPECTED_SOCKETS <= sockets_under(str(state)):
                return proc
            time.sleep(0.2)
        out = proc.stdout.read() if proc.poll() is not None else ""
        proc.kill()
        proc.wait()
        if "Address already in use" in out and attempt < 2:
            for flag in PORT_FLAGS:
                if flag not in argv:
                    continue
                i = argv.index(flag) + 1
                if argv[i] != "0":
                    argv[i] = str(free_port())
            continue
        raise AssertionError(f"agent did not come up: {sockets_under(str(state))} {out}")
    raise AssertionError("unreachable")


@ROOT_ONLY
def test_sigterm_leaves_no_sockets(tmp_path, node_netns):
    state = tmp_path / "state"
    argv, env = agent_argv(state, node_netns)
    proc = start_agent(argv, env, state)
    try:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert sockets_under(str(state)) == set(), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@ROOT_ONLY
@pytest.mark.parametrize("taken", ["xds_port", "status_port"])
def test_port_in_use_is_one_clear_line(tmp_path, taken, node_netns):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        argv, env = agent_argv(tmp_path / "s", node_netns, **{taken: port})
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and port in lines[0] and taken in lines[0], r.stderr
    assert sockets_under(str(tmp_path / "s")) == set()
    # refused before any component touched the node: no host probe rules or sets
    name = os.path.basename(node_netns)
    rules = subprocess.run(["ip", "netns", "exec", name, "iptables-save"], capture_output=True,
                           text=True).stdout
    nft = subprocess.run(["ip", "netns", "exec", name, "nft", "list", "ruleset"],
                         capture_output=True, text=True).stdout
    assert "ISTIO" not in rules and "istio" not in nft.lower(), (rules, nft)


@ROOT_ONLY
def test_second_agent_on_same_state_dir_is_refused_and_harmless(tmp_path, node_netns):
    state = tmp_path / "state"
    argv, env = agent_argv(state, node_netns)
    first = start_agent(argv, env, state)
    try:
        before = sockets_under(str(state))
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


def stop_stalled(state) -> socket.socket:
    """A CNI ADD whose body never arrives, held open on the agent's event socket: the
    graceful stop waits for it (aiohttp's shutdown timeout, 5 s), so a second signal
    sent meanwhile is certain to find the agent still stopping."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(state / "pluginevent.sock"))
    conn.sendall(b"POST /cmdadd HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    return conn


@ROOT_ONLY
def test_sighup_sigusr1_and_sigusr2_are_ignored(tmp_path, node_netns):
    state = tmp_path / "state"
    argv, env = agent_argv(state, node_netns)
    proc = start_agent(argv, env, state)
    try:
        before = sockets_under(str(state))
        for signum in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            proc.send_signal(signum)
        # the agent answers on its event socket after the signals: it is alive, serving
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(10)
            c.connect(str(state / "pluginevent.sock"))
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert c.recv(100).startswith(b"HTTP/1.1 200"), "agent not serving after SIGHUP"
        assert proc.poll() is None
        assert sockets_under(str(state)) == before
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        # (two pending SIGHUPs may be delivered as one: the kernel does not queue them)
        assert "SIGHUP ignored: the configuration is read once" in out, out
        assert "SIGUSR1 ignored: the configuration is read once" in out, out
        assert "SIGUSR2 ignored: the configuration is read once" in out, out
        assert sockets_under(str(state)) == set(), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@ROOT_ONLY
def test_second_sigterm_exits_143_and_leaves_nothing(tmp_path, node_netns):
    state = tmp_path / "state"
    argv, env = agent_argv(state, node_netns)
    proc = start_agent(argv, env, state)
    stalled = stop_stalled(state)
    try:
        time.sleep(0.3)  # the stalled request's headers are read (its handler waits on the body)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None, "the graceful stop did not wait for the stalled request"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out)
        assert "second signal SIGTERM: exiting now" in out
        assert sockets_under(str(state)) == set(), out
        assert not (state / "agent.lock").exists()
    finally:
        stalled.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _read_until(proc: subprocess.Popen, needle: str, timeout: float = 60.0) -> list[str]:
    """The agent's output lines up to the first one containing ``needle`` (a reader
    thread, so a quiet agent never blocks the test past ``timeout``)."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"no {needle!r} in the agent's output: {''.join(seen)[-3000:]}")


def _index(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines) if text in line)


@ROOT_ONLY
@pytest.mark.parametrize("client", [False, True])
def test_components_after_xds_start_after_its_first_push(tmp_path, node_netns, client):
    """Issue 28: ZDS, enrollment, the CNI parts and status start only once xDS sent a
    client its complete initial Address response, or 0.5 s after xDS started when no
    client comes; the agent is ready only after all of them."""
    import asyncio

    from ambient.xds.client import DeltaXdsClient

    state = tmp_path / "state"
    argv, env = agent_argv(state, node_netns)
    argv[argv.index("warn")] = "debug"
    xds_port = argv[argv.index("--xds-port") + 1]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    xds_client = None
    try:
        if client:
            async def connect() -> DeltaXdsClient:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with socket.socket() as s:
                        if s.connect_ex(("127.0.0.1", int(xds_port))) == 0:
                            break
                    await asyncio.sleep(0.01)
                c = DeltaXdsClient(f"127.0.0.1:{xds_port}", metadata={"NODE_NAME": "n1"})
                await c.connect()
                await c.wait_synced(timeout=60)
                return c

            loop = asyncio.new_event_loop()
            xds_client = loop.run_until_complete(connect())
        lines = _read_until(proc, "agent ready")
        pause = _index(lines, "after xds:")
        assert _index(lines, "started xds") < pause < _index(lines, "starting zds")
        assert _index(lines, "starting zds") < _index(lines, "starting enrollment") \
            < _index(lines, "started status") < _index(lines, "agent ready")
        if not client:  # nobody to push to: the pause ends at its bound
            assert "not set within 0.50 s" in lines[pause], lines[pause]
        elif "waited" in lines[pause]:  # (a client slower than 0.5 s under load: bound)
            assert _index(lines, "xds: client connected") < pause
    finally:
        if xds_client is not None:
            loop.run_until_complete(xds_client.close())
            loop.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
