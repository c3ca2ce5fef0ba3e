"""agent/core/jsondecode.py answers what ``json.loads`` answers, for what orjson accepts
and for what it refuses (the standard library then decides)."""

from __future__ import annotations

import json

import pytest

from agent.core import jsondecode

POD_EVENT = json.dumps({"type": "MODIFIED", "object": {
    "kind": "Pod", "apiVersion": "v1",
    "metadata": {"name": "pod3", "namespace": "x01", "uid": "0b9c-…", "resourceVersion": "1234",
                 "labels": {"app": "app3", "ünïcødé": "✓"},
                 "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:metadata": {}}}]},
    "spec": {"nodeName": "node-3", "containers": [{"name": "c", "ports": [
        {"name": "http", "containerPort": 8080}]}], "priority": 0, "weight": 0.25},
    "status": {"podIPs": [{"ip": "10.0.0.3"}], "conditions": [
        {"type": "Ready", "status": "True"}], "phase": "Running", "x": None, "y": False}}})

ACCEPTED_BY_BOTH = [
    POD_EVENT.encode(), POD_EVENT, bytearray(POD_EVENT.encode()), memoryview(POD_EVENT.encode()),
    b'{"a": 1, "a": 2}',                        # duplicate keys: the last one wins
    b'[1e308, -0.0, 1.5e-7, 123456789012345678]',
    b'"\\u00e9\\ud83d\\ude00 \\n\\t"',           # escapes, a surrogate pair
    b'{"deep": [[[[[[{"x": []}]]]]]]}',
    b'  {"spaces": true}  \n',
]

ORJSON_DIFFERS = [
    b'{"port": 123456789012345678901234567890}',  # beyond 64 bits: orjson makes it a float
    b'[-9223372036854775809, 18446744073709551616]',
    b'{"digits in a string": "1234567890123456789"}',  # a long run anywhere: json decides
    b'[NaN, Infinity, -Infinity]',
    '\ufeff{"bom": 1}'.encode("utf-8")[3:],      # (no BOM left: a plain document)
    b'"\\ud800"',                                # a lone surrogate escape
    '{"utf16": 1}'.encode("utf-16"),
]


@pytest.mark.parametrize("doc", ACCEPTED_BY_BOTH + ORJSON_DIFFERS)
def test_same_result_as_json(doc):
    want = json.loads(doc if not isinstance(doc, memoryview) else bytes(doc))
    got = jsondecode.loads(doc)
    assert got == want and type(got) is type(want)
    if isinstance(want, list):  # NaN != NaN: compare their text
        assert repr(got) == repr(want)


def test_big_integers_are_kept_exactly():
    assert jsondecode.loads(b'{"port": 123456789012345678901234567890}') == {
        "port": 123456789012345678901234567890}
    got = jsondecode.loads(b'[-9223372036854775809, 18446744073709551615, 9223372036854775807]')
    assert got == [-9223372036854775809, 18446744073709551615, 9223372036854775807]
    assert all(type(x) is int for x in got)


@pytest.mark.parametrize("doc", [b"", b"{", b'{"a": 1,}', b"\xff\xfe{", b'{"a": 1} x', b"nul"])
def test_refused_with_the_standard_librarys_error(doc):
    with pytest.raises(ValueError) as want:
        json.loads(doc)
    with pytest.raises(ValueError) as got:
        jsondecode.loads(doc)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
