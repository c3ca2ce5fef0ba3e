"""``ambient-agent precheck``: each check's verdict on conditions the test creates (a conf
dir with and without a primary config, a foreign istio-cni binary, a busy port, a live
ZDS socket, module lists), and the command's output and exit code."""

from __future__ import annotations

import io
import json
import os
import socket
from contextlib import redirect_stdout

from agent import cli as agent_cli
from agent import precheck
from agent.core.config import load


def config(tmp_path, **extra):
    conf = tmp_path / "net.d"
    conf.mkdir(exist_ok=True)
    return load({"state_dir": str(tmp_path / "state"), "config_file": os.devnull,
                 "cni_conf_dir": str(conf), "cni_bin_dir": str(tmp_path / "bin"),
                 "ztunnel_uds_address": str(tmp_path / "zt" / "zds.sock"),
                 "status_port": "0", "health_port": "0", "monitoring_port": "0", "xds_port": "0",
                 "xds_tls_port": "0", **extra}, env={})


def primary(tmp_path):
    (tmp_path / "net.d" / "10-bridge.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "bridge"}]}))


def test_modules(tmp_path):
    cfg = config(tmp_path, ambient_ipv6="false")
    lib = tmp_path / "lib"
    rel = lib / os.uname().release / "kernel"
    rel.mkdir(parents=True)
    (lib / os.uname().release / "modules.builtin").write_text("kernel/net/xt_mark.ko\n")
    for m in ("xt_REDIRECT", "xt_connmark", "xt_conntrack", "xt_owner", "xt_tcpudp",
              "xt_multiport", "ip_set_hash_ip"):
        (rel / f"{m}.ko.xz").write_text("")
    mods = tmp_path / "modules"
    mods.write_text("iptable_nat 16384 1 - Live 0x0\niptable_mangle 16384 0 - Live 0x0\n")
    c = precheck.check_modules(cfg, str(mods), str(lib))
    assert c.state == precheck.FAIL and "missing: ip_set " in c.detail
    (rel / "ip_set.ko").write_text("")
    c = precheck.check_modules(cfg, str(mods), str(lib))
    assert c.state == precheck.OK and "2 loaded, 1 built in, 8 loadable" in c.detail
    c = precheck.check_modules(cfg, str(mods), str(tmp_path / "nolib"))
    assert c.state == precheck.WARN and "xt_mark" in c.detail


def test_cni_config_and_foreign_istio_cni(tmp_path):
    cfg = config(tmp_path)
    c = precheck.check_cni_config(cfg)
    assert c.state == precheck.FAIL and "no *.conf" in c.detail
    primary(tmp_path)
    assert precheck.check_cni_config(cfg).state == precheck.OK
    c = precheck.check_istio_cni(cfg)
    # run installs it only with cni_manage_config (off by default): said as it is
    assert c.state == precheck.OK and "ambient-agent cni install" in c.detail, c.detail
    assert "run does not install it" in c.detail
    c = precheck.check_istio_cni(cfg.replace(cni_manage_config=True))
    assert "run installs it" in c.detail, c.detail
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "istio-cni").write_bytes(b"\x7fELF\x02\x01")
    c = precheck.check_istio_cni(cfg)
    assert c.state == precheck.FAIL and "upstream istio-cni" in c.detail


def test_busy_port_and_live_zds_socket(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    zdir = tmp_path / "zt"
    zdir.mkdir()
    zds = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zds.bind(str(zdir / "zds.sock"))
    zds.listen()
    try:
        cfg = config(tmp_path, xds_port=str(busy.getsockname()[1]))
        c = precheck.check_ports(cfg)
        assert c.state == precheck.FAIL and "xds_port" in c.detail
        # who holds it is named (a tester saw FAIL with no holder beside a running agent)
        assert f"held by pid {os.getpid()} " in c.detail, c.detail
        c = precheck.check_zds(cfg)
        assert c.state == precheck.FAIL and "live server" in c.detail
    finally:
        busy.close()
        zds.close()
    assert precheck.check_zds(cfg).state == precheck.OK  # stale socket: ours to replace


def test_command_lines_and_exit_code(tmp_path):
    args = ["precheck", "--state-dir", str(tmp_path / "state"), "--config-file", os.devnull,
            "--cni-conf-dir", str(tmp_path / "net.d"), "--cni-bin-dir", str(tmp_path / "bin"),
            "--ztunnel-uds-address", str(tmp_path / "zds.sock"), "--status-port", "0",
            "--health-port", "0", "--xds-port", "0", "--xds-tls-port", "0"]
    (tmp_path / "net.d").mkdir()
    out = io.StringIO()
    with redirect_stdout(out):
        code = agent_cli.main(args)
    lines = out.getvalue().splitlines()
    assert code == 1
    assert [ln.split()[0] for ln in lines[:-1]] and all(
        ln.split()[0] in ("ok", "warn", "FAIL") for ln in lines[:-1])
    assert any(ln.startswith("FAIL  CNI config") for ln in lines)
    assert lines[-1].endswith("failed: CNI config")
    primary(tmp_path)
    out = io.StringIO()
    with redirect_stdout(out):
        code = agent_cli.main(args)
    text = out.getvalue()
    assert "ok    CNI config" in text
    assert code == (1 if "\nFAIL" in "\n" + text else 0)  # exit code follows the lines
    # the summary counts warnings on their own: "N/N passed" only when every line is ok
    states = [ln.split()[0] for ln in text.splitlines()[:-1]]
    summary = text.splitlines()[-1]
    assert summary.startswith(f"{states.count('ok')}/{len(states)} checks passed"), summary
    if "warn" in states:
        assert f"; {states.count('warn')} with warnings: " in summary, summary


def test_crd_owner_from_installer_metadata():
    """The labels/annotations each installer sets (Istio's base chart templated, its plain
    crd-all.gen.yaml, the Gateway API's release, deploy/crds/)."""
    def crd(labels=None, annotations=None):
        return {"metadata": {"labels": labels or {}, "annotations": annotations or {}}}
    assert precheck.crd_owner(crd({"app.kubernetes.io/part-of": "istio",
                                   "helm.sh/chart": "base-1.28.0"})) == "Istio"
    assert precheck.crd_owner(crd({"app": "istio-pilot", "chart": "istio",
                                   "heritage": "Tiller", "release": "istio"})) == "Istio"
    assert precheck.crd_owner(crd(annotations={
        "gateway.networking.k8s.io/bundle-version": "v1.3.0"})) == "Gateway API"
    assert precheck.crd_owner(crd({"app.kubernetes.io/name": "ambient-agent"})) == \
        "ambient-agent"
    assert precheck.crd_owner(crd()) == "unknown"


def test_istio_crds_not_asked_without_kubernetes(tmp_path):
    c = precheck.check_istio_crds(config(tmp_path))
    assert c.state == precheck.OK and "not asked" in c.detail


def test_istio_crds_unreachable_api_server_is_a_warning(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n"
        f"    server: https://127.0.0.1:{port}\n    insecure-skip-tls-verify: true\n"
        "users:\n- name: u\n  user:\n    token: x\ncontexts:\n- name: c\n  context:\n"
        "    cluster: c\n    user: u\ncurrent-context: c\n")
    c = precheck.check_istio_crds(config(tmp_path, config_source="kubernetes",
                                         kubeconfig=str(kubeconfig)), timeout=2)
    assert c.state == precheck.WARN and "cannot read the CRDs" in c.detail, c


def test_a_port_held_by_the_running_agent_says_so(tmp_path):
    """Beside a running agent its ports are busy: precheck still FAILs them (the agent
    cannot start twice) but names the agent's pid and state dir, read from the lock the
    agent holds (here this process holds it, as ``run`` does, and listens)."""
    from agent.daemon import StateDirLock

    state = tmp_path / "state"
    state.mkdir()
    lock = StateDirLock(state)
    lock.acquire()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        assert precheck.running_agent(str(state)) == os.getpid()
        cfg = config(tmp_path, xds_port=str(busy.getsockname()[1]), state_dir=str(state))
        c = precheck.check_ports(cfg)
        assert c.state == precheck.FAIL
        assert f"held by the running agent, pid {os.getpid()}, of {state}" in c.detail, c.detail
        # its ZDS socket too (newuser: it said "another agent?" beside its own agent)
        zds = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        (tmp_path / "zt").mkdir()
        zds.bind(str(tmp_path / "zt" / "zds.sock"))
        zds.listen()
        try:
            c = precheck.check_zds(cfg)
        finally:
            zds.close()
        assert c.state == precheck.FAIL
        assert f"(the running agent, pid {os.getpid()}, of {state})" in c.detail, c.detail
    finally:
        busy.close()
        lock.release()
    assert precheck.running_agent(str(state)) is None


def test_privileges_and_state_dir(tmp_path):
    """As a plain user precheck blamed the kernel ("load ip_set") where the cause is the
    missing CAP_NET_ADMIN that ``run`` names; and it passed with a state dir ``run``
    cannot create (newuser finding). The capability is read from a status file the test
    writes; the state dir cases are directories the test makes."""
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    got = precheck.check_privileges(str(status))
    assert got.state == precheck.FAIL and "lacks CAP_NET_ADMIN" in got.detail
    status.write_text(f"CapEff:\t{1 << 12:016x}\n")
    assert precheck.check_privileges(str(status)).state == precheck.OK
    got = precheck.check_state_dir(config(tmp_path))
    assert got.state == precheck.OK and f"{tmp_path} writable (creates" in got.detail
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores the mode: a read-only bind mount
            import subprocess
            if subprocess.run(["mount", "--bind", "-o", "ro", str(locked), str(locked)]).returncode:
                import pytest
                pytest.skip("cannot make a read-only bind mount here")
            try:
                got = precheck.check_state_dir(config(tmp_path, state_dir=str(locked / "s")))
                assert got.state == precheck.FAIL and "read-only file system" in got.detail
            finally:
                subprocess.run(["umount", str(locked)], check=True)
        else:
            got = precheck.check_state_dir(config(tmp_path, state_dir=str(locked / "s")))
            assert got.state == precheck.FAIL and "not writable" in got.detail
    finally:
        locked.chmod(0o700)
