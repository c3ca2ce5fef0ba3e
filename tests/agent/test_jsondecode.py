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


def test_a_hex_digest_with_19_decimal_digits_keeps_the_fast_decoder():
    """A real pod's status holds an image digest and a container ID per container; at
    1,000 pods some hex strings hold 19 decimal digits in a row, and counting those sent
    the whole pods LIST to the standard library's decoder. A run inside a string (after
    ``sha256:``, a letter, ``/`` or a ``-`` in a name) is not an integer."""
    digest = "sha256:1234567890123456789abcdef" + "0" * 32
    pod = {"status": {"containerStatuses": [{
        "imageID": f"registry.local/app@{digest}",
        "containerID": "containerd://ab1234567890123456789ef",
        "name": "pod-1234567890123456789", "image": digest}]}}
    for separators in ((",", ":"), (", ", ": ")):
        doc = json.dumps(pod, separators=separators).encode()
        assert not jsondecode.may_hold_big_integer(doc)
        assert jsondecode.loads(doc) == pod


def test_every_long_integer_is_found_wherever_json_puts_it():
    """No document holding an integer of 19+ digits may reach orjson (it would round it):
    integers of 17-40 digits, signed, in arrays, as values after keys, first in the
    document, with compact, spaced and indented separators, beside digit runs inside
    strings; each decodes exactly, as ``int``."""
    import random
    rnd = random.Random(28)
    for _ in range(400):
        n = rnd.choice([1, -1]) * rnd.randrange(10 ** rnd.randint(16, 39), 10 ** 40)
        doc_obj = rnd.choice([
            n, [n], [1, n], {"a": n}, {"a": "x1234567890123456789", "b": [n, 0]},
            {"image": "sha256:1234567890123456789ab", "n": {"deep": [n]}}])
        text = json.dumps(doc_obj, indent=rnd.choice([None, 0, 2]),
                          separators=rnd.choice([None, (",", ":"), (" , ", " : ")]))
        raw = text.encode()
        if len(str(abs(n))) >= 19:
            assert jsondecode.may_hold_big_integer(raw), text
        got = jsondecode.loads(raw)
        assert got == json.loads(raw) == doc_obj
        assert repr(got) == repr(doc_obj)  # ints stay ints
