"""Only root can stop, drain or inspect the agent: real uids against a real status server.

The admin endpoints live on a 0600 Unix socket; loopback TCP answers 403 with a pointer to
it (loopback on a host is every local user and every host-network pod). Each caller is a
subprocess; the non-root ones drop to ``nobody`` (setgid/setuid) before doing anything.
The state dir sits in a world-traversable directory, so only the socket's own mode and the
server's SO_PEERCRED check keep ``nobody`` out.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from functools import lru_cache

import pytest

from tests.status.conftest import running_status

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: setuid to another uid")
NOBODY = 65534

CALLER = r"""
import json, socket, sys, urllib.request, urllib.error
admin, port = sys.argv[1], int(sys.argv[2])
out = {}
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(admin)
    s.sendall(b"GET /debug/components HTTP/1.0\r\nHost: x\r\n\r\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    out["admin"] = data.split(b" ", 2)[1].decode()
    out["admin_body"] = data.partition(b"\r\n\r\n")[2].decode()
except OSError as e:
    out["admin"] = type(e).__name__
for path in ("/quitquitquit", "/drain", "/debug/all"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 method="GET" if path.startswith("/debug") else "POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            out[path] = [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        out[path] = [e.code, e.read().decode()]
print(json.dumps(out))
"""


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _as(uid: int | None):
    def drop():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(uid)
    return drop if uid is not None else None


@lru_cache(maxsize=None)
def python_for(uid: int | None, imports: str = "") -> tuple[str, tuple[tuple[str, str], ...]]:
    """An interpreter (and PYTHONPATH) ``uid`` can run that imports ``imports``: ours, or
    the system one with our sources and site-packages (a venv under /root is not readable
    by nobody). Skips the test when there is none."""
    site = sysconfig.get_paths()["purelib"]
    for exe, extra in ((sys.executable, ()), ("/usr/bin/python3", (("PYTHONPATH", f"{REPO}:{site}"),))):
        if not os.path.exists(exe):
            continue
        try:
            r = subprocess.run([exe, "-c", f"import {imports or 'sys'}"], preexec_fn=_as(uid),
                               env={**os.environ, **dict(extra)}, capture_output=True,
                               cwd="/", timeout=60)
        except OSError:  # e.g. the interpreter itself is not reachable for uid
            continue
        if r.returncode == 0:
            return exe, extra
    pytest.skip(f"no Python uid {uid} can run with {imports or 'the standard library'}")


async def call(server, uid: int | None) -> dict:
    exe, extra = python_for(uid)
    proc = await asyncio.create_subprocess_exec(
        exe, "-c", CALLER, server.admin_socket, str(server.port),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_as(uid), cwd="/",
        env={**os.environ, **dict(extra)})
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def status_cli(server, uid: int | None) -> tuple[int, str, str]:
    exe, extra = python_for(uid, "aiohttp, agent.status.cli")
    proc = await asyncio.create_subprocess_exec(
        exe, "-m", "agent.cli", "status", "--socket", server.admin_socket,
        "-o", "json", stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_as(uid),
        cwd=REPO if uid is None else "/", env={**os.environ, **dict(extra)})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
def open_dir():
    """A world-traversable directory (0755) for the state dir; removed afterwards."""
    path = tempfile.mkdtemp(prefix="ambient-admin-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@ROOT_ONLY
async def test_root_and_nobody(tmp_path, open_dir):
    state = os.path.join(open_dir, "state")
    os.makedirs(state, mode=0o755)
    os.chmod(state, 0o755)
    async with running_status(tmp_path, env={"AMBIENT_AGENT_STATE_DIR": state}) as (ctx, server):
        assert server.admin_socket == os.path.join(state, "admin.sock")
        st = os.stat(server.admin_socket)
        assert (oct(st.st_mode & 0o777), st.st_uid) == ("0o600", 0)

        nobody = await call(server, NOBODY)
        assert nobody["admin"] == "PermissionError"  # the socket's mode
        for path in ("/quitquitquit", "/drain", "/debug/all"):
            code, body = nobody[path]
            assert code == 403 and server.admin_socket in body, (path, code, body)
        code, out, err = await status_cli(server, NOBODY)
        assert code == 1 and "no permission to connect" in err and "root only" in err

        # a socket whose mode was loosened by hand still refuses other uids (SO_PEERCRED)
        os.chmod(server.admin_socket, 0o666)
        loosened = await call(server, NOBODY)
        assert loosened["admin"] == "403" and "for root only" in loosened["admin_body"]
        os.chmod(server.admin_socket, 0o600)
        assert not ctx.shutdown.is_set() and not ctx.draining

        root = await call(server, None)
        assert root["admin"] == "200" and "status" in json.loads(root["admin_body"])
        for path in ("/quitquitquit", "/drain", "/debug/all"):  # TCP: root too, by design
            assert root[path][0] == 403
        assert not ctx.shutdown.is_set()
        code, out, err = await status_cli(server, None)
        assert (code, err) == (0, "") and json.loads(out)["components"]["status"]["ready"]
