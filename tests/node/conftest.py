"""Fixtures for the real-node tests (tests/node/realnode.py has the node).

``node_bin``: the kubelet, kube-controller-manager, kube-scheduler, kubectl and pause
binaries (scripts/kube-test-node.sh build, at collection when a collected test needs
them, so no test pays the first build inside its timeout; .ci/run builds them earlier).

Without root, Go, containerd/runc or the CNI plugins the tests skip with the reason; with
``AMBIENT_REQUIRE_NODE=1`` (set by .ci/run) the same conditions fail them instead, so CI
never passes by skipping the node.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.node import realnode

_built: dict[str, object] = {}


def require() -> bool:
    return os.environ.get("AMBIENT_REQUIRE_NODE") == "1"


def unavailable(reason: str) -> None:
    if require():
        pytest.fail(f"AMBIENT_REQUIRE_NODE=1 but the real node cannot run: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    if not any("node_bin" in getattr(item, "fixturenames", ()) for item in items):
        return
    reason = realnode.why_not()
    if reason:
        _built["error"] = reason
        return
    t0 = time.monotonic()
    try:
        _built["dir"] = realnode.build()
    except RuntimeError as e:
        _built["error"] = str(e)
        return
    if time.monotonic() - t0 > 5:
        print(f"\nbuilt the node binaries in {time.monotonic() - t0:.0f}s: {_built['dir']}")


@pytest.fixture(scope="session")
def node_bin():
    if "error" in _built:
        unavailable(str(_built["error"]))
    if "dir" not in _built:
        unavailable(realnode.why_not() or "node binaries not built")
    return _built["dir"]
