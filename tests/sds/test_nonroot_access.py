"""What the docs publish to non-root clients is reachable by them, and nothing else.

README: the mesh root is "published world-readable" at ``<state dir>/mesh-root/``;
docs/sds.md: ``sds_socket_mode`` 0666 (upstream's) lets Envoy as uid 1337 connect. Both
sit under the state dir, so its mode and the socket directory's decide. Checked as a real
non-root uid (``setpriv``): it reads the mesh root and connects to the SDS socket, and
can neither list the state dir nor read the CA's key. Needs root (to switch uid).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent.core.config import prepare_state_dir
from agent.core.lifecycle import AgentContext
from agent.sds.server import build
from tests.sds.helpers import make_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv to act as another uid")

PROBE = r"""
import os, socket, sys
root, sock, state, key = sys.argv[1:5]
out = []
try:
    open(root).read(); out.append("root:ok")
except OSError as e:
    out.append(f"root:{e.errno}")
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sock); out.append("sds:ok")
except OSError as e:
    out.append(f"sds:{e.errno}")
try:
    os.listdir(state); out.append("list:ok")
except OSError as e:
    out.append(f"list:{e.errno}")
try:
    open(key).read(); out.append("key:ok")
except OSError as e:
    out.append(f"key:{e.errno}")
print(" ".join(out))
"""


def probe_as(uid: int, *paths: str) -> str:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                           sys.executable, "-c", PROBE, *paths], capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


async def test_envoy_uid_reaches_sds_socket_and_anyone_the_mesh_root():
    # under /tmp (world-traversable), as an operator's mkdir -m 0700 or an earlier
    # version of the agent left it
    base = tempfile.mkdtemp(prefix="nu-state-")
    try:
        os.chmod(base, 0o700)
        config = make_config(Path(base), sds_socket_mode="0666")
        prepare_state_dir(config)
        ctx = AgentContext(config)
        sds = ctx.add(build(ctx, None, None))
        await sds.start()
        try:
            keyfiles = [os.path.join(config.ca_dir, n) for n in os.listdir(config.ca_dir)
                        if "key" in n]
            assert keyfiles, os.listdir(config.ca_dir)
            paths = (config.mesh_root_file, config.sds_socket, base, keyfiles[0])
            assert probe_as(1337, *paths) == "root:ok sds:ok list:13 key:13"
            assert probe_as(65534, *paths) == "root:ok sds:ok list:13 key:13"
            assert os.stat(keyfiles[0]).st_mode & 0o777 == 0o600
            assert os.stat(config.ca_dir).st_mode & 0o777 == 0o700
        finally:
            await sds.stop(0)
            ctx.executor.shutdown(wait=False)
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def test_default_socket_mode_keeps_other_uids_out():
    base = tempfile.mkdtemp(prefix="nu-state-")
    try:
        config = make_config(Path(base))
        prepare_state_dir(config)
        ctx = AgentContext(config)
        sds = ctx.add(build(ctx, None, None))
        await sds.start()
        try:
            out = probe_as(1337, config.mesh_root_file, config.sds_socket, base, os.devnull)
            assert out.startswith("root:ok sds:13 list:13"), out
        finally:
            await sds.stop(0)
            ctx.executor.shutdown(wait=False)
    finally:
        shutil.rmtree(base, ignore_errors=True)
