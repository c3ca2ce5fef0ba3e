"""``ambient-agent waypoint bootstrap``: the node as ``pilot-agent proxy waypoint`` sends
it, the xDS cluster at the agent, and a bootstrap the real Envoy accepts
(``envoy --mode validate``); bad arguments name the option."""

from __future__ import annotations

import json
import subprocess

import pytest
from prometheus_client import CollectorRegistry

from agent.cli import main
from agent.demo.envoy import envoy_path
from ambient.index import AmbientIndex
from ambient.objects import Mesh
from ambient.store import ObjectStore
from ambient.waypoint import resources
from ambient.waypoint.model import build_model
from tests.waypoint.test_envoy_waypoint import objects


def run(capsys, *argv: str) -> dict:
    assert main(["waypoint", "bootstrap", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_bootstrap_node_and_xds_cluster(capsys, tmp_path):
    token = tmp_path / "token"
    token.write_text("abc\n")
    ca = tmp_path / "root.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    boot = run(capsys, "--gateway", "demo/wp", "--xds-address", "10.0.0.1:15012",
               "--node-ip", "10.1.2.3", "--pod-name", "wp-5d8f-abcde", "--admin-port", "15099",
               "--token-file", str(token), "--ca", str(ca))
    node = boot["node"]
    assert node["id"] == "waypoint~10.1.2.3~wp-5d8f-abcde.demo~demo.svc.cluster.local"
    md = node["metadata"]
    assert md["LABELS"]["gateway.networking.k8s.io/gateway-name"] == "wp"
    assert md["LABELS"]["gateway.istio.io/managed"] == "istio.io-mesh-controller"
    assert md["NAMESPACE"] == "demo" and md["SERVICE_ACCOUNT"] == "wp"
    xds = boot["static_resources"]["clusters"][0]
    assert xds["name"] == "xds-grpc"
    addr = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert addr["socket_address"] == {"address": "10.0.0.1", "port_value": 15012}
    assert xds["transport_socket"]["typed_config"]["sni"] == "istiod.istio-system.svc"
    ads = boot["dynamic_resources"]["ads_config"]
    assert ads["api_type"] == "DELTA_GRPC"
    assert ads["grpc_services"][0]["initial_metadata"] == [
        {"key": "authorization", "value": "Bearer abc"}]
    assert boot["admin"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                          "port_value": 15099}
    assert boot["bootstrap_extensions"][0]["name"] == "envoy.bootstrap.internal_listener"


@pytest.mark.envoy
def test_real_envoy_accepts_the_bootstrap(capsys, tmp_path):
    boot = run(capsys, "--gateway", "demo/wp", "--sotw")
    path = tmp_path / "b.json"
    path.write_text(json.dumps(boot))
    out = subprocess.run([envoy_path(), "--mode", "validate", "-c", str(path),
                          "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--gateway", "demo"], "--gateway must be NAMESPACE/NAME"),
    (["--gateway", "demo/wp", "--xds-address", "nohost"], "--xds-address must be HOST:PORT"),
    (["--gateway", "demo/wp", "--hbone-bind", "x"], "not an IP address: 'x'"),
    (["--gateway", "demo/wp", "--admin-port", "99999"],
     "argument --admin-port: must be a TCP port 1-65535, got '99999'"),
    (["--gateway", "demo/wp", "--admin-port", "0"], "argument --admin-port: must be a TCP port"),
    # a '~' in them moved the node id's fields (newuser finding)
    (["--gateway", "de~mo/wp"], "'de~mo' is not a valid namespace name"),
    (["--gateway", "demo/a~b"], "--gateway NAME 'a~b' is not a Kubernetes name"),
    (["--gateway", "demo/UPPER_bad"], "--gateway NAME 'UPPER_bad'"),
    (["--gateway", "demo/wp\nx"], "is not a Kubernetes name"),
    (["--gateway", "demo/wp", "--pod-name", "x~y"], "--pod-name 'x~y' is not a Kubernetes name"),
    (["--gateway", "demo/wp", "--service-account", "A"], "--service-account 'A'"),
])
def test_bad_arguments_name_the_option(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(["waypoint", "bootstrap", *argv])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_unreadable_token_file(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["waypoint", "bootstrap", "--gateway", "demo/wp",
              "--token-file", str(tmp_path / "missing")])
    assert e.value.code == 2
    assert "--token-file" in capsys.readouterr().err


def test_unsupported_target_kind_is_named_and_binds_nothing():
    store = ObjectStore(CollectorRegistry())
    store.apply([(o, "test") for o in objects("127.0.5", "10.96.5.5")])
    store.apply([({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                   "metadata": {"name": "odd", "namespace": "demo"},
                   "spec": {"targetRefs": [{"kind": "HTTPRoute",
                                            "group": "gateway.networking.k8s.io",
                                            "name": "r"}], "action": "DENY"}}, "test")])
    index = AmbientIndex(store, Mesh(), CollectorRegistry())
    index.start()
    model = build_model(store, index, "demo", "wp")
    assert model.found and [s.hostname for s in model.services] == ["web.demo.svc.cluster.local"]
    assert model.policies == []
    assert any("spec.targetRefs[0]" in p and "'HTTPRoute'" in p for p in model.problems)
    built, problems = resources.build(model)
    assert set(built[resources.LISTENER_TYPE]) == {"connect_terminate", "main_internal",
                                                   "connect_originate"}
    ep = built[resources.ENDPOINT_TYPE]["inbound-vip|80|http|web.demo.svc.cluster.local"]
    assert [e.endpoint.address.envoy_internal_address.endpoint_id
            for e in ep.endpoints[0].lb_endpoints] == ["127.0.5.2:8080"]
