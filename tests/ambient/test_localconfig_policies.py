"""Policies in ztunnel's local-config format never fail open.

ztunnel reads its ``LOCAL_XDS_PATH`` file as one serde ``LocalConfig`` (src/xds.rs:
``Authorization`` and ``LocalConfig`` have ``deny_unknown_fields``; any error loads
nothing). Its ``RbacMatch`` (src/rbac.rs) lacks ``deny_unknown_fields``, so there an unknown
match key is silently ignored. We used to drop just the bad policy entry and load the rest
of the document: a DENY vanished, or the only ALLOW of a namespace vanished and everything
was allowed. Now a document with any bad entry loads nothing (every bad entry named), and
the files source keeps the file's last good version. The decisions are checked with the
port of ztunnel's RBAC in :mod:`tests.ambient.ztunnel_rbac`.
"""

from __future__ import annotations

import asyncio
import logging
import textwrap

import pytest
from prometheus_client import CollectorRegistry

from ambient import localconfig
from ambient.index import AmbientIndex
from ambient.objects import Mesh, TranslateError
from ambient.source_files import DirectorySource
from ambient.store import ObjectStore
from tests.ambient.ztunnel_rbac import Connection, Identity, PolicyStore
from tests.helpers import eventually

DOC = textwrap.dedent("""\
    workloads:
    - uid: cluster1//Pod/default/local
      name: local
      namespace: default
      serviceAccount: default
      workloadIps: ["127.0.0.1"]
      protocol: HBONE
      services: {}
    policies:
    - name: only-ns-a
      namespace: default
      scope: Namespace
      action: Allow
      dryRun: false
      rules:
      - - - namespaces: [!Exact ns-a]
    """)

FROM_A = Connection(("10.0.0.1", 5000), ("127.0.0.1", 80), Identity("cluster.local", "ns-a", "s"))
FROM_B = Connection(("10.0.0.2", 5000), ("127.0.0.1", 80), Identity("cluster.local", "ns-b", "s"))


async def run_blocking(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def decisions(index: AmbientIndex) -> tuple[bool, bool]:
    store = PolicyStore(index.authorizations().values())
    return (store.assert_rbac("default", [], FROM_A), store.assert_rbac("default", [], FROM_B))


@pytest.mark.parametrize("bad, field", [
    ({"namespaces": [], "sourceIp": ["10.0.0.0/8"]}, "sourceIp"),
    ({"sourceIps": ["ten.zero.zero.zero/8"]}, "sourceIps[0]"),
    ({"destinationPorts": [70000]}, "destinationPorts[0]"),
    ({"serviceAccounts": ["default/sa"]}, "serviceAccounts[0]"),
    ({"principals": [{"Regex": ".*"}]}, "principals[0]"),
    ({"namespaces": "ns-a"}, "namespaces"),
])
def test_bad_match_rejects_the_whole_document(bad, field):
    doc = {"workloads": [{"uid": "w", "namespace": "default", "workloadIps": ["127.0.0.1"],
                          "services": {}}],
           "policies": [{"name": "p", "namespace": "default", "scope": "Namespace",
                         "action": "Allow", "dryRun": False, "rules": [[[bad]]]}]}
    rows = localconfig.to_objects(doc)
    assert [obj for obj, _, _ in rows] == [None]  # the workload is not loaded either
    (_, label, error), = rows
    assert label == "policies[0]" and f"policies[0].rules[0][0][0].{field}" in error


def test_policy_shape_errors_are_named():
    base = {"name": "p", "namespace": "default", "scope": "Namespace", "action": "Deny",
            "dryRun": False, "rules": []}
    with pytest.raises(TranslateError, match="unknown policy field.*'actions'"):
        localconfig.policy({**base, "actions": "Deny"})
    with pytest.raises(TranslateError, match=r"rules\[0\]' must be a list of clauses"):
        localconfig.policy({**base, "rules": [None]})
    with pytest.raises(TranslateError, match=r"rules\[0\]\[0\]' must be a list of matches"):
        localconfig.policy({**base, "rules": [[{"namespaces": []}]]})
    ok = localconfig.policy({**base, "rules": [[[{"notDestinationPorts": [9999],
                                                  "principals": [localconfig.Tagged(
                                                      tag="Presence", value=[], node="sequence",
                                                      plain_empty=False)]}]]]})
    assert list(ok.groups[0].rules[0].matches[0].not_destination_ports) == [9999]


@pytest.mark.asyncio
async def test_unknown_match_key_never_allows_what_the_file_denied(tmp_path, caplog):
    registry = CollectorRegistry()
    store = ObjectStore(registry)
    f = tmp_path / "local.yaml"
    f.write_text(DOC)
    src = DirectorySource(store, str(tmp_path), run_blocking, debounce_ms=10,
                          registry=registry)
    index = AmbientIndex(store, Mesh(cluster_id="c"), registry)
    try:
        await src.start()
        index.start()
        assert decisions(index) == (True, False)
        caplog.set_level(logging.WARNING)
        # a typo'd key next to the real one: dropping the policy allowed ns-b
        f.write_text(DOC.replace("- - - namespaces: [!Exact ns-a]",
                                 "- - - namespaces: [!Exact ns-a]\n        sourceIp: [x]"))
        await eventually(lambda: registry.get_sample_value(
            "ambient_agent_config_file_errors_total", {"reason": "local-config"}) == 1)
        assert decisions(index) == (True, False)  # the last good policy is still there
        assert "unknown match field 'policies[0].rules[0][0][0].sourceIp'" in caplog.text
        assert "rejected whole" in caplog.text and "keeping its 2 objects" in caplog.text
        assert index.address("cluster1//Pod/default/local") is not None
    finally:
        await src.stop()
        index.stop()
