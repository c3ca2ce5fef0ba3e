"""The agent's own metrics (issue 17, item 17): the table in docs/status.md lists exactly
the registry of a built agent (names as exposed, types, labels), one prefix for our own
names, and a real ``ambient-agent run`` serves no ``_created`` series unless asked."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from agent.core import config as agent_config
from agent import daemon
from agent.core.lifecycle import AgentContext
from tests.status.conftest import free_port
from tests.agent.test_run_signals import ROOT_ONLY, agent_argv, node_netns, start_agent  # noqa: F401

DOC = Path(__file__).resolve().parents[2] / "docs" / "status.md"
UPSTREAM_PREFIXES = ("istio_agent_", "istio_cni_", "nodeagent_")
UPSTREAM_NAMES = {"ztunnel_connected"}  # istio-cni's, taken as it is


def documented() -> dict[str, tuple[str, set[str]]]:
    text = DOC.read_text()
    block = text.split("<!-- metrics-table -->")[1].split("<!-- /metrics-table -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, typ, labels = cells[0].strip("`"), cells[1], cells[2]
        rows[name] = (typ, set(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def exposed_name(name: str, typ: str) -> str:
    return name + "_total" if typ == "counter" else name


def built_registry(tmp_path) -> AgentContext:
    """Every component built the way the daemon builds them (nothing started), with the
    settings that add optional metrics: an Envoy admin port and the CNI installer."""
    cfg = agent_config.load({"state_dir": str(tmp_path / "state")}, {}).replace(
        envoy_admin_port=15000, cni_manage_config=True, cni_conf_dir=str(tmp_path / "conf"),
        cni_bin_dir=str(tmp_path / "bin"))
    ctx = AgentContext(cfg)
    daemon.build(ctx)
    return ctx


def registered(ctx: AgentContext) -> dict[str, tuple[str, set[str] | None]]:
    labels_of = {getattr(c, "_name", None): set(getattr(c, "_labelnames", ()))
                 for c in ctx.registry._collector_to_names}
    out = {}
    for fam in ctx.registry.collect():
        labels = labels_of.get(fam.name)
        if labels is None and fam.samples:  # a collector: the labels its samples carry
            labels = {k for s in fam.samples for k in s.labels} - {"le"}
        out[exposed_name(fam.name, fam.type)] = (fam.type, labels)
    return out


def test_table_lists_exactly_the_registry(tmp_path):
    ctx = built_registry(tmp_path)
    try:
        have, doc = registered(ctx), documented()
        assert set(have) == set(doc), ("docs/status.md metrics table out of date: missing "
                                       f"{sorted(set(have) - set(doc))}, extra "
                                       f"{sorted(set(doc) - set(have))}")
        for name, (typ, labels) in have.items():
            assert doc[name][0] == typ, f"{name}: registry type {typ}, table {doc[name][0]}"
            if labels is not None:
                assert doc[name][1] == labels, f"{name}: labels {labels}, table {doc[name][1]}"
    finally:
        ctx.executor.shutdown(wait=False)


def test_one_prefix_or_an_upstream_name(tmp_path):
    ctx = built_registry(tmp_path)
    try:
        for name in registered(ctx):
            assert name.startswith(UPSTREAM_PREFIXES + ("ambient_agent_",)) \
                or name in UPSTREAM_NAMES, name
    finally:
        ctx.executor.shutdown(wait=False)


def _scrape(port: str) -> str:
    """The merged metrics, once the status server (started last) listens."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats/prometheus",
                                        timeout=10) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@ROOT_ONLY
@pytest.mark.parametrize("asked", [False, True])
def test_running_agent_has_no_created_series_unless_asked(tmp_path, node_netns, asked):  # noqa: F811
    state = tmp_path / "state"
    argv, env = agent_argv(state, node_netns, monitoring_port=str(free_port()))
    if asked:
        env["AMBIENT_AGENT_METRICS_CREATED_SERIES"] = "true"
    proc = start_agent(argv, env, state)
    port = argv[argv.index("--status-port") + 1]  # after: a retry may have changed it
    try:
        body = _scrape(port)
        assert "istio_agent_scrapes_total" in body and "istio_cni_plugin_requests" in body
        created = [ln for ln in body.splitlines() if re.match(r"^[a-z_]+_created[{ ]", ln)]
        assert bool(created) == asked, created[:3]
        # istio-cni's monitoring port of the real daemon: its families, never _created
        monitoring = argv[argv.index("--monitoring-port") + 1]
        with urllib.request.urlopen(f"http://127.0.0.1:{monitoring}/metrics", timeout=10) as r:
            own = r.read().decode()
        assert "ztunnel_connected" in own and "istio_agent_scrapes_total" not in own
        assert not [ln for ln in own.splitlines() if re.match(r"^[a-z_]+_created[{ ]", ln)]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
