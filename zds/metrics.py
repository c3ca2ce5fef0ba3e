"""Prometheus metrics of the ZDS server, registered in the agent's one registry.

- ``ztunnel_connected`` (gauge): live ZDS connections (upstream's name, ``docs/zds.md``).
- ``ambient_agent_zds_messages_total{type,direction}``: packets by message type
  (hello/add/keep/del/snapshot_sent/ack/unexpected), direction sent|received.
- ``ambient_agent_zds_acks_total{result}``: acks received, result ok|nack.
- ``ambient_agent_zds_ack_latency_seconds``: time from sendmsg to the matching ack.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ACK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
               0.25, 0.5, 1.0, 2.5, 5.0)


class ZdsMetrics:
    """The four ZDS series; one instance per server, bound to ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.connected = Gauge("ztunnel_connected", "ztunnel ZDS connections currently open",
                               registry=registry)
        self.messages = Counter("ambient_agent_zds_messages", "ZDS messages by type and direction",
                                ["type", "direction"], registry=registry)
        self.acks = Counter("ambient_agent_zds_acks", "ZDS acks received from ztunnel, by result",
                            ["result"], registry=registry)
        self.ack_latency = Histogram("ambient_agent_zds_ack_latency_seconds",
                                     "seconds from sending a ZDS message to its ack",
                                     buckets=ACK_BUCKETS, registry=registry)
