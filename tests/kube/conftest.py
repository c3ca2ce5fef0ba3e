"""Fixtures for tests against a real kube-apiserver (tests/kube/cluster.py has the helpers).

``kube_cluster`` (session): one kube-apiserver + etcd for the whole test run, started by
scripts/kube-test-apiserver.sh in a fresh directory, with deploy/crds/crds.yaml and
deploy/kubernetes/rbac.yaml (as shipped; plus the istio-system namespace it lives in)
applied; stopped at the end of the run, also when tests fail (and, through the script's
owner watchdog, when pytest itself is killed). Tests that use it live under tests/kube/.

The binaries are built before the first test runs (at collection, only when a collected
test uses the fixture; `.ci/run` builds them even earlier), so no test pays the first
build inside its timeout.

Without root or without Go the fixture skips with the reason; with
``AMBIENT_REQUIRE_KUBE=1`` (set by .ci/run) anything that keeps the server from running —
including those two — fails the tests instead, so CI never passes by skipping them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
import time

import pytest

from tests.kube import cluster as kc

_build_error: str | None = None


def _require() -> bool:
    return os.environ.get("AMBIENT_REQUIRE_KUBE") == "1"


def _go() -> str | None:
    return shutil.which("go") or ("/usr/local/go/bin/go"
                                  if os.access("/usr/local/go/bin/go", os.X_OK) else None)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the real kube-apiserver tests run as root (as CI does)"
    if _go() is None:
        return "needs Go (go on PATH or /usr/local/go/bin/go) to build kube-apiserver and etcd"
    return None


def _unavailable(reason: str) -> None:
    if _require():
        pytest.fail(f"AMBIENT_REQUIRE_KUBE=1 but the real API server is unavailable: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    """Build (or find cached) kube-apiserver + etcd once, before any test runs, when a
    collected test needs them."""
    global _build_error
    if not any("kube_cluster" in getattr(item, "fixturenames", ()) for item in items):
        return
    if _why_not():
        return
    t0 = time.monotonic()
    proc = subprocess.run(["bash", kc.SCRIPT, "build"], capture_output=True, text=True)
    if proc.returncode:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        _build_error = (f"scripts/kube-test-apiserver.sh build failed (exit {proc.returncode}):"
                        f" {tail}")
    elif time.monotonic() - t0 > 5:
        print(f"\nbuilt kube-apiserver and etcd in {time.monotonic() - t0:.0f}s: "
              f"{proc.stdout.strip()}")


def _run(coro_fn, *args):
    """Run an async helper to completion on a private loop in a worker thread (the session
    fixture is synchronous and may be set up while a test's loop is running)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro_fn(*args)).result()


async def _prepare(cluster: kc.KubeCluster) -> None:
    api = await cluster.admin_client()
    try:
        await kc.apply_crds(api)
        await kc.create_namespace(api, kc.AGENT_NAMESPACE)
        await kc.apply_manifest(api, "rbac.yaml")
    finally:
        await api.close()


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory) -> kc.KubeCluster:
    """The session's real kube-apiserver (see the module docstring)."""
    reason = _why_not() or _build_error
    if reason:
        _unavailable(reason)
    directory = str(tmp_path_factory.mktemp("kube-apiserver"))
    env = dict(os.environ, KUBE_TEST_OWNER_PID=str(os.getpid()))
    go = _go()
    if go and not shutil.which("go"):
        env["PATH"] = f"{os.path.dirname(go)}:{env.get('PATH', '')}"
    proc = subprocess.run(["bash", kc.SCRIPT, "start", directory], capture_output=True,
                          text=True, env=env, timeout=240)
    if proc.returncode:
        tail = " | ".join(proc.stderr.strip().splitlines()[-8:])
        _unavailable(f"scripts/kube-test-apiserver.sh start failed (exit {proc.returncode}): "
                     f"{tail}")
    cluster = kc.KubeCluster(directory)
    try:
        _run(_prepare, cluster)
        yield cluster
    finally:
        subprocess.run(["bash", kc.SCRIPT, "stop", directory], capture_output=True, timeout=60)


@pytest.fixture
async def kube_admin(kube_cluster):
    """A cluster-admin ApiClient for this test (closed after it)."""
    api = await kube_cluster.admin_client()
    try:
        yield api
    finally:
        await api.close()


@pytest.fixture
async def agent_kubeconfig(kube_cluster, kube_admin, tmp_path) -> str:
    """Path of a kubeconfig holding a fresh token of the DaemonSet's ServiceAccount
    (istio-system/ambient-agent): the agent's own identity under deploy/kubernetes/rbac.yaml."""
    return await kc.agent_kubeconfig(kube_cluster, kube_admin, str(tmp_path / "agent.kubeconfig"))


@pytest.fixture
async def kube_namespace(kube_admin):
    """A fresh namespace (with its default ServiceAccount), deleted after the test."""
    name = kc.unique("t")
    await kc.create_namespace(kube_admin, name)
    try:
        yield name
    finally:
        await kc.delete_namespace(kube_admin, name)
