"""The workload xDS server's metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class XdsMetrics:
    """The xDS server's Prometheus series (``docs/xds.md``), in ``registry``."""

    def __init__(self, registry: CollectorRegistry, type_urls: tuple[str, ...] = ()):
        """``type_urls``: the types served, whose NACK counter starts at 0 (a rate or an
        alert on it has a series before the first NACK, as ``ambient_agent_sds_nacks``)."""
        self.clients = Gauge("ambient_agent_xds_connected_clients",
                             "Connected workload xDS clients by proxy type and type URL",
                             ["proxy_type", "type_url"], registry=registry)
        self.pushes = Counter("ambient_agent_xds_pushes", "xDS responses sent, by type URL",
                              ["type_url"], registry=registry)
        self.resources = Counter("ambient_agent_xds_pushed_resources",
                                 "Resources (updated + removed) sent, by type URL",
                                 ["type_url"], registry=registry)
        self.nacks = Counter("ambient_agent_xds_nacks", "NACKs received, by type URL",
                             ["type_url"], registry=registry)
        for type_url in type_urls:
            self.nacks.labels(type_url)
        self.slow = Counter("ambient_agent_xds_slow_clients_disconnected",
                            "streams closed because the client stopped reading its responses",
                            registry=registry)
        self.latency = Histogram("ambient_agent_xds_push_latency_seconds",
                                 "Index change to response handed to gRPC, seconds",
                                 ["type_url"], registry=registry,
                                 buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
