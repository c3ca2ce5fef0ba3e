"""The component lifecycle: start order, reverse stop, rollback on a failed start,
readiness aggregation and bounded stop."""

from __future__ import annotations

import asyncio
import os

import pytest

from agent.core import config as cfg
from agent.core.lifecycle import AgentContext, Component, Supervisor


class Recorder(Component):
    def __init__(self, name, log, fail=False, hang=False, ready=True):
        self.name, self.log, self.fail, self.hang, self._ready = name, log, fail, hang, ready

    async def start(self):
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")
        self.log.append(("start", self.name))

    async def stop(self, grace):
        if self.hang:
            await asyncio.sleep(3600)
        self.log.append(("stop", self.name))

    def ready(self):
        return (self._ready, "" if self._ready else "warming up")


def _ctx(tmp_path):
    return AgentContext(cfg.load({"state_dir": str(tmp_path)}, env={}))


async def test_start_in_order_stop_in_reverse(tmp_path):
    ctx, log = _ctx(tmp_path), []
    for n in ("a", "b", "c"):
        ctx.add(Recorder(n, log))
    sup = Supervisor(ctx)
    await sup.start()
    await sup.stop(grace=1)
    assert log == [("start", "a"), ("start", "b"), ("start", "c"),
                   ("stop", "c"), ("stop", "b"), ("stop", "a")]


async def test_failed_start_rolls_back(tmp_path):
    ctx, log = _ctx(tmp_path), []
    ctx.add(Recorder("a", log))
    ctx.add(Recorder("b", log, fail=True))
    ctx.add(Recorder("c", log))
    with pytest.raises(RuntimeError, match="b cannot start"):
        await Supervisor(ctx).start()
    assert log == [("start", "a"), ("stop", "a")]


async def test_readiness_names_first_unready(tmp_path):
    ctx, log = _ctx(tmp_path), []
    ctx.add(Recorder("a", log))
    ctx.add(Recorder("b", log, ready=False))
    assert ctx.ready() == (False, "b: warming up")


async def test_hanging_stop_is_bounded(tmp_path):
    ctx, log = _ctx(tmp_path), []
    ctx.add(Recorder("a", log))
    ctx.add(Recorder("slow", log, hang=True))
    sup = Supervisor(ctx)
    await sup.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await sup.stop(grace=0.2)
    assert loop.time() - t0 < 3
    assert ("stop", "a") in log


def test_duplicate_component_names_rejected(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.add(Recorder("a", []))
    with pytest.raises(ValueError, match="duplicate"):
        ctx.add(Recorder("a", []))


def _failing_build(ctx):
    """Stands in for ``agent.daemon.build`` (see test below): one component whose start
    fails."""
    ctx.add(Recorder("broken", [], fail=True))


async def test_failed_agent_start_frees_the_state_dir(tmp_path, monkeypatch):
    """A failed ``Agent.start`` releases the state-dir lock: the next agent on the same
    state dir (here in the same process) fails for its own reason, not "in use"."""
    from agent import daemon
    from agent.core.errors import ComponentStartError

    monkeypatch.setattr(daemon, "build", _failing_build)
    config = cfg.load({"state_dir": str(tmp_path)}, env={})
    for _ in range(2):
        with pytest.raises(ComponentStartError, match="broken: broken cannot start"):
            await daemon.Agent(config).start()
    assert not (tmp_path / "agent.lock").exists()


async def test_served_zds_socket_refused_before_anything_is_built(tmp_path):
    """A second agent sharing only the ZDS socket (every port moved) failed when the zds
    component started, after the CA, the mesh root and SDS had been created (newuser
    finding 12). Now it is refused before any component is built; the live ZDS server
    (a real one) keeps serving and nothing is left in the second state dir."""
    from agent import daemon
    from zds.server import ZdsServer

    first = ZdsServer(str(tmp_path / "zds" / "ztunnel.sock"), ztunnel_wait=1.0)
    await first.start()
    state = tmp_path / "second"
    try:
        config = cfg.load({"state_dir": str(state)}, env={}).replace(
            ztunnel_uds_address=first.path, status_port=0, health_port=0,
            monitoring_port=0, xds_port=0, xds_tls_port=0, ca_port=0)
        built = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(daemon, "build", lambda ctx: built.append(ctx))
            with pytest.raises(cfg.ConfigError, match="another ZDS server") as e:
                await daemon.Agent(config).start()
        assert e.value.setting == "ztunnel_uds_address" and built == []
        left = sorted(p.name for p in state.iterdir())
        assert left == [], left  # no CA, mesh root, SDS socket, lock
        assert os.path.exists(first.path)
    finally:
        await first.stop(0.5)


def test_agent_stopped_is_logged_once_worker_threads_are_done(caplog):
    """"agent stopped" was logged ~3 s before the process exited (the interpreter still
    joined worker threads): it now waits for them first, or names those still busy."""
    import logging
    import threading

    from agent import daemon

    caplog.set_level(logging.INFO, logger="agent.daemon")
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="nu-busy-worker")
    worker.start()
    try:
        assert daemon.stopped(0, timeout=0.05) == 0
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "still busy" in said[0] and "nu-busy-worker" in said[0]
    finally:
        release.set()
    caplog.clear()
    assert daemon.stopped(3) == 3
    assert worker.is_alive() is False  # waited for, then logged
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("agent stopped"), said
    assert "nu-busy-worker" not in said[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the agent as another uid")
def test_non_root_run_is_refused_before_any_component():
    """Non-root ``run`` created a CA, published the mesh root and started SDS, ZDS and
    xDS before enrollment failed (newuser finding 12): refused before any of them."""
    import shutil
    import tempfile
    from pathlib import Path

    base = Path(tempfile.mkdtemp(prefix="nu-nonroot-"))  # pytest's tmp is root-only
    os.chmod(base, 0o777)
    try:
        _run_non_root(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run_non_root(base):
    import subprocess
    import sys

    from agent.demo.envoy import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
         "-m", "agent.cli", "run", "--state-dir", str(base / "s"), "--config-file",
         os.devnull, "--ztunnel-uds-address", str(base / "zds.sock"),
         "--status-port", str(free_port()), "--health-port", str(free_port()),
         "--monitoring-port", "0", "--xds-port", str(free_port()),
         "--xds-tls-port", str(free_port()), "--ca-port", "0"],
        capture_output=True, text=True, cwd=root, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "cannot start enrollment: this process lacks CAP_NET_ADMIN" in r.stderr, r.stderr
    assert "started sds" not in r.stderr and "xds: serving" not in r.stderr, r.stderr
    assert sorted(p.name for p in (base / "s").iterdir()) == []
