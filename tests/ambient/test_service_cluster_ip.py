"""A bad Service address is reported under the field it was given in (a newuser
finding: an invalid spec.clusterIP was reported as 'spec.clusterIPs[0]')."""

from __future__ import annotations

import pytest

from ambient.objects import Mesh, TranslateError
from ambient.translate_service import k8s_service


def service(**spec):
    return {"kind": "Service", "metadata": {"name": "web", "namespace": "demo"},
            "spec": {"ports": [{"port": 80}], **spec}}


def test_bad_cluster_ip_names_its_own_field():
    with pytest.raises(TranslateError, match=r"^field 'spec\.clusterIP' is not an IP address "
                                             r"or CIDR: '10\.0\.0\.x'$"):
        k8s_service(service(clusterIP="10.0.0.x"), Mesh(), None)
    with pytest.raises(TranslateError, match=r"^field 'spec\.clusterIPs\[1\]' "):
        k8s_service(service(clusterIP="10.0.0.1", clusterIPs=["10.0.0.1", "fd00::x"]),
                    Mesh(), None)
    ok = k8s_service(service(clusterIP="10.0.0.1"), Mesh(), None)
    assert ok is not None and [bytes(a.address) for a in ok.proto.addresses] == [
        bytes([10, 0, 0, 1])]
