"""A real Envoy waypoint and values it would reject.

1. Several HTTPRoutes with values the Gateway API CRD refuses or Envoy would NACK, next
   to a good one: Envoy NACKs nothing (the agent's NACK counter, Envoy's ``config_dump``
   without an ``error_state``), the good route is in Envoy's route table and answers
   through the waypoint, each bad one is ``Accepted=False`` naming its field.
2. A resource Envoy does reject, injected in a test-only way
   (:mod:`tests.waypoint.nack_inject`): Envoy NACKs it once (one log line naming the type
   URL and the resource), later pushes do not resend it, and the fixed version is sent
   and ACKed (in Envoy's active clusters).
"""

from __future__ import annotations

import logging
import random

import pytest
from prometheus_client import CollectorRegistry

from agent.demo.envoy import EnvoyProcess, free_port
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import resources as wr
from ambient.waypoint.bootstrap import BootstrapOptions, bootstrap
from ambient.waypoint.status import statuses
from ambient.xds.server import XdsServer
from tests.waypoint.nack_inject import InjectingConfigs, cluster, touch
from tests.waypoint.test_envoy_waypoint import (CA, _ok, config_dump, dump_errors,  # noqa: F401
                                                mesh, nacks, objects, status_of, until)

pytestmark = pytest.mark.envoy
GW = "gateway.networking.k8s.io/v1"


def _route(name: str, rule: dict) -> dict:
    return {"apiVersion": GW, "kind": "HTTPRoute",
            "metadata": {"name": name, "namespace": "demo",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web"}],
                     "rules": [rule]}}


def _to_web(**fields) -> dict:
    return {"backendRefs": [{"name": "web", "port": 80}], **fields}


BAD = {
    "bad-path": (_to_web(matches=[{"path": {"type": "PathPrefix", "value": "bad?x"}}]),
                 "spec.rules[0].matches[0].path.value"),
    "bad-regex": (_to_web(matches=[{"path": {"type": "RegularExpression",
                                             "value": "/(a"}}]),
                  "spec.rules[0].matches[0].path.value"),
    "bad-header": (_to_web(matches=[{"headers": [{"name": "x y", "value": "1"}]}]),
                   "spec.rules[0].matches[0].headers[0].name"),
    "bad-weight": ({"backendRefs": [{"name": "web", "port": 80, "weight": 2_000_000}]},
                   "spec.rules[0].backendRefs[0].weight"),
    "bad-timeout": (_to_web(timeouts={"request": "99999999999999999999s"}),
                    "spec.rules[0].timeouts.request"),
    "bad-port": ({"backendRefs": [{"name": "web", "port": 70000}]},
                 "spec.rules[0].backendRefs[0].port"),
    "bad-modifier": (_to_web(filters=[{"type": "RequestHeaderModifier",
                                       "requestHeaderModifier": {
                                           "set": [{"name": "host", "value": "x"}]}}]),
                     "spec.rules[0].filters[0].requestHeaderModifier.set[0].name"),
    "bad-retry": (_to_web(retry={"attempts": -3}), "spec.rules[0].retry.attempts"),
    # the CRD takes 0s; Envoy's base interval must be > 0 (newuser finding: a NACK)
    "zero-backoff": (_to_web(retry={"attempts": 3, "codes": [503], "backoff": "0s"}),
                     "spec.rules[0].retry.backoff"),
}


def _route_names(dump: dict) -> set[str]:
    out = set()
    for conf in dump.get("configs", []):
        for rc in conf.get("dynamic_route_configs", []):
            for vh in rc.get("route_config", {}).get("virtual_hosts", []):
                out |= {r.get("name", "") for r in vh.get("routes", [])}
    return out


def _active_clusters(dump: dict) -> dict[str, dict]:
    out = {}
    for conf in dump.get("configs", []):
        for c in conf.get("dynamic_active_clusters", []):
            out[c["cluster"]["name"]] = c
    return out


async def test_bad_routes_next_to_a_good_one_no_nack(mesh, caplog):
    env = mesh
    env["store"].apply([(_route(name, rule), "test") for name, (rule, _f) in BAD.items()]
                       + [(_route("good", _to_web(matches=[
                           {"path": {"type": "PathPrefix", "value": "/allowed"}}])), "test")])
    envoy = env["start_envoy"](True)
    await envoy.wait_ready_async(30)
    await until(lambda: _ok(env), 30, "the good route answering through the waypoint")
    status, raw, _ = await env["get"]("/other")  # no rule of the good route matches: 404
    assert status == 200 and status_of(raw) == 404, raw
    dump = await config_dump(envoy)
    names = _route_names(dump)
    assert "demo.good.0.0" in names, names
    assert not [n for n in names if n.startswith("demo.bad-")], names
    assert dump_errors(dump) == []
    assert nacks(env["registry"]) == 0
    routes = statuses(env["store"])["httproutes"]
    for name, (_rule, field) in BAD.items():
        accepted = routes[f"demo/{name}"]["parents"][0]["conditions"][0]
        assert (accepted["status"], accepted["reason"]) == ("False", "UnsupportedValue"), name
        assert f"field '{field}' value" in accepted["message"], (name, accepted["message"])
        assert any(f"HTTPRoute demo/{name}: not accepted" in r.getMessage()
                   for r in caplog.records if r.levelno == logging.WARNING), name
    assert routes["demo/good"]["parents"][0]["conditions"][0]["status"] == "True"


@pytest.fixture
async def injecting(tmp_path):
    a, b = random.randint(10, 250), random.randint(10, 250)
    net, vip = f"127.{a}.{b}", f"10.92.{a}.{b}"
    store = ObjectStore(CollectorRegistry())
    store.apply([(o, "test") for o in objects(net, vip)])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    token = tmp_path / "xds-token"
    token.write_text("s3cret")
    registry = CollectorRegistry()
    configs = InjectingConfigs(store, index, issuer=CA(tmp_path / "ca"))
    server = XdsServer(index, address="127.0.0.1", port=0, debounce=0.02, debounce_max=0.1,
                       registry=registry, token_file=str(token), waypoints=configs)
    await server.start()
    envoy = None
    try:
        boot = bootstrap(BootstrapOptions(namespace="demo", gateway="wp", xds_port=server.port,
                                          token="s3cret", admin_port=free_port(),
                                          node_ip=f"{net}.1", hbone_bind=f"{net}.1",
                                          delta=True))
        envoy = EnvoyProcess(boot, tmp_path / "envoy").start()
        yield {"envoy": envoy, "store": store, "configs": configs, "server": server,
               "registry": registry}
    finally:
        if envoy is not None:
            envoy.stop()
        await server.stop(0.2)
        index.stop()


def _cds_state(server) -> dict:
    for client in server.debug_state()["clients"]:
        if client.get("proxy_type") == "waypoint":
            return client["types"].get(wr.CLUSTER_TYPE, {})
    return {}


async def test_nacked_resource_is_not_resent_and_its_fix_is_acked(injecting, caplog):
    env = injecting
    caplog.set_level(logging.WARNING, logger="ambient.xds.server")
    envoy = env["envoy"]
    await envoy.wait_ready_async(30)
    name = "test-injected"

    env["configs"].extra = {wr.CLUSTER_TYPE: {name: ("bad-1", cluster(name, -1))}}
    touch(env["store"], "demo", 1)

    async def nacked():
        return nacks(env["registry"]) >= 1
    await until(nacked, 30, "Envoy's NACK of the invalid cluster")
    lines = [r.getMessage() for r in caplog.records if " NACKed " in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"NACKed {wr.CLUSTER_TYPE} [{name}]" in lines[0], lines[0]
    assert "]: Invalid duration: Expected positive duration" in lines[0], lines[0]
    assert name not in _active_clusters(await config_dump(envoy))

    # a later push that changes another cluster: Envoy ACKs it (so the rejected cluster
    # was not in it again) and has the new cluster
    acks = _cds_state(env["server"]).get("acks", 0)
    touch(env["store"], "demo", 2, labels={"istio.io/use-waypoint": "wp"})

    async def other_acked():
        return (_cds_state(env["server"]).get("acks", 0) > acks and any(
            "touch-2.demo" in c for c in _active_clusters(await config_dump(envoy))))
    await until(other_acked, 30, "the next CDS push ACKed")
    assert nacks(env["registry"]) == 1
    assert _cds_state(env["server"])["rejected"] == 1

    # the fix: sent, ACKed, active in Envoy
    env["configs"].extra = {wr.CLUSTER_TYPE: {name: ("good-2", cluster(name, 2))}}
    touch(env["store"], "demo", 3)

    async def fixed():
        return name in _active_clusters(await config_dump(envoy))
    await until(fixed, 30, "the fixed cluster active in Envoy")
    assert nacks(env["registry"]) == 1
    assert _cds_state(env["server"])["rejected"] == 0
    assert dump_errors(await config_dump(envoy)) == []
