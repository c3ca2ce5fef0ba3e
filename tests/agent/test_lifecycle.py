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


def _failing_build(ctx, source=None):
    """Stands in for ``agent.daemon.build_first_path`` (see test below): one component
    whose start fails."""
    ctx.add(Recorder("broken", [], fail=True))


async def test_failed_agent_start_frees_the_state_dir(tmp_path, monkeypatch):
    """A failed ``Agent.start`` releases the state-dir lock: the next agent on the same
    state dir (here in the same process) fails for its own reason, not "in use"."""
    from agent import daemon
    from agent.core.errors import ComponentStartError

    monkeypatch.setattr(daemon, "build_first_path", _failing_build)
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
            mp.setattr(daemon, "build_first_path", lambda ctx, source=None: built.append(ctx))
            with pytest.raises(cfg.ConfigError, match="another ZDS server") as e:
                await daemon.Agent(config).start()
        assert e.value.setting == "ztunnel_uds_address" and built == []
        # no CA, mesh root, SDS socket, lock: nothing, so the state dir this start made
        # is gone too (newuser: a refused start left an empty one)
        assert not state.exists(), sorted(p.name for p in state.iterdir())
        assert os.path.exists(first.path)
        state.mkdir(mode=0o711)  # one that was there before the start stays
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(daemon, "build_first_path", lambda ctx, source=None: built.append(ctx))
            with pytest.raises(cfg.ConfigError, match="another ZDS server"):
                await daemon.Agent(config).start()
        assert state.is_dir() and list(state.iterdir()) == []
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
    assert not (base / "s").exists()  # nothing in it: the state dir it made is gone too


# ---------------------------------------------------------------- StartPause (issue 28)
async def _started(log, name, timeout=30.0):
    async def until():
        while ("start", name) not in log:
            await asyncio.sleep(0.005)
    await asyncio.wait_for(until(), timeout)


async def test_pause_holds_the_rest_until_the_event(tmp_path):
    """After the component the pause names, the next starts only once the event is set;
    start() returns only when every component started."""
    from agent.core.lifecycle import StartPause

    ctx, log, event = _ctx(tmp_path), [], asyncio.Event()
    for n in ("a", "b", "c", "d"):
        ctx.add(Recorder(n, log))
    sup = Supervisor(ctx)
    task = asyncio.create_task(sup.start(StartPause("b", event, at_most=60.0)))
    try:
        await _started(log, "b")
        for _ in range(20):  # the loop runs on; c still waits for the event
            await asyncio.sleep(0)
        assert log == [("start", "a"), ("start", "b")] and not task.done()
        event.set()
        await asyncio.wait_for(task, 30)
        assert log == [("start", n) for n in "abcd"]
        assert [c.name for c in sup.started] == ["a", "b", "c", "d"]
    finally:
        task.cancel()
        await sup.stop(grace=1)


async def test_pause_ends_after_at_most_without_the_event(tmp_path):
    from agent.core.lifecycle import StartPause

    ctx, log = _ctx(tmp_path), []
    for n in ("a", "b", "c"):
        ctx.add(Recorder(n, log))
    sup = Supervisor(ctx)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        await asyncio.wait_for(sup.start(StartPause("a", asyncio.Event(), at_most=0.2)), 30)
        assert loop.time() - t0 >= 0.2
        assert log == [("start", "a"), ("start", "b"), ("start", "c")]
    finally:
        await sup.stop(grace=1)


async def test_pause_naming_no_component_never_waits(tmp_path):
    from agent.core.lifecycle import StartPause

    ctx, log = _ctx(tmp_path), []
    for n in ("a", "b"):
        ctx.add(Recorder(n, log))
    sup = Supervisor(ctx)
    try:  # at_most an hour: a pause here would hit wait_for's 30 s
        await asyncio.wait_for(sup.start(StartPause("zz", asyncio.Event(), 3600.0)), 30)
        assert log == [("start", "a"), ("start", "b")]
    finally:
        await sup.stop(grace=1)


async def test_cancelled_during_the_pause_stops_what_started(tmp_path):
    """A stop signal while the agent waits for its first push: the components started so
    far are stopped, in reverse, and the rest never start."""
    from agent.core.lifecycle import StartPause

    ctx, log = _ctx(tmp_path), []
    for n in ("a", "b", "c"):
        ctx.add(Recorder(n, log))
    sup = Supervisor(ctx)
    task = asyncio.create_task(sup.start(StartPause("b", asyncio.Event(), at_most=3600.0)))
    await _started(log, "b")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    assert log == [("start", "a"), ("start", "b"), ("stop", "b"), ("stop", "a")]
    assert sup.started == []


async def test_pause_then_builds_components_that_start_after_it_in_order(tmp_path):
    """``StartPause.then`` (how the daemon builds the components after the first push):
    awaited after the wait; what it adds to the context starts next, in order, and what
    started before is not started twice. Readiness names ``start`` while
    ``ctx.pending`` is set."""
    from agent.core.lifecycle import StartPause

    ctx, log, event = _ctx(tmp_path), [], asyncio.Event()
    for n in ("a", "b"):
        ctx.add(Recorder(n, log))
    ctx.pending = "the rest is not built yet"
    seen: list = []

    async def then():
        seen.append(ctx.not_ready())
        await asyncio.sleep(0)
        for n in ("c", "d"):
            ctx.add(Recorder(n, log))
        ctx.pending = ""

    sup = Supervisor(ctx)
    task = asyncio.create_task(sup.start(StartPause("a", event, 60.0, then=then)))
    try:
        await _started(log, "a")
        assert ctx.not_ready() == [("start", "the rest is not built yet")]
        event.set()
        await asyncio.wait_for(task, 30)
        assert seen == [[("start", "the rest is not built yet")]]
        assert log == [("start", n) for n in "abcd"] and ctx.not_ready() == []
        await sup.start()  # a second call starts nothing again
        assert log == [("start", n) for n in "abcd"]
    finally:
        task.cancel()
        await sup.stop(grace=1)
    assert log[4:] == [("stop", n) for n in "dcba"]


async def test_pause_then_failing_stops_what_started(tmp_path):
    """A setting the second half rejects: the error is raised as it is, after the
    components already started were stopped in reverse."""
    from agent.core.lifecycle import StartPause

    ctx, log = _ctx(tmp_path), []
    for n in ("a", "b"):
        ctx.add(Recorder(n, log))

    async def then():
        raise cfg.ConfigError("zds_setting", "x", "bad")

    sup = Supervisor(ctx)
    with pytest.raises(cfg.ConfigError, match="zds_setting"):
        await asyncio.wait_for(sup.start(StartPause("b", asyncio.Event(), 0.01, then=then)), 30)
    assert log == [("start", "a"), ("start", "b"), ("stop", "b"), ("stop", "a")]
    assert sup.started == []


def test_the_first_push_path_imports_nothing_of_the_rest():
    """``import_first_path`` (what the daemon imports beside the LISTs) loads none of the
    modules only the components after the first push use: they are imported after it
    (``import_rest``, issue 28); nor the waypoint resources' Envoy types."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = ["agent.enrollment_zds", "zds.server", "cni.enrollment", "cni.eventserver",
            "cni.install", "cni.snapshot", "ambient.waypoint.status_writer"]
    # nor the waypoint's Envoy resources: they load with the first waypoint stream
    rest += ["ambient.waypoint.resources", "envoy.config.listener.v3.listener_pb2"]
    code = ("import sys, agent.cli, agent.daemon as d; d.import_first_path(); "
            f"print([m for m in {rest!r} if m in sys.modules]); d.import_rest(); "
            "import ambient.waypoint.resources; "
            f"print([m for m in {rest!r} if m not in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=root, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]", "[]"], r.stdout


def test_the_first_push_path_ends_at_xds():
    """The daemon's start order: what a cold start's first xDS push needs (source,
    registration, index, authn, SDS, xDS), then the pause, then the rest (ZDS before
    enrollment, status last)."""
    import dataclasses

    from agent import daemon

    names = [f.name for f in dataclasses.fields(daemon.Components)]
    path_end = names.index(daemon.FIRST_PUSH_PATH_ENDS)
    assert names[:path_end + 1] == ["source", "registration", "index", "authn", "sds", "xds"]
    assert names[path_end + 1:] == ["zds", "waypoint_status", "enrollment", "snapshot",
                                    "installer", "events", "status"]
    assert 0 < daemon.FIRST_PUSH_WAIT <= 1.0


def test_the_components_import_no_pyroute2():
    """What the daemon imports to build its components (``import_first_path`` beside
    the LISTs, ``import_rest`` after the first push) loads no pyroute2: ~150-250 ms of
    CPU, which enrollment's start pays instead (issue 28)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, agent.cli, agent.daemon as d; d.import_first_path(); d.import_rest(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyroute2'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=root, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
