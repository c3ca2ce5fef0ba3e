"""istio-cni's monitoring port: the node agent's own metrics, upstream's names, on ``/metrics``.

istio-cni serves its metrics on ``:15014/metrics`` (``monitoring_port``; 0: off), apart
from anything merged; dashboards and alerts written for it look there. This listener
answers ``GET /metrics`` with exactly the families istio-cni exports (:data:`FAMILIES`,
taken from the agent's one registry, so the numbers are the ones the merged view on the
status port shows, without ``_created`` series) plus the standard ``process_*`` families a Go exporter adds; any
other path is 404. The body is prometheus-client's, text or OpenMetrics as the
``Accept`` header asks.
"""

from __future__ import annotations

from typing import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

# istio-cni's node-agent families (prometheus-client's family names: a counter's without
# "_total"): cni/pkg/nodeagent (cni-watcher.go, informers.go, ztunnelserver.go),
# cni/pkg/install/monitoring.go and cni/pkg/repair/monitoring.go.
FAMILIES = frozenset({
    "istio_cni_plugin_requests",        # {response_code} (+ our command label)
    "nodeagent_reconcile_events",       # {type}: add, update, delete
    "ztunnel_connected",
    "istio_cni_installs",               # {result}
    "istio_cni_install_ready",
    "istio_cni_repair_pods_repaired",   # {type, result}
})


class NodeAgentView:
    """A collector of the agent registry's istio-cni families (and ``process_*``)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.process = ProcessCollector(registry=None)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if family.name in FAMILIES:
                # istio-cni's exporter has no _created series, whatever
                # metrics_created_series says for the merged view
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield kept
        yield from self.process.collect()


def app(registry: CollectorRegistry) -> web.Application:
    """The monitoring port's application: ``GET /metrics`` only (405 for other methods)."""
    view = NodeAgentView(registry)

    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(view)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    application = web.Application()
    application.router.add_get("/metrics", metrics, allow_head=False)
    return application
