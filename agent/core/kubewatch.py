"""kubernetes_asyncio's ``watch.Watch`` deserializing with the caller's API client.

The library's ``Watch()`` makes an ``ApiClient()`` of its own, with a default
``Configuration``, only to turn each event's JSON into model objects. Building that client
builds its TLS context, and with no CA file configured that loads the system's whole CA
bundle (``ssl.create_default_context()``: ~23 ms of CPU here, more under load), on the event
loop, at every watch (re)connection, and then closes it again. In the agent's cold start
the CA Secret and mesh-root ConfigMap watches did that four times right while SDS and xDS
were starting (py-spy of a 1k-pod cold start at load ~18: a third of its samples, issue
28). :class:`Watch` takes the API client the caller already has (the one it LISTs with)
and leaves it open when the watch ends; streaming, event decoding and errors are the
library's.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import watch as kwatch


class Watch(kwatch.Watch):
    """``kubernetes_asyncio.watch.Watch`` whose events are deserialized by ``api_client``
    (a ``kubernetes_asyncio.client.ApiClient``, not closed by this watch). ``return_type``
    as the library's."""

    def __init__(self, api_client: Any, return_type: str | None = None) -> None:
        # The library's __init__ is not called: all it adds to these attributes is the
        # second ApiClient (tests/agent/test_kubewatch.py keeps the attribute sets equal).
        self._raw_return_type = return_type
        self._stop = False
        self._api_client = api_client
        self.resource_version = None
        self.resp = None

    async def close(self) -> None:
        """Release the watch's response; the shared API client stays open."""
        if self.resp is not None:
            self.resp.release()
            self.resp = None
