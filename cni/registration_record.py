"""What one workload registration from CNI is (:class:`Registration`), how a CNI ADD and
the container's labels give its identity (:func:`identity`), and how registrations survive
a restart (:class:`RegistrationFile`, ``<state_dir>/registrations.json``). The component
that applies them is :mod:`cni.registration`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from agent.core.annotations import REGISTERED_BY
from agent.core.files import write_atomic
from cni.events import CniPodEvent

log = logging.getLogger(__name__)

NAMESPACE_LABEL = "io.kubernetes.pod.namespace"  # the CRI's container label for the namespace
SERVICE_ACCOUNT_LABEL = "io.kubernetes.pod.service-account"
DATAPLANE_MODE_LABEL = "istio.io/dataplane-mode"
STATE_FILE = "registrations.json"
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*"
                        r"[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


class RegistrationError(ValueError):
    """A registration that can't be built; the message names the field and value."""


@dataclasses.dataclass
class Registration:
    """One workload registered from a CNI ADD.

    ``uid``: the container ID (``CNI_CONTAINERID``); ``name``/``namespace``/
    ``service_account``: its identity; ``labels``: the runtime's labels (identity keys
    removed) plus the dataplane-mode default; ``ips``: ``prevResult`` addresses; ``netns``:
    the runtime's netns path; ``node``: this agent's node name; ``registered_at``: epoch
    seconds of the ADD that made it.
    """

    uid: str
    name: str
    namespace: str
    service_account: str
    labels: dict[str, str]
    ips: list[str]
    netns: str
    node: str
    registered_at: float = 0.0
    ambient: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "Registration":
        """Raises :class:`RegistrationError` naming the first bad field."""
        if not isinstance(data, dict):
            raise RegistrationError(f"registration must be an object, got {data!r}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                if f.default is dataclasses.MISSING:
                    raise RegistrationError(f"registration: missing field {f.name!r}")
                continue
            kwargs[f.name] = data[f.name]
        reg = cls(**kwargs)
        if not isinstance(reg.labels, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in reg.labels.items()):
            raise RegistrationError(f"registration {reg.uid}: field 'labels' must map strings "
                                    f"to strings, got {reg.labels!r}")
        if not isinstance(reg.ips, list) or not all(isinstance(i, str) for i in reg.ips):
            raise RegistrationError(f"registration {reg.uid}: field 'ips' must be a list of "
                                    f"strings, got {reg.ips!r}")
        for name in ("uid", "name", "namespace", "service_account", "netns", "node"):
            if not isinstance(getattr(reg, name), str) or not getattr(reg, name):
                if name != "netns":
                    raise RegistrationError(f"registration: field {name!r} must be a "
                                            f"non-empty string, got {getattr(reg, name)!r}")
        return reg

    def label(self) -> str:
        return f"{self.namespace}/{self.name} (container {self.uid[:12]})"

    def pod(self, name: str = "") -> dict[str, Any]:
        """The Kubernetes-shaped Pod the index and the enablement read: running, ready,
        addresses from the CNI result, node and service account set. ``name``: the name
        to give it (default: the registration's own)."""
        ips = [{"ip": ip} for ip in self.ips]
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name or self.name, "namespace": self.namespace,
                         "uid": self.uid,
                         "labels": dict(self.labels),
                         "annotations": {REGISTERED_BY: self.node}},
            "spec": {"nodeName": self.node, "serviceAccountName": self.service_account,
                     "containers": [{"name": self.name}]},
            "status": {"phase": "Running", "podIP": self.ips[0] if self.ips else "",
                       "podIPs": ips,
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }


def _dns_label(text: str, field: str) -> str:
    value = text.strip().lower().replace("_", "-").replace(".", "-")
    value = re.sub(r"[^a-z0-9-]", "-", value).strip("-")[:63].strip("-")
    if not value or not _DNS1123.match(value):
        raise RegistrationError(f"field {field!r} {text!r} can't be made a DNS label")
    return value


def identity(event: CniPodEvent, labels: dict[str, str], default_namespace: str
             ) -> tuple[str, str, str, dict[str, str]]:
    """``(name, namespace, service account, workload labels)`` for an ADD.

    The name is ``K8S_POD_NAME`` (lower-cased, ``_``/``.`` as ``-``; a name that can't be
    made a DNS label raises :class:`RegistrationError`), else the container ID's first 12
    hex digits. Label keys/values that are not valid Kubernetes labels are dropped
    (logged); the identity keys are taken out."""
    raw_name = event.pod_name or event.container_id[:12]
    name = _dns_label(raw_name, "K8S_POD_NAME")
    labels = dict(labels)
    ns_raw = labels.pop(NAMESPACE_LABEL, "") or event.pod_namespace or default_namespace
    sa_raw = labels.pop(SERVICE_ACCOUNT_LABEL, "") or "default"
    lbls: dict[str, str] = {}
    for k, v in labels.items():
        if _LABEL_KEY.match(k) and len(k) <= 317 and _LABEL_VALUE.match(v) and len(v) <= 63:
            lbls[k] = v
        else:
            log.info("container %s: label %r=%r is not a valid Kubernetes label; not "
                     "registered", event.container_id[:12], k, v)
    namespace = _dns_label(ns_raw, f"label {NAMESPACE_LABEL}")
    sa = _dns_label(sa_raw, f"label {SERVICE_ACCOUNT_LABEL}")
    return name, namespace, sa, lbls


class RegistrationFile:
    """``<state_dir>/registrations.json``: ``{"registrations": [Registration, ...]}``
    (0600, written atomically). A damaged file is renamed ``.bad`` and reported, never
    fatal."""

    def __init__(self, state_dir: str):
        self.path = Path(state_dir, STATE_FILE)

    def load(self) -> list[Registration]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            log.error("registrations file %s is unreadable (%s); keeping it as %s.bad and "
                      "starting without registrations", self.path, e, self.path.name)
            os.replace(self.path, self.path.with_suffix(".json.bad"))
            return []
        items = data.get("registrations") if isinstance(data, dict) else None
        if not isinstance(items, list):
            log.error("registrations file %s: field 'registrations' must be a list", self.path)
            return []
        out = []
        for i, item in enumerate(items):
            try:
                out.append(Registration.from_json(item))
            except (RegistrationError, TypeError) as e:
                log.error("registrations file %s: entry %d skipped: %s", self.path, i, e)
        return out

    def save(self, regs: list[Registration]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # a fresh O_EXCL temporary renamed over the file: a symlink there is replaced,
        # never written through
        write_atomic(self.path, json.dumps({"registrations": [r.to_json() for r in regs]},
                                           indent=1), 0o600)
