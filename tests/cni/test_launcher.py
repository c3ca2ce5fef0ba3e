"""The plugin launcher the installer writes (a POSIX sh script, cni/install.py): it answers
``CNI_COMMAND=VERSION`` itself and must print exactly what the Python plugin prints, byte
for byte, for every request; everything else reaches the Python plugin unchanged. Also:
the plugin's bytecode cache is hit (as root and as another user), and a result that can't
be written exits 120 even though the plugin skips interpreter finalization."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cni import plugin_request
from cni.install import Installer
from cni.install_plugin import PROJECT_ROOT

PLUGIN_CODE = ("import sys;sys.path.insert(0,%r);from cni.plugin import exit_main;exit_main()"
               % PROJECT_ROOT)
LIBCNI_REQUESTS = [b'{"cniVersion":"1.0.0"}', b'{"cniVersion":"0.4.0"}',
                   b'{"cniVersion":"1.1.0"}\n', b'{"cniVersion": "0.3.1"}', b""]
OTHER_REQUESTS = [
    b"\n", b"   ", b"\n\n", b'{"cniVersion":"9.9.9"}', b'{"cniVersion":""}',
    b'{"cniVersion":"1.0.0","name":"x"}', b'  {"cniVersion":"1.0.0"}  ',
    b'{"cniVersion":"1.0.0"}\n\n', b'{"cniVersion":"1.0.0"', b"not json", b"[]", b"null",
    b"\xff\xfe", b'{"cniVersion":"1.0\\u0041"}', b'{"cniVersion":"a\\"b"}',
    b'{"cniVersion":"1.0.0"}{"cniVersion":"2"}', b'{"cniVersion":"1.0.0"}\n{"x":1}',
    b'{"cniVersion":1}', b'{"cniVersion":"1.0.0 "}', b'{"cniVersion":"x y"}',
    b'{"cniVersion":"\xc3\xa9"}', b'{"a":"b"}', b'{"cniVersion":"1.0.0"}\r\n',
    b'{"cniVersion":"1.0.0"}\nline2\nline3']
IFNAMES = [None, "", "eth0", "net1.100", "a" * 15, "a" * 16, "bad/name", "x:y", ".", "..",
           "tab\there", "\u00e9th0", "-"]


@pytest.fixture(scope="module")
def launchers(tmp_path_factory):
    """(real launcher, launcher whose python does not exist): the second proves which
    requests the shell answers without starting Python."""
    tmp = tmp_path_factory.mktemp("launcher")
    real = Installer(conf_dir=str(tmp / "net.d"), bin_dir=str(tmp / "bin"), run_dir="/nonexistent")
    real.install_binary()
    no_python = Installer(conf_dir=str(tmp / "net.d"), bin_dir=str(tmp / "bin2"),
                          run_dir="/nonexistent", python=str(tmp / "no-such-python"))
    no_python.install_binary()
    return real.binary_path, no_python.binary_path


def version_env(ifname="eth0", **extra):
    env = {"PATH": "/usr/bin:/bin", "CNI_COMMAND": "VERSION", "CNI_PATH": "/usr/lib/cni"}
    if ifname is not None:
        env["CNI_IFNAME"] = ifname
    env.update(extra)
    return env


def run(argv, env, stdin):
    p = subprocess.run(argv, input=stdin, env=env, capture_output=True, timeout=30)
    return p.returncode, p.stdout


def python_plugin(env, stdin, *args):
    return run([sys.executable, "-I", "-S", "-c", PLUGIN_CODE, *args], env, stdin)


@pytest.mark.parametrize("stdin", LIBCNI_REQUESTS + OTHER_REQUESTS)
def test_version_same_bytes_as_python(launchers, stdin):
    env = version_env()
    assert run([launchers[0]], env, stdin) == python_plugin(env, stdin)


@pytest.mark.parametrize("ifname", IFNAMES)
def test_version_same_bytes_as_python_for_ifnames(launchers, ifname):
    env = version_env(ifname)
    for stdin in (b'{"cniVersion":"1.0.0"}', b"garbage"):
        assert run([launchers[0]], env, stdin) == python_plugin(env, stdin), (ifname, stdin)


def test_version_on_a_tty_same_as_python(launchers):
    """A person running the plugin by hand: stdin is a terminal, nothing is read."""
    env = version_env()
    outs = []
    for argv in ([launchers[0]], [sys.executable, "-I", "-S", "-c", PLUGIN_CODE]):
        primary, secondary = os.openpty()
        try:
            p = subprocess.run(argv, stdin=secondary, env=env, capture_output=True, timeout=30)
        finally:
            os.close(primary)
            os.close(secondary)
        outs.append((p.returncode, p.stdout))
    assert outs[0] == outs[1] and outs[0][0] == 0
    assert b'"cniVersion":"%s"' % plugin_request.LATEST_VERSION.encode() in outs[0][1]


@pytest.mark.parametrize("stdin", LIBCNI_REQUESTS)
def test_libcni_version_requests_answered_without_python(launchers, stdin):
    rc, out = run([launchers[1]], version_env(), stdin)
    assert (rc, out) == python_plugin(version_env(), stdin)
    assert rc == 0 and out.endswith(b"]}\n")


def test_everything_else_execs_python_with_args_env_and_stdin(launchers):
    # the launcher whose python is missing fails to exec: proof the shell did not answer
    for env, stdin in ((version_env(), b"not json"), (version_env("bad/name"), b""),
                       (version_env(CNI_COMMAND="ADD"), b"{}")):
        rc, _ = run([launchers[1]], env, stdin)
        assert rc == 127, (env, stdin)
    # arguments reach the plugin (its --help text)
    assert run([launchers[0], "--help"], version_env(), b"") == python_plugin(
        version_env(), b"", "--help")
    # a config the plugin rejects: same CNI error, same exit code
    env = version_env(None, CNI_COMMAND="ADD", CNI_CONTAINERID="c1", CNI_NETNS="/proc/1/ns/net")
    rc, out = run([launchers[0]], env, b'{"cniVersion":"1.0.0"}')
    assert (rc, out) == python_plugin(env, b'{"cniVersion":"1.0.0"}')
    assert rc == 1 and b'"code":4' in out  # CNI_IFNAME missing for ADD


def test_unwritable_result_exits_120(launchers):
    """exit_main skips finalization; a failed flush must still fail the command."""
    with open("/dev/full", "wb") as full:
        p = subprocess.run([launchers[0]], input=b'{"cniVersion":"1.0.0","x":1}',
                           env=version_env(), stdout=full, stderr=subprocess.PIPE, timeout=30)
    assert p.returncode == 120
    assert b"cannot write the result" in p.stderr


def _pyc_hit(user_prefix):
    code = "import sys;sys.path.insert(0,%r);import cni.plugin" % PROJECT_ROOT
    p = subprocess.run([*user_prefix, sys.executable, "-I", "-S", "-v", "-c", code],
                       capture_output=True, text=True, timeout=30, cwd="/")
    cached = os.path.join(PROJECT_ROOT, "cni", "__pycache__",
                          "plugin.%s.pyc" % sys.implementation.cache_tag)
    return "code object from '%s'" % cached in p.stderr, p.stderr[-2000:]


def test_bytecode_cache_hit_as_root_and_as_another_user(launchers):
    """install_binary precompiles; the plugin then loads its .pyc, not the source, also for
    a user who could not write the cache."""
    hit, err = _pyc_hit([])
    assert hit, err
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as another user")
    hit, err = _pyc_hit(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert hit, err
