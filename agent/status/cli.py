"""``ambient-agent status``: ask a running agent over its debug endpoint and print tables.

Fetches ``GET <addr>/debug/all`` (loopback only, so run it on the node) and prints the
components' readiness, then enrolled pods, ZDS connections (ztunnels), SDS certificates
and xDS clients. Sections are rendered generically (a list of objects becomes a table
with one column per key), so a component adding a field shows up without a CLI change.
``-o json`` prints the raw document. No agent answering → one line on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

SECTION_TITLES = (("pods", "Enrolled pods"), ("zds", "ZDS connections (ztunnels)"),
                  ("sds", "SDS certificates"), ("xds", "xDS clients"))
MAX_CELL = 60


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


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 3] + "..."


def table(rows: list[dict[str, Any]]) -> str:
    """Rows of dicts → aligned text table; columns = union of keys in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _rows(data: Any) -> list[dict[str, Any]] | None:
    """Find the table in a section: a list of objects, a dict of objects (keyed rows), or
    a dict holding exactly one such list."""
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        return data
    if isinstance(data, dict):
        if data and all(isinstance(v, dict) for v in data.values()):
            return [{"name": k, **v} for k, v in data.items()]
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            return _rows(lists[0])
    return None


def render(doc: dict[str, Any]) -> str:
    """The whole report as text."""
    out = ["Components", table([{"name": n, **v} for n, v in doc.get("components", {}).items()])]
    for key, title in SECTION_TITLES:
        data = doc.get(key)
        out.append("")
        if isinstance(data, dict) and data.get("missing"):
            out.append(f"{title}: not running in this agent")
            continue
        if isinstance(data, dict) and "error" in data and len(data) == 1:
            out.append(f"{title}: error: {data['error']}")
            continue
        rows = _rows(data)
        if rows == []:
            out.append(f"{title}: none")
        elif rows is not None:
            out += [f"{title} ({len(rows)})", table(rows)]
        else:
            out += [title, json.dumps(data, indent=2, default=str)]
    return "\n".join(out)


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
