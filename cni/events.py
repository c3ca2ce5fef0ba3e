"""The plugin→agent event: what the istio-cni plugin tells the agent about a pod.

The plugin POSTs this as JSON to the agent's CNI event server (``/cmdadd``,
``/cmddel`` over ``<state dir>/pluginevent.sock``; spec ``cni-zds.md`` §2.5, §3.4).
Field names on the wire are the JSON keys listed in :meth:`CniPodEvent.from_json`.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class EventError(ValueError):
    """A malformed event; the message names the field and value."""


@dataclasses.dataclass
class CniPodEvent:
    """One pod ADD or DEL as seen by the plugin.

    ``netns`` is the runtime's netns path (``CNI_NETNS``); ``ips`` the pod's addresses
    from ``prevResult`` without prefix length; ``ambient_default`` is the plugin config's
    ``ambient_default`` (used only when the agent has no Pod object; None if unset);
    ``pod_uid`` may be empty when the runtime gives none (then the container ID names it).
    """

    command: str
    container_id: str
    netns: str
    ifname: str = "eth0"
    pod_name: str = ""
    pod_namespace: str = ""
    pod_uid: str = ""
    ips: list[str] = dataclasses.field(default_factory=list)
    ambient_default: bool | None = None

    @property
    def key(self) -> str:
        """The pod's identity for the agent: its UID, or the container ID without Kubernetes."""
        return self.pod_uid or self.container_id

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "CniPodEvent":
        """Parse and validate; raises :class:`EventError` naming the first bad field."""
        if not isinstance(data, dict):
            raise EventError(f"event must be a JSON object, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise EventError(f"missing field {f.name!r}")
                continue
            value = data[f.name]
            if f.name == "ips":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise EventError(f"field 'ips' must be a list of strings, got {value!r}")
            elif f.name == "ambient_default":
                if value is not None and not isinstance(value, bool):
                    raise EventError(f"field 'ambient_default' must be a boolean, got {value!r}")
            elif not isinstance(value, str):
                raise EventError(f"field {f.name!r} must be a string, got {value!r}")
            kwargs[f.name] = value
        event = cls(**kwargs)
        if event.command not in ("ADD", "DEL"):
            raise EventError(f"field 'command' must be ADD or DEL, got {event.command!r}")
        if not event.container_id:
            raise EventError("field 'container_id' must not be empty")
        return event
