"""Sockets and namespaces for the demo's traffic checks, used by the demo and the two-host
test: run a function inside a pod's netns, listen, echo, exchange bytes, create a netns
with ``ip``, pick a free subnet, and read ztunnel's mTLS connection counters.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import urllib.request
from typing import Any, Callable

from agent.demo.model import DemoError, DemoPod


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.77.0.0/16 not overlapping any address on this host."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        used = [ipaddress.ip_network(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}", strict=False)
                for a in ipr.get_addr(family=socket.AF_INET)]
    for third in range(10, 250):
        net = ipaddress.IPv4Network(f"10.77.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.77.0.0/16 for the demo network")


def run_in_pod(pod: DemoPod, fn: Callable[[], Any]) -> Any:
    from agent.core.netns import run_in_netns_thread

    return run_in_netns_thread(pod.netns_path, fn)


def listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    return s


def echo_forever(listener: socket.socket) -> None:
    """Echo every connection until its peer closes, each in a thread of its own, until
    the listener is closed (the server pod's app)."""
    import threading

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(300)
            while data := conn.recv(4096):
                conn.sendall(data)

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def create_netns(name: str) -> None:
    """``ip netns add NAME``. Not pyroute2's ``netns.create``: it forks a Python child,
    and a fork while gRPC's threads run can crash that child (seen: SIGSEGV); ``ip``
    is fork+exec. Raises DemoError naming the netns on failure."""
    import subprocess

    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DemoError(f"ip netns add {name}: {proc.stderr.strip() or proc.returncode}")


def close_listener(listener: socket.socket) -> None:
    """Close a listener another thread is blocked in accept() on (shutdown wakes it)."""
    with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def exchange(ip: str, port: int, data: bytes) -> bytes:
    """Connect, send ``data``, return what comes back (b"" on any error)."""
    try:
        with socket.create_connection((ip, port), timeout=5) as s:
            s.sendall(data)
            return s.recv(4096)
    except OSError:
        return b""


def mtls_connections(metrics: str, source: str, destination: str) -> float:
    """Sum of ztunnel's ``istio_tcp_connections_opened_total`` samples with
    ``connection_security_policy="mutual_tls"`` between the two SPIFFE identities, both
    reporters. ztunnel serves OpenMetrics text (``# EOF``), parsed with its parser."""
    if metrics.rstrip().endswith("# EOF"):
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name == "istio_tcp_connections_opened_total"
                    and labels.get("connection_security_policy") == "mutual_tls"
                    and labels.get("source_principal") == source
                    and labels.get("destination_principal") == destination):
                total += sample.value
    return total


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode(errors="replace")
