"""Request decoding for the agent's gRPC servicers, so that bytes that are not the
method's protobuf become a clear ``INVALID_ARGUMENT`` instead of grpcio's default.

grpcio calls a method's ``request_deserializer`` before the handler runs. When that raises
(``google.protobuf.message.DecodeError``), grpcio logs an ERROR with a traceback and ends a
unary call ``UNKNOWN``; for a stream it hands the handler ``None`` and the stream can end
with status OK. Decoding runs before any authentication, so a client without a token could
fill the log that way. :func:`decoding` returns a deserializer that hands the handler an
:class:`UndecodableRequest` instead; the handler logs one bounded line and aborts
``INVALID_ARGUMENT`` with its text (the xDS, SDS and CA servicers all do).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError

from agent.core.yamlsafe import MAX_LOGGED, short_text


class UndecodableRequest(Exception):
    """A request message that is not the method's protobuf type ``type_name``: ``size``
    bytes and the decoder's reason (bounded to :data:`MAX_LOGGED` characters). Returned,
    not raised, by :func:`decoding`'s deserializer; ``str()`` is the text for the status
    and the log: ``request is not a valid <type> (<size> bytes): <reason>``."""

    def __init__(self, type_name: str, size: int, reason: str):
        super().__init__(f"request is not a valid {type_name} ({size} bytes): "
                         f"{short_text(reason, MAX_LOGGED)}")


def decoding(cls: Any) -> Callable[[bytes], Any]:
    """``cls.FromString`` (``cls`` a generated protobuf message class) that returns an
    :class:`UndecodableRequest` when the bytes do not decode. For a method handler's
    ``request_deserializer``."""
    name = cls.DESCRIPTOR.name

    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as e:
            return UndecodableRequest(name, len(data), str(e) or type(e).__name__)
    return parse


def add_service(server: grpc.aio.Server, service: str,
                handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
    """Register ``handlers`` (method name -> handler built with :func:`decoding`) for the
    fully qualified ``service`` on ``server``, the two ways generated
    ``add_*Servicer_to_server`` code does (a generic handler and grpcio's registered
    methods, the faster lookup)."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, dict(handlers))
