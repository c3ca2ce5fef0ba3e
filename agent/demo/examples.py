"""Realistic Kubernetes objects for the demo and examples (what ``kubectl get -o yaml`` shows).

The demo starts netns pods and writes their Pod objects into a copy of
``examples/cluster/`` with :func:`pod_manifest`, so the directory source and the index see
them exactly as they would see pods read from a cluster.
"""

from __future__ import annotations

import datetime


def pod_manifest(name: str, namespace: str, uid: str, ip: str, node: str,
                 service_account: str = "default", labels: dict[str, str] | None = None,
                 ready: bool = True) -> dict:
    """A Running Pod as the API server returns it (status with podIP/podIPs, Ready condition).

    ``ip`` may be IPv4 or IPv6. Raises nothing; values are copied as given.
    """
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = "True" if ready else "False"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": "1",
            "creationTimestamp": now,
            "labels": dict(labels or {"app": name}),
        },
        "spec": {
            "nodeName": node,
            "serviceAccountName": service_account,
            "serviceAccount": service_account,
            "restartPolicy": "Always",
            "dnsPolicy": "ClusterFirst",
            "containers": [{
                "name": name,
                "image": "busybox:1.36",
                "command": ["sleep", "infinity"],
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "imagePullPolicy": "IfNotPresent",
            }],
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.89.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now,
            "qosClass": "BestEffort",
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "Ready", "status": status, "lastTransitionTime": now},
                {"type": "ContainersReady", "status": status, "lastTransitionTime": now},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            ],
        },
    }
