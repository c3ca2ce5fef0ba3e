"""Issue 27: the demo bound 15020, 8000 and 15010 on the host (in the way of an agent
already running there); unless a port flag asks for one, it now takes free ports, and
its port flags say so in ``--help``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from agent.cli import build_parser

WELL_KNOWN = (15020, 8000, 15010)


def test_demo_takes_free_ports_unless_asked(tmp_path):
    from agent.demo.driver import Demo

    held = []
    for port in WELL_KNOWN:  # hold them where we can: the demo must not need them
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", port))
            s.listen()
            held.append(s)
        except OSError:
            s.close()  # somebody else's: equally in the way
    try:
        args = build_parser().parse_args(["demo", "--workdir", str(tmp_path / "demo"),
                                          "--runtime", "netns"])
        demo = Demo(args)
        demo.preflight()
        ports = (args.status_port, args.health_port, args.xds_port)
        assert all(ports) and not set(ports) & set(WELL_KNOWN), ports
        flags = demo.agent_flags()
        assert flags["status_port"] == str(args.status_port)
        assert flags["monitoring_port"] == "0"
    finally:
        for s in held:
            s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="demo --help needs no root, but the CLI path does")
def test_demo_port_flags_have_help():
    r = subprocess.run([sys.executable, "-m", "agent.cli", "demo", "--help"],
                       capture_output=True, text=True, timeout=60)
    text = " ".join(r.stdout.split())
    for flag in ("--status-port PORT", "--health-port PORT", "--xds-port PORT"):
        assert flag in text
    assert text.count("default 0: a free port") >= 3
    r = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert "(default 5.0)" in " ".join(r.stdout.split())


@pytest.mark.parametrize("argv,named", [
    (["--status-port", "99999"], "argument --status-port: '99999': port must be between 0 and 65535"),
    (["--xds-port", "-5"], "argument --xds-port: '-5': port must be between 0 and 65535"),
    (["--health-port", "abc"], "argument --health-port: 'abc': expected a port number"),
    (["--log-level", "loud"], "argument --log-level: 'loud': unknown level 'loud'"),
])
def test_demo_refuses_a_bad_port_or_level_as_a_usage_error(argv, named):
    """A fresh-eyes run found ``demo --status-port 99999`` ending in an OverflowError
    traceback from the port probe (and a bad ``--log-level`` refused only after the
    network and image were set up): both are now refused by the parser, exit 2, one
    line naming the flag and the value, before anything is touched."""
    p = subprocess.run([sys.executable, "-m", "agent.cli", "demo", *argv],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert named in p.stderr and "Traceback" not in p.stderr, p.stderr
