"""Annotation names written by one component and read by another.

A name lives here when two components must agree on it and neither should import the
other to learn it: the writer and the readers each import it from the kernel.

- :data:`REGISTERED_BY` — ``ambient.istio.io/registered-by`` on a WorkloadEntry the
  agent registered for a pod it runs outside Kubernetes (podman): the node that
  registered it. Written by ``cni.registration`` / ``cni.registration_kube``; read by
  the ambient index (the entry's ``node``, ``ambient.translate_workload``) and by the
  embedded CA, which lets a node's agent sign for the entries registered on that node
  (``agent.sds.ca_server``). Ours, not an upstream Istio annotation.
"""

from __future__ import annotations

REGISTERED_BY = "ambient.istio.io/registered-by"
