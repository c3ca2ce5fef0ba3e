"""After a long API-server outage the kubernetes source resumes within seconds of the
server answering again, not after its backoff (up to 30 s x 1.2 in production) has run
out: ambient/source_kube.py's outage probe (``/readyz`` every ``PROBE_INTERVAL`` s while
the kinds wait) ends the waits. Faults are real: kube-apiserver stopped and started again
on the same port (tests/kube/cluster.py), the source authenticated as the DaemonSet's
ServiceAccount. The probe makes no request loop either: a server that answers /readyz
but fails a kind's LISTs (503 from a proxy in front of it, tests/kube/proxy.py) gets one
early retry per ``WAKE_SPACING``, not one per probe."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ambient import source_kube
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from tests.helpers import eventually
from tests.kube import cluster as kc
from tests.kube.proxy import SlowApiProxy

pytestmark = pytest.mark.timeout(300)

RESUME_BOUND = 5.0  # s from the server answering again to every kind listed (docs/ambient.md)


@contextlib.asynccontextmanager
async def apiserver_down(cluster: kc.KubeCluster):
    """kube-apiserver stopped (off the loop: the source keeps running meanwhile); yields
    a callable that starts it again; started again at exit whatever happened."""
    state = {"down": True}

    async def start() -> None:
        await asyncio.to_thread(cluster.apiserver_start)
        state["down"] = False

    await asyncio.to_thread(cluster.apiserver_stop)
    try:
        yield start
    finally:
        if state["down"]:
            await asyncio.to_thread(cluster.apiserver_start)


async def test_source_resumes_within_seconds_of_the_server_answering_after_a_long_backoff(
        kube_cluster, kube_namespace, agent_kubeconfig, monkeypatch):
    # The backoff an outage of minutes leaves every kind in, from the first failure on:
    # whatever the source waits beyond RESUME_BOUND after the server is back is the bug.
    monkeypatch.setattr(source_kube, "BACKOFF_START", 60.0)
    monkeypatch.setattr(source_kube, "BACKOFF_MAX", 60.0)
    loop = asyncio.get_running_loop()
    kinds = ["Pod", "Service"]
    src = KubernetesSource(ObjectStore(), agent_kubeconfig, kinds=kinds, sync_timeout=30)
    await src.start()
    try:
        assert src.is_synced()
        async with apiserver_down(kube_cluster) as start_again:
            await eventually(lambda: set(src.next_retry) == set(kinds)
                             and all(src.errors.get(k) for k in kinds), timeout=90,
                             what="every kind failed and waits its backoff")
            due = min(src.next_retry.values())
            await start_again()  # returns once the server's /readyz is ok
            up = loop.time()
            # without the probe nothing would be asked before `due`
            assert due - up > RESUME_BOUND + 5, (due - up, "the restart took too long for "
                                                 "this test to tell")
            await eventually(lambda: not src.errors and not src.next_retry, timeout=60,
                             what="every kind listed again")
            took = loop.time() - up
            assert took <= RESUME_BOUND, f"resumed {took:.1f}s after the server was back"
            assert src.probes >= 1
        # and it watches again: a pod made now reaches the store
        api = await kube_cluster.admin_client()  # a fresh client: the old pool predates it
        try:
            await kc.run_pod(api, "after", kube_namespace, kc.unique("node"), ["10.250.7.1"])
        finally:
            await api.close()
        await eventually(lambda: src.store.get("Pod", kube_namespace, "after") is not None,
                         timeout=30, what="the pod made after the outage")
    finally:
        await src.stop()


async def test_no_request_loop_when_readyz_answers_but_the_lists_fail(
        kube_cluster, kube_admin, tmp_path, monkeypatch):
    monkeypatch.setattr(source_kube, "BACKOFF_START", 60.0)
    monkeypatch.setattr(source_kube, "BACKOFF_MAX", 60.0)
    proxy = await SlowApiProxy(kube_cluster.url, kube_cluster.ca_file,
                               unavailable=frozenset({"/api/v1/pods"})).start()
    try:
        token = await kc.service_account_token(kube_admin, kc.AGENT_NAMESPACE,
                                                kc.AGENT_SERVICE_ACCOUNT)
        kubeconfig = kc.kubeconfig_for_token(kube_cluster, token, str(tmp_path / "p.kubeconfig"),
                                             server=proxy.url)
        src = KubernetesSource(ObjectStore(), kubeconfig, kinds=["Pod", "Service"],
                               sync_timeout=1)
        loop = asyncio.get_running_loop()
        await src.start()
        try:
            began = loop.time()
            await eventually(lambda: loop.time() - began > 25, timeout=60,
                             what="25 s of a failing Pod LIST")
            lists = proxy.refused["/api/v1/pods"]
            # the first LIST, the first wake (the probe never saw the server down: it
            # answered), then one per WAKE_SPACING (10 s): not one per 1 s probe
            assert 2 <= lists <= 5, lists
            assert src.errors["Pod"].startswith("503"), src.errors
            assert src.synced["Service"].is_set() and "Service" not in src.errors
        finally:
            await src.stop()
    finally:
        await proxy.stop()
