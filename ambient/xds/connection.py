"""The transport side of one workload xDS stream: a bounded inbox of the client's
requests and the server's own wake-ups (:class:`StreamInbox`), and the push pending for
the stream (:class:`Connection`), so requests and pushes reach the stream's state
machine (:class:`ambient.xds.stream.XdsStream`) strictly in order.

The inbox is bounded so that a client that keeps sending requests while never reading
its responses cannot grow the agent (one such client once grew it by 746 MB).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from ambient.api import IndexChange
from ambient.xds.stream import XdsStream
from ambient.xds.waypoint_stream import WaypointStream

MAX_QUEUED_REQUESTS = 64  # per stream: requests read from the client, not yet handled
MAX_QUEUED_BYTES = 4 << 20  # per stream: their serialized size (one larger request still fits)


class StreamInbox:
    """The ordered inbox of one stream: the client's requests and the server's own
    wake-ups (a push, end of stream, a read error), handled strictly in arrival order.

    Wake-ups are always accepted (the server keeps at most one push pending). Requests
    are bounded: at most ``max_requests`` of them and ``max_bytes`` of serialized size.
    :meth:`put_request` on a full inbox waits, so the reader stops taking requests from
    gRPC and HTTP/2 flow control holds the client back; the handler side drains it
    unless it is stuck writing to a client that does not read (which the server detects
    on its writes and answers by closing the stream).
    """

    def __init__(self, max_requests: int = MAX_QUEUED_REQUESTS,
                 max_bytes: int = MAX_QUEUED_BYTES):
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._items: collections.deque[tuple[int, Any]] = collections.deque()
        self.requests = 0  # queued requests
        self.bytes = 0  # their size
        self.high_water = 0  # most requests ever queued at once
        self._readable = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()

    def put_nowait(self, item: Any) -> None:
        """A wake-up (never refused)."""
        self._items.append((-1, item))
        self._readable.set()

    def full(self, size: int = 0) -> bool:
        return self.requests >= self.max_requests or (
            self.requests > 0 and self.bytes + size > self.max_bytes)

    async def put_request(self, request: Any) -> None:
        """Queue one request, waiting while the inbox is full."""
        size = request.ByteSize()
        while self.full(size):
            self._space.clear()
            await self._space.wait()
        self._items.append((size, request))
        self.requests += 1
        self.bytes += size
        self.high_water = max(self.high_water, self.requests)
        self._readable.set()

    async def get(self) -> Any:
        while not self._items:
            self._readable.clear()
            await self._readable.wait()
        size, item = self._items.popleft()
        if size >= 0:
            self.requests -= 1
            self.bytes -= size
            self._space.set()
        return item

    def debug(self) -> dict:
        return {"queued_requests": self.requests, "queued_bytes": self.bytes,
                "high_water": self.high_water}


class Connection:
    """Transport side of one stream: an inbox of requests and push wake-ups, drained
    by the response generator so requests and pushes are handled strictly in order."""

    EOF = object()
    PUSH = object()

    def __init__(self, state: XdsStream | WaypointStream):
        self.state: XdsStream | WaypointStream = state
        self.inbox = StreamInbox()
        self.pending: IndexChange | None = None
        self.pending_since = 0.0
        self.counted: set[str] = set()
        self.error = ""
        self.error_code = ""  # a grpc.StatusCode name; "" is INVALID_ARGUMENT
        self.connected_at = 0.0  # monotonic time of the first valid request

    def notify(self, change: IndexChange, since: float) -> None:
        if self.pending is None:
            self.pending, self.pending_since = change, since
            self.inbox.put_nowait(self.PUSH)
        else:
            self.pending = merge_changes(self.pending, change)

    def take(self) -> tuple[IndexChange | None, float]:
        change, since = self.pending, self.pending_since
        self.pending = None
        return change, since


def merge_changes(a: IndexChange, b: IndexChange) -> IndexChange:
    """Set-union of two changes; a name changed in the later one is no longer removed."""
    ac = a.addresses_changed | b.addresses_changed
    zc = a.authorizations_changed | b.authorizations_changed
    return IndexChange(
        addresses_changed=ac,
        addresses_removed=(a.addresses_removed - b.addresses_changed) | b.addresses_removed,
        authorizations_changed=zc,
        authorizations_removed=(a.authorizations_removed - b.authorizations_changed)
        | b.authorizations_removed)
