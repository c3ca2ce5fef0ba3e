"""The installer on tmp CNI dirs: idempotent bytes, .conf conversion and exact undo, the
CLI, and the agent component repairing the chain when the primary CNI rewrites its file
(real watchfiles)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from agent.core.lifecycle import AgentContext
from cni import conflist, install
from cni.installwatch import CniInstallerComponent
from tests.cni.conftest import make_config

DATA = os.path.join(os.path.dirname(__file__), "testdata")


@pytest.fixture
def dirs(tmp_path):
    conf, bin_ = tmp_path / "net.d", tmp_path / "bin"
    conf.mkdir()
    return conf, bin_


def installer(dirs, **kw):
    return install.Installer(conf_dir=str(dirs[0]), bin_dir=str(dirs[1]),
                             run_dir="/var/run/ambient-agent", exclude_namespaces=["kube-system"],
                             **kw)


def snapshot(d):
    return {p: open(os.path.join(d, p), "rb").read() for p in sorted(os.listdir(d))}


def test_install_is_idempotent_and_uninstall_exact(dirs):
    conf, _ = dirs
    shutil.copy(os.path.join(DATA, "list.conflist"), conf / "10-list.conflist")
    os.chmod(conf / "10-list.conflist", 0o640)
    before = snapshot(conf)
    inst = installer(dirs)
    path = inst.install()
    assert path == str(conf / "10-list.conflist") and inst.check() is None
    first = snapshot(conf)
    assert first[os.path.basename(path)] == open(os.path.join(DATA, "list.conflist.golden"),
                                                 "rb").read()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert inst.install_config() == (path, False)
    inst.install()
    assert snapshot(conf) == first
    assert os.access(inst.binary_path, os.X_OK)
    inst.uninstall()
    assert json.loads(snapshot(conf)["10-list.conflist"]) == json.loads(before["10-list.conflist"])
    assert not os.path.exists(inst.binary_path)


def test_conf_converted_then_restored(dirs):
    conf, _ = dirs
    shutil.copy(os.path.join(DATA, "bridge.conf"), conf / "10-bridge.conf")
    original = json.loads((conf / "10-bridge.conf").read_text())
    inst = installer(dirs)
    assert inst.install() == str(conf / "10-bridge.conflist")
    assert sorted(os.listdir(conf)) == ["10-bridge.conflist"]
    assert inst.check() is None
    inst.uninstall()
    assert sorted(os.listdir(conf)) == ["10-bridge.conf"]
    assert json.loads((conf / "10-bridge.conf").read_text()) == original


def test_no_primary_and_invalid(dirs):
    """A failed install writes nothing (conf dir checked before the launcher is written)
    and its message names each file considered and why it was rejected."""
    with pytest.raises(install.NoPrimaryConfig, match=r"has no \*.conf, \*.conflist or \*.json"):
        installer(dirs).install()
    assert not os.path.exists(dirs[1] / "istio-cni")
    (dirs[0] / "10-x.conflist").write_text('{"name": "x", "plugins": "nope"}')
    (dirs[0] / "20-y.conflist").write_text('{\n  "name": "y",\n  "plugins": [}\n')
    (dirs[0] / "30-z.conf").write_text('{"name": "z"}')
    (dirs[0] / "README").write_text("not a config")
    with pytest.raises(install.NoPrimaryConfig) as err:  # invalid files are skipped
        installer(dirs).install()
    msg = str(err.value)
    assert msg.startswith(f"no valid CNI network config in {dirs[0]}: ")
    assert "10-x.conflist: field 'plugins' is missing, empty or not an array" in msg
    assert "20-y.conflist: invalid JSON at line 3 column 15" in msg
    assert "30-z.conf: field 'type' is missing or empty" in msg
    assert "README" not in msg
    assert not os.path.exists(dirs[1] / "istio-cni")
    assert sorted(os.listdir(dirs[0])) == ["10-x.conflist", "20-y.conflist", "30-z.conf",
                                           "README"]
    with pytest.raises(install.NoPrimaryConfig, match="named 40-w.conflist: no such file"):
        installer(dirs, conf_name="40-w.conflist").install()
    with pytest.raises(conflist.ConflistError, match="20-y.conflist: not JSON"):
        installer(dirs, conf_name="20-y.conflist").install()
    assert not os.path.exists(dirs[1])


def test_cli_install_failure_leaves_nothing(dirs):
    conf, bin_ = dirs
    (conf / "10-x.conflist").write_text('{"name": "x",\n "plugins": [1,]}')
    r = cli("install", "--conf-dir", str(conf), "--bin-dir", str(bin_))
    assert r.returncode == 1
    assert "10-x.conflist: invalid JSON at line 2" in r.stderr, r.stderr
    assert not os.path.exists(bin_)


def test_cli_install_says_it_created_a_missing_bin_dir(dirs, tmp_path):
    """Newuser: a typo in --bin-dir made a new directory silently. It is still made (the
    agent's own installer makes it on a fresh node), and said, once, on stderr."""
    conf, bin_ = dirs
    shutil.copy(os.path.join(DATA, "bridge.conf"), conf / "10-bridge.conf")
    flags = ["--conf-dir", str(conf), "--bin-dir", str(bin_), "--state-dir", str(tmp_path)]
    r = cli("install", *flags)
    assert r.returncode == 0, r.stderr
    assert f"created --bin-dir {bin_}, which did not exist" in r.stderr, r.stderr
    r = cli("install", *flags)
    assert r.returncode == 0 and "created" not in r.stderr, r.stderr
    assert cli("uninstall", *flags).returncode == 0


def cli(*args, env=None, config_file=os.devnull):
    extra = ["--config-file", config_file] if config_file else []
    return subprocess.run([sys.executable, "-m", "agent.cli", "cni", *args, *extra],
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          cwd=os.path.dirname(DATA) + "/../..")


@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_cli_help_lists_only_its_flags(action):
    r = cli(action, "--help", config_file="")
    assert r.returncode == 0, r.stderr
    flags = {w.rstrip(",]") for w in r.stdout.replace("[", " ").split() if w.startswith("--")}
    assert flags == {"--help", "--conf-dir", "--bin-dir", "--conf-name", "--state-dir",
                     "--cni-event-socket", "--exclude-namespaces", "--config-file",
                     "--plugin-bundle"} | ({"--force"} if action == "install" else set())
    assert "MOUNTED_CNI_NET_DIR" in r.stdout  # each flag names its env variable


def test_cli_flag_env_file_precedence(dirs, tmp_path):
    """flag > env > config file > default, for the settings the command uses; env of
    settings it does not use (even invalid) is ignored."""
    conf, bin_ = dirs
    shutil.copy(os.path.join(DATA, "minikube.conf"), conf / "05-minikube.conf")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"cni_conf_dir: {conf}\ncni_bin_dir: {tmp_path / 'file-bin'}\n"
                   f"state_dir: {tmp_path / 'file-state'}\nexclude_namespaces: [a, b]\n")
    env = {"CNI_BIN_DIR": str(bin_), "EXCLUDE_NAMESPACES": "c",
           "AMBIENT_AGENT_XDS_PORT": "not-a-port"}
    r = cli("install", "--state-dir", str(tmp_path / "s"), env=env, config_file=str(cfg))
    assert r.returncode == 0, r.stderr
    entry = json.loads((conf / "05-minikube.conflist").read_text())["plugins"][-1]
    assert entry["cni_agent_run_dir"] == str(tmp_path / "s")  # flag over file
    assert entry["exclude_namespaces"] == ["c"]  # env over file
    assert os.path.exists(bin_ / "istio-cni")  # env over file
    assert not os.path.exists(tmp_path / "file-bin")
    r = cli("uninstall", "--bin-dir", str(tmp_path / "file-bin"), env=env,
            config_file=str(cfg))
    assert r.returncode == 0, r.stderr
    assert os.listdir(conf) == ["05-minikube.conf"]
    assert os.path.exists(bin_ / "istio-cni")  # flag over env: another bin dir was cleaned
    # the event socket's directory is the run dir when given
    r = cli("install", "--cni-event-socket", str(tmp_path / "ev" / "x.sock"), env=env,
            config_file=str(cfg))
    assert r.returncode == 0, r.stderr
    entry = json.loads((conf / "05-minikube.conflist").read_text())["plugins"][-1]
    assert entry["cni_agent_run_dir"] == str(tmp_path / "ev")
    assert cli("uninstall", env=env, config_file=str(cfg)).returncode == 0


def test_cli_conf_name_picks_the_conflist(dirs, tmp_path):
    conf, bin_ = dirs
    shutil.copy(os.path.join(DATA, "minikube.conf"), conf / "05-minikube.conf")
    shutil.copy(os.path.join(DATA, "bridge.conf"), conf / "10-bridge.conf")
    flags = ["--conf-dir", str(conf), "--bin-dir", str(bin_), "--state-dir", str(tmp_path)]
    r = cli("install", "--conf-name", "10-bridge.conf", *flags)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(conf)) == ["05-minikube.conf", "10-bridge.conflist"]
    assert cli("uninstall", "--conf-name", "10-bridge.conf", *flags).returncode == 0
    assert sorted(os.listdir(conf)) == ["05-minikube.conf", "10-bridge.conf"]


def test_cli_bad_config_names_the_setting(dirs, tmp_path):
    r = cli("install", "--conf-dir", str(dirs[0]), config_file=str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "config_file" in r.stderr and "missing.yaml" in r.stderr
    assert "Traceback" not in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("cni_conf_dir: [unclosed\n")
    r = cli("install", config_file=str(bad))
    assert r.returncode == 2 and "config_file" in r.stderr and "malformed YAML" in r.stderr
    assert os.listdir(dirs[0]) == []


def test_cli_install_uninstall(dirs, tmp_path):
    conf, bin_ = dirs
    shutil.copy(os.path.join(DATA, "minikube.conf"), conf / "05-minikube.conf")
    flags = ["--conf-dir", str(conf), "--bin-dir", str(bin_), "--state-dir", str(tmp_path / "s")]
    r = cli("install", *flags)
    assert r.returncode == 0, r.stderr
    assert "05-minikube.conflist" in r.stdout
    entry = json.loads((conf / "05-minikube.conflist").read_text())["plugins"][-1]
    assert entry["cni_agent_run_dir"] == str(tmp_path / "s")
    assert cli("install", *flags).returncode == 0
    r = cli("uninstall", *flags)
    assert r.returncode == 0 and "restored" in r.stdout
    assert os.listdir(conf) == ["05-minikube.conf"] and not os.path.exists(bin_ / "istio-cni")
    r = cli("install", "--conf-dir", str(tmp_path / "empty"), "--bin-dir", str(bin_))
    assert r.returncode == 1 and "no valid CNI network config" in r.stderr


async def wait_for(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_component_installs_repairs_and_uninstalls(dirs, state_dir):
    conf, bin_ = dirs
    ctx = AgentContext(make_config(state_dir, cni_manage_config=True, cni_conf_dir=str(conf),
                                   cni_bin_dir=str(bin_)))
    component = install.build(ctx)
    assert isinstance(component, CniInstallerComponent)
    await component.start()
    try:
        assert component.ready()[0] is False  # no primary CNI config yet
        # the node's CNI writes its config after us: installed as soon as it appears
        shutil.copy(os.path.join(DATA, "bridge.conf"), conf / "10-bridge.conf")
        await wait_for(lambda: component.ready()[0])
        assert os.listdir(conf) == ["10-bridge.conflist"]
        # the primary CNI writes its .conf again (atomic rename, as CNIs do): it sorts
        # before our .conflist, so the runtime would use it unchained until we repair
        tmp = conf / ".tmp-write"
        shutil.copy(os.path.join(DATA, "bridge.conf"), tmp)
        os.rename(tmp, conf / "10-bridge.conf")
        await wait_for(lambda: component.repairs >= 1 and component.installer.check() is None
                       and os.listdir(conf) == ["10-bridge.conflist"])
        # ... or rewrites the chain as a list without us
        plain = conflist.remove(json.loads((conf / "10-bridge.conflist").read_text()))[0]
        tmp.write_text(json.dumps({"cniVersion": "0.4.0", "name": "mynet", "plugins": [plain]}))
        os.rename(tmp, conf / "10-bridge.conflist")
        await wait_for(lambda: component.repairs >= 2 and component.installer.check() is None)
        os.rename(conf / "10-bridge.conflist", tmp)  # back to the converted form for the end
        tmp.write_text(conflist.dumps(conflist.insert(plain, component.installer.entry)).decode())
        os.rename(tmp, conf / "10-bridge.conflist")
        os.unlink(bin_ / "istio-cni")
        await wait_for(lambda: os.path.exists(bin_ / "istio-cni"))
        installed = (conf / "10-bridge.conflist").read_bytes()
    finally:
        await component.stop(2.0)
        ctx.executor.shutdown(wait=False)
    # the plugin stays across the agent's stop (upstream's safe upgrade): pods created
    # while no agent runs still meet istio-cni
    assert os.listdir(conf) == ["10-bridge.conflist"]
    assert (conf / "10-bridge.conflist").read_bytes() == installed
    assert os.access(bin_ / "istio-cni", os.X_OK)
    # the next agent finds it installed: nothing rewritten
    ctx = AgentContext(make_config(state_dir, cni_manage_config=True, cni_conf_dir=str(conf),
                                   cni_bin_dir=str(bin_)))
    component = install.build(ctx)
    await component.start()
    try:
        assert component.ready() == (True, "") and component.repairs == 0
        assert (conf / "10-bridge.conflist").read_bytes() == installed
    finally:
        await component.stop(2.0)
        ctx.executor.shutdown(wait=False)


async def test_component_uninstalls_at_stop_when_safe_upgrade_is_disabled(dirs, state_dir):
    """``ambient_disable_safe_upgrade`` (the node is decommissioned): stop removes the
    launcher and our entry, restoring the primary CNI's own file."""
    conf, bin_ = dirs
    shutil.copy(os.path.join(DATA, "bridge.conf"), conf / "10-bridge.conf")
    ctx = AgentContext(make_config(state_dir, cni_manage_config=True, cni_conf_dir=str(conf),
                                   cni_bin_dir=str(bin_), ambient_disable_safe_upgrade=True))
    component = install.build(ctx)
    await component.start()
    try:
        assert component.ready() == (True, "")
        assert os.listdir(conf) == ["10-bridge.conflist"]
    finally:
        await component.stop(2.0)
        ctx.executor.shutdown(wait=False)
    assert sorted(os.listdir(conf)) == ["10-bridge.conf"]
    assert not os.path.exists(bin_ / "istio-cni")


def test_build_disabled_by_default(state_dir):
    ctx = AgentContext(make_config(state_dir))
    assert install.build(ctx) is None


async def test_component_survives_an_unreadable_launcher_path(dirs, state_dir):
    """A directory where the launcher belongs makes the check itself fail (EISDIR): the
    agent still starts, the component reports the problem, and repairs once it's gone."""
    conf, bin_ = dirs
    shutil.copy(os.path.join(DATA, "bridge.conf"), conf / "10-bridge.conf")
    (bin_ / "istio-cni").mkdir(parents=True)
    ctx = AgentContext(make_config(state_dir, cni_manage_config=True, cni_conf_dir=str(conf),
                                   cni_bin_dir=str(bin_)))
    component = install.build(ctx)
    await component.start()
    try:
        ok, why = component.ready()
        assert ok is False and "istio-cni" in why
        (bin_ / "istio-cni").rmdir()
        await wait_for(lambda: component.ready()[0])
        assert os.access(bin_ / "istio-cni", os.X_OK)
    finally:
        await component.stop(2.0)
        ctx.executor.shutdown(wait=False)
    assert sorted(os.listdir(conf)) == ["10-bridge.conflist"]  # kept at stop
