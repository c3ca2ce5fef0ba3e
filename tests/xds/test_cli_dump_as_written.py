"""Issue 27: ``xds dump`` says what went wrong in one line with a non-zero exit: an
``--on-demand`` key the server does not hold (it printed ``{}`` and exited 0), and a
``--ca`` file that is not PEM (it printed four gRPC core lines)."""

from __future__ import annotations

import asyncio
import json
import sys

from tests.xds.test_tools import POD_A, ROOT


async def _dump(*args):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "xds", "dump", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_on_demand_miss_is_an_error_line(server):
    rc, out, err = await _dump("--addr", f"127.0.0.1:{server.port}", "--on-demand",
                               "/10.9.9.7", "--timeout", "5")
    assert rc == 1, (out, err)
    assert err.count("\n") == 1 and "--on-demand /10.9.9.7" in err and "no address" in err
    json.loads(out)  # what it did receive is still printed


async def test_on_demand_hit_exits_zero(server):
    rc, out, err = await _dump("--addr", f"127.0.0.1:{server.port}", "--on-demand", POD_A,
                               "--type", "address", "--timeout", "5")
    assert rc == 0, err
    assert POD_A in json.loads(out)["type.googleapis.com/istio.workload.Address"]


async def test_non_pem_ca_is_one_line(tmp_path, server):
    bad = tmp_path / "root.pem"
    bad.write_text("not a certificate\n")
    rc, out, err = await _dump("--addr", f"127.0.0.1:{server.port}", "--ca", str(bad))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and f"--ca {bad}: not a PEM certificate" in err


async def test_help_names_timeout_default():
    rc, out, _ = await _dump("--help")
    assert rc == 0 and "(default 10.0)" in " ".join(out.split())
