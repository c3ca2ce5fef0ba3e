"""The cluster states of the differential suite (tests/oracle/test_oracle.py).

A :class:`Case` is a sequence of steps; each step is a list of operations on the API server
(:data:`Op`), applied in order, after which both control planes are compared. After the last
step the case's objects are deleted and the two are compared once more (so every case also
tests deletes). Each case lives in its own namespaces (``c<NN>`` and ``c<NN>b``); objects it
puts into istio-system (mesh-wide policies) are deleted with it.

Operations:

- ``("apply", obj)`` server-side apply (forced; a later apply of the same object replaces
  the fields the earlier one set: that is how a case *changes* an object);
- ``("pod", manifest, ips, ready, phase)`` create a pod (bound to a node) and write its
  status as the kubelet would;
- ``("podstatus", ns, name, ips, ready, phase)`` rewrite a pod's status;
- ``("gwstatus", ns, name, addresses)`` write a Gateway's ``status.addresses`` as its
  controller does once the deployment is ready (list of ``(type, value)``);
- ``("lbstatus", ns, name, ips)`` write a Service's ``status.loadBalancer.ingress``;
- ``("delete", apiVersion, kind, ns, name)`` delete one object (pods: user + kubelet);
- ``("terminate", ns, name)`` a pod's graceful delete only (it stays, terminating).

``xfail`` names the issue item a case is known to differ by while its fix is pending
(non-strict; none today); ``deliberate`` names entries of docs/xds.md "Deliberate
differences from istiod" that the case may show.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tests.oracle.harness import NODE, NODE_ZONED

Op = tuple[Any, ...]
AMBIENT = {"istio.io/dataplane-mode": "ambient"}
SEC, NET, GW = "security.istio.io/v1", "networking.istio.io/v1", "gateway.networking.k8s.io/v1"


@dataclasses.dataclass
class Case:
    id: str
    steps: list[list[Op]]
    namespaces: tuple[str, ...]
    extra_scope: tuple[str, ...] = ()      # more namespaces whose resources are compared
    xfail: str | None = None
    deliberate: tuple[str, ...] = ()
    empty: bool = False                    # both must serve nothing for it (asserted)

    @property
    def scope(self) -> tuple[str, ...]:
        return self.namespaces + self.extra_scope


# ---------------------------------------------------------------- object builders

def ns(name: str, labels: dict | None = None) -> Op:
    return ("apply", {"apiVersion": "v1", "kind": "Namespace",
                      "metadata": {"name": name, "labels": labels or {}}})


def sa(namespace: str, name: str) -> Op:
    return ("apply", {"apiVersion": "v1", "kind": "ServiceAccount",
                      "metadata": {"name": name, "namespace": namespace}})


def pod(name: str, namespace: str, ips: list[str], labels: dict | None = None,
        annotations: dict | None = None, node: str = NODE, ready: bool = True,
        phase: str = "Running", service_account: str = "default",
        ports: list[dict] | None = None, **spec: Any) -> Op:
    container: dict[str, Any] = {"name": "app", "image": "registry.invalid/app:1"}
    if ports:
        container["ports"] = ports
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                             "annotations": annotations or {}},
                "spec": {"nodeName": node, "serviceAccountName": service_account,
                         "containers": [container], **spec}}
    return ("pod", manifest, ips, ready, phase)


def svc(name: str, namespace: str, selector: dict | None, ports: list[dict] | None = None,
        labels: dict | None = None, annotations: dict | None = None, **spec: Any) -> Op:
    body: dict[str, Any] = {"ports": ports or [{"name": "http", "port": 80,
                                                "targetPort": 8080}], **spec}
    if selector is not None:
        body["selector"] = selector
    return ("apply", {"apiVersion": "v1", "kind": "Service",
                      "metadata": {"name": name, "namespace": namespace,
                                   "labels": labels or {}, "annotations": annotations or {}},
                      "spec": body})


def slice_(name: str, namespace: str, service: str, endpoints: list[dict],
           ports: list[dict] | None = None, family: str = "IPv4") -> Op:
    return ("apply", {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                      "metadata": {"name": name, "namespace": namespace,
                                   "labels": {"kubernetes.io/service-name": service}},
                      "addressType": family, "endpoints": endpoints,
                      "ports": ports or [{"name": "http", "port": 8080, "protocol": "TCP"}]})


def se(name: str, namespace: str, spec: dict, labels: dict | None = None) -> Op:
    return ("apply", {"apiVersion": NET, "kind": "ServiceEntry",
                      "metadata": {"name": name, "namespace": namespace,
                                   "labels": labels or {}}, "spec": spec})


def we(name: str, namespace: str, spec: dict, labels: dict | None = None) -> Op:
    return ("apply", {"apiVersion": NET, "kind": "WorkloadEntry",
                      "metadata": {"name": name, "namespace": namespace,
                                   "labels": labels or {}}, "spec": spec})


def ap(name: str, namespace: str, spec: dict, annotations: dict | None = None) -> Op:
    return ("apply", {"apiVersion": SEC, "kind": "AuthorizationPolicy",
                      "metadata": {"name": name, "namespace": namespace,
                                   "annotations": annotations or {}}, "spec": spec})


def pa(name: str, namespace: str, spec: dict) -> Op:
    return ("apply", {"apiVersion": SEC, "kind": "PeerAuthentication",
                      "metadata": {"name": name, "namespace": namespace}, "spec": spec})


def gateway(name: str, namespace: str, cls: str = "istio-waypoint",
            labels: dict | None = None, listeners: list[dict] | None = None,
            annotations: dict | None = None) -> Op:
    return ("apply", {"apiVersion": GW, "kind": "Gateway",
                      "metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                                   "annotations": annotations or {}},
                      "spec": {"gatewayClassName": cls, "listeners": listeners or [
                          {"name": "mesh", "port": 15008, "protocol": "HBONE"}]}})


def waypoint(name: str, namespace: str, ip: str | None = None, labels: dict | None = None,
             hostname: bool = True) -> list[Op]:
    """A waypoint as Istio's deployment controller leaves it: the Gateway, its Service
    (``<name>.<ns>.svc.cluster.local``, port 15008), its ready status address (the Service's
    hostname, or ``ip``), one running instance pod."""
    ops = [svc(name, namespace, {"gateway.networking.k8s.io/gateway-name": name},
               ports=[{"name": "mesh", "port": 15008, "protocol": "TCP"}],
               labels={"gateway.networking.k8s.io/gateway-name": name}),
           gateway(name, namespace, labels=labels)]
    addr = (("Hostname", f"{name}.{namespace}.svc.cluster.local") if hostname
            else ("IPAddress", ip))
    ops.append(("gwstatus", namespace, name, [addr]))
    if ip:
        ops.append(sa(namespace, name))
        ops.append(pod(f"{name}-0", namespace, [ip],
                       labels={"gateway.networking.k8s.io/gateway-name": name},
                       service_account=name))
    return ops


def delete(api_version: str, kind: str, namespace: str, name: str) -> Op:
    return ("delete", api_version, kind, namespace, name)


def _net(i: int, n: int) -> str:
    return f"10.244.{i}.{n}"


# ---------------------------------------------------------------- the cases

def _cases() -> list[Case]:
    cases: list[Case] = []

    def case(cid: str, build, extra_scope: tuple[str, ...] = (), xfail: str | None = None,
             deliberate: tuple[str, ...] = (), second_ns: bool = False, empty: bool = False,
             labels: dict | None = None, labels_b: dict | None = None) -> None:
        i = len(cases) + 1
        a, b = f"c{i:02d}", f"c{i:02d}b"
        head = [ns(a, AMBIENT if labels is None else labels), sa(a, "default")]
        if second_ns:
            head += [ns(b, AMBIENT if labels_b is None else labels_b), sa(b, "default")]
        steps = build(a, b, lambda n: _net(i, n))
        steps[0] = head + steps[0]
        cases.append(Case(cid, steps, (a, b) if second_ns else (a,), extra_scope, xfail,
                          deliberate, empty))

    # ---- pods
    case("pod-no-labels", lambda a, b, ip: [[pod("p", a, [ip(1)])]])
    case("pod-app-version-labels", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], labels={"app": "web", "version": "v2"})]])
    case("pod-k8s-recommended-labels", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], labels={"app.kubernetes.io/name": "shop",
                                 "app.kubernetes.io/version": "1.2"})]])
    case("pod-canonical-labels", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], labels={"service.istio.io/canonical-name": "cart",
                                 "service.istio.io/canonical-revision": "r7", "app": "x"})]])
    case("pod-redirection-annotation", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], annotations={"ambient.istio.io/redirection": "enabled"})]])
    case("pod-namespace-not-ambient", lambda a, b, ip: [[pod("p", a, [ip(1)])]], labels={})
    case("pod-opt-out-label", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], labels={"istio.io/dataplane-mode": "none"})]])
    case("pod-ambient-label-in-plain-namespace", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], labels=AMBIENT)]], labels={})
    case("pod-sidecar-injected", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], labels={"security.istio.io/tlsMode": "istio"},
        annotations={"sidecar.istio.io/status": '{"containers":["istio-proxy"]}'})]],
        labels={})
    case("pod-dual-stack", lambda a, b, ip: [[pod("p", a, [ip(1), "fd00:10:244::5"])]])
    case("pod-not-ready", lambda a, b, ip: [[pod("p", a, [ip(1)], ready=False)]])
    case("pod-pending-without-ip", lambda a, b, ip: [[pod("p", a, [], ready=False,
                                                          phase="Pending")]],
         empty=True)
    case("pod-host-network", lambda a, b, ip: [[pod("p", a, ["10.250.0.2"],
                                                    hostNetwork=True)]])
    case("pod-service-account", lambda a, b, ip: [[sa(a, "ledger"), pod(
        "p", a, [ip(1)], service_account="ledger")]])
    case("pod-on-zoned-node", lambda a, b, ip: [[pod("p", a, [ip(1)], node=NODE_ZONED)]])
    case("pod-network-label", lambda a, b, ip: [[pod(
        "p", a, [ip(1)], labels={"topology.istio.io/network": "net-1"})]])
    case("pod-labels-changed", lambda a, b, ip: [
        [svc("web", a, {"app": "web"}), pod("p", a, [ip(1)], labels={"app": "web"})],
        [("apply", {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "p", "namespace": a, "labels": {"app": "other"}}})]])
    case("pod-ip-changed-and-deleted", lambda a, b, ip: [
        [pod("p", a, [ip(1)]), pod("q", a, [ip(2)])],
        [("podstatus", a, "p", [ip(3)], True, "Running")],
        [delete("v1", "Pod", a, "q")]])
    case("pod-terminating", lambda a, b, ip: [
        [pod("p", a, [ip(1)], labels={"app": "t"}), svc("t", a, {"app": "t"})],
        [("terminate", a, "p")]])
    case("pod-succeeded", lambda a, b, ip: [
        [pod("p", a, [ip(1)])], [("podstatus", a, "p", [ip(1)], False, "Succeeded")]])

    # ---- services and endpoint slices
    case("service-clusterip-selecting-pods", lambda a, b, ip: [[
        svc("web", a, {"app": "web"}, ports=[{"name": "http", "port": 80, "targetPort": 8080},
                                             {"name": "grpc", "port": 9090}]),
        pod("w1", a, [ip(1)], labels={"app": "web"}),
        pod("w2", a, [ip(2)], labels={"app": "web"})]])
    case("service-named-target-port", lambda a, b, ip: [[
        svc("web", a, {"app": "web"}, ports=[{"name": "http", "port": 80,
                                              "targetPort": "web-port"}]),
        pod("w1", a, [ip(1)], labels={"app": "web"},
            ports=[{"name": "web-port", "containerPort": 8081}])]])
    case("service-headless", lambda a, b, ip: [[
        svc("db", a, {"app": "db"}, clusterIP="None"),
        pod("d1", a, [ip(1)], labels={"app": "db"})]])
    case("service-without-selector-with-slice", lambda a, b, ip: [[
        svc("ext", a, None),
        slice_("ext-1", a, "ext", [{"addresses": [ip(9)], "conditions": {"ready": True}}])]])
    case("service-slice-pointing-at-pod", lambda a, b, ip: [[
        svc("ext", a, None), pod("p", a, [ip(1)], labels={"app": "p"}),
        slice_("ext-1", a, "ext", [{"addresses": [ip(1)], "conditions": {"ready": True},
                                    "targetRef": {"kind": "Pod", "name": "p",
                                                  "namespace": a}}])]])
    case("service-external-name", lambda a, b, ip: [[
        svc("alias", a, None, type="ExternalName", externalName="example.invalid")]],
         empty=True)
    case("service-load-balancer", lambda a, b, ip: [[
        svc("lb", a, {"app": "lb"}, type="LoadBalancer"),
        pod("l1", a, [ip(1)], labels={"app": "lb"})],
        [("lbstatus", a, "lb", ["192.0.2.10"])]])
    case("service-dual-stack", lambda a, b, ip: [[
        svc("ds", a, {"app": "ds"}, ipFamilyPolicy="RequireDualStack"),
        pod("d1", a, [ip(1), "fd00:10:244::7"], labels={"app": "ds"})]])
    case("service-traffic-distribution", lambda a, b, ip: [[
        svc("td", a, {"app": "td"}, trafficDistribution="PreferClose"),
        svc("td2", a, {"app": "td"},
            annotations={"networking.istio.io/traffic-distribution": "PreferNetwork"}),
        pod("t1", a, [ip(1)], labels={"app": "td"}, node=NODE_ZONED)]])
    case("service-app-protocol-and-udp", lambda a, b, ip: [[
        svc("mixed", a, {"app": "m"}, ports=[
            {"name": "h2", "port": 81, "appProtocol": "http2", "targetPort": 8081},
            {"name": "dns", "port": 53, "protocol": "UDP"}]),
        pod("m1", a, [ip(1)], labels={"app": "m"})]])
    case("service-ports-changed-then-deleted", lambda a, b, ip: [
        [svc("web", a, {"app": "web"}), pod("w1", a, [ip(1)], labels={"app": "web"})],
        [svc("web", a, {"app": "web"}, ports=[{"name": "http", "port": 8000,
                                                "targetPort": 9000}])],
        [delete("v1", "Service", a, "web")]])
    case("service-selector-changed", lambda a, b, ip: [
        [svc("web", a, {"app": "a"}), pod("w1", a, [ip(1)], labels={"app": "a"}),
         pod("w2", a, [ip(2)], labels={"app": "b"})],
        [svc("web", a, {"app": "b"})]])
    case("service-publish-not-ready", lambda a, b, ip: [[
        svc("web", a, {"app": "web"}, publishNotReadyAddresses=True),
        pod("w1", a, [ip(1)], labels={"app": "web"}, ready=False)]])

    # ---- service entries
    def se_spec(resolution: str, **extra: Any) -> dict:
        return {"hosts": [f"{resolution.lower().replace('_', '-')}.example.invalid"],
                "ports": [{"number": 443, "name": "tls", "protocol": "TLS"}],
                "location": "MESH_EXTERNAL", "resolution": resolution, **extra}

    case("serviceentry-static-inline-endpoints", lambda a, b, ip: [[se(
        "static", a, se_spec("STATIC", addresses=["240.0.0.10"],
                             endpoints=[{"address": ip(1), "labels": {"app": "ep"}},
                                        {"address": ip(2), "ports": {"tls": 8443}}]),
        labels={"team": "x"})]])
    case("serviceentry-workload-selector", lambda a, b, ip: [[
        se("sel", a, {"hosts": ["sel.internal"], "addresses": ["240.0.0.11"],
                      "ports": [{"number": 80, "name": "http", "protocol": "HTTP",
                                 "targetPort": 8080}],
                      "location": "MESH_INTERNAL", "resolution": "STATIC",
                      "workloadSelector": {"labels": {"app": "sel"}}}),
        pod("s1", a, [ip(1)], labels={"app": "sel"}),
        we("s2", a, {"address": ip(2), "labels": {"app": "sel"}}, labels={"app": "sel"})]])
    case("serviceentry-dns", lambda a, b, ip: [[se(
        "dns", a, se_spec("DNS", endpoints=[{"address": "a.example.invalid"},
                                            {"address": "b.example.invalid"}]))]])
    case("serviceentry-dns-round-robin", lambda a, b, ip: [[se(
        "rr", a, se_spec("DNS_ROUND_ROBIN"))]])
    case("serviceentry-none", lambda a, b, ip: [[se(
        "none", a, se_spec("NONE", addresses=["240.0.0.12"]))]])
    case("serviceentry-auto-allocated-address", lambda a, b, ip: [[se(
        "auto", a, {"hosts": ["auto.example.invalid"],
                    "ports": [{"number": 80, "name": "http", "protocol": "HTTP"}],
                    "resolution": "DNS"})]])
    case("serviceentry-mesh-internal-multi-host", lambda a, b, ip: [[se(
        "multi", a, {"hosts": ["m1.internal", "m2.internal"], "addresses": ["240.0.0.13"],
                     "ports": [{"number": 8080, "name": "http", "protocol": "HTTP"}],
                     "location": "MESH_INTERNAL", "resolution": "STATIC",
                     "endpoints": [{"address": ip(1), "serviceAccount": "m"}]})]])
    case("serviceentry-dns-with-strict-peerauthentication", lambda a, b, ip: [[
        pa("strict", a, {"mtls": {"mode": "STRICT"}}),
        se("dns", a, se_spec("DNS", endpoints=[{"address": "a.example.invalid"}]))]])
    case("serviceentry-inline-endpoints-selector-policy", lambda a, b, ip: [[
        se("static", a, se_spec("STATIC", addresses=["240.0.0.14"],
                                endpoints=[{"address": ip(1), "labels": {"app": "ep"}}]),
           labels={"app": "se"}),
        ap("by-se-label", a, {"selector": {"matchLabels": {"app": "se"}},
                              "action": "DENY", "rules": [{"to": [{"operation": {
                                  "ports": ["9999"]}}]}]}),
        ap("by-ep-label", a, {"selector": {"matchLabels": {"app": "ep"}},
                              "action": "DENY", "rules": [{"to": [{"operation": {
                                  "ports": ["9998"]}}]}]})]])
    case("serviceentry-policy-added-after", lambda a, b, ip: [
        [se("static", a, se_spec("STATIC", addresses=["240.0.0.15"],
                                 endpoints=[{"address": ip(1)}]), labels={"app": "se"})],
        [ap("late", a, {"selector": {"matchLabels": {"app": "se"}}, "action": "DENY",
                        "rules": [{"to": [{"operation": {"ports": ["9999"]}}]}]})],
        [delete(SEC, "AuthorizationPolicy", a, "late")]])
    case("serviceentry-changed-then-deleted", lambda a, b, ip: [
        [se("s", a, se_spec("STATIC", addresses=["240.0.0.16"],
                            endpoints=[{"address": ip(1)}]))],
        [se("s", a, se_spec("STATIC", addresses=["240.0.0.17"],
                            endpoints=[{"address": ip(2)}, {"address": ip(3)}]))],
        [delete(NET, "ServiceEntry", a, "s")]])

    # ---- workload entries
    case("workloadentry-basic", lambda a, b, ip: [[we(
        "vm", a, {"address": ip(1), "labels": {"app": "vm"}, "serviceAccount": "vm-sa",
                  "locality": "region-a/zone-b/sub-c"}, labels={"app": "vm"})]])
    case("workloadentry-without-address", lambda a, b, ip: [[we(
        "remote", a, {"network": "net-2", "labels": {"app": "r"}}, labels={"app": "r"})]])
    case("workloadentry-selected-by-service", lambda a, b, ip: [[
        svc("vmsvc", a, {"app": "vm"}),
        we("vm", a, {"address": ip(1), "labels": {"app": "vm"},
                     "ports": {"http": 8081}}, labels={"app": "vm"})]])
    case("workloadentry-changed-then-deleted", lambda a, b, ip: [
        [we("vm", a, {"address": ip(1)}, labels={"app": "vm"})],
        [we("vm", a, {"address": ip(2), "weight": 3}, labels={"app": "vm2"})],
        [delete(NET, "WorkloadEntry", a, "vm")]])

    # ---- authorization policies
    case("authz-allow-selector", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": "api"}),
        ap("allow-api", a, {"selector": {"matchLabels": {"app": "api"}}, "action": "ALLOW",
                            "rules": [{"from": [{"source": {"principals": [
                                "cluster.local/ns/x/sa/y"]}}]}]})]])
    case("authz-deny-namespace", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": "api"}),
        ap("deny-all-ports", a, {"action": "DENY", "rules": [{"to": [{"operation": {
            "ports": ["22"]}}]}]})]])
    case("authz-audit", lambda a, b, ip: [[
        pod("p", a, [ip(1)]), ap("audit", a, {"action": "AUDIT", "rules": [{}]})]])
    case("authz-custom", lambda a, b, ip: [[
        pod("p", a, [ip(1)]),
        ap("custom", a, {"action": "CUSTOM", "provider": {"name": "ext-authz"},
                         "rules": [{"to": [{"operation": {"ports": ["80"]}}]}]})]])
    case("authz-allow-nothing-and-deny-all", lambda a, b, ip: [[
        pod("p", a, [ip(1)]), ap("allow-nothing", a, {}),
        ap("deny-all", a, {"action": "DENY", "rules": [{}]})]])
    case("authz-rich-rules", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": "api"}),
        ap("rich", a, {"selector": {"matchLabels": {"app": "api"}}, "action": "ALLOW",
                       "rules": [
                           {"from": [{"source": {
                               "principals": ["cluster.local/ns/a/sa/b", "*-suffix",
                                              "prefix-*"],
                               "notPrincipals": ["cluster.local/ns/a/sa/bad"],
                               "namespaces": ["c01", "team-*"], "notNamespaces": ["evil"],
                               "ipBlocks": ["10.0.0.0/8", "192.0.2.1"],
                               "notIpBlocks": ["10.9.0.0/16"]}}],
                            "to": [{"operation": {"ports": ["80", "8080"],
                                                  "notPorts": ["81"]}}],
                            "when": [{"key": "source.ip", "values": ["10.1.0.0/16"]},
                                     {"key": "destination.port", "values": ["80"]},
                                     {"key": "source.principal",
                                      "notValues": ["spiffe://x"]}]},
                           {"from": [{"source": {"requestPrincipals": ["iss/sub"]}}]},
                           {"to": [{"operation": {"methods": ["GET"], "paths": ["/x"]}}]}]})]])
    case("authz-http-only-deny", lambda a, b, ip: [[
        pod("p", a, [ip(1)]),
        ap("deny-get", a, {"action": "DENY", "rules": [{"to": [{"operation": {
            "methods": ["GET"]}}]}]})]],
         deliberate=("deny-http-only-denies-all",))
    case("authz-targetref-waypoint-gateway", lambda a, b, ip: [
        waypoint("waypoint", a, ip=ip(50)) + [
            ap("on-waypoint", a, {"targetRefs": [{"kind": "Gateway", "group":
                                                  "gateway.networking.k8s.io",
                                                  "name": "waypoint"}],
                                  "action": "DENY", "rules": [{"to": [{"operation": {
                                      "ports": ["9000"]}}]}]})]])
    case("authz-targetref-service", lambda a, b, ip: [[
        svc("web", a, {"app": "web"}), pod("w", a, [ip(1)], labels={"app": "web"}),
        ap("on-service", a, {"targetRefs": [{"kind": "Service", "group": "",
                                             "name": "web"}],
                             "action": "ALLOW", "rules": [{"to": [{"operation": {
                                 "ports": ["80"]}}]}]})]])
    case("authz-targetref-serviceentry", lambda a, b, ip: [[
        se("ext", a, se_spec("STATIC", addresses=["240.0.0.18"],
                             endpoints=[{"address": ip(1)}])),
        ap("on-se", a, {"targetRefs": [{"kind": "ServiceEntry", "group":
                                        "networking.istio.io", "name": "ext"}],
                        "action": "DENY", "rules": [{}]})]])
    case("authz-targetref-gatewayclass-in-root", lambda a, b, ip: [[
        pod("p", a, [ip(1)]),
        ap(f"{a}-on-class", "istio-system", {
            "targetRefs": [{"kind": "GatewayClass", "group": "gateway.networking.k8s.io",
                            "name": "istio-waypoint"}],
            "action": "DENY", "rules": [{"to": [{"operation": {"ports": ["9001"]}}]}]})]],
        extra_scope=("istio-system",))
    case("authz-root-namespace-mesh-wide", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": "x"}),
        ap(f"{a}-mesh-deny", "istio-system", {"action": "DENY", "rules": [
            {"to": [{"operation": {"ports": ["2222"]}}]}]})]],
        extra_scope=("istio-system",))
    case("authz-root-namespace-selector", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": f"{a}-x"}),
        ap(f"{a}-mesh-sel", "istio-system", {"selector": {"matchLabels": {"app": f"{a}-x"}},
                                             "action": "ALLOW", "rules": [{}]})]],
        extra_scope=("istio-system",))
    case("authz-changed-then-deleted", lambda a, b, ip: [
        [pod("p", a, [ip(1)], labels={"app": "api"}),
         ap("pol", a, {"selector": {"matchLabels": {"app": "api"}}, "action": "ALLOW",
                       "rules": [{"to": [{"operation": {"ports": ["80"]}}]}]})],
        [ap("pol", a, {"selector": {"matchLabels": {"app": "api"}}, "action": "DENY",
                       "rules": [{"to": [{"operation": {"ports": ["81"]}}]}]})],
        [ap("pol", a, {"selector": {"matchLabels": {"app": "nothing"}}, "action": "DENY",
                       "rules": [{"to": [{"operation": {"ports": ["81"]}}]}]})],
        [delete(SEC, "AuthorizationPolicy", a, "pol")]])
    case("authz-selector-policy-pod-without-labels", lambda a, b, ip: [[
        pod("bare", a, [ip(1)]), pod("labelled", a, [ip(2)], labels={"app": "api"}),
        ap("sel", a, {"selector": {"matchLabels": {"app": "api"}}, "action": "DENY",
                      "rules": [{"to": [{"operation": {"ports": ["9999"]}}]}]})]],
         deliberate=("no-labels-no-selector-policies",))
    case("authz-dry-run-annotation", lambda a, b, ip: [[
        pod("p", a, [ip(1)]),
        ap("dry", a, {"action": "DENY", "rules": [{}]},
           annotations={"istio.io/dry-run": "true"})]])

    # ---- peer authentication
    case("peerauthn-namespace-strict", lambda a, b, ip: [[
        pod("p", a, [ip(1)]), pa("default", a, {"mtls": {"mode": "STRICT"}})]])
    case("peerauthn-mesh-strict", lambda a, b, ip: [[
        pod("p", a, [ip(1)]), pa("default", "istio-system", {"mtls": {"mode": "STRICT"}})]],
        extra_scope=("istio-system",))
    case("peerauthn-selector-port-level", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": "db"}),
        pa("db", a, {"selector": {"matchLabels": {"app": "db"}},
                     "mtls": {"mode": "PERMISSIVE"},
                     "portLevelMtls": {"5432": {"mode": "STRICT"}}})]])
    case("peerauthn-strict-namespace-port-disable", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": "db"}),
        pa("default", a, {"mtls": {"mode": "STRICT"}}),
        pa("db", a, {"selector": {"matchLabels": {"app": "db"}},
                     "portLevelMtls": {"9090": {"mode": "DISABLE"}}})]],
         deliberate=("port-level-disable-under-inherited-strict",))
    case("peerauthn-disable-and-unset", lambda a, b, ip: [[
        pod("p", a, [ip(1)], labels={"app": "x"}), pod("q", a, [ip(2)], labels={"app": "y"}),
        pa("off", a, {"selector": {"matchLabels": {"app": "x"}}, "mtls": {"mode": "DISABLE"}}),
        pa("unset", a, {"selector": {"matchLabels": {"app": "y"}},
                        "mtls": {"mode": "UNSET"}})]])
    case("peerauthn-changed-then-deleted", lambda a, b, ip: [
        [pod("p", a, [ip(1)]), pa("default", a, {"mtls": {"mode": "STRICT"}})],
        [pa("default", a, {"mtls": {"mode": "PERMISSIVE"}})],
        [delete(SEC, "PeerAuthentication", a, "default")]])

    # ---- waypoints
    case("waypoint-namespace", lambda a, b, ip: [
        waypoint("waypoint", a, ip=ip(50), labels={"istio.io/waypoint-for": "all"}),
        [ns(a, {**AMBIENT, "istio.io/use-waypoint": "waypoint"}),
         svc("web", a, {"app": "web"}), pod("w", a, [ip(1)], labels={"app": "web"})]])
    case("waypoint-service", lambda a, b, ip: [
        waypoint("wp", a, ip=ip(50)) + [
            svc("web", a, {"app": "web"}, labels={"istio.io/use-waypoint": "wp"}),
            pod("w", a, [ip(1)], labels={"app": "web"})]])
    case("waypoint-workload", lambda a, b, ip: [
        waypoint("wp", a, ip=ip(50), labels={"istio.io/waypoint-for": "workload"}) + [
            pod("w", a, [ip(1)], labels={"istio.io/use-waypoint": "wp"})]])
    case("waypoint-cross-namespace", lambda a, b, ip: [
        [ns(b, AMBIENT), sa(b, "default")]
        + waypoint("shared", b, ip=ip(50), labels={"istio.io/waypoint-for": "all"})
        + [svc("web", a, {"app": "web"}, labels={
            "istio.io/use-waypoint": "shared", "istio.io/use-waypoint-namespace": b}),
           pod("w", a, [ip(1)], labels={"app": "web"})]], second_ns=True)
    case("waypoint-ip-address-status", lambda a, b, ip: [
        waypoint("wp", a, ip=ip(50), hostname=False,
                 labels={"istio.io/waypoint-for": "all"}) + [
            ns(a, {**AMBIENT, "istio.io/use-waypoint": "wp"}),
            pod("w", a, [ip(1)])]])
    case("waypoint-not-ready-yet", lambda a, b, ip: [
        [gateway("wp", a), svc("web", a, {"app": "web"},
                               labels={"istio.io/use-waypoint": "wp"}),
         pod("w", a, [ip(1)], labels={"app": "web"})],
        [("gwstatus", a, "wp", [("Hostname", f"wp.{a}.svc.cluster.local")]),
         svc("wp", a, {"gateway.networking.k8s.io/gateway-name": "wp"},
             ports=[{"name": "mesh", "port": 15008}])]])
    case("waypoint-opt-out-and-wrong-traffic-type", lambda a, b, ip: [
        waypoint("wp", a, ip=ip(50), labels={"istio.io/waypoint-for": "service"}) + [
            ns(a, {**AMBIENT, "istio.io/use-waypoint": "wp"}),
            svc("web", a, {"app": "web"}, labels={"istio.io/use-waypoint": "none"}),
            pod("w", a, [ip(1)], labels={"app": "web", "istio.io/use-waypoint": "wp"})]])
    case("waypoint-label-removed", lambda a, b, ip: [
        waypoint("wp", a, ip=ip(50)) + [
            svc("web", a, {"app": "web"}, labels={"istio.io/use-waypoint": "wp"}),
            pod("w", a, [ip(1)], labels={"app": "web"})],
        [svc("web", a, {"app": "web"})]])

    # ---- network gateways
    def netgw(a: str, network: str, addr: str) -> list[Op]:
        return [("apply", {"apiVersion": GW, "kind": "Gateway",
                           "metadata": {"name": "eastwest", "namespace": a,
                                        "labels": {"topology.istio.io/network": network}},
                           "spec": {"gatewayClassName": "istio-remote", "listeners": [
                               {"name": "cross-network", "port": 15008,
                                "protocol": "HBONE", "tls": {"mode": "Passthrough"}}]}}),
                ("gwstatus", a, "eastwest", [("IPAddress", addr)])]

    case("network-gateway-remote-workloadentry", lambda a, b, ip: [
        netgw(a, "net-2", "192.0.2.50") + [
            we("remote-vm", a, {"address": ip(1), "network": "net-2"},
               labels={"app": "rvm"}),
            svc("rsvc", a, {"app": "rvm"})]])
    case("network-gateway-local-network", lambda a, b, ip: [
        netgw(a, "", "192.0.2.51") + [pod("p", a, [ip(1)])]])
    return cases


CASES = _cases()
