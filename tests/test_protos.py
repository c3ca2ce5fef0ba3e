"""Wire-contract protobufs: drift check, ZDS byte vectors, field numbers.

Spec: ``docs/zds.md`` (ZDS), ``docs/xds.md`` (workload,
authorization), ``docs/sds.md`` (Istio CA).
"""

from __future__ import annotations

import filecmp
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from agent.sds import ca_pb2, ca_pb2_grpc  # noqa: E402
from ambient import authorization_pb2, workload_pb2  # noqa: E402
from zds import zds_pb2  # noqa: E402


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location(
        "gen_protos", REPO_ROOT / "scripts" / "gen_protos.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- drift


def test_generated_modules_match_protos(tmp_path):
    gen = _load_gen_protos()
    gen.generate(tmp_path)
    differing = []
    for rel in gen.generated_files():
        committed = REPO_ROOT / rel
        fresh = tmp_path / rel
        if not committed.exists() or not filecmp.cmp(committed, fresh, shallow=False):
            differing.append(rel)
    assert not differing, (
        f"generated protobuf modules are stale or missing: {', '.join(differing)}; "
        "run `python scripts/gen_protos.py` from the repo root and commit the result"
    )


# ---------------------------------------- ZDS vectors (``docs/zds.md``)

ZDS_VECTORS = [
    ("hello", zds_pb2.ZdsHello(version=zds_pb2.V1), "0801"),
    (
        "snapshot_sent",
        zds_pb2.WorkloadRequest(snapshot_sent=zds_pb2.SnapshotSent()),
        "1a00",
    ),
    ("ack", zds_pb2.WorkloadResponse(ack=zds_pb2.Ack(error="")), "0a00"),
    ("del", zds_pb2.WorkloadRequest(**{"del": zds_pb2.DelWorkload(uid="x")}), "1203120178"),
    ("keep", zds_pb2.WorkloadRequest(keep=zds_pb2.KeepWorkload(uid="x")), "2a030a0178"),
    (
        "add",
        zds_pb2.WorkloadRequest(
            add=zds_pb2.AddWorkload(
                uid="u",
                workload_info=zds_pb2.WorkloadInfo(
                    name="n", namespace="s", service_account="a"
                ),
            )
        ),
        "0a0e0a017512090a016e1201731a0161",
    ),
]


@pytest.mark.parametrize("name,msg,hexbytes", ZDS_VECTORS, ids=[v[0] for v in ZDS_VECTORS])
def test_zds_vectors_encode(name, msg, hexbytes):
    assert msg.SerializeToString() == bytes.fromhex(hexbytes)


@pytest.mark.parametrize("name,msg,hexbytes", ZDS_VECTORS, ids=[v[0] for v in ZDS_VECTORS])
def test_zds_vectors_decode(name, msg, hexbytes):
    decoded = type(msg).FromString(bytes.fromhex(hexbytes))
    assert decoded == msg
    if isinstance(msg, zds_pb2.WorkloadRequest):
        assert decoded.WhichOneof("payload") == msg.WhichOneof("payload")
    if isinstance(msg, zds_pb2.WorkloadResponse):
        assert decoded.WhichOneof("payload") == "ack"
        assert decoded.ack.error == ""


def test_zds_field_numbers():
    assert zds_pb2.DelWorkload.DESCRIPTOR.fields_by_name["uid"].number == 2
    req = zds_pb2.WorkloadRequest.DESCRIPTOR
    assert {f.name: f.number for f in req.oneofs_by_name["payload"].fields} == {
        "add": 1, "keep": 5, "del": 2, "snapshot_sent": 3,
    }
    assert zds_pb2.Version.Value("NOT_USED") == 0 and zds_pb2.Version.Value("V1") == 1
    assert zds_pb2.WorkloadInfo.DESCRIPTOR.full_name == "istio.workload.zds.WorkloadInfo"
    assert "trust_domain" not in zds_pb2.WorkloadInfo.DESCRIPTOR.fields_by_name


# ---------------------------------------- workload (``docs/xds.md``)


def _numbers(message_cls):
    return {f.name: f.number for f in message_cls.DESCRIPTOR.fields}


def test_address_oneof():
    d = workload_pb2.Address.DESCRIPTOR
    assert d.full_name == "istio.workload.Address"
    assert {f.name: f.number for f in d.oneofs_by_name["type"].fields} == {
        "workload": 1, "service": 2,
    }


def test_workload_field_numbers():
    n = _numbers(workload_pb2.Workload)
    assert n["uid"] == 20
    assert n["addresses"] == 3
    assert n["hostname"] == 21
    assert n["network_gateway"] == 19
    assert n["services"] == 22
    assert n["authorization_policies"] == 16
    assert n["application_tunnel"] == 23
    assert n["capacity"] == 27
    assert 15 not in n.values()
    capacity = workload_pb2.Workload.DESCRIPTOR.fields_by_name["capacity"]
    assert capacity.message_type.full_name == "google.protobuf.UInt32Value"
    assert workload_pb2.TunnelProtocol.Value("LEGACY_ISTIO_MTLS") == 2
    assert workload_pb2.WorkloadType.Value("POD") == 2


def test_service_and_supporting_field_numbers():
    n = _numbers(workload_pb2.Service)
    assert (n["hostname"], n["waypoint"], n["weighted_waypoints"], n["visibility"]) == (3, 7, 13, 14)
    assert workload_pb2.Service.Visibility.Value("NAMESPACE") == 1
    gw = workload_pb2.GatewayAddress.DESCRIPTOR
    assert {f.name: f.number for f in gw.oneofs_by_name["destination"].fields} == {
        "hostname": 1, "address": 2,
    }
    assert gw.fields_by_name["hbone_mtls_port"].number == 3
    length = workload_pb2.NetworkAddress.DESCRIPTOR.fields_by_name["length"]
    assert length.number == 3 and length.has_presence
    assert workload_pb2.LoadBalancing.Scope.Value("NETWORK") == 6
    assert workload_pb2.LoadBalancing.Mode.Value("PASSTHROUGH") == 3
    assert workload_pb2.LoadBalancing.HealthPolicy.Value("ALLOW_ALL") == 1
    assert workload_pb2.AppProtocol.Value("TLS") == 5


def test_address_round_trip():
    wl = workload_pb2.Workload(
        uid="Kubernetes//Pod/default/foo",
        name="foo",
        namespace="default",
        addresses=[bytes([10, 0, 0, 5])],
        tunnel_protocol=workload_pb2.HBONE,
        waypoint=workload_pb2.GatewayAddress(
            hostname=workload_pb2.NamespacedHostname(namespace="default", hostname="wp.default.svc.cluster.local"),
            hbone_mtls_port=15008,
        ),
        services={"default/foo.default.svc.cluster.local": workload_pb2.PortList(
            ports=[workload_pb2.Port(service_port=80, target_port=8080)]
        )},
        workload_type=workload_pb2.POD,
    )
    wl.capacity.value = 3
    addr = workload_pb2.Address(workload=wl)
    back = workload_pb2.Address.FromString(addr.SerializeToString())
    assert back == addr and back.WhichOneof("type") == "workload"
    assert back.workload.capacity.value == 3
    # uid is field 20, length-delimited: tag (20 << 3 | 2) = varint a2 01
    assert workload_pb2.Workload(uid="x").SerializeToString() == bytes.fromhex("a2010178")

    svc = workload_pb2.Service(
        name="foo", namespace="default", hostname="foo.default.svc.cluster.local",
        addresses=[workload_pb2.NetworkAddress(network="", address=bytes([10, 96, 0, 1]))],
    )
    assert not svc.addresses[0].HasField("length")
    back = workload_pb2.Address.FromString(workload_pb2.Address(service=svc).SerializeToString())
    assert back.WhichOneof("type") == "service" and back.service == svc


# ---------------------------------------- authorization (``docs/xds.md``)


def test_authorization_field_numbers():
    assert authorization_pb2.Authorization.DESCRIPTOR.full_name == "istio.security.Authorization"
    n = _numbers(authorization_pb2.Authorization)
    assert n == {
        "name": 1, "namespace": 2, "scope": 3, "action": 4,
        "groups": 5, "dry_run": 6, "extensions": 7,
    }
    ext = authorization_pb2.Authorization.DESCRIPTOR.fields_by_name["extensions"]
    assert ext.message_type.full_name == "istio.workload.Extension"
    assert _numbers(authorization_pb2.Group) == {"rules": 1}
    assert _numbers(authorization_pb2.Rules) == {"matches": 2}
    m = _numbers(authorization_pb2.Match)
    assert (m["namespaces"], m["not_principals"], m["destination_ports"],
            m["not_service_accounts"], m["extensions"]) == (1, 4, 9, 12, 13)
    assert _numbers(authorization_pb2.ServiceAccountMatch) == {"namespace": 1, "serviceAccount": 2}
    sm = authorization_pb2.StringMatch.DESCRIPTOR
    assert {f.name: f.number for f in sm.oneofs_by_name["match_type"].fields} == {
        "exact": 1, "prefix": 2, "suffix": 3, "presence": 4,
    }
    assert authorization_pb2.Scope.Value("WORKLOAD_SELECTOR") == 2
    assert authorization_pb2.Action.Value("DENY") == 1


def test_authorization_round_trip():
    # STRICT mTLS as ztunnel sees it: deny connections without a peer identity.
    pol = authorization_pb2.Authorization(
        name="converted_peer_authentication_strict",
        namespace="default",
        scope=authorization_pb2.WORKLOAD_SELECTOR,
        action=authorization_pb2.DENY,
        groups=[authorization_pb2.Group(rules=[authorization_pb2.Rules(matches=[
            authorization_pb2.Match(
                not_principals=[authorization_pb2.StringMatch(presence={})],
                source_ips=[authorization_pb2.Address(address=bytes([10, 0, 0, 0]), length=8)],
                destination_ports=[80, 9090],
            )
        ])])],
    )
    back = authorization_pb2.Authorization.FromString(pol.SerializeToString())
    assert back == pol
    sm = back.groups[0].rules[0].matches[0].not_principals[0]
    assert sm.WhichOneof("match_type") == "presence"


# ---------------------------------------- Istio CA (``docs/sds.md``)


def test_ca_messages_and_service():
    req = ca_pb2.IstioCertificateRequest.DESCRIPTOR
    assert req.full_name == "istio.v1.auth.IstioCertificateRequest"
    assert _numbers(ca_pb2.IstioCertificateRequest) == {
        "csr": 1, "validity_duration": 3, "metadata": 4,
    }
    assert req.fields_by_name["metadata"].message_type.full_name == "google.protobuf.Struct"
    assert _numbers(ca_pb2.IstioCertificateResponse) == {"cert_chain": 1}

    msg = ca_pb2.IstioCertificateRequest(csr="-----BEGIN CERTIFICATE REQUEST-----", validity_duration=86400)
    msg.metadata.update({"CertSigner": ""})
    back = ca_pb2.IstioCertificateRequest.FromString(msg.SerializeToString())
    assert back == msg and back.metadata["CertSigner"] == ""

    svc = ca_pb2.DESCRIPTOR.services_by_name["IstioCertificateService"]
    assert svc.full_name == "istio.v1.auth.IstioCertificateService"
    method = svc.methods_by_name["CreateCertificate"]
    assert method.input_type is req
    assert not method.client_streaming and not method.server_streaming
    assert hasattr(ca_pb2_grpc, "IstioCertificateServiceStub")
    assert hasattr(ca_pb2_grpc, "add_IstioCertificateServiceServicer_to_server")


def test_method_path_in_grpc_stubs():
    source = (REPO_ROOT / "agent" / "sds" / "ca_pb2_grpc.py").read_text()
    assert "/istio.v1.auth.IstioCertificateService/CreateCertificate" in source


# --------------------------------------------------------------------------- coexistence with xds-protos


def test_imports_cleanly_with_xds_protos_under_warnings_as_errors():
    code = (
        "import envoy.service.discovery.v3.discovery_pb2\n"
        "import envoy.extensions.transport_sockets.tls.v3.secret_pb2\n"
        "import zds.zds_pb2, ambient.workload_pb2, ambient.authorization_pb2\n"
        "import agent.sds.ca_pb2, agent.sds.ca_pb2_grpc\n"
        "import envoy.service.secret.v3.sds_pb2\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
