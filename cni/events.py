"""The plugin→agent event: what the istio-cni plugin tells the agent about a pod.

The plugin POSTs this as JSON to the agent's CNI event server (``/cmdadd``,
``/cmddel`` over ``<state dir>/pluginevent.sock``; ``docs/cni.md``).
Field names on the wire are the JSON keys listed in :meth:`CniPodEvent.from_json`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from cni.podips import normalize_ips


class EventError(ValueError):
    """A malformed event; the message names the field and value."""


class EnrollmentError(Exception):
    """Enrolling or removing one pod failed; ``str()`` says which pod, which step and why
    (the CNI plugin shows it as the ADD error). ``retryable`` is True when the agent
    keeps retrying in the background (ztunnel, host set or status failures).

    Raised by the enrollment reconciler (:mod:`cni.enrollment`, which re-exports it) and
    answered by the event server (:mod:`cni.eventserver`): it lives here, with the event
    both sides share, so the server does not import the reconciler."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


@dataclasses.dataclass
class CniPodEvent:
    """One pod ADD or DEL as seen by the plugin.

    ``netns`` is the runtime's netns path (``CNI_NETNS``); ``ips`` the pod's addresses
    from ``prevResult`` without prefix length, normalized at construction
    (:func:`cni.podips.normalize_ips`: ``::ffff:10.0.0.19`` becomes ``10.0.0.19``, as
    upstream's ``Unmap()``; a value that is no address raises :class:`EventError` naming
    ``ips[i]``); ``ambient_default`` is the plugin config's
    ``ambient_default`` (used only when the agent has no Pod object; None if unset);
    ``pod_uid`` may be empty when the runtime gives none (then the container ID names it).
    ``timeout`` is how long the plugin waits for the agent's answer (seconds, its
    ``agent_timeout``; None from a plugin that doesn't say): the agent answers within it,
    naming the cause, instead of letting the plugin time out (e.g. no ztunnel yet).
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
    timeout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ips, list):
            try:
                self.ips = normalize_ips(self.ips, "ips")
            except ValueError as e:
                raise EventError(str(e)) from None

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
            elif f.name == "timeout":
                if value is not None and (isinstance(value, bool) or not isinstance(
                        value, (int, float)) or not 0 < value < float("inf")):
                    raise EventError("field 'timeout' must be a positive number of seconds, "
                                     f"got {value!r}")
            elif not isinstance(value, str):
                raise EventError(f"field {f.name!r} must be a string, got {value!r}")
            kwargs[f.name] = value
        event = cls(**kwargs)
        if event.command not in ("ADD", "DEL"):
            raise EventError(f"field 'command' must be ADD or DEL, got {event.command!r}")
        if not event.container_id:
            raise EventError("field 'container_id' must not be empty")
        _check_names(event)
        return event


# Kubernetes' own name rules (apimachinery validation): a Pod name is a DNS-1123
# subdomain (<= 253: lower-case alphanumerics, '-', '.'), a namespace a DNS-1123 label
# (<= 63: lower-case alphanumerics, '-'). The CNI spec's container ID: alphanumerics,
# '_', '.', '-', starting alphanumeric. Without a namespace (podman: K8S_POD_NAME is the
# container name) the name is podman's: the container-ID alphabet, <= 253. A pod UID is
# the API server's UUID; kept to <= 128 of the container-ID alphabet (with ':').
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL = re.compile(_LABEL)
_DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_CNI_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]*")


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:80] + "...") + (
        f" ({len(value)} characters)" if len(value) > 80 else "")


def _check_names(event: "CniPodEvent") -> None:
    """Raise :class:`EventError` naming the first field that breaks its rule above (the
    value shown cut at 80 characters)."""
    if not _CNI_ID.fullmatch(event.container_id):
        raise EventError(f"field 'container_id' {_shown(event.container_id)} must be "
                         "alphanumerics, '_', '.' and '-', starting alphanumeric (CNI spec)")
    if event.pod_namespace and (len(event.pod_namespace) > 63
                                or not _DNS1123_LABEL.fullmatch(event.pod_namespace)):
        raise EventError(f"field 'pod_namespace' {_shown(event.pod_namespace)} must be a "
                         "DNS-1123 label: at most 63 lower-case alphanumerics or '-'")
    name = event.pod_name
    if name:
        if len(name) > 253:
            raise EventError(f"field 'pod_name' {_shown(name)} is longer than 253 characters")
        if event.pod_namespace and not _DNS1123_SUBDOMAIN.fullmatch(name):
            raise EventError(f"field 'pod_name' {_shown(name)} must be a DNS-1123 subdomain: "
                             "lower-case alphanumerics, '-' and '.'")
        if not event.pod_namespace and not _CNI_ID.fullmatch(name):
            raise EventError(f"field 'pod_name' {_shown(name)} must be alphanumerics, '_', "
                             "'.' and '-', starting alphanumeric")
    if event.pod_uid and (len(event.pod_uid) > 128 or not _UID.fullmatch(event.pod_uid)):
        raise EventError(f"field 'pod_uid' {_shown(event.pod_uid)} must be at most 128 "
                         "alphanumerics, '_', '.', ':' and '-' (a Kubernetes UID)")
