"""agent/core/kubewatch.py: the library's Watch minus its own ApiClient. The streaming
itself is exercised against a real API server in tests/kube/test_kubewatch.py."""

from __future__ import annotations

import ssl

from kubernetes_asyncio import client as kclient
from kubernetes_asyncio import watch as kwatch

from agent.core import kubewatch


async def test_same_attributes_as_the_library_watch_without_building_a_client(monkeypatch):
    """Our __init__ sets what the library's sets (a library update that adds state
    fails here), holds the caller's client, and never builds a TLS context."""
    library = kwatch.Watch()
    try:
        shared = kclient.ApiClient(kclient.Configuration())
        try:
            contexts = []
            real = ssl.create_default_context
            monkeypatch.setattr(ssl, "create_default_context",
                                lambda *a, **k: contexts.append(1) or real(*a, **k))
            ours = kubewatch.Watch(shared, return_type="V1Secret")
            assert set(vars(ours)) == set(vars(library))
            assert ours._api_client is shared and ours._raw_return_type == "V1Secret"
            assert contexts == []
            await ours.close()  # releases only its response: the shared client is open
            assert not shared.rest_client.pool_manager.closed
        finally:
            await shared.close()
    finally:
        await library.close()
