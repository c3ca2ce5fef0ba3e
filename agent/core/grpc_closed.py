"""What a grpc.aio server handler sees when it writes to a call that has already ended.

When a client cancels a stream (ztunnel restarting, Envoy draining a listener, a client
giving up) while the server has a response in flight, grpc.aio fails that pending
``context.write`` instead of dropping it: with ``asyncio.InvalidStateError`` or
``grpc.aio.UsageError`` once the call is done, with the Cython layer's
``ExecuteBatchError`` when the send batch is refused, or with ``grpc.aio.AioRpcError``.
For a streaming server each of these means "this stream is over", not a server fault:
the xDS and SDS servers catch :data:`CLOSED_STREAM_ERRORS` around their writes, log the
end of the stream at DEBUG and return from the handler.

A write future left behind when the handler itself is cancelled still fails later; hand
it to :func:`retrieve_later` so asyncio never logs "Task exception was never retrieved".
"""

from __future__ import annotations

import asyncio

import grpc
from grpc._cython import cygrpc  # ExecuteBatchError has no public alias in grpc.aio

CLOSED_STREAM_ERRORS: tuple[type[BaseException], ...] = (
    asyncio.InvalidStateError, grpc.aio.AioRpcError, grpc.aio.UsageError,
    cygrpc.ExecuteBatchError)


def _collect(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def retrieve_later(future: asyncio.Future) -> None:
    """Collect ``future``'s outcome when it finishes (its error is the ended call's)."""
    future.add_done_callback(_collect)
