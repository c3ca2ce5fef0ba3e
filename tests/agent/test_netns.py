"""agent.core.netns on real namespaces: entering one and always coming back, without fd leaks."""

from __future__ import annotations

import pytest

from agent.core import netns
from tests.helpers import fd_count


def test_run_in_netns_thread_enters_and_returns(bridge):
    pod = bridge.add_pod()
    host = netns.netns_inode("/proc/thread-self/ns/net")
    inside = netns.run_in_netns_thread(
        pod.netns_path, lambda: netns.netns_inode("/proc/thread-self/ns/net"))
    assert inside == netns.netns_inode(pod.netns_path) != host
    assert netns.netns_inode("/proc/thread-self/ns/net") == host


def test_missing_or_unenterable_netns_leaks_no_fd(tmp_path):
    """A pod whose netns is gone is a routine case for the daemon: each failed attempt
    must close every fd it opened (the thread's own netns fd included)."""
    not_a_netns = tmp_path / "file"
    not_a_netns.write_text("")
    before = fd_count()
    for _ in range(20):
        with pytest.raises(netns.NetnsError, match="cannot open netns"):
            with netns.entered(str(tmp_path / "missing")):
                pass
        with pytest.raises(netns.NetnsError, match="cannot enter netns"):
            with netns.entered(str(not_a_netns)):
                pass
    assert fd_count() == before


# --- host path translation (setting host_mounts_path) ---

def test_host_path_unchanged_without_host_mounts():
    assert netns.host_path("/proc/42/ns/net", "") == "/proc/42/ns/net"
    assert netns.host_path("relative", "") == "relative"


def test_host_path_joins_like_upstream(tmp_path):
    host = str(tmp_path / "host")
    assert netns.host_path("/proc/42/ns/net", host) == f"{host}/proc/42/ns/net"
    assert netns.host_path("/var/run/docker/netns/abc", host + "/") == \
        f"{host}/var/run/docker/netns/abc"
    # normalised first: never above the host mounts
    assert netns.host_path("/proc/../../../etc/shadow", host) == f"{host}/etc/shadow"
    assert netns.host_path("//proc//7/ns/net", host) == f"{host}/proc/7/ns/net"


def test_host_path_run_and_var_run_are_one_dir(tmp_path):
    host = tmp_path / "host"
    (host / "var" / "run" / "netns").mkdir(parents=True)
    (host / "var" / "run" / "netns" / "netns-1").write_text("")
    (host / "run" / "only").mkdir(parents=True)
    (host / "run" / "only" / "x").write_text("")
    # podman passes /run/netns/...; the DaemonSet mounts the host's /var/run/netns
    assert netns.host_path("/run/netns/netns-1", str(host)) == \
        f"{host}/var/run/netns/netns-1"
    assert netns.host_path("/var/run/only/x", str(host)) == f"{host}/run/only/x"
    # neither exists: the direct join, so the error names the expected place
    assert netns.host_path("/run/netns/gone", str(host)) == f"{host}/run/netns/gone"


def test_host_path_refuses_relative(tmp_path):
    with pytest.raises(ValueError, match="'ns/net' is not absolute"):
        netns.host_path("ns/net", str(tmp_path))
