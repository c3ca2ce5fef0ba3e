"""The README's main job, end to end: `ambient-agent demo` with real CNI plugins, real
netns pods, real iptables, the real agent, the reference ztunnel (a faithful ZDS/xDS
client, since ztunnel itself can't run here) and a real Envoy. Every row of the table
must pass, and nothing may be left behind afterwards, with --once and after Ctrl-C."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from pyroute2 import IPRoute

from agent.envoy import free_port

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
]


def _argv(workdir) -> list[str]:
    return [sys.executable, "-m", "agent.cli", "demo", "--workdir", str(workdir),
            "--status-port", str(free_port()), "--health-port", str(free_port()),
            "--xds-port", str(free_port())]


def _assert_nothing_left(workdir) -> None:
    assert not os.path.exists(workdir)
    assert not [n for n in os.listdir("/var/run/netns") if n.startswith("ambdemo-")] \
        if os.path.isdir("/var/run/netns") else True
    with IPRoute() as ipr:
        names = [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]
    assert not [n for n in names if n.startswith("ambdemo")], names
    saved = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    assert "ISTIO" not in saved
    nft = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    assert "istio" not in nft.lower()
    procs = subprocess.run(["pgrep", "-af", str(workdir)], capture_output=True, text=True).stdout
    assert procs.strip() == "", procs


def _rows_ok(out: str) -> None:
    for subject, check in ROWS:
        line = next((l for l in out.splitlines()
                     if l.startswith(subject) and f" {check} " in l), None)
        assert line is not None, f"row {subject} / {check} missing:\n{out}"
        assert re.search(r"\s ok\s", line), f"row failed: {line}\n{out}"
    assert "FAIL" not in out


def test_demo_once_all_checks_pass_and_leaves_nothing(tmp_path):
    workdir = tmp_path / "demo"
    r = subprocess.run(_argv(workdir) + ["--once"], capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    _rows_ok(r.stdout)
    assert "clean: no netns" in r.stdout
    _assert_nothing_left(workdir)


def test_demo_ctrl_c_cleans_up(tmp_path):
    workdir = tmp_path / "demo"
    proc = subprocess.Popen(_argv(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "press Ctrl-C" in line:
                break
        assert any("press Ctrl-C" in l for l in lines), "".join(lines)
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
    _assert_nothing_left(workdir)
