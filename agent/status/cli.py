"""``ambient-agent status``: ask a running agent over its admin socket and print tables.

Fetches ``GET /debug/all`` on the agent's admin socket (``admin_socket``, default
``<state dir>/admin.sock``, mode 0600: run it as root on the node) and prints the
components' readiness, then enrolled pods, ZDS connections (ztunnels), SDS certificates
and xDS clients, one table each (:mod:`agent.status.report`; fields it doesn't know are
shown generically, never an error). ``-o json`` prints the raw document. No agent
answering, or no permission on the socket → one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping


from agent.core.argtypes import positive_seconds
from agent.status import adminclient
from agent.status.report import render

DEFAULT_STATE_DIR = "/var/run/ambient-agent"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None,
                        help="the agent's admin socket (default: $AMBIENT_AGENT_ADMIN_SOCKET, "
                             "else <state dir>/admin.sock)")
    parser.add_argument("--state-dir", default=None,
                        help="the agent's state dir (default: $AMBIENT_AGENT_STATE_DIR, else "
                             f"{DEFAULT_STATE_DIR})")
    parser.add_argument("--timeout", type=positive_seconds, default=5.0,
                        help="seconds to wait for the agent (default %(default)s)")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table",
                        help="table (default) or the raw JSON document")
    mesh = parser.add_argument_group(
        "mesh view (what the index serves to ztunnel, like istioctl ztunnel-config); any of "
        "these prints only the chosen sections")
    for section in ("workloads", "services", "policies", "waypoints"):
        mesh.add_argument(f"--{section}", action="store_true",
                          help=f"list {section}")
    mesh.add_argument("--namespace", "-n", default=None, metavar="NAMESPACE",
                      help="only this namespace")
    mesh.add_argument("--node", default=None, metavar="NODE",
                      help="only workloads on this node")
    mesh.add_argument("--wide", action="store_true",
                      help="workloads also show identity, services and uid")


def socket_path(args: argparse.Namespace, env: dict[str, str] | None = None) -> str:
    """``--socket``, else ``$AMBIENT_AGENT_ADMIN_SOCKET``, else ``<state dir>/admin.sock``
    (the same defaults as ``ambient-agent run``)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    if args.socket:
        return args.socket
    if environ.get("AMBIENT_AGENT_ADMIN_SOCKET"):
        return environ["AMBIENT_AGENT_ADMIN_SOCKET"]
    state = args.state_dir or environ.get("AMBIENT_AGENT_STATE_DIR") or DEFAULT_STATE_DIR
    return os.path.join(state, "admin.sock")


def fetch(path: str, timeout: float) -> dict[str, Any]:
    """``GET /debug/all`` on the admin socket ``path`` → dict. Raises RuntimeError with a
    one-line message (:func:`agent.status.adminclient.get_json`)."""
    doc: dict[str, Any] = adminclient.get_json(path, "/debug/all", timeout)
    return doc


def main(args: argparse.Namespace) -> int:
    try:
        doc = fetch(socket_path(args), args.timeout)
    except RuntimeError as e:
        print(f"ambient-agent status: {e}", file=sys.stderr)
        return 1
    from agent.status import mesh

    chosen = [s for s in mesh.SECTIONS if getattr(args, s, False)]
    filtered = chosen or args.namespace or args.node
    view = doc.get("mesh") or {"error": "this agent serves no mesh view (older version?)"}
    if args.output == "json":
        if filtered:
            sections = chosen or list(mesh.SECTIONS)
            doc = {s: mesh.select(view, s, args.namespace, args.node) for s in sections}
        print(json.dumps(doc, indent=2))
    elif filtered:
        print(mesh.render(view, chosen or mesh.SECTIONS, args.namespace, args.node, args.wide))
    else:
        print(render(doc))
        print()
        print(mesh.render(view, mesh.SECTIONS, wide=args.wide))
    return 0
