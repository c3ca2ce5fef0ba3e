"""Access log and stats of a real Envoy waypoint configured by us, as istiod configures
them when meshConfig ``accessLogFile`` is set: the file access log with istiod's default
text (or JSON) format on every chain of ``main_internal``, ``connect_terminate`` logging
only responses >= 400, the listeners only unmatched connections; the ``;``-delimited stat
prefixes and alt stat names, and the Istio bootstrap's stats tags turning them into the
labels an Istio waypoint's ``/stats/prometheus`` carries. Same set-up as
``test_envoy_waypoint`` (our xDS server, CA, the HBONE client and terminator)."""

from __future__ import annotations

import asyncio
import json

import pytest

from ambient.waypoint.resources import AccessLog
from tests.waypoint.test_envoy_waypoint import (  # noqa: F401  (mesh: the fixture)
    config_dump, deny_policy, dump_errors, mesh, nacks, ready, status_of, until)

pytestmark = pytest.mark.envoy

HOST = "web.demo.svc.cluster.local"
CLUSTER = f"inbound-vip|80|http|{HOST}"


def _lines(path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("encoding", ["TEXT", "JSON"])
async def test_access_log_lines_for_allowed_and_denied_requests(mesh, tmp_path, encoding):
    env = mesh
    log = tmp_path / "access.log"
    env["server"].waypoints.access_log = AccessLog(str(log), encoding)
    env["store"].apply([(deny_policy("/denied"), "test")])
    envoy = env["start_envoy"](True)
    await ready(env, envoy)
    assert status_of((await env["get"]("/allowed?q=1", "User-Agent: telemetry-test\r\n"))[1]) \
        == 200
    assert status_of((await env["get"]("/denied"))[1]) == 403

    async def logged():  # Envoy flushes its access log about once a second
        found = [line for line in _lines(log) if "telemetry-test" in line or "/denied" in line]
        return found if len(found) >= 2 else None
    found = await until(logged, 15, "two access log lines")
    assert dump_errors(await config_dump(envoy)) == [] and nacks(env["registry"]) == 0
    if encoding == "JSON":
        entries = [json.loads(line) for line in found]
        ok = next(e for e in entries if e["user_agent"] == "telemetry-test")
        assert (ok["method"], ok["path"], ok["response_code"], ok["protocol"]) == \
            ("GET", "/allowed?q=1", 200, "HTTP/1.1")
        assert ok["upstream_cluster"] == CLUSTER and ok["authority"] == HOST
        assert ok["upstream_host"].endswith(":8080")  # the destination pod, via HBONE
        denied = next(e for e in entries if e["path"] == "/denied")
        assert denied["response_code"] == 403
        assert denied["response_code_details"].startswith("rbac_access_denied")
        assert denied["upstream_cluster"] == CLUSTER
    else:
        ok = next(line for line in found if "telemetry-test" in line)
        # istiod's default format, field by field where this request decides them
        assert '"GET /allowed?q=1 HTTP/1.1" 200 - via_upstream - "-"' in ok
        assert '"telemetry-test" ' in ok and f'"{HOST}"' in ok and f" {CLUSTER} " in ok
        assert ok.startswith("[") and ok.rstrip().endswith(" default")  # route name
        denied = next(line for line in found if "/denied" in line)
        assert '"GET /denied HTTP/1.1" 403 - rbac_access_denied' in denied
    # the CONNECT tunnels themselves were 200: connect_terminate logs >= 400 only, and
    # every connection matched a chain (no NR line from any listener)
    every = _lines(log)
    assert not any('"CONNECT ' in line or '"CONNECT"' in line for line in every), every
    assert not any(" NR " in line or '"NR"' in line for line in every), every


async def test_no_access_log_unless_configured(mesh):
    env = mesh
    envoy = env["start_envoy"](True)
    await ready(env, envoy)
    dump = await config_dump(envoy)
    listeners = [c for c in dump["configs"] if c["@type"].endswith("ListenersConfigDump")]
    assert listeners and "main_internal" in json.dumps(listeners)
    assert "access_log" not in json.dumps(listeners)


async def test_stats_carry_istio_prefixes_and_labels(mesh):
    env = mesh
    env["store"].apply([(deny_policy("/denied"), "test")])
    envoy = env["start_envoy"](True)
    await ready(env, envoy)
    for path in ("/allowed", "/allowed", "/denied"):
        await env["get"](path)

    async def stats() -> str | None:
        status, body = await asyncio.to_thread(envoy.admin, "/stats")
        return body if status == 200 and "inbound_0.0.0.0_80;.rbac.denied: 1" in body else None
    body = await until(stats, 10, "the chain's RBAC denial in /stats")
    values = dict(line.split(": ", 1) for line in body.splitlines() if ": " in line)
    # the HTTP chain of the service port: istiod's ';'-delimited inbound prefix
    assert int(values["http.inbound_0.0.0.0_80;.downstream_rq_2xx"]) >= 2
    assert int(values["http.inbound_0.0.0.0_80;.downstream_rq_4xx"]) >= 1
    # the HBONE side: connect_terminate's HCM, connect_originate's TCP proxy
    assert int(values["http.connect_terminate.downstream_rq_total"]) >= 3
    # (the pod connections are pooled: at least one tunnel)
    assert int(values["tcp.connect_originate.downstream_cx_total"]) >= 1
    # the service cluster's stats under its alt stat name (the cluster name and ';')
    assert int(values[f"cluster.{CLUSTER};.upstream_rq_completed"]) >= 2
    status, prom = await asyncio.to_thread(envoy.admin, "/stats/prometheus")
    assert status == 200
    # Istio's stats tags: the prefixes become labels, as on an Istio waypoint
    rq = [line for line in prom.splitlines() if line.startswith("envoy_http_downstream_rq")]
    assert any('http_conn_manager_prefix="inbound_0.0.0.0_80"' in line for line in rq), rq
    assert any(line.startswith("envoy_cluster_upstream_rq_completed{") and
               f'cluster_name="{CLUSTER}"' in line for line in prom.splitlines())
    assert any(line.startswith("envoy_http_rbac{") and 'authz_enforce_result="denied"' in line
               for line in prom.splitlines())
