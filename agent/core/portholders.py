"""Who listens on a TCP port: for error messages that name the holder of a busy port
(``precheck``'s ports check, ``run``'s refusal to start on a busy port)."""

from __future__ import annotations


def port_holders(ports: set[int]) -> dict[int, list[tuple[int, str]]]:
    """Listening TCP ``port -> [(pid, process name)]`` for ``ports``, from the kernel's
    socket table (psutil). Sockets of processes we may not inspect have no pid (0)."""
    import psutil

    out: dict[int, list[tuple[int, str]]] = {}
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return out
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port not in ports:
            continue
        pid = c.pid or 0
        try:
            name = psutil.Process(pid).name() if pid else "?"
        except psutil.Error:
            name = "?"
        if (pid, name) not in out.setdefault(c.laddr.port, []):
            out[c.laddr.port].append((pid, name))
    return out


def describe(port: int) -> str:
    """`` (held by pid 123 python3)`` for a listening ``port``, ``""`` when nobody can
    be named (not listening, or a process we may not inspect)."""
    named = [f"pid {pid} {name}" for pid, name in port_holders({port}).get(port, []) if pid]
    return f" (held by {', '.join(named)})" if named else ""
