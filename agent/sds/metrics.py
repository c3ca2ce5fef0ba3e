"""Prometheus view of the SDS component, computed at scrape time (no hot-path cost).

Upstream exposes ``cert_expiry_seconds{resource_name}`` per cached secret (spec
``sds-ca-status.md`` §2.4); a node agent caches one certificate per identity, so ours is
labelled by SPIFFE ID instead.
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class SdsCollector:
    """A ``prometheus_client`` collector over an :class:`agent.sds.server.SdsServer`."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        streams = GaugeMetricFamily("ambient_agent_sds_streams",
                                    "Open SDS streams (SotW and delta)")
        streams.add_metric([], len(s.service.connections) if s.service else 0)
        yield streams
        nacks = CounterMetricFamily("ambient_agent_sds_nacks", "SDS responses NACKed by clients")
        nacks.add_metric([], s.service.nacks if s.service else 0)
        yield nacks
        csrs = CounterMetricFamily("ambient_agent_sds_csrs", "CSRs sent to the CA")
        csrs.add_metric([], s.cache.csr_count if s.cache else 0)
        yield csrs
        expiry = GaugeMetricFamily("ambient_agent_sds_cert_expiry_seconds",
                                   "Seconds until a cached workload certificate expires",
                                   labels=["spiffe_id"])
        now = time.time()
        for item in list(s.cache.items.values()) if s.cache else []:
            expiry.add_metric([item.spiffe_id], item.expire - now)
        yield expiry
