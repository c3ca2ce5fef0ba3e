"""istio-cni's monitoring port (``monitoring_port``, 15014 upstream): ``GET /metrics`` serves
the node-agent families under upstream's names, and only those (plus ``process_*``);
the body passes ``promtool check metrics``; the status port's merged view still has them;
0 turns the listener off; a busy port is one ConfigError naming the setting."""

from __future__ import annotations

import shutil
import socket
import subprocess

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.core.config import ConfigError
from agent.status.monitoring import FAMILIES
from cni.enrollment import metrics as enrollment_metrics
from tests.status.conftest import free_port, running_status
from zds.metrics import ZdsMetrics


async def scrape(port: int, path: str = "/metrics", accept: str = "") -> tuple[int, str, str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}{path}",
                         headers={"Accept": accept} if accept else {}) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.text()


async def test_upstream_names_only_and_promtool_clean(tmp_path):
    port = free_port()
    async with running_status(tmp_path, env={"MONITORING_PORT": str(port)}) as (ctx, server):
        assert server.monitoring_port == port
        ZdsMetrics(ctx.registry).connected.set(1)
        m = enrollment_metrics.of(ctx.registry)
        m.event(None, {"kind": "Pod"})
        m.event({}, {})
        m.repaired.labels("label", "success").inc()
        status, ctype, body = await scrape(port)
        assert status == 200 and ctype.startswith("text/plain")
        names = {f.name for f in text_string_to_metric_families(body)}
        own = names - {n for n in names if n.startswith("process_")}
        assert own <= FAMILIES and {"ztunnel_connected", "nodeagent_reconcile_events",
                                    "istio_cni_repair_pods_repaired"} <= own
        assert 'nodeagent_reconcile_events_total{type="add"} 1.0' in body
        assert 'nodeagent_reconcile_events_total{type="update"} 1.0' in body
        assert "ztunnel_connected 1.0" in body and "process_open_fds" in body
        assert "istio_agent_" not in body and "ambient_agent_" not in body
        promtool = shutil.which("promtool")
        if promtool is None:
            pytest.fail("promtool is not installed (scripts/install-system-deps.sh installs it)")
        check = subprocess.run([promtool, "check", "metrics"], input=body, text=True,
                               capture_output=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        # OpenMetrics when asked, as prometheus-client negotiates it
        status, ctype, om = await scrape(port, accept="application/openmetrics-text")
        assert ctype.startswith("application/openmetrics-text") and om.endswith("# EOF\n")
        # only /metrics; the status port still has the merged view with the same series
        assert (await scrape(port, "/stats/prometheus"))[0] == 404
        _, _, merged = await scrape(server.port, "/stats/prometheus")
        assert 'nodeagent_reconcile_events_total{type="add"} 1.0' in merged
        assert "istio_agent_scrapes_total" in merged


async def test_zero_turns_it_off(tmp_path):
    async with running_status(tmp_path) as (_, server):  # the fixtures' MONITORING_PORT=0
        assert server.monitoring_port == 0 and "monitoring" not in server.sites
        assert server.debug_state()["monitoring_port"] == 0


async def test_busy_port_names_the_setting(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="monitoring_port"):
            async with running_status(tmp_path, env={"MONITORING_PORT": str(port)}):
                pass
