"""``ambient-agent status``: ask a running agent over its debug endpoint and print tables.

Fetches ``GET <addr>/debug/all`` (loopback only, so run it on the node) and prints the
components' readiness, then enrolled pods, ZDS connections (ztunnels), SDS certificates
and xDS clients, one table each (:mod:`agent.status.report`; fields it doesn't know are
shown generically, never an error). ``-o json`` prints the raw document. No agent
answering → one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from agent.status.report import render  # noqa: F401 - the report, importable from here


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", default="http://127.0.0.1:15020",
                        help="the agent's status server URL (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")


def fetch(addr: str, timeout: float) -> dict[str, Any]:
    """GET ``<addr>/debug/all`` → dict. Raises RuntimeError with a one-line message."""
    url = addr.rstrip("/") + "/debug/all"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"agent at {addr} answered HTTP {e.code} for /debug/all"
                           + (" (debug endpoints answer loopback only)" if e.code == 403 else "")
                           ) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RuntimeError(f"no agent answering at {addr}: {reason}") from None
    except ValueError as e:
        raise RuntimeError(f"agent at {addr} sent invalid JSON: {e}") from None


def main(args: argparse.Namespace) -> int:
    try:
        doc = fetch(args.addr, args.timeout)
    except RuntimeError as e:
        print(f"ambient-agent status: {e}", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps(doc, indent=2))
    else:
        print(render(doc))
    return 0
