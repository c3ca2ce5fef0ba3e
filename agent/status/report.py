"""The ``ambient-agent status`` text report: ``/debug/all`` (a dict) → operator tables.

One explicit table per section, built from the shapes the components' ``debug_state()``
return (``cni/enrollment/reconciler.py``, ``zds/server.py``, ``agent/sds/server.py`` +
``sds/cache.py`` + ``sds/service.py``, ``ambient/xds/server.py`` + ``ambient/xds/stream.py``; the
document itself is ``agent/status/debug.py:everything``):

- Components: name, ready, reason.
- Enrolled pods: pod (ns/name), uid (first 8), status, IPs, netns, attempts, error; the
  live counters (pods enrolled or removed because their labels changed) when non-zero,
  and the pods whose annotation write is being retried.
- ZDS connections: id, ztunnel pid, version, connected since, snapshot sent, pods held.
- SDS: mode, CA, streams; each certificate's SPIFFE ID, serial, expiry, watching streams.
- xDS clients: one row per (client, type URL): wildcard/on-demand, held, last nonce, NACKs.

Nothing here may crash on a shape it doesn't know: a field a component adds later is
shown generically (top-level scalars as ``key: value``, nested data as a generic table or
compact JSON, unknown row fields as extra columns), and a section whose shape no longer
matches its explicit renderer falls back to the generic rendering with a note. Times are
UTC; ``now`` (epoch seconds) is a parameter so tests can pin it.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any, Callable

MAX_CELL = 60
SHORT = 8  # characters of a UID or serial shown; enough to grep for the full one
FEW_HELD = 3  # a ZDS connection holding at most this many pods lists their UIDs

Rows = list[dict[str, Any]]


# --- cells and tables ---------------------------------------------------------------------

def cell(value: Any, limit: int | None = MAX_CELL) -> str:
    """One table cell: strings as is, None as "-", lists joined, anything else as JSON;
    cut to ``limit`` characters (None = never)."""
    if value is None or value == "":
        text = "-"
    elif isinstance(value, str):
        text = value
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        text = ",".join(str(v) for v in value) or "-"
    else:
        text = json.dumps(value, default=str)
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


def table(rows: Rows, columns: list[str] | None = None, unlimited: tuple[str, ...] = ()) -> str:
    """Rows of dicts → aligned text; ``columns`` (default: union of keys in first-seen
    order) are the headers, upper-cased; cells in ``unlimited`` columns are never cut."""
    if columns is None:
        columns = []
        for row in rows:
            columns += [k for k in row if k not in columns]
    cells = [[cell(row[c], None if c in unlimited else MAX_CELL) if c in row else ""
              for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def with_extras(rows: Rows, columns: list[str], sources: list[dict], known: set[str]) -> list[str]:
    """Copy each source's fields outside ``known`` into its row (a field a component added
    later becomes an extra column); returns the columns extended by them."""
    extra: list[str] = []
    for row, src in zip(rows, sources):
        for k, v in src.items():
            if k not in known:
                name = k if k not in columns else f"{k}*"
                row[name] = v
                extra += [name] if name not in extra else []
    return columns + extra


def short(text: Any) -> str:
    s = "" if text is None else str(text)
    return s[:SHORT]


def when(epoch: Any, now: float, relative_only: bool = False) -> str:
    """``2024-05-01 12:00:00Z (5m ago)`` / ``(in 23h)``, the date left out when it is
    ``now``'s (UTC); just ``5m ago`` with ``relative_only``; "-" for None; unparsable
    text as is."""
    if isinstance(epoch, str):
        try:
            epoch = dt.datetime.fromisoformat(epoch).timestamp()
        except ValueError:
            return epoch
    if not isinstance(epoch, (int, float)) or isinstance(epoch, bool):
        return cell(epoch)
    delta = epoch - now
    rel = f"in {duration(delta)}" if delta > 0 else f"{duration(-delta)} ago"
    if relative_only:
        return rel
    t = dt.datetime.fromtimestamp(epoch, dt.timezone.utc)
    today = dt.datetime.fromtimestamp(now, dt.timezone.utc).date() == t.date()
    return t.strftime("%H:%M:%SZ" if today else "%Y-%m-%d %H:%M:%SZ") + f" ({rel})"


def duration(seconds: float) -> str:
    """``45s``, ``5m``, ``5m3s``, ``3h12m``, ``2d4h``: the two largest units."""
    s = int(seconds)
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m"), (s % 60, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    head, nxt = parts[0], parts[1] if len(parts) > 1 else (0, "")
    return f"{head[0]}{head[1]}" + (f"{nxt[0]}{nxt[1]}" if nxt[0] else "")


def facts(data: dict, keys: list[tuple[str, str]]) -> str:
    """``label value`` pairs for the keys present and not None, joined by two spaces."""
    return "  ".join(f"{label} {cell(data[k], None)}" for k, label in keys
                     if k in data and data[k] is not None)


# --- generic fallback ---------------------------------------------------------------------

def generic_rows(data: Any) -> Rows | None:
    """A table in unknown data: a list of objects, a dict of objects (keyed rows), or a
    dict holding exactly one such list; else None."""
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        return data
    if isinstance(data, dict):
        if data and all(isinstance(v, dict) for v in data.values()):
            return [{"key": k, **v} for k, v in data.items()]
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            return generic_rows(lists[0])
    return None


def generic(title: str, data: Any) -> list[str]:
    rows = generic_rows(data)
    if rows == []:
        return [f"{title}: none"]
    if rows is not None:
        return [f"{title} ({len(rows)})", table(rows)]
    return [title, json.dumps(data, indent=2, default=str)]


def leftovers(data: dict, known: set[str]) -> list[str]:
    """Lines for a section's fields no explicit renderer knows: scalars as ``key: value``,
    nested data generically."""
    out: list[str] = []
    for k, v in data.items():
        if k in known:
            continue
        if isinstance(v, (dict, list)) and v:
            out += generic(f"  {k}", v)
        else:
            out.append(f"  {k}: {cell(v, None)}")
    return out


# --- sections -----------------------------------------------------------------------------

def components(data: dict, now: float) -> list[str]:
    states = [v if isinstance(v, dict) else {"state": v} for v in data.values()]
    rows = [{"name": n, "ready": v.get("ready"), "reason": v.get("reason")}
            for n, v in zip(data, states)]
    columns = with_extras(rows, ["name", "ready", "reason"], states, {"ready", "reason", "type"})
    ready = sum(1 for v in states if v.get("ready") is True)
    return [f"Components ({ready}/{len(rows)} ready)", table(rows, columns, unlimited=("reason",))]


POD_KNOWN = {"pod", "status", "error", "steps", "netns", "ips", "attempts"}


def pods(data: dict, now: float) -> list[str]:
    records = data["pods"]
    if not isinstance(records, dict):
        raise TypeError("pods is not keyed by UID")
    head = "Enrolled pods"
    backend = facts(data, [("backend", "backend"), ("iptables_flavor", "flavor")])
    out = [f"{head} ({len(records)})" + (f"  {backend}" if backend else "")]
    rows = [{"pod": pod_name(uid, r), "uid": short(uid), "status": r.get("status"),
             "ips": r.get("ips"), "netns": netns_name(r.get("netns")),
             "attempts": r.get("attempts"), "error": r.get("error")}
            for uid, r in records.items()]
    columns = with_extras(rows, ["pod", "uid", "status", "ips", "netns", "attempts", "error"],
                          list(records.values()), POD_KNOWN)
    out += [table(rows, columns, unlimited=("error",))] if rows else ["  none"]
    live = data.get("live")
    if isinstance(live, dict) and any(live.values()):  # running pods that followed labels
        out.append("  live: " + ", ".join(f"{k.replace('_', ' ')} {cell(v, None)}"
                                          for k, v in live.items()))
    retries = data.get("annotation_retries")
    if isinstance(retries, dict) and retries:
        out.append("  annotation writes being retried: " + ", ".join(short(u) for u in retries))
    note = data.get("backend_note")
    if note:  # why the rules backend is not the configured one
        out.append(f"  backend: {cell(note, None)}")
    return out + leftovers(data, {"backend", "iptables_flavor", "pods", "live",
                                  "annotation_retries", "backend_note"})


def pod_name(uid: str, record: dict) -> str:
    """``ns/name`` from enrollment's label ``"ns/name (uid U)"`` (``"pod (uid U)"`` when
    the name is unknown → "-")."""
    label = str(record.get("pod") or "")
    label = label.removesuffix(f" (uid {uid})")
    return "-" if label in ("", "pod") else label


def netns_name(path: Any) -> Any:
    """A named netns (``/run/netns/X``, ``/var/run/netns/X``) as ``X``, the name ``ip netns
    exec`` takes; other paths (``/proc/<pid>/ns/net``) unchanged."""
    if isinstance(path, str):
        for prefix in ("/run/netns/", "/var/run/netns/"):
            if path.startswith(prefix):
                return path[len(prefix):]
    return path


ZDS_CONN_KNOWN = {"id", "peer_pid", "version", "connected_at", "snapshot_sent", "queued",
                  "last_keepalive", "holds", "latest"}


def zds(data: dict, now: float) -> list[str]:
    conns = data["connections"]
    known_pods = data.get("pods") or {}
    head = f"ZDS connections (ztunnels) ({len(conns)})"
    head += f"  socket {cell(data.get('socket'), None)}  pods known {len(known_pods)}"
    if data.get("accepting") is False:  # restart recovery still running
        head += "  not accepting yet (restart recovery)"
    out = [head]
    rows = [{"id": str(c.get("id")) + (" (latest)" if c.get("latest") else ""),
             "ztunnel pid": c.get("peer_pid"), "version": c.get("version"),
             "connected since": when(c.get("connected_at"), now),
             "snapshot sent": c.get("snapshot_sent"), "queued": c.get("queued"),
             "last keepalive": when(c.get("last_keepalive"), now, relative_only=True),
             "pods held": held(c.get("holds") or {})} for c in conns]
    columns = with_extras(rows, ["id", "ztunnel pid", "version", "connected since",
                                 "snapshot sent", "queued", "last keepalive", "pods held"],
                          conns, ZDS_CONN_KNOWN)
    out += [table(rows, columns, unlimited=("pods held",))] if rows else ["  none connected"]
    return out + leftovers(data, {"socket", "pods", "connections", "accepting"})


def held(holds: dict) -> str:
    """``2 (0712f71b, fe2cb86e keep)``: the count, and the short UIDs when few (a pod
    announced without its netns is marked ``keep``)."""
    if len(holds) > FEW_HELD or not holds:
        return str(len(holds))
    uids = ", ".join(short(u) + ("" if k == "add" else f" {k}") for u, k in holds.items())
    return f"{len(holds)} ({uids})"


SDS_KNOWN = {"mode", "identity", "socket", "ca", "ca_port", "ca_issued", "streams", "nacks",
             "csr_count", "certificates", "failures", "mesh_root_file"}
CERT_KNOWN = {"spiffe_id", "serial", "expires", "watchers"}


def sds(data: dict, now: float) -> list[str]:
    streams = data.get("streams") or []
    certs = data["certificates"] if "certificates" in data else []
    ca = cell(data.get("ca"), None) + (f":{data['ca_port']}" if data.get("ca_port") else "")
    out = ["SDS  " + "  ".join(
        x for x in [facts(data, [("mode", "mode"), ("identity", "identity")]), f"CA {ca}",
                    facts(data, [("ca_issued", "issued"), ("csr_count", "CSRs")]),
                    f"streams {len(streams)}", facts(data, [("nacks", "NACKs")])] if x),
           f"  socket {cell(data.get('socket'), None)}"
           + (f"  mesh root {data['mesh_root_file']}" if data.get("mesh_root_file") else "")]
    if "ca_port_tls" in data and not data["ca_port_tls"]:
        data = {k: v for k, v in data.items() if k != "ca_port_tls"}  # no separate CA port
    rows = [{"spiffe id": c.get("spiffe_id"), "serial": short(c.get("serial")),
             "expires": when(c.get("expires"), now),
             "watching streams": watching(c, streams)} for c in certs]
    columns = with_extras(rows, ["spiffe id", "serial", "expires", "watching streams"],
                          certs, CERT_KNOWN)
    out.append(f"Certificates ({len(rows)})")
    out += [table(rows, columns, unlimited=("watching streams",))] if rows else ["  none"]
    for sid, why in (data.get("failures") or {}).items():
        out.append(f"  certificate for {sid} failing: {why}")
    for s in streams:
        if isinstance(s, dict) and s.get("last_nack"):
            out.append(f"  stream {s.get('id')} last NACK: {s['last_nack']}")
        if isinstance(s, dict) and isinstance(s.get("unresolved"), dict):
            for name, why in s["unresolved"].items():
                out.append(f"  stream {s.get('id')} unresolved {name}: {why}")
    return out + leftovers(data, SDS_KNOWN)


def watching(cert: dict, streams: list) -> str:
    """The cache's watcher count, and the streams of that identity with what they asked
    for: ``2 (#1 default, #2 ROOTCA)``."""
    mine = [f"#{s.get('id')} {','.join(s.get('resource_names') or [])}".rstrip()
            for s in streams if isinstance(s, dict) and s.get("identity") == cert.get("spiffe_id")]
    count = cert.get("watchers", len(mine))
    return f"{count} ({', '.join(mine)})" if mine else str(count)


XDS_KNOWN = {"plaintext", "tls", "tls_port", "authn", "token_required", "debounce_seconds", "pushes",
             "cached_resources", "clients"}
CLIENT_KNOWN = {"stream", "peer", "identity", "protocol", "node_id", "proxy_type", "node_name",
                "connected_at", "types"}
TYPE_KNOWN = {"wildcard", "subscribed", "subscribed_sample", "held", "last_nonce", "responses",
              "acks", "stale_nonces", "nacks", "last_nacks", "rejected"}


def xds(data: dict, now: float) -> list[str]:
    clients = data["clients"]
    cached = data.get("cached_resources") or {}
    out = ["xDS clients " + f"({len(clients)})  " + "  ".join(x for x in [
        facts(data, [("plaintext", "plaintext"), ("tls", "TLS"),
                     ("token_required", "token required"), ("pushes", "pushes")]),
        ("cached " + ", ".join(f"{type_name(t)} {n}" for t, n in cached.items())) if cached else "",
    ] if x)]
    rows: Rows = []
    sources: list[dict] = []
    for c in clients:
        types = c.get("types") or {}
        first = {"stream": f"{c.get('stream')} ({c.get('protocol')})", "node id": c.get("node_id"),
                 "identity": c.get("identity") or "- (plaintext)"}
        extra = {k: v for k, v in c.items() if k not in CLIENT_KNOWN}
        if not types:
            rows.append({**first, **extra})
            sources.append({})
        for i, (t, s) in enumerate(types.items()):
            rows.append({**(first if i == 0 else {}), "type": type_name(t),
                         "mode": mode(s), "held": s.get("held"), "last nonce": s.get("last_nonce"),
                         "nacks": s.get("nacks"), **(extra if i == 0 else {})})
            sources.append(s)
    columns = with_extras(rows, ["stream", "node id", "identity", "type", "mode", "held",
                                 "last nonce", "nacks"], sources, TYPE_KNOWN)
    columns += [k for r in rows for k in r if k not in columns]
    out += [table(rows, columns, unlimited=("node id",))] if rows else ["  none connected"]
    for c in clients:
        for t, s in (c.get("types") or {}).items():
            for n in s.get("last_nacks") or []:
                names = n.get("names") or []
                more = int(n.get("count") or len(names)) - len(names)
                listed = (f" [{', '.join(map(str, names))}"
                          f"{f' and {more} more' if more > 0 else ''}]") if names else ""
                out.append(f"  stream {c.get('stream')} {type_name(t)} NACK of nonce "
                           f"{n.get('nonce')}{listed} {when(n.get('at'), now)}: "
                           f"{n.get('detail')}")
    return out + leftovers(data, XDS_KNOWN)


def type_name(type_url: str) -> str:
    """``type.googleapis.com/istio.workload.Address`` → ``Address``."""
    return str(type_url).rsplit("/", 1)[-1].rsplit(".", 1)[-1]


def mode(state: dict) -> str:
    if state.get("wildcard", True):
        return "wildcard"
    n = state.get("subscribed", 0)
    return f"on-demand ({n} name{'' if n == 1 else 's'})"


# --- the report ---------------------------------------------------------------------------

Section = Callable[[dict, float], list[str]]
SECTIONS: tuple[tuple[str, str, Section], ...] = (
    ("pods", "Enrolled pods", pods),
    ("zds", "ZDS connections (ztunnels)", zds),
    ("sds", "SDS", sds),
    ("xds", "xDS clients", xds),
)
SKIPPED = {"config", "components", "mesh"}  # config: too long (see -o json); mesh: agent.status.mesh


def render(doc: dict[str, Any], now: float | None = None) -> str:
    """The whole report as text; ``now`` = epoch seconds for relative times."""
    now = time.time() if now is None else now
    out = section("Components", doc.get("components") or {}, components, now)
    for key, title, renderer in SECTIONS:
        out += [""] + section(title, doc.get(key), renderer, now)
    for key, data in doc.items():  # a section added to /debug/all later
        if key not in SKIPPED and key not in {k for k, _, _ in SECTIONS}:
            out += [""] + generic(key, data)
    return "\n".join(out)


def section(title: str, data: Any, renderer: Section, now: float) -> list[str]:
    if isinstance(data, dict) and data.get("missing"):
        return [f"{title}: not running in this agent"]
    if isinstance(data, dict) and "error" in data and len(data) == 1:
        return [f"{title}: error: {data['error']}"]
    if data is None:
        return [f"{title}: not in the agent's answer"]
    try:
        return renderer(data, now)
    except Exception as e:  # noqa: BLE001 - an unexpected shape must never crash the CLI
        return [f"{title} (shape not recognized: {type(e).__name__}: {e}; shown as is)"] \
            + generic(title, data)[1:]
