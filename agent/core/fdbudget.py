"""File descriptors: use the whole allowance, and keep some of it for the node's own sockets.

The agent is one process: the network-facing listeners (status 15020, health 8000, xDS)
share ``RLIMIT_NOFILE`` with the node-local sockets that pods depend on (the CNI event
socket, ZDS with one netns fd per enrollment in flight, the SDS front door with four fds per
caller, config files, netlink). 1,100 idle connections to the status port once took all
1,024 fds, and CNI ADD, ZDS and SDS failed with it.

- :func:`raise_soft_limit`: the soft limit is raised to the hard limit at start, as the Go
  runtime does for istio-cni and pilot-agent (the systemd unit sets ``LimitNOFILE``).
- :func:`listener_caps`: the configured connection caps (``status_max_connections``,
  ``health_max_connections``, ``xds_max_connections``) are scaled down, if needed, so that
  all of them full still leave :func:`headroom` fds for everything else.
"""

from __future__ import annotations

import logging
import resource
from agent.core.config import Config

log = logging.getLogger(__name__)

CAP_SETTINGS = ("status_max_connections", "health_max_connections", "xds_max_connections")
MIN_HEADROOM = 256
_SOFT_CEILING = 1 << 20  # when the hard limit is unlimited


def raise_soft_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (never lowers it); returns the soft
    limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _SOFT_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)
    return _SOFT_CEILING if soft == resource.RLIM_INFINITY else soft


def soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _SOFT_CEILING if soft == resource.RLIM_INFINITY else soft


def headroom(nofile: int) -> int:
    """fds kept for everything but the capped listeners: a quarter, at least 256."""
    return max(MIN_HEADROOM, nofile // 4)


def configured_caps(config: Config) -> dict[str, int]:
    """The caps ``config`` asks for, by setting name (0: as many as the budget allows)."""
    return {"status_max_connections": config.status_max_connections,
            "health_max_connections": config.health_max_connections,
            "xds_max_connections": config.xds_max_connections}


def listener_caps(config: Config, nofile: int | None = None) -> dict[str, int]:
    """The connection cap of each network listener (setting name -> cap), scaled down
    proportionally (each at least 1) when their sum would eat into :func:`headroom`.
    A configured 0 means "as many as the budget allows" for that listener alone."""
    nofile = soft_limit() if nofile is None else nofile
    budget = max(len(CAP_SETTINGS), nofile - headroom(nofile))
    wanted = {name: (cap if cap > 0 else budget) for name, cap in configured_caps(config).items()}
    total = sum(wanted.values())
    if total <= budget:
        return wanted
    return {name: max(1, cap * budget // total) for name, cap in wanted.items()}


def describe(config: Config, nofile: int | None = None) -> str:
    """One line for the start-up log when caps were scaled down, else ""."""
    nofile = soft_limit() if nofile is None else nofile
    caps = listener_caps(config, nofile)
    asked = configured_caps(config)
    scaled = {n: c for n, c in caps.items() if c < asked[n]}
    if not scaled:
        return ""
    return (f"open-files limit {nofile} keeps {headroom(nofile)} fds for node-local sockets: "
            + ", ".join(f"{n} lowered from {asked[n]} to {c}"
                        for n, c in scaled.items()))
