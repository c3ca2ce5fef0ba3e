"""``ambient-agent log-level [SCOPE=LEVEL ...]``: a running agent's log levels, without a restart.

With no argument, prints the levels in force (``current log level is zds=debug,info``,
ztunnel's form); with arguments, changes them: ``SCOPE=LEVEL`` (or ``SCOPE:LEVEL``) sets
one scope (``zds``, ``sds``, ``cni.enrollment``, a library such as ``pyroute2``), a bare
``LEVEL`` sets the default; ``--reset`` first returns to the levels the agent started
with. Talks to ``POST /logging`` on the agent's root-only admin socket (the same
endpoint ztunnel's admin port has). The arguments are checked before anything is sent:
a bad scope or level is one line on stderr, exit 2, nothing changed; no agent answering
is one line, exit 1.
"""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlencode

from agent.status.cli import socket_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("levels", nargs="*", metavar="SCOPE=LEVEL",
                        help="a scope's level (zds=debug) or the default level (info); "
                             "levels: debug, info, warn, error, none. None given: print "
                             "the current levels")
    parser.add_argument("--reset", action="store_true",
                        help="return to the start-up levels (then apply any given)")
    parser.add_argument("--socket", default=None,
                        help="the agent's admin socket (default: $AMBIENT_AGENT_ADMIN_SOCKET, "
                             "else <state dir>/admin.sock)")
    parser.add_argument("--state-dir", default=None,
                        help="the agent's state dir (default: $AMBIENT_AGENT_STATE_DIR, else "
                             "/var/run/ambient-agent)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the agent (default: 5)")


def main(args: argparse.Namespace) -> int:
    from agent.core.logsetup import parse_levels
    from agent.status.adminclient import AdminUnreachable, request

    spec = ",".join(args.levels)
    try:
        parse_levels(spec)
    except ValueError as e:
        print(f"ambient-agent log-level: {e}", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"ambient-agent log-level: --timeout must be a positive number of seconds, "
              f"not {args.timeout}", file=sys.stderr)
        return 2
    query = {}
    if spec:
        query["level"] = spec
    if args.reset:
        query["reset"] = "true"
    path = socket_path(args)
    try:
        status, body = request(path, "POST", "/logging" + ("?" + urlencode(query) if query
                                                            else ""), args.timeout)
    except AdminUnreachable as e:
        print(f"ambient-agent log-level: {e}", file=sys.stderr)
        return 1
    text = body.decode("utf-8", "replace").strip()
    if status != 200:
        first = text.splitlines()[0] if text else ""
        print(f"ambient-agent log-level: agent at {path} answered HTTP {status}: {first}",
              file=sys.stderr)
        return 1
    print(text)
    return 0
