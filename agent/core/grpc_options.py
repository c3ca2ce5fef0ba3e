"""gRPC server options shared by the agent's TCP-facing gRPC servers (xDS, CA): keepalive
enforcement and the connection bounds (:func:`grpc_server_bounds`).

Keepalive enforcement (issue 13 item 5). ztunnel's control-plane client sends HTTP/2
PINGs every 30 s (hyper ``http2_keep_alive_interval``, ``src/tls/control.rs``); istiod
accepts pings down to 15 s with or without streams (``pilot/pkg/grpc/grpc.go``:
``EnforcementPolicy{MinTime: Time/2}`` with ``GRPC_KEEPALIVE_INTERVAL`` 30 s). grpc core's
defaults (5 min floor, 2-hour floor without calls, 2 strikes) answer a 30 s pinger with
GOAWAY ``too_many_pings`` after about 120 s.

What grpc core (1.85, ``chttp2/transport/ping_abuse_policy.cc``) honours on a server:

- ``grpc.keepalive_permit_without_calls`` — when 0, a connection without streams is held
  to a 2-hour floor; 1 applies the floor below to idle connections too;
- ``grpc.http2.min_ping_interval_without_data_ms`` — the floor. This is the string value
  of grpc core's ``GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS``; the
  look-alike ``grpc.http2.min_recv_ping_interval_without_data_ms`` is read by nobody
  (tests/ztunnel_exact/test_keepalive.py shows which one grpc obeys). 10 s, not istiod's
  15 s: grpc measures arrival intervals, and pings sent every 15 s arrive a few
  milliseconds early about half the time, which would count as strikes;
- ``grpc.http2.max_ping_strikes`` — pings under the floor tolerated before GOAWAY (kept at
  grpc's 2, so a ping flood is still cut). Strikes reset whenever the server sends data.

The server's own pings (``keepalive_time_ms`` 30 s,
``keepalive_timeout_ms`` 10 s, istiod's ``keepalive.ServerParameters``) find dead clients.
"""

from __future__ import annotations

MIN_PING_INTERVAL_MS = 10_000

KEEPALIVE_SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]

GRPC_HANDSHAKE_TIMEOUT_MS = 10_000  # a connection must finish its HTTP/2 (TLS) handshake
GRPC_IDLE_MS = 300_000  # a connection without streams for 5 min is closed (GOAWAY)


def grpc_server_bounds(max_connections: int) -> list[tuple[str, int]]:
    """``grpc.aio.server`` options: past ``max_connections`` (0: no cap) gRPC core closes
    new connections at once; handshakes and stream-less connections are timed out."""
    options = [("grpc.server_handshake_timeout_ms", GRPC_HANDSHAKE_TIMEOUT_MS),
               ("grpc.max_connection_idle_ms", GRPC_IDLE_MS)]
    if max_connections > 0:
        options.append(("grpc.max_allowed_incoming_connections", max_connections))
    return options
