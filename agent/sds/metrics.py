"""Prometheus view of the SDS component, computed at scrape time (no hot-path cost).

Names follow pilot-agent where it has the figure (its registry is prefixed
``istio_agent_``; security/pkg/nodeagent/cache/monitoring.go):
``istio_agent_num_outgoing_requests{request_type="csr"}``,
``istio_agent_num_failed_outgoing_requests{request_type="csr"}``,
``istio_agent_num_file_secret_failures_total`` and ``istio_agent_cert_expiry_seconds``.
Upstream's expiry gauge is per resource name of its one workload; a node agent caches one
certificate per identity, so ours also carries ``spiffe_id`` (``resource_name`` is
``default``, the name such certificates are served under). prometheus-client writes a
counter's samples with ``_total``; pilot-agent's Go exporter leaves it off for the first
two. The rest are ours (``ambient_agent_sds_*``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from agent.sds.server import SdsServer

RESOURCE_KINDS = ("default", "ROOTCA", "file-cert", "file-root")


class SdsCollector:
    """A ``prometheus_client`` collector over an :class:`agent.sds.server.SdsServer`."""

    def __init__(self, server: SdsServer):
        self.server = server

    def collect(self) -> Iterator[Metric]:
        s = self.server
        service, cache = s.service, s.cache
        streams = GaugeMetricFamily("ambient_agent_sds_streams",
                                    "Open SDS streams (SotW and delta)")
        streams.add_metric([], len(service.connections) if service else 0)
        yield streams
        nacks = CounterMetricFamily("ambient_agent_sds_nacks", "SDS responses NACKed by clients")
        nacks.add_metric([], service.nacks if service else 0)
        yield nacks
        failed = CounterMetricFamily(
            "ambient_agent_sds_generate_failures",
            "SDS resource names that could not be generated when asked for (left out of the "
            "response and retried on the stream), by resource kind", labels=["resource"])
        counts = service.generate_failures if service else {}
        for kind in RESOURCE_KINDS:
            failed.add_metric([kind], counts.get(kind, 0))
        yield failed
        csrs = CounterMetricFamily("istio_agent_num_outgoing_requests",
                                   "Requests sent to the CA (CSRs)", labels=["request_type"])
        csrs.add_metric(["csr"], cache.csr_count if cache else 0)
        yield csrs
        csr_failures = CounterMetricFamily("istio_agent_num_failed_outgoing_requests",
                                           "Requests to the CA (CSRs) that failed",
                                           labels=["request_type"])
        csr_failures.add_metric(["csr"], cache.csr_failures if cache else 0)
        yield csr_failures
        files = CounterMetricFamily("istio_agent_num_file_secret_failures",
                                    "Times a file-backed secret or trust file could not be read "
                                    "(file-cert/file-root names, mounted certs, trust anchors, CA "
                                    "root)")
        files.add_metric([], s.file_secret_failures)
        yield files
        expiry = GaugeMetricFamily("istio_agent_cert_expiry_seconds",
                                   "Seconds until a cached workload certificate expires",
                                   labels=["resource_name", "spiffe_id"])
        now = time.time()
        for item in list(cache.items.values()) if cache else []:
            expiry.add_metric(["default", item.spiffe_id], item.expire - now)
        yield expiry
