"""``ambient-agent ztunnel-config workloads|services|policies|certificates|connections``.

The views of ``istioctl ztunnel-config``, read from the node's ztunnel admin
``/config_dump`` (default ``localhost:15000``, ``--ztunnel-admin``) and joined with what
this agent says about the same objects, from its root-only admin socket
(``/debug/all``):

- workloads — istioctl's NAMESPACE, POD NAME, ADDRESS, NODE, WAYPOINT, PROTOCOL, then
  ENROLLED (this agent's enrollment state of the pod: ``enabled``, ``pending``,
  ``failed``...; ``-`` when the pod is not enrolled here), XDS (``yes`` when this agent's
  workload xDS serves that uid, ``no`` when ztunnel has it from elsewhere) and ZDS
  (``acked`` when ztunnel acked the pod on the agent's newest ZDS connection);
- services — NAMESPACE, SERVICE NAME, SERVICE VIP, WAYPOINT, ENDPOINTS (healthy/all, as
  istioctl counts them), XDS;
- policies — NAMESPACE, POLICY NAME, ACTION, SCOPE, XDS;
- certificates — istioctl's CERTIFICATE NAME, TYPE, STATUS, VALID CERT, SERIAL NUMBER
  (hex), NOT AFTER, NOT BEFORE (ztunnel's own; the agent has no view of them);
- connections — WORKLOAD, DIRECTION, LOCAL, REMOTE, REMOTE TARGET, PROTOCOL (addresses
  named after the service or workload that has them, as istioctl does; ``--raw`` keeps
  them), then ENROLLED.

A closing line names the agent's xDS client stream from this node's ztunnel and its
last ACKed nonce. ``-o json`` / ``-o yaml`` print the selected ztunnel objects, each with
an ``agent`` object holding the joined fields. ``--no-agent`` skips the join.

The config_dump's shape is ztunnel's ``ConfigDump`` (``src/admin.rs``): ``workloads``,
``services``, ``policies`` (camelCase, as its serde serialisation writes them),
``certificates`` (``identity``, ``state``, ``certChain``/``rootCerts`` of ``pem``,
``serialNumber`` in decimal, ``validFrom``, ``expirationTime``), and ``workloadState``
(pod uid → ``state``, ``info``, ``connections.inbound|outbound``).

Bad flags, no ztunnel answering, no agent answering, or a document that is not a
config dump: one line on stderr, exit 2 (flags) or 1, nothing printed on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
from datetime import datetime
from typing import Any

VIEWS = ("workloads", "services", "policies", "certificates", "connections")
DEFAULT_ADMIN = "localhost:15000"
BODY_MAX = 64 << 20  # bytes of config_dump read at most


class ViewError(RuntimeError):
    """One line for the operator."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("view", choices=VIEWS, help="what to list")
    parser.add_argument("--ztunnel-admin", default=DEFAULT_ADMIN, metavar="HOST:PORT",
                        help=f"ztunnel's admin address on this node (default: {DEFAULT_ADMIN})")
    parser.add_argument("--socket", default=None,
                        help="the agent's admin socket (default: $AMBIENT_AGENT_ADMIN_SOCKET, "
                             "else <state dir>/admin.sock)")
    parser.add_argument("--state-dir", default=None,
                        help="the agent's state dir (default: $AMBIENT_AGENT_STATE_DIR, else "
                             "/var/run/ambient-agent)")
    parser.add_argument("--no-agent", action="store_true",
                        help="ztunnel's view only: do not ask the agent")
    parser.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table",
                        help="table (default), json or yaml")
    parser.add_argument("-n", "--namespace", default=None, help="only this namespace")
    parser.add_argument("--node", default=None, help="workloads: only those on this node")
    parser.add_argument("--address", default=None, help="workloads: only the one with this IP")
    parser.add_argument("--workload", default=None,
                        help="connections: only this workload (NAME or NAME.NAMESPACE)")
    parser.add_argument("--direction", choices=["inbound", "outbound"], default=None,
                        help="connections: only this direction")
    parser.add_argument("--raw", action="store_true",
                        help="connections: show addresses, not the names they belong to")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for ztunnel and for the agent (default: 5)")


# --- fetching -------------------------------------------------------------------------

def admin_url(address: str) -> str:
    """``HOST:PORT`` (or ``[v6]:PORT``) → ``http://HOST:PORT``. Raises ViewError."""
    from agent.core.hostport import format_addr, parse_addr

    try:
        host, port = parse_addr(address, 15000)
    except argparse.ArgumentTypeError as e:
        raise ViewError(str(e).replace("--addr", "--ztunnel-admin", 1)) from None
    return "http://" + format_addr(host, port)


async def _get_dump(url: str, timeout: float) -> dict:
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.get(url + "/config_dump") as resp:
                body = await resp.content.read(BODY_MAX + 1)
                status = resp.status
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        cause = getattr(e, "os_error", None)
        reason = getattr(cause, "strerror", None) or str(e) or "timed out"
        raise ViewError(f"no ztunnel admin answering at {url}: {reason}") from None
    if status != 200:
        raise ViewError(f"ztunnel admin at {url} answered HTTP {status} for /config_dump")
    if len(body) > BODY_MAX:
        raise ViewError(f"ztunnel admin at {url}: config_dump larger than {BODY_MAX} bytes")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ViewError(f"ztunnel admin at {url}: /config_dump is not JSON: {e}") from None
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k, []), list)
                                            for k in ("workloads", "services", "policies")):
        raise ViewError(f"ztunnel admin at {url}: /config_dump is not a ztunnel config dump "
                        "(no workloads/services/policies lists)")
    problem = dump_shape_problem(doc)
    if problem:
        raise ViewError(f"ztunnel admin at {url}: /config_dump is malformed: {problem}")
    return doc


LIST_KEYS = ("workloads", "services", "policies", "certificates")


def dump_shape_problem(doc: dict) -> str:
    """The first place ``doc`` departs from the shape the views read (each of
    :data:`LIST_KEYS` a list of objects, ``workloadState`` an object of objects), as
    ``services[0] is null, expected an object``; "" when it has none."""
    def kind(v: Any) -> str:
        return "null" if v is None else type(v).__name__
    for key in LIST_KEYS:
        value = doc.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            return f"{key} is {kind(value)}, expected a list"
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                return f"{key}[{i}] is {kind(item)}, expected an object"
    states = doc.get("workloadState")
    if states is not None and not isinstance(states, dict):
        return f"workloadState is {kind(states)}, expected an object"
    return ""


def fetch_dump(address: str, timeout: float) -> dict:
    """ztunnel's ``/config_dump`` at ``address`` → dict. Raises ViewError."""
    return asyncio.run(_get_dump(admin_url(address), timeout))


def fetch_agent(path: str, timeout: float) -> dict:
    """The agent's ``/debug/all``. Raises ViewError."""
    from agent.status.adminclient import get_json

    try:
        doc = get_json(path, "/debug/all", timeout)
    except RuntimeError as e:
        raise ViewError(str(e)) from None
    if not isinstance(doc, dict):
        raise ViewError(f"agent at {path}: /debug/all is not a JSON object")
    return doc


# --- the agent's side of the join ------------------------------------------------------

class AgentView:
    """What the agent's ``/debug/all`` says: enrollment by uid / (namespace, name) / IP,
    the uids, service keys and policy keys its xDS serves, what ZDS acked."""

    def __init__(self, doc: dict | None):
        self.present = doc is not None
        doc = doc or {}
        mesh: dict = doc["mesh"] if isinstance(doc.get("mesh"), dict) else {}
        self.workloads = {w.get("uid"): w for w in mesh.get("workloads") or [] if w.get("uid")}
        self.services = {f"{s.get('namespace')}/{s.get('hostname')}"
                         for s in mesh.get("services") or []}
        self.policies = {f"{p.get('namespace')}/{p.get('name')}"
                         for p in mesh.get("policies") or []}
        self.pods: dict[Any, dict] = {}
        pods = (doc.get("pods") or {}).get("pods") if isinstance(doc.get("pods"), dict) else {}
        for uid, rec in (pods or {}).items():
            # "namespace/name (uid ...)", the record's label
            ns, _, name = str(rec.get("pod", "")).split(" (uid ", 1)[0].partition("/")
            entry = {"uid": uid, "status": rec.get("status", "")}
            self.pods[uid] = entry
            self.pods[(ns, name)] = entry
            for ip in rec.get("ips") or []:
                self.pods[ip] = entry
        self.xds_client = _ztunnel_client(doc.get("xds"))

    def workload(self, w: dict) -> dict:
        if not self.present:
            return {}
        served = self.workloads.get(w.get("uid"))
        rec = self.pods.get((w.get("namespace"), w.get("name"))) or next(
            (self.pods[ip] for ip in w.get("workloadIps") or [] if ip in self.pods), None)
        return {"enrolled": rec["status"] if rec else "",
                "xds": served is not None,
                "zds_acked": bool(served and served.get("ztunnel"))}

    def service(self, s: dict) -> dict:
        if not self.present:
            return {}
        return {"xds": f"{s.get('namespace')}/{s.get('hostname')}" in self.services}

    def policy(self, p: dict) -> dict:
        if not self.present:
            return {}
        return {"xds": f"{p.get('namespace')}/{p.get('name')}" in self.policies}

    def enrolled(self, uid: str, namespace: str, name: str) -> str:
        """The enrollment state of a pod by its uid (ZDS's, as ztunnel's workloadState
        keys it), else by namespace and name; "" when not enrolled here."""
        rec = self.pods.get(uid) or self.pods.get((namespace, name))
        return rec["status"] if rec else ""


def _ztunnel_client(xds: Any) -> dict | None:
    """The agent's xDS stream from a ztunnel (the newest), with its address type's
    acks and last nonce."""
    clients = (xds or {}).get("clients") if isinstance(xds, dict) else None
    ztunnels = [c for c in clients or [] if "ztunnel" in str(c.get("node_id") or "")
                or c.get("proxy_type") == "ztunnel"]
    if not ztunnels:
        return None
    client = max(ztunnels, key=lambda c: c.get("connected_at") or 0)
    types = client.get("types") or {}
    address: dict = next((t for url, t in types.items() if url.endswith("/istio.workload.Address")),
                   next(iter(types.values()), {}))
    return {"stream": client.get("stream"), "peer": client.get("peer"),
            "node_id": client.get("node_id"), "acks": address.get("acks"),
            "nacks": address.get("nacks"), "last_nonce": address.get("last_nonce")}


# --- the views ------------------------------------------------------------------------

def _ns_ok(args: argparse.Namespace, namespace: str) -> bool:
    return not args.namespace or args.namespace.lower() == (namespace or "").lower()


def _vip(addr: str) -> str:
    return addr.partition("/")[2] or addr


def _waypoint(gateway: Any, services: list[dict]) -> str:
    """The waypoint's service name, as istioctl resolves it (``None`` when unset)."""
    if not isinstance(gateway, dict):
        return "None"
    dest = gateway.get("destination", "")
    for svc in services:
        if f"{svc.get('namespace')}/{svc.get('hostname')}" == dest or dest in (
                svc.get("vips") or []):
            return svc.get("name", "")
    return "NA"


def _yes(value: Any) -> str:
    return "yes" if value else "no"


def workloads(dump: dict, agent: AgentView, args: argparse.Namespace
              ) -> tuple[list[str], list[list[str]], list[dict]]:
    services = dump.get("services") or []
    chosen = [w for w in dump.get("workloads") or []
              if _ns_ok(args, w.get("namespace", ""))
              and (not args.node or args.node.lower() == str(w.get("node", "")).lower())
              and (not args.address or args.address in (w.get("workloadIps") or []))]
    chosen.sort(key=lambda w: (f"{w.get('namespace')}.{w.get('name')}", w.get("node", "")))
    head = ["NAMESPACE", "POD NAME", "ADDRESS", "NODE", "WAYPOINT", "PROTOCOL"]
    if agent.present:
        head += ["ENROLLED", "XDS", "ZDS"]
    rows, items = [], []
    for w in chosen:
        joined = agent.workload(w)
        row = [w.get("namespace", ""), w.get("name", ""),
               ",".join(w.get("workloadIps") or []) or w.get("hostname", ""),
               w.get("node", ""), _waypoint(w.get("waypoint"), services),
               w.get("protocol", "")]
        if agent.present:
            row += [joined["enrolled"] or "-", _yes(joined["xds"]),
                    "acked" if joined["zds_acked"] else "-"]
        rows.append(row)
        items.append({**w, "agent": joined} if agent.present else w)
    return head, rows, items


def services_view(dump: dict, agent: AgentView, args: argparse.Namespace
                  ) -> tuple[list[str], list[list[str]], list[dict]]:
    services = dump.get("services") or []
    by_uid = {w.get("uid"): w for w in dump.get("workloads") or []}
    chosen = sorted((s for s in services if _ns_ok(args, s.get("namespace", ""))),
                    key=lambda s: (s.get("namespace", ""), s.get("name", ""),
                                   s.get("hostname", "")))
    head = ["NAMESPACE", "SERVICE NAME", "SERVICE VIP", "WAYPOINT", "ENDPOINTS"]
    if agent.present:
        head.append("XDS")
    rows, items = [], []
    for s in chosen:
        endpoints = s.get("endpoints") or {}
        healthy = sum(1 for ep in endpoints.values()
                      if (by_uid.get(ep.get("workloadUid")) or {}).get("status") == "Healthy")
        row = [s.get("namespace", ""), s.get("name", ""),
               ",".join(_vip(a) for a in s.get("vips") or []),
               _waypoint(s.get("waypoint"), services), f"{healthy}/{len(endpoints)}"]
        joined = agent.service(s)
        if agent.present:
            row.append(_yes(joined["xds"]))
        rows.append(row)
        items.append({**s, "agent": joined} if agent.present else s)
    return head, rows, items


def policies_view(dump: dict, agent: AgentView, args: argparse.Namespace
                  ) -> tuple[list[str], list[list[str]], list[dict]]:
    chosen = sorted((p for p in dump.get("policies") or [] if _ns_ok(args, p.get("namespace", ""))),
                    key=lambda p: (p.get("namespace", ""), p.get("name", "")))
    head = ["NAMESPACE", "POLICY NAME", "ACTION", "SCOPE"] + (["XDS"] if agent.present else [])
    rows, items = [], []
    for p in chosen:
        joined = agent.policy(p)
        row = [p.get("namespace", ""), p.get("name", ""), str(p.get("action", "")),
               str(p.get("scope", ""))]
        if agent.present:
            row.append(_yes(joined["xds"]))
        rows.append(row)
        items.append({**p, "agent": joined} if agent.present else p)
    return head, rows, items


def _valid(cert: dict, now: float) -> bool:
    try:
        start = datetime.fromisoformat(cert["validFrom"].replace("Z", "+00:00")).timestamp()
        end = datetime.fromisoformat(cert["expirationTime"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError, AttributeError):
        return False
    return start <= now <= end


def _serial_hex(serial: Any) -> str:
    try:
        return format(int(str(serial)), "x")
    except ValueError:
        return str(serial)


def certificates_view(dump: dict, agent: AgentView, args: argparse.Namespace
                      ) -> tuple[list[str], list[list[str]], list[dict]]:
    head = ["CERTIFICATE NAME", "TYPE", "STATUS", "VALID CERT", "SERIAL NUMBER", "NOT AFTER",
            "NOT BEFORE"]
    rows, items, now = [], [], time.time()
    for c in dump.get("certificates") or []:
        state = "Unavailable" if "Unavailable" in str(c.get("state", "")) else c.get("state", "")
        chain, roots = c.get("certChain") or [], c.get("rootCerts") or []
        items.append(c)
        if not chain:
            rows.append([c.get("identity", ""), "NA", state, "false", "NA", "NA", "NA"])
            continue
        for i, cert in enumerate(chain):
            kind = "Leaf" if i == 0 else ("Root" if i == len(chain) - 1 and not roots
                                          else "Intermediate")
            rows.append([c.get("identity", ""), kind, state, str(_valid(cert, now)).lower(),
                         _serial_hex(cert.get("serialNumber", "")),
                         cert.get("expirationTime") or "NA", cert.get("validFrom") or "NA"])
        for cert in roots:
            rows.append([c.get("identity", ""), "Root", state, str(_valid(cert, now)).lower(),
                         _serial_hex(cert.get("serialNumber", "")),
                         cert.get("expirationTime") or "NA", cert.get("validFrom") or "NA"])
    return head, rows, items


def _split_addr(addr: str) -> tuple[str, str]:
    host, _, port = str(addr).rpartition(":")
    return host.strip("[]"), port


def connections_view(dump: dict, agent: AgentView, args: argparse.Namespace
                     ) -> tuple[list[str], list[list[str]], list[dict]]:
    workload, namespace = args.workload, args.namespace
    if workload and not namespace and "." in workload:
        workload, namespace = workload.split(".", 1)
    names: dict[str, str] = {}
    for s in dump.get("services") or []:
        ip = _vip((s.get("vips") or ["None"])[0])
        names[ip] = s.get("hostname", "")
    for w in dump.get("workloads") or []:
        ips = w.get("workloadIps") or ["None"]
        names[ips[0]] = f"{w.get('name')}.{w.get('namespace')}"

    def name_of(addr: Any) -> str:
        if args.raw or not addr:
            return str(addr or "")
        host, port = _split_addr(str(addr))
        if host in names:
            label = names[host]
            return f"{label}:{port}" if port else label
        return str(addr)

    states = sorted(((uid, st) for uid, st in (dump.get("workloadState") or {}).items()
                     if isinstance(st, dict)),
                    key=lambda e: ((e[1].get("info") or {}).get("namespace", ""),
                                   (e[1].get("info") or {}).get("name", "")))
    head = ["WORKLOAD", "DIRECTION", "LOCAL", "REMOTE", "REMOTE TARGET", "PROTOCOL"]
    if agent.present:
        head.append("ENROLLED")
    rows, items = [], []
    for uid, st in states:
        info = st.get("info") or {}
        if namespace and namespace != info.get("namespace"):
            continue
        if workload and workload.lower() != str(info.get("name", "")).lower():
            continue
        label = f"{info.get('name')}.{info.get('namespace')}"
        enrolled = agent.enrolled(uid, info.get("namespace", ""), info.get("name", "")) or "-"
        conns = st.get("connections") or {}
        if args.direction != "outbound":
            for c in conns.get("inbound") or []:
                rows.append([label, "Inbound", name_of(c.get("actualDst")), name_of(c.get("src")),
                             str(c.get("originalDst") or ""), str(c.get("protocol", ""))])
                if agent.present:
                    rows[-1].append(enrolled)
        if args.direction != "inbound":
            for c in conns.get("outbound") or []:
                rows.append([label, "Outbound", name_of(c.get("src")),
                             name_of(c.get("actualDst")), name_of(c.get("originalDst")),
                             str(c.get("protocol", ""))])
                if agent.present:
                    rows[-1].append(enrolled)
        items.append({**st, "agent": {"enrolled": enrolled if enrolled != "-" else ""}}
                     if agent.present else st)
    return head, rows, items


BUILDERS = {"workloads": workloads, "services": services_view, "policies": policies_view,
            "certificates": certificates_view, "connections": connections_view}


def table(head: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell, three spaces apart (istioctl's tabwriter)."""
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("   ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [head, *rows])


def _check(args: argparse.Namespace) -> None:
    if not args.timeout > 0:
        raise ViewError(f"--timeout must be a positive number of seconds, not {args.timeout}")
    if args.address:
        try:
            ipaddress.ip_address(args.address)
        except ValueError:
            raise ViewError(f"--address {args.address!r} is not an IP address") from None
    admin_url(args.ztunnel_admin)


def main(args: argparse.Namespace) -> int:
    from agent.status.cli import socket_path

    prog = "ambient-agent ztunnel-config"
    try:
        _check(args)
    except ViewError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    try:
        dump = fetch_dump(args.ztunnel_admin, args.timeout)
        agent = AgentView(None if args.no_agent else fetch_agent(socket_path(args), args.timeout))
    except ViewError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    try:
        head, rows, items = BUILDERS[args.view](dump, agent, args)
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as e:
        # deeper than dump_shape_problem looks: one line, never a traceback
        print(f"{prog}: ztunnel admin at {admin_url(args.ztunnel_admin)}: /config_dump has "
              f"an unexpected shape for the {args.view} view ({type(e).__name__}: "
              f"{str(e)[:200]})", file=sys.stderr)
        return 1
    if args.output == "json":
        print(json.dumps(items, indent=2))
    elif args.output == "yaml":
        import yaml

        print(yaml.safe_dump(items, sort_keys=False, default_flow_style=False), end="")
    else:
        print(table(head, rows))
        if agent.present and args.view != "certificates":
            c = agent.xds_client
            print()
            print("agent xDS: " + (f"ztunnel stream {c['stream']} from {c['peer']} "
                                   f"({c['node_id']}), address acks {c['acks']}, nacks "
                                   f"{c['nacks']}, last nonce {c['last_nonce'] or '-'}"
                                   if c else "no ztunnel connected to this agent's xDS"))
    return 0
