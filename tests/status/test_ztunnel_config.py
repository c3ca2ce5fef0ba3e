"""``ambient-agent ztunnel-config``: ztunnel's ``/config_dump`` joined with the agent's view.

No ztunnel binary is needed for most of this: the config dump is written here in the
shape ztunnel's admin server serialises (``src/admin.rs`` ``ConfigDump``: the proxy
state's ``workloads``/``services``/``policies`` as serde's camelCase of
``src/state/workload.rs``/``service.rs``, ``certificates`` of ``CertsDump``, the inpod
handler's ``workloadState``), from the Address resources the agent's real ambient index
serves, plus objects the agent does not serve; a small aiohttp server plays ztunnel's
admin port. The agent side is the real status server with the real index, an
Enrollment's records and the reference ZDS client as ztunnel. Against a real ztunnel
(``AMBIENT_TEST_ZTUNNEL``): tests/peers/test_ztunnel_real.py runs the command on the
demo node, where that ztunnel's only control plane is the agent."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
from contextlib import redirect_stderr, redirect_stdout

import yaml
from aiohttp import web

from agent import cli as agent_cli
from ambient.index import IndexComponent
from cni.enrollment import PodRecord
from tests.status.conftest import running_status, serve_app
from tests.status.test_status_mesh import harness
from tests.zds.helpers import netns_fd, running_client, running_server
from zds import PodInfo


def _ip(raw: bytes) -> str:
    import ipaddress
    return str(ipaddress.ip_address(raw))


def ztunnel_dump(index) -> dict:
    """The config dump a ztunnel fed by ``index`` writes, plus a stray workload, service
    and policy from another control plane, a certificate and connection state."""
    from agent.status.mesh import _enum_name

    workloads, services, policies = [], [], []
    for _, addr in sorted(index.addresses().items()):
        if addr.HasField("workload"):
            w = addr.workload
            workloads.append({
                "workloadIps": [_ip(a) for a in w.addresses],
                "protocol": _enum_name(w, "tunnel_protocol") if w.tunnel_protocol else "TCP",
                "networkMode": "Standard", "uid": w.uid, "name": w.name,
                "namespace": w.namespace, "serviceAccount": w.service_account or "default",
                "node": w.node, "status": "Healthy", "clusterId": w.cluster_id or "Kubernetes",
                "services": sorted(w.services), "capacity": 1})
        elif addr.HasField("service"):
            s = addr.service
            services.append({
                "name": s.name, "namespace": s.namespace, "hostname": s.hostname,
                "vips": [f"{a.network}/{_ip(a.address)}" for a in s.addresses],
                "ports": {str(p.service_port): p.target_port for p in s.ports},
                "endpoints": {}, "ipFamilies": "IPv4"})
    for s in services:  # ztunnel's endpoints: workloads selected by the service
        key = f"{s['namespace']}/{s['hostname']}"
        for w in workloads:
            if key in w["services"]:
                s["endpoints"][w["uid"]] = {"workloadUid": w["uid"], "service": key,
                                            "port": s["ports"]}
    for _, p in sorted(index.authorizations().items()):
        policies.append({"name": p.name, "namespace": p.namespace,
                         "scope": "Namespace", "action": "Allow", "rules": [], "dryRun": False})
    workloads.append({"workloadIps": ["10.9.9.9"], "protocol": "TCP", "networkMode": "Standard",
                      "uid": "Kubernetes//Pod/other/stray", "name": "stray",
                      "namespace": "other", "node": "node-z", "status": "Unhealthy",
                      "clusterId": "Kubernetes", "capacity": 1,
                      "waypoint": {"destination": "shop/cart.shop.svc.domain.suffix",
                                   "hboneMtlsPort": 15008}})
    policies.append({"name": "elsewhere", "namespace": "other", "scope": "Global",
                     "action": "Deny", "rules": [], "dryRun": False})
    return {
        "workloads": workloads, "services": services, "policies": policies,
        "stagedServices": {}, "staticConfig": {"workloads": [], "services": []},
        "version": {"version": "1.0", "gitRevision": "x"}, "config": {"adminAddr": "x"},
        "certificates": [
            {"identity": "spiffe://cluster.local/ns/shop/sa/cart", "state": "Available",
             "certChain": [{"pem": "LS0t", "serialNumber": "255",
                            "validFrom": "2020-01-01T00:00:00Z",
                            "expirationTime": "2999-01-01T00:00:00Z"}],
             "rootCerts": [{"pem": "LS0t", "serialNumber": "4096",
                            "validFrom": "2020-01-01T00:00:00Z",
                            "expirationTime": "2021-01-01T00:00:00Z"}]},
            {"identity": "spiffe://cluster.local/ns/front/sa/web",
             "state": "Unavailable: CA unreachable", "certChain": [], "rootCerts": []}],
        "workloadState": {
            "uid-shop-cart": {
                "state": "Up",
                "connections": {
                    "inbound": [{"src": "10.1.0.6:41000", "originalDst":
                                 "cart.shop.svc.domain.suffix", "actualDst": "10.1.0.5:8080",
                                 "protocol": "HBONE"}],
                    "outbound": [{"src": "10.1.0.5:52000", "originalDst": "10.96.0.10:80",
                                  "actualDst": "10.1.0.6:15008", "protocol": "HBONE"}]},
                "info": {"name": "cart", "namespace": "shop", "trustDomain": "",
                         "serviceAccount": "cart"}}},
    }


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = agent_cli.main(["ztunnel-config", *argv])
    return code, out.getvalue(), err.getvalue()


def rows(out: str) -> list[list[str]]:
    import re
    return [re.split(r"\s{3,}", line.strip()) for line in out.splitlines() if line.strip()]


async def test_views_join_the_agent(tmp_path):
    h = harness()
    h.index.start()
    index = IndexComponent(h.index)
    dump = ztunnel_dump(h.index)
    app = web.Application()

    async def config_dump(request):
        return web.json_response(dump)
    app.router.add_get("/config_dump", config_dump)
    nsfd = netns_fd()
    try:
        async with serve_app(app) as zport, running_server(ztunnel_wait=3) as zds, \
                running_client(zds.path) as client:
            await client.wait_snapshot(timeout=3)
            cart_uid = next(w["uid"] for w in dump["workloads"] if w["name"] == "cart")
            await zds.add(PodInfo("uid-shop-cart", "cart", "shop", "cart", nsfd))
            await client.wait_for_pod("uid-shop-cart", timeout=5)
            async with running_status(tmp_path, components=[index, zds],
                                      enrollment=True) as (ctx, server):
                ctx.components["enrollment"].records = {"uid-shop-cart": PodRecord(
                    "uid-shop-cart", "cart", "shop", netns="/x", ips=["10.1.0.5"],
                    status="enabled")}
                base = ("--ztunnel-admin", f"127.0.0.1:{zport}", "--socket", server.admin_socket)

                async def cli(*argv):
                    return await asyncio.to_thread(run_cli, *argv, *base)

                code, out, err = await cli("workloads")
                assert code == 0, err
                table = rows(out)
                assert table[0] == ["NAMESPACE", "POD NAME", "ADDRESS", "NODE", "WAYPOINT",
                                    "PROTOCOL", "ENROLLED", "XDS", "ZDS"]
                by_name = {r[1]: r for r in table[1:] if len(r) > 2}
                assert by_name["cart"] == ["shop", "cart", "10.1.0.5", "node-a", "None", "HBONE",
                                           "enabled", "yes", "acked"]
                assert by_name["db"][6:] == ["-", "yes", "-"]
                # not from this agent: ztunnel has it from elsewhere; its waypoint resolved
                assert by_name["stray"] == ["other", "stray", "10.9.9.9", "node-z", "cart",
                                            "TCP", "-", "no", "-"]
                assert out.splitlines()[-1].startswith("agent xDS: ")

                code, out, _ = await cli("workloads", "--node", "node-a", "-n", "shop")
                assert [r[1] for r in rows(out)[1:-1]] == ["cart"]

                code, out, _ = await cli("services")
                assert rows(out)[:2] == [
                    ["NAMESPACE", "SERVICE NAME", "SERVICE VIP", "WAYPOINT", "ENDPOINTS", "XDS"],
                    ["shop", "cart", "10.96.0.10", "None", "1/1", "yes"]]

                code, out, _ = await cli("policies")
                assert rows(out)[1:3] == [["other", "elsewhere", "Deny", "Global", "no"],
                                          ["shop", "allow-front", "Allow", "Namespace", "yes"]]

                code, out, _ = await cli("certificates")
                table = rows(out)
                assert table[0][:3] == ["CERTIFICATE NAME", "TYPE", "STATUS"]
                assert table[1] == ["spiffe://cluster.local/ns/shop/sa/cart", "Leaf",
                                    "Available", "true", "ff", "2999-01-01T00:00:00Z",
                                    "2020-01-01T00:00:00Z"]
                assert table[2][1:5] == ["Root", "Available", "false", "1000"]
                assert table[3] == ["spiffe://cluster.local/ns/front/sa/web", "NA",
                                    "Unavailable", "false", "NA", "NA", "NA"]

                code, out, _ = await cli("connections")
                table = rows(out)
                assert table[1] == ["cart.shop", "Inbound", "cart.shop:8080", "db.shop:41000",
                                    "cart.shop.svc.domain.suffix", "HBONE", "enabled"]
                assert table[2] == ["cart.shop", "Outbound", "cart.shop:52000", "db.shop:15008",
                                    "cart.shop.svc.domain.suffix:80", "HBONE", "enabled"]
                code, out, _ = await cli("connections", "--raw", "--direction", "outbound")
                assert rows(out)[1][2:5] == ["10.1.0.5:52000", "10.1.0.6:15008", "10.96.0.10:80"]

                code, out, _ = await cli("workloads", "-o", "json", "-n", "shop")
                doc = json.loads(out)
                cart = next(w for w in doc if w["name"] == "cart")
                assert cart["uid"] == cart_uid and cart["agent"] == {
                    "enrolled": "enabled", "xds": True, "zds_acked": True}
                code, out, _ = await cli("policies", "-o", "yaml")
                assert [p["name"] for p in yaml.safe_load(out)] == ["elsewhere", "allow-front"]

                code, out, _ = await asyncio.to_thread(
                    run_cli, "services", "--no-agent", "--ztunnel-admin", f"127.0.0.1:{zport}",
                    "--socket", str(tmp_path / "nothing.sock"))
                assert code == 0 and rows(out)[0][-1] == "ENDPOINTS"
    finally:
        os.close(nsfd)
        h.index.stop()


async def test_unreachable_and_foreign_documents(tmp_path):
    async def not_a_dump(request):
        return web.json_response(["not", "a", "dump"])

    async def html(request):
        return web.Response(text="<html>", content_type="text/html")
    app = web.Application()
    app.router.add_get("/config_dump", not_a_dump)
    other = web.Application()
    other.router.add_get("/config_dump", html)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, not listening: refused
        async with serve_app(app) as bad, serve_app(other) as htmlport:
            cases = [
                (("workloads", "--ztunnel-admin", f"127.0.0.1:{dead}", "--no-agent"), 1,
                 "no ztunnel admin answering at http://127.0.0.1:"),
                (("workloads", "--ztunnel-admin", f"127.0.0.1:{bad}", "--no-agent"), 1,
                 "is not a ztunnel config dump"),
                (("workloads", "--ztunnel-admin", f"127.0.0.1:{htmlport}", "--no-agent"), 1,
                 "is not JSON"),
                (("workloads", "--ztunnel-admin", f"127.0.0.1:{bad}", "--socket",
                  str(tmp_path / "none.sock")), 1, "is not a ztunnel config dump"),
                (("workloads", "--ztunnel-admin", "a:b:c"), 2, "--ztunnel-admin"),
                (("workloads", "--timeout", "0"), 2, "--timeout"),
                (("workloads", "--address", "nope"), 2, "--address 'nope'"),
            ]
            for argv, want, text in cases:
                code, out, err = await asyncio.to_thread(run_cli, *argv)
                assert (code, out) == (want, ""), (argv, err)
                assert text in err and len(err.splitlines()) == 1, (argv, err)
    # a live ztunnel, no agent: one line naming the socket
    dump = {"workloads": [], "services": [], "policies": []}

    async def empty(request):
        return web.json_response(dump)
    ok = web.Application()
    ok.router.add_get("/config_dump", empty)
    async with serve_app(ok) as zport:
        code, out, err = await asyncio.to_thread(
            run_cli, "services", "--ztunnel-admin", f"127.0.0.1:{zport}",
            "--socket", str(tmp_path / "none.sock"))
        assert code == 1 and out == "" and "no agent answering at" in err
        assert len(err.splitlines()) == 1


async def test_malformed_dump_is_one_line_and_exit_1():
    """A dump whose lists hold non-objects (newuser finding: services/certificates/
    connections crashed with AttributeError): one line saying where, exit 1."""
    views = ("workloads", "services", "policies", "certificates", "connections")
    docs = [  # (dump, the views that must refuse it, the text they say)
        ({"workloads": [], "services": [None], "policies": [], "certificates": [1]},
         views, "services[0] is null, expected an object"),
        ({"workloads": [], "services": [], "policies": [], "certificates": [1]},
         views, "certificates[0] is int, expected an object"),
        ({"workloads": [], "services": [], "policies": [], "workloadState": [1]},
         views, "workloadState is list, expected an object"),
        # deeper than the top-level check: the view that reads it still says one line
        ({"workloads": [], "services": [{"endpoints": [1]}], "policies": []},
         ("services",), "unexpected shape for the services view"),
        ({"workloads": [], "services": [], "policies": [],
          "workloadState": {"u": {"info": {}, "connections": {"inbound": [7]}}}},
         ("connections",), "unexpected shape for the connections view"),
    ]
    for doc, refusing, text in docs:
        async def dump(request, doc=doc):
            return web.json_response(doc)
        app = web.Application()
        app.router.add_get("/config_dump", dump)
        async with serve_app(app) as port:
            for view in refusing:
                code, out, err = await asyncio.to_thread(
                    run_cli, view, "--ztunnel-admin", f"127.0.0.1:{port}", "--no-agent")
                assert (code, out) == (1, ""), (view, doc, err)
                assert text in err and len(err.splitlines()) == 1, (view, err)
