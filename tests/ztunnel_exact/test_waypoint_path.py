"""What ztunnel needs from the agent's xDS to send a Service's traffic through its
waypoint, checked on the resources ztunnel's own client receives
(:mod:`tests.ztunnel_exact.xds`) for the example cluster (``examples/cluster``: Service
``demo/server`` labelled ``istio.io/use-waypoint: waypoint``, Gateway ``demo/waypoint``
whose address is the hostname ``waypoint.demo.svc.cluster.local``, the waypoint's pod
and Service).

:class:`ZtunnelView` redoes the lookups ztunnel makes, written from istio/ztunnel:

- outbound (``src/proxy/outbound.rs`` ``build_request``): the target IP is a Service VIP;
  ``fetch_service_waypoint`` takes the Service's ``waypoint`` (``src/state.rs``); a
  hostname destination is resolved with ``find_hostname`` (a Service in that namespace
  first, else a workload with that hostname), an IP one as a VIP or a workload IP; the
  Service's endpoint (from the workloads' ``services`` map) and its port for
  ``hbone_mtls_port`` give the waypoint's ``IP:15008`` (``find_upstream_from_service``:
  the endpoint's port, else the Service's target port); the SANs ztunnel demands of the
  waypoint's certificate are the workload's identity and the Service's
  ``subject_alt_names`` (``workload_and_services_san``); the CONNECT authority stays the
  VIP and port the client dialled (single HBONE: same network);
- inbound at the destination (``src/proxy/inbound.rs`` ``validate_destination``,
  ``find_inbound_upstream``): a CONNECT whose address is the pod's own IP passes, the
  port is taken from it, and RBAC runs against the HBONE peer, i.e. the waypoint.

The real binary runs the same path in ``tests/peers/test_ztunnel_waypoint.py``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from ambient import workload_pb2 as wl
from tests.peers.test_ztunnel_waypoint import POLICIES, SERVICE_VIP
from tests.ztunnel_exact.test_xds import env_for
from tests.ztunnel_exact.xds import ADDRESS_TYPE, AUTHORIZATION_TYPE, ZtunnelXdsClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cluster"
HBONE_PORT = 15008
WAYPOINT_ID = "spiffe://cluster.local/ns/demo/sa/waypoint"


def example_objects() -> str:
    import yaml

    docs = [(EXAMPLES / f).read_text() for f in ("namespaces.yaml", "services.yaml",
                                                  "waypoint.yaml", "pods.yaml")]
    return "\n---\n".join(docs + [yaml.safe_dump_all(POLICIES)])


def _ip(raw: bytes) -> str:
    return str(ipaddress.ip_address(raw))


class ZtunnelView:
    """Workloads and Services as ztunnel indexes them (``src/state/workload.rs``,
    ``src/state/service.rs``): services by VIP and by ``(namespace, hostname)``,
    endpoints from each workload's ``services`` map (``namespace/hostname`` -> ports)."""

    def __init__(self, addresses: dict):
        self.workloads: dict[str, wl.Workload] = {}
        self.services: dict[tuple[str, str], wl.Service] = {}
        self.by_vip: dict[str, wl.Service] = {}
        for a in addresses.values():
            if a.WhichOneof("type") == "workload":
                self.workloads[a.workload.uid] = a.workload
            else:
                s = a.service
                self.services[(s.namespace, s.hostname)] = s
                for v in s.addresses:
                    self.by_vip[_ip(v.address)] = s

    @staticmethod
    def identity(w: wl.Workload) -> str:
        """``Workload::identity``: trust domain, namespace, service account."""
        return (f"spiffe://{w.trust_domain or 'cluster.local'}/ns/{w.namespace}/sa/"
                f"{w.service_account or 'default'}")

    def endpoints(self, svc: wl.Service) -> list[tuple[wl.Workload, dict[int, int]]]:
        key = f"{svc.namespace}/{svc.hostname}"
        return [(w, {p.service_port: p.target_port for p in w.services[key].ports})
                for w in self.workloads.values() if key in w.services
                and w.status == wl.HEALTHY]

    def _upstream_of_service(self, svc: wl.Service, port: int) -> tuple[wl.Workload, int, wl.Service]:
        svc_ports = {p.service_port: p.target_port for p in svc.ports}
        for w, ep_ports in self.endpoints(svc):
            target = ep_ports.get(port) or svc_ports.get(port)
            if target:
                return w, target, svc
        raise LookupError(f"service {svc.hostname} has no endpoint for port {port}")

    def service_waypoint(self, svc: wl.Service) -> tuple[wl.Workload, str, list[str]]:
        """``fetch_service_waypoint``: (waypoint workload, ``IP:port`` ztunnel dials,
        SANs it demands). LookupError where ztunnel answers UnknownWaypoint."""
        gw = svc.waypoint
        kind = gw.WhichOneof("destination")
        if kind == "hostname":
            found = self.services.get((gw.hostname.namespace, gw.hostname.hostname))
            if found is None:
                raise LookupError(f"waypoint {gw.hostname.hostname} not found")
            w, port, wsvc = self._upstream_of_service(found, gw.hbone_mtls_port)
        elif kind == "address":
            ip = _ip(gw.address.address)
            if ip in self.by_vip:
                w, port, wsvc = self._upstream_of_service(self.by_vip[ip], gw.hbone_mtls_port)
            else:
                w = next(x for x in self.workloads.values() if ip in map(_ip, x.addresses))
                port, wsvc = gw.hbone_mtls_port, None
        else:
            raise LookupError("the Service has no waypoint")
        sans = [self.identity(w), *(wsvc.subject_alt_names if wsvc else [])]
        return w, f"{_ip(w.addresses[0])}:{port}", sans

    @staticmethod
    def inbound_target(local: wl.Workload, conn_dst_ip: str, hbone: str) -> str:
        """``validate_destination`` + ``find_inbound_upstream`` for a SocketAddr
        authority: the pod's own IP passes; the upstream is that IP and the CONNECT's
        port. ValueError for an IP mismatch (ztunnel's 400)."""
        ip, _, port = hbone.rpartition(":")
        if ip != conn_dst_ip and not local.HasField("application_tunnel"):
            raise ValueError(f"IP mismatch: {conn_dst_ip} != {ip}")
        return f"{conn_dst_ip}:{port}"


async def test_ztunnel_resolves_the_service_waypoint_from_our_xds(make_agent):
    agent = await make_agent(extra_objects=example_objects())
    client = await ZtunnelXdsClient(env_for(agent)).start()
    try:
        await client.wait_ready()
        assert not client.nacks
        view = ZtunnelView(client.resources[ADDRESS_TYPE])
        policies = client.resources[AUTHORIZATION_TYPE]
    finally:
        await client.close()

    server_svc = view.by_vip[SERVICE_VIP]
    assert server_svc.hostname == "server.demo.svc.cluster.local"
    # the Service names its waypoint by hostname, with HBONE's port
    assert server_svc.waypoint.hostname == wl.NamespacedHostname(
        namespace="demo", hostname="waypoint.demo.svc.cluster.local")
    assert server_svc.waypoint.hbone_mtls_port == HBONE_PORT

    # client -> 10.96.10.20:80: HBONE to the waypoint pod's 15008, its identity demanded
    waypoint, dial, sans = view.service_waypoint(server_svc)
    assert waypoint.name == "waypoint-5c8f7d9b6-x2k4p"
    assert dial == "10.244.1.14:15008"
    assert sans == [WAYPOINT_ID]  # what the waypoint's certificate must carry
    # the waypoint's own pod is not sent through a waypoint, nor captured
    assert not waypoint.HasField("waypoint")
    assert waypoint.tunnel_protocol == wl.NONE

    # waypoint -> server pod 15008, CONNECT <pod IP>:8080 (the waypoint's EDS endpoint,
    # tests/waypoint/test_envoy_waypoint.py): the destination ztunnel accepts it
    server = next(w for w in view.workloads.values() if w.name == "server")
    assert not server.HasField("waypoint")  # bound as a Service, not as a workload
    assert view.inbound_target(server, "10.244.1.12", "10.244.1.12:8080") == "10.244.1.12:8080"

    # ztunnel enforces the selector policy (against the waypoint's identity); the policy
    # aimed at the waypoint (targetRefs) is Envoy's alone
    assert "demo/server-only-from-waypoint" in policies
    assert not any("deny-denied-path" in name for name in policies)
    rule = policies["demo/server-only-from-waypoint"]
    principals = [p.exact for g in rule.groups for r in g.rules for m in r.matches
                  for p in m.principals]
    assert principals == ["cluster.local/ns/demo/sa/waypoint"]
