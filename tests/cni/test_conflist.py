"""Golden-file tests of the conflist cases of ``docs/cni.md`` (inputs and
expected outputs in tests/cni/testdata/; regenerate with UPDATE_GOLDEN=1 and review)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from cni import conflist

DATA = os.path.join(os.path.dirname(__file__), "testdata")
ENTRY = conflist.plugin_entry("/var/run/ambient-agent", ["kube-system"])


def load(name):
    with open(os.path.join(DATA, name), "rb") as f:
        return f.read()


def golden(name, data: bytes):
    path = os.path.join(DATA, name)
    if os.environ.get("UPDATE_GOLDEN"):
        with open(path, "wb") as f:
            f.write(data)
    assert data == load(name), f"differs from {name}"


@pytest.mark.parametrize("src", ["bridge.conf", "list.conflist", "list-with-istio.conflist",
                                 "minikube.conf"])
def test_insert_golden(src):
    out = conflist.dumps(conflist.insert(json.loads(load(src)), ENTRY))
    golden(src + ".golden", out)
    again = conflist.dumps(conflist.insert(json.loads(out), ENTRY))
    assert again == out  # reinstalling gives the same bytes
    assert conflist.chain_problem(json.loads(out), ENTRY) is None


def test_conf_conversion_keeps_version_name_and_every_key():
    original = json.loads(load("bridge.conf"))
    out = conflist.insert(original, ENTRY)
    assert out["cniVersion"] == "0.4.0" and out["name"] == "mynet"
    assert out["plugins"][0] == original
    restored, as_conf = conflist.remove(out)
    assert as_conf and restored == original


@pytest.mark.parametrize("src, error", [("invalid-arr.conflist", "JSON object"),
                                        ("invalid-map.conflist", "plugins")])
def test_insert_rejects_invalid(src, error):
    with pytest.raises(conflist.ConflistError, match=error):
        conflist.insert(json.loads(load(src)), ENTRY)


def test_remove_golden():
    installed = json.loads(load("list-with-istio.conflist.golden"))
    out, as_conf = conflist.remove(installed)
    assert not as_conf
    golden("list-no-istio.conflist", conflist.dumps(out))
    listed = json.loads(load("list.conflist"))
    assert conflist.remove(conflist.insert(listed, ENTRY))[0] == listed


@pytest.mark.parametrize("config, problem", [
    ({"type": "bridge"}, "single-plugin"),
    ({"name": "n", "plugins": [{"type": "bridge"}]}, "missing"),
    ({"name": "n", "plugins": [{"type": "bridge"}, {"type": 3}]}, "string type"),
    ({"name": "n", "plugins": [ENTRY, {"type": "bridge"}]}, "not the last"),
    ({"name": "n", "plugins": [{"type": "bridge"}, {**ENTRY, "cni_agent_run_dir": "/x"}]},
     "differs"),
    ({"name": "n", "plugins": [{"type": "bridge"}, ENTRY, ENTRY]}, "more than once"),
])
def test_chain_problems(config, problem):
    assert problem in conflist.chain_problem(config, ENTRY)


def test_find_primary_skips_invalid_files(tmp_path):
    for name, text in [("00-notes.txt", "x"), ("01-bad.conf", "{not json"),
                       ("02-notype.conf", '{"name": "x"}'),
                       ("03-noname.conflist", '{"plugins": [{"type": "bridge"}]}'),
                       ("04-noplugins.conflist", '{"name": "x", "plugins": []}'),
                       ("05-array.conflist", "[]")]:
        (tmp_path / name).write_text(text)
    assert conflist.find_primary(str(tmp_path)) is None
    shutil.copy(os.path.join(DATA, "list.conflist"), tmp_path / "10-list.conflist")
    shutil.copy(os.path.join(DATA, "bridge.conf"), tmp_path / "20-bridge.conf")
    assert conflist.find_primary(str(tmp_path)).endswith("10-list.conflist")
    assert conflist.find_primary(str(tmp_path), "20-bridge.conf").endswith("20-bridge.conf")
    # a named .conf we already converted is found as its .conflist counterpart
    assert conflist.find_primary(str(tmp_path), "10-list.conf").endswith("10-list.conflist")
    assert conflist.find_primary(str(tmp_path), "99-absent.conflist") is None
    assert conflist.find_primary(str(tmp_path / "nope")) is None


def test_an_invalid_config_passed_over_is_named_in_the_log(tmp_path, caplog):
    """libcni skips a config that does not parse; so do we, but with a WARNING naming the
    file and why (an operator otherwise never learns their 05-*.conflist is broken)."""
    import json as _json
    import logging

    from cni.conflist import find_primary

    (tmp_path / "05-bad.conflist").write_text("{bad")
    (tmp_path / "10-ok.conflist").write_text(_json.dumps(
        {"cniVersion": "1.0.0", "name": "ok", "plugins": [{"type": "bridge"}]}))
    with caplog.at_level(logging.WARNING, logger="cni.conflist"):
        assert find_primary(str(tmp_path)) == str(tmp_path / "10-ok.conflist")
    [record] = [r for r in caplog.records if "05-bad.conflist" in r.getMessage()]
    assert "invalid JSON" in record.getMessage()
