"""A small dict-backed ``ambient.api.ObjectStore`` for SDS tests (the real config source
is built elsewhere; this implements the same read protocol over a dict of Pods)."""

from __future__ import annotations


def pod(uid: str, namespace: str, service_account: str, name: str = "", node: str = "",
        phase: str = "Running") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"uid": uid, "namespace": namespace, "name": name or f"pod-{uid[:6]}"},
            "spec": {"serviceAccountName": service_account, "nodeName": node},
            "status": {"phase": phase}}


class DictStore:
    """Pods only: ``get``/``list``/``pod_by_uid`` as in :class:`ambient.api.ObjectStore`."""

    def __init__(self, pods: list[dict] = ()):
        self.pods = {p["metadata"]["uid"]: p for p in pods}

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        if kind != "Pod":
            return None
        return next((p for p in self.pods.values() if p["metadata"]["namespace"] == namespace
                     and p["metadata"]["name"] == name), None)

    def list(self, kind: str, namespace: str | None = None):
        if kind != "Pod":
            return []
        return [p for p in self.pods.values()
                if namespace is None or p["metadata"]["namespace"] == namespace]

    def pod_by_uid(self, uid: str) -> dict | None:
        return self.pods.get(uid)
