"""``ambient-agent status`` against a live status server whose components are the real
ones (ZdsServer with the reference ZDS client as ztunnel, SdsServer with its embedded CA
and a real StreamSecrets stream, XdsServer with the reference delta xDS client over the
tests' in-memory index, Enrollment), so the tables are checked against the shapes their
``debug_state()`` really return. Enrollment is constructed but not started (starting it
installs host iptables rules); its pods are put in its ``records`` as ``enroll()``
leaves them (enabled / failed at a step), since enrolling needs real pod netns, which
tests/netns covers. ``-o json``, unknown shapes and the no-agent error are checked too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re

import grpc
from prometheus_client import CollectorRegistry

from agent import cli as agent_cli
from agent.sds.server import SdsServer
from agent.status import report
from ambient.xds.client import DeltaXdsClient
from ambient.xds.server import XdsServer
from cni.enrollment import PodRecord
from tests.sds.helpers import Stream, executor_runner, make_config as sds_config, request
from tests.status.conftest import FakeComponent, running_status
from tests.xds.fake_index import FakeIndex, pod as xds_pod
from tests.zds.helpers import netns_fd, running_client, running_server
from zds import PodInfo

UID_OK = "0712f71b-9516-4aba-8001-49a36be54a35"
UID_BAD = "fe2cb86e-5489-4d39-9d39-9fd1539563d1"
SPIFFE = "spiffe://cluster.local/ns/shop/sa/cart"


def cli(server, *extra: str) -> tuple[int, str, str]:
    """Run ``ambient-agent status`` in a thread (the server's loop keeps serving)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = agent_cli.main(["status", "--socket", server.admin_socket, *extra])
    return code, out.getvalue(), err.getvalue()


def block(out: str, title: str) -> list[str]:
    """The lines of the section starting with ``title`` up to the next blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def row(lines: list[str], needle: str) -> list[str]:
    """The cells (split on runs of 2+ spaces) of the one line containing ``needle``."""
    (line,) = [ln for ln in lines if needle in ln]
    return re.split(r"\s{2,}", line.strip())


@contextlib.asynccontextmanager
async def real_components(tmp_path, state_dir):
    """Started ZDS, SDS (fixed identity) and xDS servers plus an Enrollment; all stopped."""
    run = executor_runner()
    sds = SdsServer(sds_config(state_dir, service_account="cart", pod_namespace="shop",
                               ecc_signature_algorithm="ECDSA"), run)
    index = FakeIndex()
    index.put(xds_pod("a", ip="10.0.0.1"), xds_pod("b", ip="10.0.0.2"))
    xds = XdsServer(index, address="127.0.0.1", port=0, debounce=0.005, debounce_max=0.05,
                    registry=CollectorRegistry())
    async with running_server(ztunnel_wait=3) as zds:
        await sds.start()
        await xds.start()
        try:
            yield zds, sds, xds
        finally:
            await xds.stop(0.5)
            await sds.stop(0.2)
            run.pool.shutdown(wait=False)


async def test_empty_agent(tmp_path, state_dir):
    async with real_components(tmp_path, state_dir) as (zds, sds, xds):
        async with running_status(tmp_path, [zds, sds, xds], enrollment=True) as (ctx, server):
            code, out, err = await asyncio.to_thread(cli, server)
    assert (code, err) == (0, "")
    assert out.startswith("Components (")
    assert block(out, "Components")[0] == "Components (4/5 ready)"
    assert row(block(out, "Components"), "enrollment") == ["enrollment", "no", "not started"]
    assert block(out, "Enrolled pods") == ["Enrolled pods (0)", "  none"]
    zds_lines = block(out, "ZDS connections")
    assert "pods known 0" in zds_lines[0] and zds_lines[1:] == ["  none connected"]
    sds_lines = block(out, "SDS")
    assert f"mode fixed  identity {SPIFFE}  CA embedded" in sds_lines[0]
    assert "streams 0" in sds_lines[0]
    # fixed mode mints its certificate at start: held, nobody watching
    assert sds_lines[2] == "Certificates (1)" and row(sds_lines[3:], SPIFFE)[3] == "0"
    # the mesh root on the socket line, no raw "key: -" lines for an absent CA port
    assert sds.config.mesh_root_file and f"mesh root {sds.config.mesh_root_file}" in sds_lines[1]
    assert "ca_port_tls" not in out and "mesh_root_file" not in out
    xds_lines = block(out, "xDS clients")
    assert xds_lines[0].startswith("xDS clients (0)  plaintext 127.0.0.1:")
    assert "pushes 0  cached Address 0" in xds_lines[0] and xds_lines[1:] == ["  none connected"]
    assert "{" not in out  # no raw JSON anywhere


async def test_populated_agent(tmp_path, state_dir):
    nsfd = netns_fd()
    async with real_components(tmp_path, state_dir) as (zds, sds, xds):
        async with running_status(tmp_path, [zds, sds, xds], enrollment=True) as (ctx, server):
            enrollment = ctx.components["enrollment"]
            enrollment.records = {
                UID_OK: PodRecord(UID_OK, "client", "demo", netns="/run/netns/pod-a",
                                  ips=["10.77.10.2"], status="enabled",
                                  steps={"rules": True, "zds": True}),
                UID_BAD: PodRecord(UID_BAD, "server", "demo", netns="/proc/4242/ns/net",
                                   ips=["10.77.10.3", "fd00::3"], status="failed",
                                   error="zds: no ztunnel connected within 3s", attempts=2,
                                   steps={"rules": True, "zds": False})}
            await zds.add(PodInfo(UID_OK, "client", "demo", "client", nsfd), wait_ack=False)
            channel = grpc.aio.insecure_channel("unix:" + sds.config.sds_socket)
            xds_client = DeltaXdsClient(f"127.0.0.1:{xds.port}", metadata={"NODE_NAME": "n1"})
            on_demand = DeltaXdsClient(f"127.0.0.1:{xds.port}", node_id="ztunnel~2~od.ns~ns",
                                       metadata={"NODE_NAME": "n1"}, on_demand=True)
            try:
                async with running_client(zds.path) as ztunnel:
                    await ztunnel.wait_snapshot(timeout=3)
                    stream = Stream(channel)
                    await stream.send(request(["default"]))
                    await stream.recv()
                    await xds_client.connect()
                    await xds_client.wait_synced()
                    await on_demand.connect()
                    await on_demand.request("Kubernetes//Pod/default/a")
                    code, out, err = await asyncio.to_thread(cli, server)
                    jcode, jout, _ = await asyncio.to_thread(cli, server, "-o", "json")
                    stream.cancel()
            finally:
                await xds_client.close()
                await on_demand.close()
                await channel.close()
                os.close(nsfd)
    assert (code, err) == (0, "")
    pods = block(out, "Enrolled pods")
    assert pods[0].startswith("Enrolled pods (2)")
    assert pods[1].split() == ["POD", "UID", "STATUS", "IPS", "NETNS", "ATTEMPTS", "ERROR"]
    assert row(pods, "demo/client") == ["demo/client", UID_OK[:8], "enabled", "10.77.10.2",
                                        "pod-a", "0", "-"]
    assert row(pods, "demo/server") == ["demo/server", UID_BAD[:8], "failed",
                                        "10.77.10.3,fd00::3", "/proc/4242/ns/net", "2",
                                        "zds: no ztunnel connected within 3s"]
    zds_lines = block(out, "ZDS connections")
    assert "ZTUNNEL PID" in zds_lines[1] and "PODS HELD" in zds_lines[1]
    conn = row(zds_lines, "(latest)")
    assert conn[0] == "1 (latest)" and conn[1] == str(os.getpid())  # the client is us
    assert re.fullmatch(r"\d\d:\d\d:\d\dZ \(\d+s ago\)", conn[3]), conn
    assert conn[4] == "yes" and conn[-1] == f"1 ({UID_OK[:8]})"
    sds_lines = block(out, "SDS")
    assert "streams 1" in sds_lines[0]
    cert = row(sds_lines[2:], SPIFFE)
    assert re.fullmatch(r"[0-9a-f]{1,8}", cert[1])
    assert re.fullmatch(r"\d\d\d\d-\d\d-\d\d \d\d:\d\d:\d\dZ \(in \d+h\d*m?\)|"
                        r"\d\d:\d\d:\d\dZ \(in \d+h\d*m?\)", cert[2]), cert
    # stream ids come from a process-wide counter: other tests' streams shift them
    assert re.fullmatch(r"1 \(#\d+ default\)", cert[3]), cert[3]
    xds_lines = block(out, "xDS clients")
    assert xds_lines[0].startswith("xDS clients (2)")
    assert xds_lines[1].split() == ["STREAM", "NODE", "ID", "IDENTITY", "TYPE", "MODE", "HELD",
                                    "LAST", "NONCE", "NACKS"]
    wildcard = row(xds_lines, xds_client.node_id)
    assert wildcard[0].endswith("(delta)") and wildcard[2:5] == ["- (plaintext)", "Address",
                                                                 "wildcard"]
    assert wildcard[5] == "2" and wildcard[6] != "-" and wildcard[7] == "0"
    # the next row is the same client's Authorization type, stream/node/identity blank
    auth = xds_lines[xds_lines.index(next(ln for ln in xds_lines if xds_client.node_id in ln)) + 1]
    assert re.split(r"\s{2,}", auth.strip())[:2] == ["Authorization", "wildcard"]
    od = row(xds_lines, "ztunnel~2~od.ns~ns")
    assert od[3:6] == ["Address", "on-demand (1 name)", "1"]
    assert "{" not in out
    # -o json: the /debug/all document unchanged
    doc = json.loads(jout)
    assert jcode == 0 and set(doc["pods"]["pods"]) == {UID_OK, UID_BAD}
    assert doc["zds"]["connections"][0]["holds"] == {UID_OK: "add"}


async def test_unknown_fields_and_shapes_never_crash(tmp_path):
    """A component adding fields (top-level and per row), a section whose shape changed,
    and a section /debug/all gained later: all shown generically, exit 0."""
    pods = FakeComponent("enrollment", {"backend": "nft", "new_top": 7, "pods": {
        UID_OK: {"pod": f"demo/web (uid {UID_OK})", "status": "enabled", "error": "",
                 "netns": "/run/netns/x", "ips": [], "attempts": 0, "priority": "high"}}})
    zds = FakeComponent("zds", [{"ztunnel": "conn-1", "pods": ["u1"]}])  # not its shape
    sds = FakeComponent("sds", RuntimeError("boom"))
    async with running_status(tmp_path, [pods, zds, sds]) as (_, server):
        code, out, err = await asyncio.to_thread(cli, server)
    assert (code, err) == (0, "")
    lines = block(out, "Enrolled pods")
    assert lines[1].split()[-1] == "PRIORITY" and row(lines, "demo/web")[-1] == "high"
    assert "  new_top: 7" in lines
    zds_lines = block(out, "ZDS connections")
    assert "shape not recognized" in zds_lines[0] and "conn-1" in zds_lines[2]
    assert "SDS: error: RuntimeError: boom" in out
    assert "xDS clients: not running in this agent" in out
    assert report.render({"components": {}, "future": {"a": {"b": 1}}}).endswith(
        "future (1)\nKEY  B\na    1")


def test_times_and_cells():
    now = 1_800_000_000.0
    assert report.when(now - 125, now) == "07:57:55Z (2m5s ago)"
    assert report.when(now - 125, now, relative_only=True) == "2m5s ago"
    assert report.when(now + 86400 + 3600, now).endswith("(in 1d1h)")
    assert report.when("2027-01-20T08:00:00+00:00", now) == "2027-01-20 08:00:00Z (in 5d)"
    assert report.when("not a time", now) == "not a time" and report.when(None, now) == "-"
    assert report.duration(59) == "59s" and report.duration(3600) == "1h"
    assert report.held({"a" * 36: "add", "b" * 36: "keep"}) == "2 (aaaaaaaa, bbbbbbbb keep)"
    assert report.held({str(i): "add" for i in range(10)}) == "10"


async def test_no_agent_is_one_line_and_exit_1(capsys, tmp_path):
    code = await asyncio.to_thread(
        agent_cli.main, ["status", "--state-dir", str(tmp_path / "nothing-here")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith(
        f"ambient-agent status: no agent answering at {tmp_path}/nothing-here/admin.sock")
    assert err.count("\n") == 1


def test_enrolled_pods_live_counters_and_annotation_retries():
    """The enrollment's live counters show once non-zero; pods whose annotation write is
    being retried are named (first 8 of the uid)."""
    section = {"backend": "iptables", "pods": {}, "annotation_retries": {},
               "live": {"enrolled_live": 0, "removed_live": 0, "not_found": 0, "scans": 0}}
    assert report.pods(section, 0) == ["Enrolled pods (0)  backend iptables", "  none"]
    section["live"] = {"enrolled_live": 2, "removed_live": 1, "not_found": 0, "scans": 3}
    section["annotation_retries"] = {"0123456789abcdef": "retrying"}
    assert report.pods(section, 0)[2:] == [
        "  live: enrolled live 2, removed live 1, not found 0, scans 3",
        "  annotation writes being retried: 01234567"]
