"""Tell systemd the agent is ready (``Type=notify`` in ``systemd/ambient-agent.service``).

The unit is ordered ``Before=`` the container runtimes so that containers they restart at
boot find an agent answering their CNI ADD. With ``Type=simple`` systemd would start the
runtime as soon as the agent process exists, long before its CNI event socket is bound;
with ``Type=notify`` it waits for ``READY=1``, which :func:`agent.daemon.run` sends once
every component has started.

Protocol (sd_notify(3), "NOTIFY_SOCKET"): one datagram of newline-separated
``KEY=VALUE`` assignments to the ``AF_UNIX``/``SOCK_DGRAM`` socket named by the
``NOTIFY_SOCKET`` environment variable; a leading ``@`` names an abstract socket.
Nothing happens when the variable is unset (not started by systemd). Sending never
raises: a notification that cannot be delivered is logged and the agent carries on
(systemd then times the unit out on its own, which says more than a crash here would).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str, env: dict[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``, ``"STOPPING=1"``) to ``$NOTIFY_SOCKET``.

    Returns True when a datagram was sent, False when there is no socket or sending
    failed (logged at WARNING with the path and the error).
    """
    path = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path[0] not in "/@":
        log.warning("NOTIFY_SOCKET=%r is neither an absolute path nor an abstract name; "
                    "not notifying systemd", path)
        return False
    address = "\0" + path[1:] if path[0] == "@" else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(1.0)
            s.sendto(state.encode(), address)
    except OSError as e:
        log.warning("cannot notify systemd at %s (%s): %s", path, state, e)
        return False
    return True
