"""The README's main job, end to end: `ambient-agent demo` with real CNI plugins, real
pods (podman containers by default here, named netns with `--runtime netns`), real
iptables, the real agent, the reference ztunnel (ZDS/xDS client; the real ztunnel's
variant is tests/peers/test_ztunnel_real.py) and a real Envoy. Every row of the table
must pass, and the demo must leave nothing behind (no container, image, netns or
interface of its own, no istio rule added to the host, no process), with --once and
after Ctrl-C. Only the demo's own objects are judged: other demos or an agent may run on
the same host."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from pyroute2 import IPRoute

from agent.demo import podman
from agent.demo.model import DEMO_LABEL
from agent.demo.envoy import free_port

ROWS = [
    ("demo/client", "enrollment"), ("demo/client", "redirection rules"),
    ("demo/client", "ZDS (netns fd acked by ztunnel)"), ("demo/client", "workload in xDS"),
    ("demo/server", "enrollment"), ("demo/server", "redirection rules"),
    ("demo/server", "ZDS (netns fd acked by ztunnel)"), ("demo/server", "workload in xDS"),
    ("legacy/legacy", "enrollment"), ("legacy/legacy", "redirection rules"),
    ("legacy/legacy", "ZDS (netns fd acked by ztunnel)"), ("legacy/legacy", "workload in xDS"),
    ("envoy", "serves our SDS certificate"),
    ("client -> server:8080", "redirected to ztunnel"),
    ("legacy -> server:8080", "not redirected at source"),
    ("status server", "/stats/prometheus"), ("status server", "/debug"),
    ("status server", "status --workloads"),
]


def _argv(workdir, *extra) -> list[str]:
    return [sys.executable, "-m", "agent.cli", "demo", "--workdir", str(workdir),
            "--status-port", str(free_port()), "--health-port", str(free_port()),
            "--xds-port", str(free_port()), *extra]


def _runtime(out: str) -> str:
    m = re.search(r"pods run with (\w+)", out)
    assert m, out
    return m.group(1)


def _imported_image(out: str) -> str:
    """The tag the demo imported (it names it in its teardown of the image)."""
    m = re.search(r"localhost/ambient-demo:\w+", out)
    return m.group(0) if m else ""


def _suffix(out: str) -> str:
    """The suffix the demo names its netns and interfaces with (its first line says)."""
    m = re.search(r"named ambdemo\*(\w+)\)", out)
    assert m, out
    return m.group(1)


def _demo_objects(suffix: str) -> set[str]:
    """netns and interfaces of the demo whose names end with ``suffix`` on this host now
    (other demos running concurrently on the machine are not this test's business)."""
    found = {f"netns {n}" for n in (os.listdir("/var/run/netns")
                                    if os.path.isdir("/var/run/netns") else [])
             if n.startswith("ambdemo") and n.endswith(suffix)}
    with IPRoute() as ipr:
        found |= {f"link {link.get_attr('IFLA_IFNAME')}" for link in ipr.get_links()
                  if link.get_attr("IFLA_IFNAME").startswith("ambdemo")
                  and link.get_attr("IFLA_IFNAME").endswith(suffix)}
    return found


def _istio_host_rules() -> set[str]:
    saved = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    nft = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    def plain(line: str) -> str:  # packet counters move while the test runs
        return re.sub(r"counter packets \d+ bytes \d+", "counter", line.strip())

    return ({plain(line) for line in saved.splitlines()
             if "ISTIO" in line and not line.startswith("#")}
            | {plain(line) for line in nft.splitlines() if "istio" in line.lower()})


_HOST_RULES_BEFORE: set[str] = set()


@pytest.fixture(autouse=True)
def _host_rules_baseline():
    """The host's istio rules before the test (an agent may run on this node): the demo
    keeps its host rules in a netns of its own, so it must add none to the host's."""
    _HOST_RULES_BEFORE.clear()
    _HOST_RULES_BEFORE.update(_istio_host_rules())
    yield


def _assert_nothing_left(workdir, out: str, image: str = "") -> None:
    assert not os.path.exists(workdir)
    if podman.available():
        host = podman.Podman(None)
        assert host.containers(f"{DEMO_LABEL}={workdir}") == []
        if image:
            assert not host.image_exists(image), image
    assert _demo_objects(_suffix(out)) == set()
    assert _istio_host_rules() <= _HOST_RULES_BEFORE, _istio_host_rules() - _HOST_RULES_BEFORE
    procs = subprocess.run(["pgrep", "-af", str(workdir)], capture_output=True, text=True).stdout
    assert procs.strip() == "", procs


def _read_until_running(proc: subprocess.Popen, lines: list[str]) -> None:
    """Append ``proc``'s output lines to ``lines`` until the demo says it is up ("press
    Ctrl-C"), its output ends, or 180 s pass; the caller asserts which it was."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "press Ctrl-C" in line:
            break


def _rows_ok(out: str) -> None:
    for subject, check in ROWS:
        line = next((row for row in out.splitlines()
                     if row.startswith(subject) and f" {check} " in row), None)
        assert line is not None, f"row {subject} / {check} missing:\n{out}"
        assert re.search(r"\s ok\s", line), f"row failed: {line}\n{out}"
    assert "FAIL" not in out


def test_demo_once_all_checks_pass_and_leaves_nothing(tmp_path):
    """The default (--runtime auto): podman when podman and runc are installed."""
    workdir = tmp_path / "demo"
    r = subprocess.run(_argv(workdir) + ["--once"], capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert _runtime(out) == ("podman" if podman.available() else "netns"), out
    _rows_ok(r.stdout)
    assert "clean: no netns" in r.stdout
    _assert_nothing_left(workdir, out, _imported_image(out))


def test_demo_netns_runtime_all_checks_pass_and_leaves_nothing(tmp_path):
    workdir = tmp_path / "demo"
    r = subprocess.run(_argv(workdir, "--once", "--runtime", "netns"), capture_output=True,
                       text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert _runtime(out) == "netns"
    _rows_ok(r.stdout)
    assert "clean: no netns" in r.stdout
    _assert_nothing_left(workdir, out)


@pytest.mark.skipif(not podman.available(), reason="podman or runc not installed")
def test_demo_podman_runtime_with_a_given_image_keeps_it(tmp_path):
    """--image: the pods run on an image the demo did not import; it is still there after."""
    conf = tmp_path / "containers.conf"
    podman.write_containers_conf(conf, ["/usr/lib/cni"], tmp_path)
    own = podman.Podman(conf)
    image = f"localhost/ambient-demo-test:{os.getpid()}{int(time.time() * 1000) % 100000}"
    own.import_busybox(image)
    try:
        workdir = tmp_path / "demo"
        r = subprocess.run(_argv(workdir, "--once", "--runtime", "podman", "--image", image),
                           capture_output=True, text=True, timeout=240)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        _rows_ok(r.stdout)
        assert own.image_exists(image)
        _assert_nothing_left(workdir, out)
    finally:
        own.run("rmi", "-f", image, check=False)


def test_demo_rejects_missing_image(tmp_path):
    if not podman.available():
        pytest.skip("podman or runc not installed")
    workdir = tmp_path / "demo"
    r = subprocess.run(_argv(workdir, "--once", "--runtime", "podman", "--image",
                             "localhost/no-such-image:x"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert "--image 'localhost/no-such-image:x': no such podman image" in r.stderr
    _assert_nothing_left(workdir, r.stdout)


def test_demo_ctrl_c_cleans_up(tmp_path):
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(_argv(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, out = [], ""
    try:
        _read_until_running(proc, lines)
        assert any("press Ctrl-C" in seen for seen in lines), "".join(lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        out = "".join(lines) + rest
        assert proc.returncode == 0, out
        _rows_ok(out)
        assert "clean: no netns" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_nothing_left(workdir, out, _imported_image(out))


def test_demo_ctrl_c_during_bring_up_stops_and_cleans_up(tmp_path):
    """A newuser finding: SIGINT 1-2.5 s in, the demo carried on to "running; press
    Ctrl-C" and needed a second one. Now the bring-up stops at the end of its current
    step and the teardown runs; one Ctrl-C is enough."""
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(_argv(workdir, "--runtime", "netns"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, out = [], ""
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "starting the agent" in line:  # the bring-up is under way
                break
        assert any("starting the agent" in seen for seen in lines), "".join(lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        out = "".join(lines) + rest
        assert "press Ctrl-C" not in out, out
        assert "interrupted before" in out and "tearing down" in out, out
        assert "clean: no netns" in out, out
        assert proc.returncode == 1, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_nothing_left(workdir, out)


@pytest.mark.skipif(not podman.available(), reason="podman or runc not installed")
def test_leftover_check_reports_a_podman_container_and_the_imported_image(tmp_path):
    """The demo's own leftover check sees its containers (by label) and its image."""
    import argparse

    from agent.demo.driver import Demo

    demo = Demo(argparse.Namespace(workdir=str(tmp_path / "demo"), runtime="podman", image=""))
    conf = tmp_path / "containers.conf"
    podman.write_containers_conf(conf, ["/usr/lib/cni"], tmp_path)
    own = podman.Podman(conf)
    own.import_busybox(demo.image)
    demo.imported_image = demo.image
    name = f"ambdemo-left-{demo.suffix}"
    try:
        own.create(name, "none", demo.image, "/bin/busybox", "true",
                   labels={DEMO_LABEL: str(demo.root)})
        assert demo.podman_leftovers() == [f"podman container {name}",
                                           f"podman image {demo.image}"]
    finally:
        own.remove(name)
        own.run("rmi", "-f", demo.image, check=False)
    assert demo.podman_leftovers() == []


def test_demo_runtime_podman_without_podman_is_a_clear_error(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no podman, no runc
    r = subprocess.run(_argv(tmp_path / "demo", "--once", "--runtime", "podman"), env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--runtime podman: podman and runc must be installed" in r.stderr
    assert not os.path.exists(tmp_path / "demo")


def test_demo_refuses_busy_ports_and_existing_workdir_up_front(tmp_path):
    """Every busy port is named at once with its flag, and an existing --workdir is
    refused; nothing is created in either case."""
    import socket

    with socket.socket() as a, socket.socket() as b:
        a.bind(("0.0.0.0", 0))
        a.listen()
        b.bind(("127.0.0.1", 0))
        b.listen()
        status_port, xds_port = a.getsockname()[1], b.getsockname()[1]
        argv = [sys.executable, "-m", "agent.cli", "demo", "--once", "--workdir",
                str(tmp_path / "demo"), "--status-port", str(status_port),
                "--health-port", str(free_port()), "--xds-port", str(xds_port)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--status-port {status_port}" in r.stderr and f"--xds-port {xds_port}" in r.stderr
    assert not (tmp_path / "demo").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "agent.cli", "demo", "--once", "--workdir",
                        str(existing), "--status-port", str(free_port()), "--health-port",
                        str(free_port()), "--xds-port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr
    assert (existing / "keep.txt").read_text() == "mine"


def test_demo_double_ctrl_c_at_the_terminal_still_cleans_up(tmp_path):
    """Issue 27: Ctrl-C twice at a terminal (SIGINT to the whole foreground process
    group, podman's commands of the teardown included) left a container and the image
    behind and printed "some checks FAILED" after every check passed."""
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(_argv(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own group, as a shell's job
    lines, out = [], ""
    try:
        _read_until_running(proc, lines)
        assert any("press Ctrl-C" in seen for seen in lines), "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)
        while True:  # the second Ctrl-C lands in the teardown
            line = proc.stdout.readline()
            lines.append(line)
            if not line or "tearing down" in line:
                break
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
        out = "".join(lines) + rest
        assert proc.returncode == 0, out
        assert "FAILED" not in out and "left behind" not in out, out
        assert "clean: no netns" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_nothing_left(workdir, out, _imported_image(out))


def test_demo_hangup_tears_down_like_ctrl_c(tmp_path):
    """A newuser finding: SIGHUP (the terminal closed, SSH lost) killed the demo with no
    teardown: containers, image, Envoy, bridge, netns and workdir stayed. The whole group
    gets it, as a terminal's hangup delivers it."""
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(_argv(workdir, "--runtime", "netns"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, out = [], ""
    try:
        _read_until_running(proc, lines)
        assert any("press Ctrl-C" in seen for seen in lines), "".join(lines)
        os.killpg(proc.pid, signal.SIGHUP)
        rest, _ = proc.communicate(timeout=90)
        out = "".join(lines) + rest
        assert proc.returncode == 0, out
        assert "tearing down" in out and "clean: no netns" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_nothing_left(workdir, out)


def test_earlier_demos_leftovers_are_noticed(tmp_path):
    """What a demo killed without its teardown left is named by the next demo (its
    naming: netns ambdemo-*-<hex4>, bridge ambdemo<hex4>)."""
    import argparse
    import secrets

    from pyroute2 import netns as pr_netns

    from agent.demo.driver import Demo

    demo = Demo(argparse.Namespace(workdir=str(tmp_path / "demo"), runtime="netns", image=""))
    name = f"ambdemo-left-{secrets.token_hex(2)}"
    pr_netns.create(name)
    try:
        assert f"netns {name}" in demo.earlier_leftovers()
    finally:
        pr_netns.remove(name)
    assert f"netns {name}" not in demo.earlier_leftovers()
