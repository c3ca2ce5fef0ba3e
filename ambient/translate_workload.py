"""Pod, WorkloadEntry, ServiceEntry endpoint and EndpointSlice endpoint ->
``istio.workload.Workload`` (``docs/ambient.md``).

These functions fill the fields that come from the object itself (uid, addresses, status,
identity, names, tunnel protocol, locality). The relational fields — ``services``,
``authorization_policies``, ``waypoint``, ``application_tunnel``, ``network_gateway`` — are
filled by the index, which knows the other objects.
"""

from __future__ import annotations

import re

from google.protobuf import wrappers_pb2

from agent.core.annotations import REGISTERED_BY
from ambient import workload_pb2 as wl
from ambient.objects import (Mesh, TranslateError, annotations_of, field, ip_bytes, labels, meta,
                             parse_ip_or_none, pod_ips, spec, status)

REDIRECTION = "ambient.istio.io/redirection"
TUNNEL = "networking.istio.io/tunnel"
_JOB_NAME = re.compile(r"^(.+)-\d{8,10}$")


def pod_uid(mesh: Mesh, namespace: str, name: str) -> str:
    return f"{mesh.cluster_id}//Pod/{namespace}/{name}"


def workload_name(pod: dict) -> str:
    """Label, else the controller owner (ReplicaSet hash / Job suffix trimmed), else name."""
    m = meta(pod)
    lbls = labels(pod)
    if lbls.get("service.istio.io/workload-name"):
        return lbls["service.istio.io/workload-name"]
    owners = [o for o in (m.get("ownerReferences") or []) if isinstance(o, dict)]
    owner = next((o for o in owners if o.get("controller")), None)
    if not m.get("generateName") or owner is None or not isinstance(owner.get("name"), str):
        return m["name"]
    name, kind = owner["name"], owner.get("kind")
    if kind == "ReplicaSet":
        for key in ("pod-template-hash", "rollouts-pod-template-hash"):
            h = lbls.get(key)
            if h and name.endswith("-" + h):
                return name[:-len(h) - 1]
    if kind == "ReplicationController" and lbls.get("deploymentconfig"):
        return lbls["deploymentconfig"]
    if kind == "Job":
        match = _JOB_NAME.match(name)
        if match:
            return match.group(1)
    return name


def canonical(lbls: dict[str, str], wname: str) -> tuple[str, str]:
    name = (lbls.get("service.istio.io/canonical-name") or lbls.get("app.kubernetes.io/name")
            or lbls.get("app") or wname)
    rev = (lbls.get("service.istio.io/canonical-revision")
           or lbls.get("app.kubernetes.io/version") or lbls.get("version") or "latest")
    return name, rev


def locality(node: dict | None) -> wl.Locality | None:
    if not node:
        return None
    lbls = labels(node)
    loc = wl.Locality(region=lbls.get("topology.kubernetes.io/region", ""),
                      zone=lbls.get("topology.kubernetes.io/zone", ""),
                      subzone=lbls.get("topology.istio.io/subzone", ""))
    return loc if (loc.region or loc.zone or loc.subzone) else None


def tunnel(lbls: dict[str, str], ann: dict[str, str], w: wl.Workload) -> None:
    """tunnel_protocol / native_tunnel, as istiod's ``setTunnelProtocol``
    (``pilot/pkg/serviceregistry/ambient/workloads.go``; LEGACY_ISTIO_MTLS is
    feature-gated off): HBONE only when ``ambient.istio.io/redirection: enabled`` says
    the pod is captured (the node agent writes it once the pod is enrolled), or the
    ``networking.istio.io/tunnel: http`` label says it speaks HBONE natively. Labels that
    merely select a pod for ambient are not enough: another ztunnel would send HBONE to
    a pod where nothing listens on 15008."""
    if ann.get(REDIRECTION) == "enabled":
        w.tunnel_protocol = wl.HBONE
    if "http" in [v.strip() for v in lbls.get(TUNNEL, "").split(",")]:
        w.tunnel_protocol = wl.HBONE
        w.native_tunnel = True


def pod_included(pod: dict) -> bool:
    """Not terminal and has an IP."""
    return status(pod).get("phase") not in ("Succeeded", "Failed") and bool(pod_ips(pod))


def container_ports(pod: dict) -> dict[str, int]:
    """Named TCP ports of containers and native-sidecar init containers."""
    out: dict[str, int] = {}
    containers = list(field(pod, "spec.containers", list, []))
    containers += [c for c in field(pod, "spec.initContainers", list, [])
                   if isinstance(c, dict) and c.get("restartPolicy") == "Always"]
    for c in containers:
        if not isinstance(c, dict):
            continue
        for p in c.get("ports") or []:
            if (isinstance(p, dict) and p.get("name") and (p.get("protocol") or "TCP") == "TCP"
                    and isinstance(p.get("containerPort"), int)):
                out.setdefault(p["name"], p["containerPort"])
    return out


def pod_workload(pod: dict, mesh: Mesh, namespace_obj: dict | None,
                 node: dict | None) -> wl.Workload:
    """The object-local fields of a pod's Workload. Raises TranslateError on bad fields.
    ``namespace_obj`` is the pod's Namespace (or None); ``node`` its Node (locality)."""
    m, s = meta(pod), spec(pod)
    ns, name = m["namespace"], m["name"]
    w = wl.Workload(uid=pod_uid(mesh, ns, name), name=name, namespace=ns,
                    network=mesh.network, cluster_id=mesh.cluster_id,
                    trust_domain=mesh.sent_trust_domain, workload_type=wl.POD)
    for i, ip in enumerate(pod_ips(pod)):
        w.addresses.append(ip_bytes(ip, f"status.podIPs[{i}]"))
    w.node = field(pod, "spec.nodeName", str, "")
    w.service_account = field(pod, "spec.serviceAccountName", str, "")
    ready = any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
                for c in field(pod, "status.conditions", list, []))
    w.status = wl.HEALTHY if ready and not m.get("deletionTimestamp") else wl.UNHEALTHY
    if s.get("hostNetwork") is True:
        w.network_mode = wl.HOST_NETWORK
    lbls = labels(pod)
    w.workload_name = workload_name(pod)
    w.canonical_name, w.canonical_revision = canonical(lbls, w.workload_name)
    loc = locality(node)
    if loc is not None:
        w.locality.CopyFrom(loc)
    tunnel(lbls, annotations_of(pod), w)
    return w


def workload_entry(we: dict, mesh: Mesh) -> tuple[wl.Workload, dict[str, str], dict[str, int]]:
    """WorkloadEntry -> (Workload, merged labels, named ports)."""
    m = meta(we)
    ns, name = m["namespace"], m["name"]
    lbls = dict(labels(we))
    spec_labels = field(we, "spec.labels", dict, {})
    lbls.update({str(k): str(v) for k, v in spec_labels.items()})
    w = wl.Workload(uid=f"{mesh.cluster_id}/networking.istio.io/WorkloadEntry/{ns}/{name}",
                    name=name, namespace=ns, cluster_id=mesh.cluster_id,
                    trust_domain=mesh.sent_trust_domain, workload_type=wl.POD,
                    status=wl.HEALTHY)
    address = field(we, "spec.address", str, "")
    if address:
        _address(w, address, "spec.address")
    # else: no address at all, as istiod keeps it (an entry on another network reached
    # through that network's gateway, or only through its waypoint); the index logs it
    w.network = field(we, "spec.network", str, "") or mesh.network
    w.service_account = field(we, "spec.serviceAccount", str, "")
    weight = field(we, "spec.weight", int, 0)
    if weight > 0:
        w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=weight))
    w.workload_name = (annotations_of(we).get("istio.io/autoRegistrationGroup")
                       or lbls.get("service.istio.io/workload-name") or name)
    w.canonical_name, w.canonical_revision = canonical(lbls, w.workload_name)
    _locality_text(w, field(we, "spec.locality", str, ""))
    # An entry a host's agent registered from CNI (cni/registration_kube.py) runs on that
    # host: its node is what lets that host's ztunnel find it as one of its own pods
    # (ztunnel indexes node-local workloads by node name). Other entries have no node.
    w.node = annotations_of(we).get(REGISTERED_BY, "")
    tunnel(lbls, annotations_of(we), w)
    return w, lbls, _named_ports(field(we, "spec.ports", dict, {}), "spec.ports")


def se_endpoint(se: dict, ep: object, index: int, mesh: Mesh
                ) -> tuple[wl.Workload, dict[str, str], dict[str, int]]:
    """ServiceEntry ``spec.endpoints[index]`` -> (Workload, labels, named ports)."""
    path = f"spec.endpoints[{index}]"
    if not isinstance(ep, dict):
        raise TranslateError(f"field {path!r} must be a mapping, got {ep!r}")
    m = meta(se)
    ns, name = m["namespace"], m["name"]
    address = ep.get("address") or ""
    if not isinstance(address, str):
        raise TranslateError(f"field '{path}.address' must be a string, got {address!r}")
    # an endpoint without an address (on another network, reached through its gateway)
    # is kept, as istiod keeps it; its uid then ends in "/", as istiod's does
    w = wl.Workload(uid=f"{mesh.cluster_id}/networking.istio.io/ServiceEntry/{ns}/{name}/"
                        f"{address}", name=name, namespace=ns, cluster_id=mesh.cluster_id,
                    trust_domain=mesh.sent_trust_domain, workload_type=wl.POD,
                    status=wl.HEALTHY)
    if address:
        _address(w, address, f"{path}.address")
    w.network = str(ep.get("network") or mesh.network)
    w.service_account = str(ep.get("serviceAccount") or "")
    weight = ep.get("weight")
    if isinstance(weight, int) and not isinstance(weight, bool) and weight > 0:
        w.capacity.CopyFrom(wrappers_pb2.UInt32Value(value=weight))
    _locality_text(w, str(ep.get("locality") or ""))
    se_labels = labels(se)
    ep_labels = {str(k): str(v) for k, v in (ep.get("labels") or {}).items()}
    w.workload_name = name  # istiod: the ServiceEntry's name, whatever its labels
    w.canonical_name, w.canonical_revision = canonical(se_labels, w.workload_name)
    tunnel(se_labels, annotations_of(se), w)
    return w, ep_labels, _named_ports(ep.get("ports") or {}, f"{path}.ports")


def dns_host_workload(se: dict, host: str, mesh: Mesh) -> wl.Workload:
    """The implicit Workload of a DNS ServiceEntry host without endpoints."""
    m = meta(se)
    ns, name = m["namespace"], m["name"]
    w = wl.Workload(uid=f"{mesh.cluster_id}/networking.istio.io/ServiceEntry/{ns}/{name}/{host}",
                    name=name, namespace=ns, hostname=host, network=mesh.network,
                    cluster_id=mesh.cluster_id, trust_domain=mesh.sent_trust_domain,
                    workload_type=wl.POD, status=wl.HEALTHY)
    # istiod names every ServiceEntry workload after the ServiceEntry itself
    w.workload_name = name
    w.canonical_name, w.canonical_revision = canonical(labels(se), w.workload_name)
    tunnel(labels(se), annotations_of(se), w)
    return w


def slice_endpoint(slice_obj: dict, ep: dict, index: int, mesh: Mesh) -> wl.Workload:
    """An EndpointSlice endpoint without a Pod targetRef -> HOST_NETWORK Workload, as
    istiod's ``endpointSlicesBuilder``: nothing is known of what answers there, so the
    workload carries no workload name, canonical name or revision, and the proto's
    default workload type (``DEPLOYMENT``, where pods say ``POD``), no service account,
    locality, waypoint or policies.

    Raises TranslateError naming ``endpoints[index].addresses[j]`` when an address is
    not an IP (istiod skips that endpoint; so does the index) or the list is empty."""
    addrs = ep.get("addresses") or []
    if not isinstance(addrs, list) or not addrs:
        raise TranslateError(f"field 'endpoints[{index}].addresses' must be a non-empty list, "
                             f"got {addrs!r}")
    m = meta(slice_obj)
    ns, name = m["namespace"], m["name"]
    w = wl.Workload(uid=f"{mesh.cluster_id}/discovery.k8s.io/EndpointSlice/{ns}/{name}/{addrs[0]}",
                    name=name, namespace=ns, network=mesh.network, cluster_id=mesh.cluster_id,
                    trust_domain=mesh.sent_trust_domain, network_mode=wl.HOST_NETWORK)
    for j, a in enumerate(addrs):
        w.addresses.append(ip_bytes(a, f"endpoints[{index}].addresses[{j}]"))
    ready = (ep.get("conditions") or {}).get("ready")
    w.status = wl.UNHEALTHY if ready is False else wl.HEALTHY
    return w


def _address(w: wl.Workload, address: str, path: str) -> None:
    if not address:
        raise TranslateError(f"field {path!r} is required")
    raw = parse_ip_or_none(address)
    if raw is not None:
        w.addresses.append(raw)
    elif "/" in address or ":" in address:
        raise TranslateError(f"field {path!r} is neither an IP nor a hostname: {address!r}")
    else:
        w.hostname = address


def _locality_text(w: wl.Workload, text: str) -> None:
    if text:
        parts = (text.split("/") + ["", "", ""])[:3]
        w.locality.CopyFrom(wl.Locality(region=parts[0], zone=parts[1], subzone=parts[2]))


def _named_ports(raw: object, path: str) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise TranslateError(f"field {path!r} must map port names to numbers, got {raw!r}")
    out = {}
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 65535:
            raise TranslateError(f"field '{path}.{k}' must be a port number, got {v!r}")
        out[str(k)] = v
    return out
