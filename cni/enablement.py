"""Is this pod ambient? The agent's decision for a CNI ADD.

Istio's rules (``docs/cni.md``, ``cni/pkg/util/enablement_selector.go``), in
order: a pod in an excluded namespace is never ambient; a host-network pod is never
ambient; a pod with the ``sidecar.istio.io/status`` annotation (a sidecar pod) is never
ambient; otherwise it is ambient when any enablement selector matches (pod selector
on the pod's labels AND namespace selector on its namespace's labels). The default
selectors make a pod ambient when it carries ``istio.io/dataplane-mode=ambient``, or
its namespace does and the pod is not labelled ``istio.io/dataplane-mode=none``.

Our addition: on a host without Kubernetes the pod is named by its container ID
(:attr:`cni.events.CniPodEvent.key`); a Pod object whose ``metadata.uid`` is that
container ID is the pod's object (see :func:`find_pod`). Without any Pod object the
network's plugin config decides (``ambient_default``), except in a namespace whose
Namespace object says a pod without labels of its own is ambient: there the decision
waits for the Pod object (:attr:`Decision.retry`), as upstream's plugin fails the ADD
while it cannot get the Pod from the API server, so a lagging cache never lets an
ambient pod start unmeshed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from cni.events import CniPodEvent
from cni.sourceapi import PodStore

DATAPLANE_MODE_LABEL = "istio.io/dataplane-mode"
SIDECAR_STATUS_ANNOTATION = "sidecar.istio.io/status"
TERMINAL_PHASES = ("Succeeded", "Failed")  # a pod in these phases is never (re-)enrolled

DEFAULT_SELECTORS: list[dict[str, Any]] = [
    {"podSelector": {"matchLabels": {DATAPLANE_MODE_LABEL: "ambient"}}},
    {"podSelector": {"matchExpressions": [
        {"key": DATAPLANE_MODE_LABEL, "operator": "NotIn", "values": ["none"]}]},
     "namespaceSelector": {"matchLabels": {DATAPLANE_MODE_LABEL: "ambient"}}},
]


@dataclasses.dataclass(frozen=True)
class Decision:
    """``ambient``: enroll or not; ``reason``: one human line; ``pod``: the Pod object used;
    ``retry``: undecided for now (no Pod object yet in an ambient namespace): the ADD
    fails with "try again later" (``ambient`` is False then, nothing is enrolled)."""

    ambient: bool
    reason: str
    pod: dict | None = None
    retry: bool = False


def label_selector_matches(selector: dict | None, labels: dict | None) -> bool:
    """Kubernetes LabelSelector semantics: ``matchLabels`` AND every ``matchExpressions``
    entry (operators In, NotIn, Exists, DoesNotExist). An empty/None selector matches all.

    Raises ValueError naming the operator or field when the selector is malformed.
    """
    labels = labels or {}
    if not selector:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op = expr.get("key"), expr.get("operator")
        values = expr.get("values") or []
        if not isinstance(key, str):
            raise ValueError(f"matchExpressions key must be a string, got {key!r}")
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise ValueError(f"matchExpressions operator must be In, NotIn, Exists or "
                             f"DoesNotExist, got {op!r}")
        if not ok:
            return False
    return True


def pod_matches(pod: dict, namespace_labels: dict | None,
                selectors: Iterable[dict] = DEFAULT_SELECTORS) -> tuple[bool, str]:
    """Istio's ``Matches(pod, nsLabels)``; returns ``(ambient, reason)``."""
    spec = pod.get("spec") or {}
    meta = pod.get("metadata") or {}
    if spec.get("hostNetwork"):
        return False, "host-network pod"
    if SIDECAR_STATUS_ANNOTATION in (meta.get("annotations") or {}):
        return False, f"sidecar pod (annotation {SIDECAR_STATUS_ANNOTATION})"
    labels = meta.get("labels") or {}
    for sel in selectors:
        if (label_selector_matches(sel.get("podSelector"), labels)
                and label_selector_matches(sel.get("namespaceSelector"), namespace_labels)):
            return True, f"matches enablement selector {sel}"
    mode = labels.get(DATAPLANE_MODE_LABEL)
    return False, (f"pod label {DATAPLANE_MODE_LABEL}={mode}" if mode
                   else "no enablement selector matches")


def find_pod(store: PodStore | None, event: CniPodEvent) -> dict | None:
    """The Pod object for the event, or None if absent: by UID when given, else by
    namespace/name; an event with neither UID nor namespace (podman, or any runtime
    without Kubernetes: ``CNI_ARGS`` has only ``K8S_POD_NAME=<container name>``) names its
    pod by container ID (:attr:`CniPodEvent.key`), so the Pod object is the one whose
    ``metadata.uid`` equals that container ID."""
    if store is None:
        return None
    if event.pod_uid:
        pod = store.pod_by_uid(event.pod_uid)
        if pod is not None:
            return pod
    if event.pod_namespace and event.pod_name:
        return store.get("Pod", event.pod_namespace, event.pod_name)
    if not event.pod_uid and not event.pod_namespace:
        return store.pod_by_uid(event.key)
    return None


def decide(event: CniPodEvent, store: PodStore | None, exclude_namespaces: Iterable[str],
           selectors: Iterable[dict] = DEFAULT_SELECTORS, pod: dict | None = None) -> Decision:
    """Decide for one ADD. ``store`` is a :class:`cni.sourceapi.PodStore` or None;
    ``pod`` may be passed when the caller already looked it up.

    Raises ValueError for a malformed selector (a config error, reported to the plugin).
    """
    excluded = set(exclude_namespaces)  # once: it may be a one-shot iterator
    namespace = event.pod_namespace
    if namespace and namespace in excluded:
        return Decision(False, f"namespace {namespace} is excluded", pod)
    if pod is None:
        pod = find_pod(store, event)
    if pod is not None:
        # the Pod object's namespace: the only one there is for a pod found by container ID
        namespace = (pod.get("metadata") or {}).get("namespace") or namespace
        if namespace and namespace in excluded:
            return Decision(False, f"namespace {namespace} is excluded", pod)
    if pod is None:
        if event.ambient_default:
            return Decision(True, "no Pod object; plugin config ambient_default is true")
        if namespace and event.pod_name and store is not None \
                and store.get("Namespace", "", namespace) is not None:
            probe = {"metadata": {"namespace": namespace, "name": "", "labels": {}}}
            if object_is_ambient(probe, store, excluded, selectors):
                # its own labels may say otherwise, but only the Pod object can tell:
                # wait for it rather than let an ambient pod start unmeshed
                return Decision(False, f"Pod object {namespace}/{event.pod_name} is not known "
                                       f"yet and namespace {namespace} is ambient; try again "
                                       "later", retry=True)
        return Decision(False, "no Pod object and plugin config ambient_default is not true")
    ns_obj = store.get("Namespace", "", namespace) if (store is not None and namespace) else None
    ns_labels = ((ns_obj or {}).get("metadata") or {}).get("labels") or {}
    ambient, reason = pod_matches(pod, ns_labels, selectors)
    return Decision(ambient, reason, pod)


def object_is_ambient(pod: dict, store: PodStore | None, exclude_namespaces: Iterable[str],
                      selectors: Iterable[dict] = DEFAULT_SELECTORS) -> bool:
    """The decision for a Pod object already in ``store`` (a
    :class:`cni.sourceapi.PodStore`), as a CNI ADD for it would make it now: excluded
    namespace, then :func:`pod_matches` with its Namespace object's labels (none when the
    store has no such Namespace). Used for running pods (``cni.enrollment.watch``) and the
    plugin's snapshot (``cni.snapshot``). Raises ValueError for a malformed selector."""
    namespace = (pod.get("metadata") or {}).get("namespace") or ""
    if namespace and namespace in set(exclude_namespaces):
        return False
    ns_obj = store.get("Namespace", "", namespace) if (store is not None and namespace) else None
    ambient, _ = pod_matches(pod, ((ns_obj or {}).get("metadata") or {}).get("labels") or {},
                             selectors)
    return ambient


def on_this_node(pod: dict, node_name: str, files_source: bool) -> bool:
    """``spec.nodeName`` is ``node_name``; with the files source a Pod without a node
    counts too (a host describing its own containers rarely names itself)."""
    node = (pod.get("spec") or {}).get("nodeName") or ""
    return node == node_name or (not node and files_source)
