"""Fixtures of the differential suite: ``oracle`` (package) is one kube-apiserver, one istiod
and one agent read by one ztunnel-like client each (tests/oracle/harness.py).

istiod is built before the first test runs (at collection, only when a collected test uses
the fixture; `.ci/run` builds it even earlier), so no test pays the build in its timeout.

Without root or Go the fixture skips with the reason; with ``AMBIENT_REQUIRE_ISTIOD=1``
(set by .ci/run) anything that keeps istiod, the API server or the agent from running fails
the tests instead, so CI never passes by skipping them.
"""

from __future__ import annotations

import contextlib
import subprocess
import time

import pytest

from tests.oracle import harness as h

_build_error: str | None = None


def _unavailable(reason: str) -> None:
    if h.require_istiod():
        pytest.fail(f"AMBIENT_REQUIRE_ISTIOD=1 but the differential suite cannot run: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    """Build (or find cached) pilot-discovery once, before any test, when one needs it."""
    global _build_error
    if not any(f in getattr(item, "fixturenames", ()) for item in items
               for f in ("oracle", "istiod_ca")):
        return
    if h.why_not():
        return
    t0 = time.monotonic()
    proc = subprocess.run(["bash", h.ISTIOD_SCRIPT, "build"], capture_output=True, text=True,
                          env=h.script_env())
    if proc.returncode:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        _build_error = f"scripts/istiod-test.sh build failed (exit {proc.returncode}): {tail}"
    elif time.monotonic() - t0 > 5:
        print(f"\nbuilt istiod in {time.monotonic() - t0:.0f}s: {proc.stdout.strip()}")


@pytest.fixture(scope="package")
def oracle(tmp_path_factory):
    """The package's :class:`tests.oracle.harness.Oracle` (started once, stopped after the
    last test of tests/oracle/, also when tests fail), shared by test_oracle.py and
    test_waypoint_oracle.py: each leaves nothing behind (test_oracle.py's cases delete their namespaces and what
    they put in istio-system, asserting nothing is left; the waypoint suite deletes its
    own namespace ``wpo``), their namespaces and pod IPs are disjoint, and both compare
    only what they load, so either order gives the same results and starting the API
    server, istiod and the agent is paid once."""
    with running(lambda: h.Oracle(str(tmp_path_factory.mktemp("oracle")))) as o:
        yield o


@contextlib.contextmanager
def running(make):
    """``make()``'s peer (anything with ``start()``/``stop()``: the oracle, the istiod
    CA), started; stopped on leaving, also when the tests fail. Without root, Go or the
    build it skips with the reason, and a failed start is the fixture's failure, both
    through :func:`_unavailable` (which fails instead under ``AMBIENT_REQUIRE_ISTIOD=1``)."""
    reason = h.why_not() or _build_error
    if reason:
        _unavailable(reason)
    peer = make()
    try:
        try:
            peer.start()
        except Exception as e:  # noqa: BLE001 - reported as the fixture's failure
            _unavailable(f"{type(e).__name__}: {e}")
        yield peer
    finally:
        peer.stop()
