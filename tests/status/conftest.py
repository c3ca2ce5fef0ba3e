"""Fixtures for the status server tests: a real AgentContext with small real components,
and a running StatusServer on ephemeral ports."""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from agent.core import config as agent_config
from agent.demo.envoy import free_port  # noqa: F401 - the tests import it from here
from agent.core.lifecycle import AgentContext, Component
from agent.status.server import StatusServer


class FakeComponent(Component):
    """A real Component whose readiness and debug state the test controls."""

    def __init__(self, name: str, state: Any = None, ok: bool = True, why: str = ""):
        self.name, self.state, self.ok, self.why = name, state, ok, why

    def ready(self) -> tuple[bool, str]:
        return self.ok, self.why

    def debug_state(self) -> Any:
        if isinstance(self.state, Exception):
            raise self.state
        return self.state


def make_config(tmp_path, env: dict[str, str] | None = None, **overrides):
    """A Config resolved the real way (env strings parsed), with ephemeral ports."""
    base = {"AMBIENT_AGENT_STATE_DIR": str(tmp_path / "state"),
            "AMBIENT_AGENT_CONFIG_FILE": str(tmp_path / "none.yaml"),
            "STATUS_PORT": "0", "AMBIENT_AGENT_HEALTH_PORT": "0", "MONITORING_PORT": "0",
            "AMBIENT_AGENT_STATUS_ADDRESS": "127.0.0.1",
            "AMBIENT_AGENT_SHUTDOWN_GRACE": "2"}
    base.update(env or {})
    (tmp_path / "none.yaml").write_text("")
    cfg = agent_config.load({}, base)
    return cfg.replace(**overrides) if overrides else cfg


@contextlib.asynccontextmanager
async def running_status(tmp_path, components=(), env=None, enrollment=False, **overrides):
    """Yield (ctx, server) with the status server started; always stopped. The
    ``components`` named ``ambient-index`` and ``zds`` are handed to the server as
    ``agent.daemon.build`` hands them; ``enrollment=True`` adds a real (not started)
    ``cni.enrollment.Enrollment`` built on the same context (or the one a callable
    ``enrollment(ctx)`` makes) and hands that over too."""
    ctx = AgentContext(make_config(tmp_path, env, **overrides))
    for c in components:
        ctx.add(c)
    enroller = None
    if enrollment:
        from cni.enrollment import Enrollment

        enroller = ctx.add(enrollment(ctx) if callable(enrollment) else Enrollment(ctx))
    index = ctx.components.get("ambient-index")
    server = StatusServer(ctx, enrollment=enroller, index=getattr(index, "index", None),
                          zds=ctx.components.get("zds"))
    ctx.add(server)
    await server.start()
    try:
        yield ctx, server
    finally:
        await server.stop(1.0)
        ctx.executor.shutdown(wait=False)


@contextlib.asynccontextmanager
async def serve_app(app: web.Application, host: str = "127.0.0.1", ssl_context=None):
    """Run an aiohttp app on an ephemeral port; yields the port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0, ssl_context=ssl_context)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
