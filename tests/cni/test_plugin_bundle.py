"""The standalone istio-cni build and its atomic install into a CNI bin dir.

The build is the repo's own script (``scripts/build-cni-plugin.py``, Debian's
``python3.11`` + the plugin module); the plugin runs exec'd as a runtime execs it,
against the real CNI event server (``RecordingEnroller`` answers at once). The chroot
test runs the installed plugin on a root that holds only glibc and busybox (no Python,
nothing of the agent): VERSION (answered by the launcher's shell) and ADD (the bundled
interpreter posting to the agent's socket inside the chroot).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess

import pytest

from cni.install import Installer
from cni.install_plugin import BUNDLE_DIR, BundleError, read_bundle
from cni.plugin_request import SUPPORTED_VERSIONS
from tests.cni.conftest import cni_env, net_conf, run_plugin, start_agent
from tests.cni.standalone import (build_bundle, glibc_busybox_root, missing_build_tools,
                                  missing_chroot_tools, python_files)

pytestmark = pytest.mark.skipif(bool(missing_build_tools()), reason=missing_build_tools())


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    return build_bundle(tmp_path_factory.mktemp("bundle") / "istio-cni")


def test_build_is_reproducible_and_self_contained(bundle, tmp_path):
    again = build_bundle(tmp_path / "istio-cni")
    assert read_bundle(str(again)) == read_bundle(str(bundle))
    for rel in json.loads((bundle / "MANIFEST.json").read_text())["files"]:
        assert (again / rel).read_bytes() == (bundle / rel).read_bytes(), rel
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    assert set(manifest["packages"]) >= {"python3.11-minimal", "libpython3.11-minimal"}
    # the interpreter loads its non-glibc libraries from the bundle
    ldd = subprocess.run(["ldd", str(bundle / "bin" / "python3.11")], capture_output=True,
                         text=True).stdout
    for lib in ("libz.so.1", "libexpat.so.1"):
        line = next(ln for ln in ldd.splitlines() if lib in ln)
        assert str(bundle / "lib") in os.path.realpath(line.split("=>")[1].split()[0]), line


def installer(tmp_path, bundle, **kw) -> Installer:
    return Installer(conf_dir=str(tmp_path / "net.d"), bin_dir=str(tmp_path / "bin"),
                     run_dir=str(tmp_path / "run"), plugin_bundle=str(bundle), **kw)


async def test_installed_bundle_answers_version_and_add(bundle, tmp_path, state_dir):
    inst = installer(tmp_path, bundle)
    assert inst.install_binary()
    bundle_id = read_bundle(str(bundle))[0]
    text = open(inst.binary_path).read()
    assert f"{BUNDLE_DIR}/{bundle_id}/bin/python3.11" in text
    assert sys_python_not_named(text)
    agent = await start_agent(state_dir)
    try:
        # VERSION through the bundled interpreter too (a request shape the shell passes on)
        code, out, err = await run_plugin(inst.binary_path, cni_env("VERSION"),
                                          '{"cniVersion": "0.4.0", "name": "x"}')
        assert (code, out) == (0, {"cniVersion": "0.4.0",
                                   "supportedVersions": list(SUPPORTED_VERSIONS)}), err
        code, out, err = await run_plugin(inst.binary_path, cni_env("ADD"),
                                          net_conf(agent.run_dir, ambient_default=True))
        assert code == 0, (out, err)
        assert out["ips"][0]["address"] == "10.9.8.7/24"
        assert len(agent.enroller.enrolled) == 1
    finally:
        await agent.server.stop(1.0)
    # the agent gone: ADD answers "try again later" (code 11), never a crash
    code, out, err = await run_plugin(inst.binary_path, cni_env("ADD"),
                                      net_conf(agent.run_dir, ambient_default=True))
    assert code == 1 and out["code"] == 11, (out, err)


def sys_python_not_named(text: str) -> bool:
    import sys
    return os.path.realpath(sys.executable) not in text and "/.venv/" not in text


def test_reinstall_keeps_previous_build_and_prunes_older(bundle, tmp_path):
    inst = installer(tmp_path, bundle)
    inst.install_binary()
    assert not inst.install_binary()  # identical: nothing written
    root = tmp_path / "bin" / BUNDLE_DIR
    first = read_bundle(str(bundle))[0]
    ids = [first]
    for n in range(2):  # two newer builds (a plugin change = a new manifest)
        newer = tmp_path / f"newer{n}"
        shutil.copytree(bundle, newer)
        m = json.loads((newer / "MANIFEST.json").read_text())
        m["python"] += f"+test{n}"
        (newer / "MANIFEST.json").write_text(json.dumps(m))
        assert installer(tmp_path, newer).install_binary()
        ids.append(read_bundle(str(newer))[0])
    # current and the one the replaced launcher pointed at; the first is gone
    assert sorted(os.listdir(root)) == sorted(ids[1:])
    assert f"{BUNDLE_DIR}/{ids[2]}/" in open(inst.binary_path).read()
    inst.uninstall()
    assert not (tmp_path / "bin" / "istio-cni").exists() and not root.exists()


def test_damaged_build_is_refused_and_changes_nothing(bundle, tmp_path):
    good = installer(tmp_path, bundle)
    good.install_binary()
    before = open(good.binary_path, "rb").read()
    damaged = tmp_path / "damaged"
    shutil.copytree(bundle, damaged)
    with open(damaged / "lib" / "python311.zip", "r+b") as f:
        f.seek(100)
        f.write(b"\0garbage\0")
    m = json.loads((damaged / "MANIFEST.json").read_text())
    m["python"] += "+damaged"  # a different id, so it is copied (and checked)
    (damaged / "MANIFEST.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="lib/python311.zip differs from its MANIFEST"):
        installer(tmp_path, damaged).install_binary()
    assert open(good.binary_path, "rb").read() == before
    root = tmp_path / "bin" / BUNDLE_DIR
    assert os.listdir(root) == [read_bundle(str(bundle))[0]]  # no temp dir left
    with pytest.raises(BundleError, match="no MANIFEST.json"):
        installer(tmp_path, tmp_path / "nothing").install_binary()


def test_cli_install_with_plugin_bundle(bundle, tmp_path):
    """``cni install`` with a bundle; its install record goes to the test's own state dir
    (without --state-dir it was added to the host's /var/run/ambient-agent record)."""
    conf = tmp_path / "net.d"
    conf.mkdir()
    (conf / "10-br.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": "br", "plugins": [{"type": "bridge"}]}))
    import sys
    env = {"PATH": os.environ["PATH"], "AMBIENT_AGENT_CNI_PLUGIN_BUNDLE": str(bundle)}
    r = subprocess.run([sys.executable, "-m", "agent.cli", "cni", "install", "--conf-dir",
                        str(conf), "--bin-dir", str(tmp_path / "bin"), "--config-file",
                        os.devnull, "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "bin" / BUNDLE_DIR / read_bundle(str(bundle))[0]).is_dir()


CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"


async def chroot_plugin(root, env, stdin: bytes) -> tuple[int, dict | None, str]:
    # a private mount namespace with /proc mounted in the root, as on any node (the
    # dynamic loader resolves the bundle's $ORIGIN RUNPATH through /proc/self/exe);
    # it goes away with the process
    script = f'mount -t proc proc "$1/proc" && exec {CHROOT} "$1" /opt/cni/bin/istio-cni'
    proc = await asyncio.create_subprocess_exec(
        "unshare", "-m", "--propagation", "private", "/bin/sh", "-c", script, "sh",
        str(root), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(stdin), 30)
    text = out.decode().strip()
    return proc.returncode, (json.loads(text) if text else None), err.decode()


async def check_in_glibc_busybox_chroot(bin_dir, root) -> None:
    """Copy the installed ``bin_dir`` to ``<root>/opt/cni/bin`` of a glibc+busybox root and
    run VERSION and ADD there (the agent's socket at ``<root>/run/ambient-agent``)."""
    glibc_busybox_root(root)
    shutil.copytree(bin_dir, root / "opt" / "cni" / "bin", symlinks=True, dirs_exist_ok=True)
    assert python_files(root) == []
    env = {k: v for k, v in cni_env("VERSION").items() if k != "PATH"}
    code, out, err = await chroot_plugin(root, env, b'{"cniVersion":"1.0.0"}')
    assert (code, out["cniVersion"]) == (0, "1.0.0"), err
    agent = await start_agent(root / "run" / "ambient-agent")
    try:
        conf = net_conf("/run/ambient-agent", ambient_default=True)
        code, out, err = await chroot_plugin(root, {k: v for k, v in cni_env().items()
                                                    if k != "PATH"}, json.dumps(conf).encode())
        assert code == 0 and not err, (out, err)
        assert out["ips"][0]["address"] == "10.9.8.7/24"
        assert [e.container_id for e in agent.enroller.enrolled] == ["c0ffee"]
    finally:
        await agent.server.stop(1.0)


@pytest.mark.root
@pytest.mark.skipif(bool(missing_chroot_tools()), reason=missing_chroot_tools())
async def test_installed_plugin_runs_in_glibc_busybox_chroot(bundle, tmp_path, short_root):
    inst = installer(tmp_path, bundle)
    inst.install_binary()
    await check_in_glibc_busybox_chroot(tmp_path / "bin", short_root)


@pytest.fixture
def short_root():
    """A chroot dir with a short path (the agent's socket paths live under it)."""
    import tempfile
    from pathlib import Path
    d = Path(tempfile.mkdtemp(prefix="cr", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_agent_with_a_bad_bundle_keeps_running_and_reports_it(tmp_path, state_dir):
    """cni_manage_config with a cni_plugin_bundle that is not a build: the installer
    component logs and reports the problem (readiness names it), the agent does not die."""
    from cni.installwatch import CniInstallerComponent
    from tests.cni.conftest import make_config
    from agent.core.lifecycle import AgentContext

    conf = tmp_path / "net.d"
    conf.mkdir()
    (conf / "10-br.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": "br", "plugins": [{"type": "bridge"}]}))
    ctx = AgentContext(make_config(state_dir))
    comp = CniInstallerComponent(ctx, installer(tmp_path, tmp_path / "not-a-build"))
    await comp.start()
    try:
        ok, why = comp.ready()
        assert not ok and "no MANIFEST.json" in why, why
    finally:
        await comp.stop(1.0)
        ctx.executor.shutdown(wait=False)


def test_partial_dir_at_the_target_is_replaced(bundle, tmp_path):
    inst = installer(tmp_path, bundle)
    target = tmp_path / "bin" / BUNDLE_DIR / read_bundle(str(bundle))[0]
    target.mkdir(parents=True)
    (target / "junk").write_text("x")  # no MANIFEST.json: not a copy of ours
    inst.install_binary()
    assert (target / "MANIFEST.json").exists() and not (target / "junk").exists()


def test_execs_during_reinstalls_always_get_a_whole_plugin(bundle, tmp_path):
    """Upgrades while the runtime keeps exec'ing: two builds installed in turn, over and
    over, while this thread execs the plugin (a VERSION request shape the shell hands to
    the bundled interpreter) 150 times; every exec answers correctly."""
    import threading

    other = tmp_path / "other"
    shutil.copytree(bundle, other)
    m = json.loads((other / "MANIFEST.json").read_text())
    m["python"] += "+other"
    (other / "MANIFEST.json").write_text(json.dumps(m))
    installers = [installer(tmp_path, bundle), installer(tmp_path, other)]
    installers[0].install_binary()
    installers[1].install_binary()
    failures: list[str] = []
    stop = threading.Event()
    installs = [0]

    def upgrade():
        while not stop.is_set():
            assert installers[installs[0] % 2].install_binary()  # the launcher changes
            installs[0] += 1

    t = threading.Thread(target=upgrade)
    t.start()
    try:
        env = cni_env("VERSION")
        for _ in range(150):
            r = subprocess.run([installers[0].binary_path], capture_output=True, env=env,
                               input=b'{"cniVersion": "0.4.0", "name": "x"}')
            if r.returncode != 0 or json.loads(r.stdout or b"{}").get("cniVersion") != "0.4.0":
                failures.append(f"exit {r.returncode}: {r.stdout!r} {r.stderr!r}")
    finally:
        stop.set()
        t.join()
    assert not failures, failures[:3]
    assert installs[0] >= 30, installs
