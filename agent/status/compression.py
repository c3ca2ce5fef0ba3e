"""Response compression for buffered status-port bodies (``docs/status.md``).

Applied per handler, not as an application middleware: a middleware would wrap every
request, including the ``/healthz/ready`` probe that kubelet and load balancers hit most
and that never has a body worth compressing.
"""

from __future__ import annotations

from aiohttp import web

COMPRESS_MIN_BYTES = 1024  # smaller bodies are not worth compressing


def compress_large(response: web.Response) -> web.Response:
    """``response``, with gzip/deflate negotiated from the request's ``Accept-Encoding``
    (at send time) when its buffered body is at least :data:`COMPRESS_MIN_BYTES`."""
    body = response.body  # handlers here buffer bytes; a streamed Payload is left as is
    if isinstance(body, (bytes, bytearray)) and len(body) >= COMPRESS_MIN_BYTES:
        response.enable_compression()
    return response
