"""``cleanup`` finds the plugin where ``cni install`` put it (newuser finding 6): after
``cni install --conf-dir X --bin-dir Y``, a cleanup not given those dirs left istio-cni
chained (its pods then held). The install records its dirs in the state dir; cleanup
reads them. Real CLI calls on tmp dirs; host rules looked for in a scratch netns (never
the host's); needs root (cleanup refuses otherwise)."""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout

import pytest
from pyroute2 import netns as pr_netns

from agent import cli as agent_cli
from cni.install import RECORD_NAME
from tests.netns.toolkit import unique

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cleanup runs as root only")

PRIMARY = {"cniVersion": "1.0.0", "name": "podman",
           "plugins": [{"type": "bridge", "bridge": "cni0"}]}


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = agent_cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def scratch_netns():
    name = unique("tcr")
    pr_netns.create(name)
    try:
        yield f"/var/run/netns/{name}"
    finally:
        pr_netns.remove(name)


def test_cleanup_removes_the_recorded_install(tmp_path, scratch_netns):
    state, conf, bindir = tmp_path / "state", tmp_path / "nu-cni" / "net.d", tmp_path / "nu-cni" / "bin"
    conf.mkdir(parents=True)
    (conf / "10-podman.conflist").write_text(json.dumps(PRIMARY))
    none = tmp_path / "none.yaml"
    none.write_text("")
    code, out, err = cli("cni", "install", "--conf-dir", str(conf), "--bin-dir", str(bindir),
                         "--state-dir", str(state), "--config-file", str(none))
    assert code == 0, err
    assert json.loads((state / RECORD_NAME).read_text())["installs"][0]["conf_dir"] == str(conf)
    # cleanup's own settings name other (empty) CNI dirs, as its defaults would
    other = tmp_path / "default-cni"
    argv = ("cleanup", "--state-dir", str(state), "--config-file", str(none),
            "--cni-conf-dir", str(other / "net.d"), "--cni-bin-dir", str(other / "bin"),
            "--host-rules-netns", scratch_netns, "--ambient-ipv6", "false",
            "--ztunnel-uds-address", str(tmp_path / "zds.sock"),
            "--admin-socket", str(state / "admin.sock"))
    code, out, err = cli(*argv, "--dry-run")
    assert code == 0, err
    assert f"would remove istio-cni from {conf / '10-podman.conflist'}" in out, out
    assert f"would remove {bindir / 'istio-cni'}" in out, out
    assert f"would remove state {state / RECORD_NAME}" in out, out
    code, out, err = cli(*argv)
    assert code == 0, (out, err)
    assert [p["type"] for p in json.loads((conf / "10-podman.conflist").read_text())[
        "plugins"]] == ["bridge"]
    assert not (bindir / "istio-cni").exists() and not (state / RECORD_NAME).exists()
    assert cli(*argv) == (0, "nothing to clean up\n", "")


def test_uninstall_forgets_the_record(tmp_path):
    state, conf, bindir = tmp_path / "state", tmp_path / "net.d", tmp_path / "bin"
    conf.mkdir()
    (conf / "10-podman.conflist").write_text(json.dumps(PRIMARY))
    none = tmp_path / "none.yaml"
    none.write_text("")
    common = ("--conf-dir", str(conf), "--bin-dir", str(bindir), "--state-dir", str(state),
              "--config-file", str(none))
    assert cli("cni", "install", *common)[0] == 0
    assert (state / RECORD_NAME).exists()
    assert cli("cni", "uninstall", *common)[0] == 0
    assert not (state / RECORD_NAME).exists()
