"""Readiness says why: ``/healthz/ready`` (status port) and ``/readyz`` (health port) name
every component not ready with its last error, bounded, escaped and with secrets
redacted; the transitions are logged once per change (ready -> not ready with the reason,
and back), not once per probe; the Kubernetes source's reason names the kinds not
listed and their last error."""

from __future__ import annotations

import logging

import aiohttp
from kubernetes_asyncio import client as kclient

from agent.status.readiness import (MAX_BODY_CHARS, MAX_REASON_CHARS, NotReady,
                                    ReadinessLog, clean_reason, summary)
from ambient.source import ConfigSource
from ambient.source_kube import KubernetesSource
from ambient.store import ObjectStore
from tests.helpers import eventually
from tests.status.conftest import FakeComponent, free_port, running_status

LOGGER = "agent.status.server"


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as c:
        async with c.get(url) as r:
            return r.status, await r.text()


class Broken(FakeComponent):
    def ready(self) -> tuple[bool, str]:
        raise RuntimeError("state lost")


async def test_both_endpoints_name_every_component_not_ready_and_its_error(tmp_path):
    zds = FakeComponent("zds", ok=False, why="no ztunnel connected")
    sds = FakeComponent("sds", ok=False, why="remote CA ca_addr=x:15012 not usable: refused")
    xds = FakeComponent("xds", ok=True)
    async with running_status(tmp_path, [zds, sds, xds, Broken("odd")]) as (_, server):
        status, body = await _get(f"http://127.0.0.1:{server.port}/healthz/ready")
        assert status == 503
        assert body == ("zds: no ztunnel connected; sds: remote CA ca_addr=x:15012 not "
                        "usable: refused; odd: ready() raised RuntimeError: state lost\n")
        status, body = await _get(f"http://127.0.0.1:{server.health_port}/readyz")
        assert (status, body) == (503, "Service Unavailable: zds: no ztunnel connected; sds: "
                                       "remote CA ca_addr=x:15012 not usable: refused; odd: "
                                       "ready() raised RuntimeError: state lost\n")


async def test_reasons_are_escaped_bounded_and_carry_no_secret(tmp_path):
    hostile = FakeComponent("sds", ok=False, why=(
        "CA said 401\nfake: line\r\x1b[31mred\x00 authorization: Bearer abc.DEF-123 "
        "-----BEGIN PRIVATE KEY-----\nMIIEv\n-----END PRIVATE KEY-----"))
    long = FakeComponent("xds", ok=False, why="x" * 5000)
    many = [FakeComponent(f"c{i}", ok=False, why="y" * 250) for i in range(12)]
    async with running_status(tmp_path, [hostile, long, *many]) as (_, server):
        for url in (f"http://127.0.0.1:{server.port}/healthz/ready",
                    f"http://127.0.0.1:{server.health_port}/readyz"):
            status, body = await _get(url)
            assert status == 503
            assert body.endswith("\n") and body.count("\n") == 1  # one line, whatever came in
            assert "abc.DEF-123" not in body and "MIIEv" not in body
            assert "[REDACTED" in body
            assert "\\n" in body and "\\x1b" in body and "\\x00" in body and "\x1b" not in body
            assert "x" * (MAX_REASON_CHARS + 1) not in body
            assert "(4700 more characters)" in body
            assert len(body) < MAX_BODY_CHARS + 400
            # the parts that did not fit are still named
            assert "more not ready: " in body and "c11" in body


def test_summary_and_clean_reason_bounds():
    assert clean_reason("a\u2028b\tc") == "a\\u2028b\\tc"
    assert clean_reason("z" * 10, limit=4) == "zzzz... (6 more characters)"
    parts = [NotReady(f"p{i}", "r" * 100) for i in range(50)]
    text = summary(parts, limit=500)
    assert text.startswith("p0: ") and text.endswith("p49")
    assert len(text.split("; and ")[0]) <= 500
    assert summary([]) == ""


async def test_transitions_logged_once_per_change_not_per_probe(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    source = FakeComponent("config-source", ok=False, why="kubernetes source not synced")
    async with running_status(tmp_path, [source]) as (_, server):
        ready = f"http://127.0.0.1:{server.port}/healthz/ready"
        readyz = f"http://127.0.0.1:{server.health_port}/readyz"

        def lines() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == LOGGER
                    and ("ready" in r.getMessage())]

        for _ in range(5):  # probes on both endpoints: one line for the one state
            assert (await _get(ready))[0] == 503
            assert (await _get(readyz))[0] == 503
        assert [(r.levelname, r.getMessage()) for r in lines()] == [
            ("INFO", "agent not ready: config-source: kubernetes source not synced")]
        source.why = "kubernetes source not synced: Pod: 403 Forbidden"  # same part
        await _get(ready)
        assert len(lines()) == 1
        source.ok = True
        for _ in range(5):
            assert (await _get(ready))[0] == 200
            assert (await _get(readyz))[0] == 200
        assert [r.getMessage() for r in lines()][1:] == ["agent is ready"]  # first time
        source.ok, source.why = False, "kubernetes source not synced: Pod: 401 Unauthorized"
        for _ in range(3):
            await _get(readyz)
            await _get(ready)
        assert [(r.levelname, r.getMessage()) for r in lines()][2:] == [
            ("WARNING", "agent not ready: config-source: kubernetes source not synced: Pod: "
                        "401 Unauthorized")]
        source.ok = True
        await _get(readyz)
        await _get(ready)
        assert [r.getMessage() for r in lines()][3:] == [
            "agent is ready (config-source ready again)"]


async def test_draining_is_logged_once_though_only_the_status_port_checks_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with running_status(tmp_path) as (ctx, server):
        ready = f"http://127.0.0.1:{server.port}/healthz/ready"
        readyz = f"http://127.0.0.1:{server.health_port}/readyz"
        assert (await _get(ready))[0] == 200
        ctx.draining = True
        for _ in range(3):
            assert (await _get(ready)) == (503, "drain: the agent is draining (POST /drain)\n")
            assert (await _get(readyz))[0] == 200  # istio-cni's readiness ignores a drain
        messages = [r.getMessage() for r in caplog.records if r.name == LOGGER
                    and "ready" in r.getMessage()]
        assert messages == ["agent is ready",
                            "agent not ready: drain: the agent is draining (POST /drain)"]


def test_readiness_log_keeps_one_state_across_scopes():
    log = logging.getLogger("test.readiness")
    rl = ReadinessLog(log)
    envoy, zds = NotReady("envoy", "config not received"), NotReady("zds", "no socket")
    assert rl.observe({"envoy", "zds"}, [envoy, zds]) == [
        "agent not ready: envoy: config not received; zds: no socket"]
    # the health port does not check Envoy: its answer says nothing about it
    assert rl.observe({"zds"}, []) == ["ready: zds (still not ready: envoy)"]
    assert rl.observe({"zds"}, []) == []
    assert rl.observe({"envoy", "zds"}, []) == ["agent is ready"]
    assert rl.observe({"envoy", "zds"}, []) == []
    assert rl.observe({"envoy", "zds"}, [zds]) == ["agent not ready: zds: no socket"]
    assert rl.observe({"envoy", "zds"}, []) == ["agent is ready (zds ready again)"]


def test_a_part_first_seen_after_ready_is_not_a_regression(caplog):
    """Newuser: the health port's /readyz (no ztunnel in its scope) said "agent is
    ready", then the status port's first look logged WARNING "agent not ready:
    ztunnel" on every normal start. A part never ready yet is INFO; one that was
    ready and is not is the WARNING."""
    rl = ReadinessLog(logging.getLogger(LOGGER))
    caplog.set_level(logging.INFO, logger=LOGGER)
    ztunnel = NotReady("ztunnel", "no ztunnel connected")
    assert rl.observe({"agent", "zds"}, []) == ["agent is ready"]
    assert rl.observe({"agent", "zds", "ztunnel"}, [ztunnel]) == [
        "agent not ready: ztunnel: no ztunnel connected"]
    assert rl.observe({"agent", "zds", "ztunnel"}, []) == ["agent is ready"]
    assert rl.observe({"agent", "zds", "ztunnel"}, [ztunnel]) == [
        "agent not ready: ztunnel: no ztunnel connected"]
    levels = [r.levelname for r in caplog.records if "not ready" in r.getMessage()]
    assert levels == ["INFO", "WARNING"], levels


async def test_kubernetes_source_reason_names_kinds_and_last_error():
    """The real source against an address where nothing listens: its readiness reason
    names the kinds not listed and the connection error, not just "not synced"."""
    port = free_port()
    cfg = kclient.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    api = kclient.ApiClient(cfg)
    backend = KubernetesSource(ObjectStore(), api_client=api, kinds=["Pod", "Service"])
    source = ConfigSource(backend.store, backend)
    try:
        await backend.begin()
        await eventually(lambda: len(backend.errors) == 2, timeout=30, what="both kinds failed once")
        ok, why = source.ready()
        assert not ok
        assert why.startswith("kubernetes source not synced: Pod, Service: ")
        assert f"127.0.0.1:{port}" in why
    finally:
        await backend.stop()
        await api.close()
