"""The directory source, real files and inotify: an object of another API that shares a
kind's name is refused (Istio's ingress ``networking.istio.io`` Gateway once took the place
of a waypoint ``gateway.networking.k8s.io`` Gateway, dropping the service's waypoint), and
a copy refused as "already defined by" another file takes over when that file stops
defining it (it stayed unloaded until its own file was touched: the object was lost)."""

from __future__ import annotations

import asyncio
import logging
import textwrap

from prometheus_client import CollectorRegistry

from ambient.source_files import DirectorySource
from ambient.store import InvalidObject, ObjectStore, validate
from tests.helpers import eventually

WAYPOINT = textwrap.dedent("""\
    apiVersion: gateway.networking.k8s.io/v1
    kind: Gateway
    metadata: {name: waypoint, namespace: demo}
    spec:
      gatewayClassName: istio-waypoint
      listeners: [{name: mesh, port: 15008, protocol: HBONE}]
    """)
ISTIO_INGRESS = textwrap.dedent("""\
    apiVersion: networking.istio.io/v1
    kind: Gateway
    metadata: {name: waypoint, namespace: demo}
    spec: {selector: {istio: ingressgateway}}
    """)
SERVICE = textwrap.dedent("""\
    apiVersion: v1
    kind: Service
    metadata: {name: legacy, namespace: legacy, labels: {copy: "%s"}}
    spec: {selector: {app: legacy}, ports: [{port: 80}]}
    """)


async def run_blocking(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_api_version_of_another_group_is_refused_naming_it():
    try:
        validate({"apiVersion": "networking.istio.io/v1", "kind": "Gateway",
                  "metadata": {"name": "g", "namespace": "demo"}})
    except InvalidObject as e:
        assert "'apiVersion' 'networking.istio.io/v1'" in str(e)
        assert "gateway.networking.k8s.io/v1" in str(e)
    else:
        raise AssertionError("an Istio ingress Gateway was taken as a Gateway API one")
    for api in ("totally/wrong", "v2", "security.istio.io/v1", 7):
        try:
            validate({"apiVersion": api, "kind": "Namespace", "metadata": {"name": "n"}})
        except InvalidObject as e:
            assert "apiVersion" in str(e)
        else:
            raise AssertionError(f"Namespace with apiVersion {api!r} accepted")
    # the versions the API server serves for each kind, and none at all (hand-written)
    for api, kind in (("security.istio.io/v1beta1", "AuthorizationPolicy"),
                      ("networking.istio.io/v1alpha3", "ServiceEntry"),
                      ("gateway.networking.k8s.io/v1alpha2", "TCPRoute"),
                      ("gateway.networking.k8s.io/v1beta1", "HTTPRoute"),
                      (None, "Service")):
        obj = {"kind": kind, "metadata": {"name": "x", "namespace": "demo"}}
        if api:
            obj["apiVersion"] = api
        assert validate(obj) == (kind, "demo", "x")


async def test_istio_ingress_gateway_never_replaces_the_waypoint(tmp_path, caplog):
    directory = tmp_path / "cluster"
    directory.mkdir()
    # sorted first, so it would have won the name before the check
    (directory / "a-istio-gateway.yaml").write_text(ISTIO_INGRESS)
    (directory / "waypoint.yaml").write_text(WAYPOINT)
    store = ObjectStore(CollectorRegistry())
    src = DirectorySource(store, str(directory), run_blocking, debounce_ms=10)
    caplog.set_level(logging.WARNING)
    try:
        await src.start()
        gw = store.get("Gateway", "demo", "waypoint")
        assert gw is not None and gw["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert store.origin_of(("Gateway", "demo", "waypoint")).endswith("waypoint.yaml")
        refused = [r.getMessage() for r in caplog.records if "apiVersion" in r.getMessage()]
        assert len(refused) == 1 and "a-istio-gateway.yaml#0" in refused[0], refused
        assert not any("already defined" in r.getMessage() for r in caplog.records)
    finally:
        await src.stop()


LEGACY = ("Service", "legacy", "legacy")


def _two_copies(tmp_path):
    """A directory where ``services.yaml`` (read first) and ``zz-svc.yaml`` both define
    :data:`LEGACY`; its store and (not started) source."""
    directory = tmp_path / "cluster"
    directory.mkdir()
    (directory / "services.yaml").write_text(SERVICE % "first")
    (directory / "zz-svc.yaml").write_text(SERVICE % "second")
    store = ObjectStore(CollectorRegistry())
    return directory, store, DirectorySource(store, str(directory), run_blocking,
                                             debounce_ms=10)


async def test_refused_duplicate_takes_over_when_the_winning_file_goes(tmp_path, caplog):
    directory, store, src = _two_copies(tmp_path)
    key = LEGACY
    events: list = []
    store.subscribe(events.extend)
    caplog.set_level(logging.INFO)
    try:
        await src.start()
        assert store.get(*key)["metadata"]["labels"] == {"copy": "first"}
        assert sum("already defined by" in r.getMessage() for r in caplog.records) == 1
        events.clear()
        (directory / "services.yaml").unlink()
        await eventually(lambda: (store.get(*key) or {}).get("metadata", {}).get("labels")
                         == {"copy": "second"}, timeout=10)
        assert store.origin_of(key).endswith("zz-svc.yaml")
        # one update, never a moment without the Service
        mine = [e for e in events if (e.kind, e.namespace, e.name) == key]
        assert len(mine) == 1 and mine[0].old is not None and mine[0].new is not None
        assert any("now comes from" in r.getMessage() and "zz-svc.yaml" in r.getMessage()
                   for r in caplog.records)
        # the new owner's file goes too: nothing is left
        (directory / "zz-svc.yaml").unlink()
        await eventually(lambda: store.get(*key) is None, timeout=10)
    finally:
        await src.stop()


async def test_a_copy_its_file_no_longer_defines_never_comes_back(tmp_path):
    directory, store, src = _two_copies(tmp_path)
    key = LEGACY
    try:
        await src.start()
        # the refused file now defines something else instead
        (directory / "zz-svc.yaml").write_text(
            (SERVICE % "other").replace("name: legacy, namespace", "name: other, namespace"))
        await eventually(lambda: store.get("Service", "legacy", "other") is not None,
                         timeout=10)
        (directory / "services.yaml").unlink()
        await eventually(lambda: store.get(*key) is None, timeout=10)
    finally:
        await src.stop()
