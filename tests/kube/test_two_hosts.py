"""Two hosts without Kubernetes, each a network namespace, sharing workloads through the
real kube-apiserver used as a store only (layout: :mod:`tests.kube.hosts`; one shared
root file as the mesh root).

Checks: (a) each agent serves both pods' workloads (``<pod>-<node>`` WorkloadEntries)
over workload xDS to the reference client, with the other host's pod IP (checked by
:func:`tests.kube.hosts.two_hosts`); (b) a TCP connection from the pod on host A reaches
an echo listener in the pod on host B. With a real ztunnel (``AMBIENT_TEST_ZTUNNEL``) one
ztunnel runs per host, the pods are ambient, and the connection must be HBONE: ztunnel's
``istio_tcp_connections_opened_total{connection_security_policy="mutual_tls"}`` between
the two pods' SPIFFE identities grows on both hosts, and each ztunnel's access log has the
connection ("outbound" on A, "inbound" on B) with both identities. Without the binary the
pods are not ambient (nothing would serve their redirected traffic) and (b) is plain
routing; the test prints that it checked no HBONE.
"""

from __future__ import annotations

import os

import pytest

from agent.demo.traffic import mtls_connections
from tests.kube.hosts import ZT_STATS, access_lines, two_hosts, until

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, veth, CNI, iptables)"),
]


async def test_two_hosts_serve_each_others_pods(kube_cluster, kube_admin, kube_namespace,
                                                capsys):
    async with two_hosts(kube_cluster, kube_admin, kube_namespace) as t:
        a, b, src = t.a, t.b, t.identity
        hosts = (a, b)
        before = {}
        if t.ztunnel:
            for h in hosts:
                before[h.letter] = mtls_connections(h.get(ZT_STATS, "/metrics")[1], src, src)
        await t.first_exchange()
        if t.ztunnel:
            # both ztunnels report the connection as mutual TLS between the pods' identities
            def counted() -> bool:
                return all(mtls_connections(h.get(ZT_STATS, "/metrics")[1], src, src)
                           > before[h.letter] for h in hosts)
            await until("ztunnel on both hosts to count an mTLS connection "
                        f"{src} -> {src}", counted, timeout=30,
                        detail=lambda: f"ztunnel a log: {a.log('ztunnel.log')}")
            # and both log it in their access log with both identities (ztunnel logs the
            # identities of a connection only when it was mutual TLS)
            def logged() -> bool:
                return bool(access_lines(a.full_log("ztunnel.log"), "outbound", src, src)
                            and access_lines(b.full_log("ztunnel.log"), "inbound", src, src))
            await until("both ztunnels' access logs to show the connection with both "
                        "identities", logged, timeout=30,
                        detail=lambda: f"ztunnel a log: {a.log('ztunnel.log')}\n"
                                       f"ztunnel b log: {b.log('ztunnel.log')}")
            with capsys.disabled():
                for h, d in ((a, "outbound"), (b, "inbound")):
                    print(f"\nztunnel {h.letter} access log: "
                          f"{access_lines(h.full_log('ztunnel.log'), d, src, src)[0]}")
        else:
            with capsys.disabled():
                print(f"\n{__name__}: AMBIENT_TEST_ZTUNNEL not set: checked xDS and plain "
                      "routing between the hosts' pods, not HBONE")
