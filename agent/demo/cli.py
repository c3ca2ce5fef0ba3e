"""The ``ambient-agent demo`` subcommand: its flags and entry point.

Imported to build the command-line parser (``agent/cli.py``), so it imports nothing
heavy; :func:`main` loads the demo itself (:class:`agent.demo.driver.Demo`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from agent.core.argtypes import checked as _checked
from agent.demo.model import RUNTIMES, DemoError


def _port(text: str) -> int:
    from agent.core.config_values import parse_port
    return parse_port(text)


def _levels(text: str) -> str:
    from agent.core.logsetup import parse_levels
    parse_levels(text)  # raises ValueError naming the bad part
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true",
                        help="run the checks, print the table, tear down; exit 1 on any failure")
    parser.add_argument("--runtime", choices=RUNTIMES, default="auto",
                        help="what runs the pods: podman (CNI backend, runc), netns (named "
                        "netns + the CNI calls a runtime makes), or auto: podman when podman "
                        "and runc are installed (default)")
    parser.add_argument("--image", default="",
                        help="podman image for the pods, must have /bin/busybox (default: "
                        "import busybox-static under a tag of this run, removed at the end)")
    parser.add_argument("--ztunnel", default="", metavar="PATH",
                        help="run this ztunnel binary (built from istio/ztunnel) instead of "
                        "the reference client: it uses the agent for ZDS, xDS and its "
                        "certificates, and the client pod talks to the server pod over HBONE")
    parser.add_argument("--workdir", default="",
                        help="directory for every file the demo creates (default: a new "
                        "/run/ambient-demo-<random>)")
    parser.add_argument("--status-port", type=_checked(_port), default=0, metavar="PORT",
                        help="the demo agent's status port (default 0: a free port, so an "
                        "agent already on 15020 is not in the way)")
    parser.add_argument("--health-port", type=_checked(_port), default=0, metavar="PORT",
                        help="the demo agent's /healthz port (default 0: a free port)")
    parser.add_argument("--xds-port", type=_checked(_port), default=0, metavar="PORT",
                        help="the demo agent's plaintext xDS port on 127.0.0.1 (default 0: a "
                        "free port)")
    parser.add_argument("--log-level", type=_checked(_levels), default="warn",
                        help="agent log level while the demo runs (as run's --log-level: "
                        "debug, info, warn, error, none, or SCOPE:LEVEL,...)")


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("ambient-agent demo: needs root (it creates network namespaces, a bridge and "
              "firewall rules)", file=sys.stderr)
        return 2
    try:
        from agent.demo.driver import Demo

        demo = Demo(args)
        demo.preflight()
    except DemoError as e:
        print(f"ambient-agent demo: {e}", file=sys.stderr)
        return 2
    return asyncio.run(demo.run())
