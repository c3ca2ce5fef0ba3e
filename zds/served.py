"""Whether a ZDS server already answers on a socket path (``docs/zds.md``): the check the
daemon makes before it touches the node, kept apart from :mod:`zds.server` so that it
runs before the server's modules are imported (they load beside the first LISTs)."""

from __future__ import annotations

import socket

from agent.core.config import ConfigError


def refuse_if_served(path: str) -> None:
    """Raise :class:`ConfigError` (field ``ztunnel_uds_address``) if a live server
    answers on ``path``; blocking, at most 1 s.

    Upstream unlinks whatever is there; a second agent doing that would silently cut the
    first one off from ztunnel. A socket nobody accepts on (ECONNREFUSED) is stale.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return  # missing, stale or not a socket: ours to replace
    finally:
        probe.close()
    raise ConfigError("ztunnel_uds_address", path, "another ZDS server (agent) is serving on it")
