"""cni.netns on real namespaces: entering one and always coming back, without fd leaks."""

from __future__ import annotations

import pytest

from cni import netns
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
