"""Shared fixtures. Tests that need root skip with a clear reason when not root."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.netns.toolkit import Bridge, is_root  # noqa: E402

requires_root = pytest.mark.skipif(not is_root(), reason="needs root: creates network namespaces, "
                                   "interfaces and firewall rules")


def pytest_collection_modifyitems(config, items):
    """Anything under tests/netns/ or tests/peers/, or marked `root`, needs root."""
    for item in items:
        path = str(item.fspath)
        if (f"{os.sep}netns{os.sep}" in path or f"{os.sep}peers{os.sep}" in path
                or item.get_closest_marker("root")):
            item.add_marker(requires_root)


@pytest.fixture
def bridge():
    """A fresh bridge (random IPv4 /24) that pods can be added to; always torn down."""
    if not is_root():
        pytest.skip("needs root: creates a bridge and network namespaces")
    br = Bridge()
    try:
        yield br
    finally:
        br.close()


@pytest.fixture
def bridge6():
    """Like `bridge`, dual-stack (IPv4 + a random ULA /64)."""
    if not is_root():
        pytest.skip("needs root: creates a bridge and network namespaces")
    br = Bridge(ipv6=True)
    try:
        yield br
    finally:
        br.close()


@pytest.fixture
def state_dir(tmp_path):
    """A private state dir for an agent under test."""
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d
