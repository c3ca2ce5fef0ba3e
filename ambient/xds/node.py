"""Who is on the other end of a workload xDS stream: the client's node, parsed from
``Node.id`` and ``Node.metadata`` as istiod's ``model.ParseServiceNodeWithMetadata`` reads
them (``docs/xds.md``), and the error a refused request raises."""

from __future__ import annotations

import dataclasses

from envoy.config.core.v3 import base_pb2
from google.protobuf import json_format

WAYPOINT_LABEL = "gateway.networking.k8s.io/gateway-name"


class RequestError(ValueError):
    """A request the server refuses; ``field`` and ``value`` name what was wrong.
    The server closes the stream with INVALID_ARGUMENT and this message."""

    def __init__(self, field: str, value: object, reason: str):
        self.field, self.value = field, value
        super().__init__(f"{field}={value!r}: {reason}")


@dataclasses.dataclass
class NodeInfo:
    """A client's node, from ``Node.id`` ``<type>~<ip>~<pod>.<ns>~<ns>.svc.<domain>``
 and ``Node.metadata`` (string values; ``NODE_NAME``, ``CLUSTER_ID``, ``LABELS``).

    ``proxy_type`` is ``ztunnel``, ``waypoint``, ``sidecar``, ``router`` or whatever the
    first field says (``"unknown"`` for ids without ``~``).
    """

    id: str
    proxy_type: str = "unknown"
    ip: str = ""
    pod_name: str = ""
    namespace: str = ""
    dns_domain: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)

    @property
    def node_name(self) -> str:
        return str(self.metadata.get("NODE_NAME", ""))

    @property
    def cluster_id(self) -> str:
        return str(self.metadata.get("CLUSTER_ID", ""))

    def waypoint_name(self) -> str:
        """The Gateway a waypoint proxy serves: its ``gateway-name`` label (metadata
        ``LABELS``), else ``WORKLOAD_NAME``/``WAYPOINT_NAME`` metadata, else the pod name
        without the Deployment's two hash suffixes (``<gw>-<rs>-<pod>``)."""
        labels = self.metadata.get("LABELS")
        if isinstance(labels, dict) and labels.get(WAYPOINT_LABEL):
            return str(labels[WAYPOINT_LABEL])
        for key in ("WAYPOINT_NAME", "WORKLOAD_NAME"):
            if self.metadata.get(key):
                return str(self.metadata[key])
        parts = self.pod_name.rsplit("-", 2)
        return parts[0] if len(parts) == 3 else self.pod_name


def parse_node(node: base_pb2.Node) -> NodeInfo:
    """Parse an ``envoy.config.core.v3.Node``. Raises :class:`RequestError` for an
    empty id. Ids without the four ``~`` fields are accepted as type ``unknown``."""
    if not node.id:
        raise RequestError("node.id", node.id, "missing on the first request of the stream")
    metadata = json_format.MessageToDict(node.metadata) if node.HasField("metadata") else {}
    info = NodeInfo(id=node.id, metadata=metadata)
    parts = node.id.split("~")
    if len(parts) == 4:
        info.proxy_type, info.ip = parts[0], parts[1]
        pod, _, ns = parts[2].rpartition(".")
        info.pod_name, info.namespace = (pod, ns) if pod else (parts[2], "")
        info.dns_domain = parts[3]
    if not info.namespace:
        info.namespace = str(metadata.get("NAMESPACE", ""))
    if not info.pod_name:
        info.pod_name = str(metadata.get("NAME", ""))
    return info
