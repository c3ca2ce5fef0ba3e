"""Issue 27: ``cni install`` and ``run --cni-manage-config`` replaced a foreign
``istio-cni`` binary (upstream's ELF plugin) and conflist entry (another agent's) without
a word. Now both refuse, one line naming what is there, nothing changed; ``--force``
(``cni_force_install``) replaces it. A CNI dir that can't be created names its setting."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from agent.core.config import ConfigError
from agent.core.lifecycle import AgentContext
from cni import install
from tests.cni.conftest import make_config
from tests.cni.test_install import DATA, cli, snapshot

ELF = b"\x7fELF\x02\x01\x01" + b"\0" * 64  # the head of upstream's Go plugin binary


@pytest.fixture
def dirs(tmp_path):
    conf, bin_ = tmp_path / "net.d", tmp_path / "bin"
    conf.mkdir()
    bin_.mkdir()
    shutil.copy(os.path.join(DATA, "bridge.conf"), conf / "10-bridge.conf")
    return conf, bin_


def test_cli_refuses_a_foreign_binary_unless_forced(dirs, tmp_path):
    conf, bin_ = dirs
    (bin_ / "istio-cni").write_bytes(ELF)
    before = snapshot(conf), snapshot(bin_)
    flags = ["--conf-dir", str(conf), "--bin-dir", str(bin_), "--state-dir", str(tmp_path / "s")]
    r = cli("install", *flags)
    assert r.returncode == 1, r.stdout
    assert len(r.stderr.strip().splitlines()) == 1
    assert "upstream istio-cni?" in r.stderr and "--force" in r.stderr
    assert (snapshot(conf), snapshot(bin_)) == before
    r = cli("install", "--force", *flags)
    assert r.returncode == 0, r.stderr
    assert (bin_ / "istio-cni").read_bytes() != ELF


def test_cli_refuses_another_agents_entry(dirs, tmp_path):
    conf, bin_ = dirs
    flags = ["--conf-dir", str(conf), "--bin-dir", str(bin_)]
    assert cli("install", *flags, "--state-dir", str(tmp_path / "other")).returncode == 0
    before = snapshot(conf)
    r = cli("install", *flags, "--state-dir", str(tmp_path / "mine"))
    assert r.returncode == 1 and "another agent's" in r.stderr
    assert snapshot(conf) == before
    # the same agent again is no foreigner
    assert cli("install", *flags, "--state-dir", str(tmp_path / "other")).returncode == 0


async def test_component_refuses_to_start_over_a_foreign_plugin(dirs, state_dir):
    conf, bin_ = dirs
    (bin_ / "istio-cni").write_bytes(ELF)
    before = snapshot(conf), snapshot(bin_)
    ctx = AgentContext(make_config(state_dir, cni_manage_config=True, cni_conf_dir=str(conf),
                                   cni_bin_dir=str(bin_)))
    with pytest.raises(ConfigError, match="refusing to replace another istio-cni") as e:
        await install.build(ctx).start()
    assert e.value.setting == "cni_force_install"
    assert (snapshot(conf), snapshot(bin_)) == before
    ctx = AgentContext(make_config(state_dir, cni_manage_config=True, cni_conf_dir=str(conf),
                                   cni_bin_dir=str(bin_), cni_force_install=True))
    component = install.build(ctx)
    await component.start()
    try:
        assert component.installer.check() is None
        assert json.loads((conf / "10-bridge.conflist").read_text())["plugins"][-1][
            "type"] == "istio-cni"
    finally:
        await component.stop(1.0)


async def test_component_names_a_bin_dir_it_cannot_create(dirs, state_dir, tmp_path):
    conf, _ = dirs
    blocker = tmp_path / "file"
    blocker.write_text("")
    ctx = AgentContext(make_config(state_dir, cni_manage_config=True, cni_conf_dir=str(conf),
                                   cni_bin_dir=str(blocker / "bin")))
    with pytest.raises(ConfigError, match="cannot create it") as e:
        await install.build(ctx).start()
    assert e.value.setting == "cni_bin_dir"
