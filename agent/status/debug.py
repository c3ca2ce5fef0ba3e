"""``/debug/...``: the operator's read-only JSON window into the running agent (served on the
root-only admin socket, see :mod:`agent.status.server`).

Every endpoint answers pretty-printed JSON (``application/json``):

==========================  ====================================================================
``/debug``                  index: every endpoint with a one-line description, component names
``/debug/config``           effective configuration, each value with its source (flag/env/file)
``/debug/components``       each component: ready or not (with reason), its Python type
``/debug/pods``             enrolled pods and their status (component ``enrollment``)
``/debug/zds``              ZDS connections (ztunnels) and the pods each holds (``zds``)
``/debug/sds``              SDS streams and their certificates' expiry (``sds``)
``/debug/xds``              xDS clients and their subscriptions (``xds``)
``/debug/mesh``             workloads, services, policies, waypoints as the index serves them
``/debug/component/<name>`` any component's ``debug_state()``
``/debug/all``              all of the above in one document (used by ``ambient-agent status``)
==========================  ====================================================================

A section whose component is not running answers 404 ``{"error": ...}``; a component
whose ``debug_state()`` raises answers 500 with the error text, and the agent keeps
serving.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from agent.core.lifecycle import AgentContext
from agent.status.compression import compress_large
from agent.status.mesh import MeshParts, mesh_view

log = logging.getLogger(__name__)

# section path -> (component name, description)
SECTIONS: dict[str, tuple[str, str]] = {
    "pods": ("enrollment", "enrolled pods and their status"),
    "zds": ("zds", "ZDS connections (ztunnels) and the pods each holds"),
    "sds": ("sds", "SDS streams and their certificates' expiry"),
    "xds": ("xds", "workload xDS clients and their subscriptions"),
}


class ComponentMissing(LookupError):
    """The requested component is not part of this agent."""


def dumps(data: Any) -> str:
    """Pretty JSON; values JSON can't express (datetimes, bytes, sets) become strings."""
    return json.dumps(data, indent=2, default=_fallback) + "\n"


def _fallback(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def json_response(data: Any, status: int = 200) -> web.Response:
    return compress_large(web.Response(text=dumps(data), status=status,
                                       content_type="application/json"))


def component_state(ctx: AgentContext, name: str) -> Any:
    """``debug_state()`` of component ``name``. Raises :class:`ComponentMissing`;
    re-raises what ``debug_state`` raised."""
    component = ctx.components.get(name)
    if component is None:
        raise ComponentMissing(f"component {name!r} is not running in this agent "
                               f"(running: {', '.join(ctx.components) or 'none'})")
    return component.debug_state()


def components_summary(ctx: AgentContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, component in ctx.components.items():
        try:
            ok, why = component.ready()
        except Exception as e:  # noqa: BLE001 - a broken component must not break /debug
            ok, why = False, f"ready() raised {type(e).__name__}: {e}"
        out[name] = {"ready": ok, "reason": why, "type": type(component).__qualname__}
    return out


def index(ctx: AgentContext) -> dict[str, Any]:
    endpoints = {
        "/debug/config": "effective configuration with each value's source",
        "/debug/components": "components and their readiness",
        **{f"/debug/{s}": f"{desc} (component {c!r})" for s, (c, desc) in SECTIONS.items()},
        "/debug/mesh": "workloads, services, policies and waypoints as the index serves them",
        "/debug/component/<name>": "any component's debug state",
        "/debug/all": "everything above in one document",
    }
    return {"endpoints": endpoints, "components": list(ctx.components)}


def everything(ctx: AgentContext, parts: MeshParts) -> dict[str, Any]:
    """One document with config, components and every section; failures inline."""
    doc: dict[str, Any] = {"config": ctx.config.as_dict(), "components": components_summary(ctx)}
    try:
        doc["mesh"] = mesh_view(parts)
    except Exception as e:  # noqa: BLE001
        log.exception("mesh view failed")
        doc["mesh"] = {"error": f"{type(e).__name__}: {e}"}
    for section, (name, _) in SECTIONS.items():
        try:
            doc[section] = component_state(ctx, name)
        except ComponentMissing as e:
            doc[section] = {"error": str(e), "missing": True}
        except Exception as e:  # noqa: BLE001
            log.exception("debug_state of %s failed", name)
            doc[section] = {"error": f"{type(e).__name__}: {e}"}
    return doc


def add_routes(app: web.Application, ctx: AgentContext, parts: MeshParts) -> None:
    """Register the ``/debug`` routes on ``app`` (the admin app: access is decided there);
    ``/debug/mesh`` reads ``parts``, the others ``ctx.components`` by name."""

    def guarded(build: Callable[[web.Request], Any]
                ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            try:
                return json_response(build(request))
            except ComponentMissing as e:
                return json_response({"error": str(e)}, status=404)
            except web.HTTPException:
                raise
            except Exception as e:  # noqa: BLE001 - one failing component is not fatal
                log.exception("debug endpoint %s failed", request.path)
                return json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
        return handler

    app.router.add_get("/debug", guarded(lambda r: index(ctx)))
    app.router.add_get("/debug/", guarded(lambda r: index(ctx)))
    app.router.add_get("/debug/config", guarded(lambda r: ctx.config.as_dict()))
    app.router.add_get("/debug/components", guarded(lambda r: components_summary(ctx)))
    app.router.add_get("/debug/all", guarded(lambda r: everything(ctx, parts)))
    app.router.add_get("/debug/mesh", guarded(lambda r: mesh_view(parts)))
    app.router.add_get("/debug/component/{name}",
                       guarded(lambda r: component_state(ctx, r.match_info["name"])))
    def section(name: str) -> Callable[[web.Request], Any]:
        return lambda r: component_state(ctx, name)

    for path, (name, _) in SECTIONS.items():
        app.router.add_get(f"/debug/{path}", guarded(section(name)))
    app.router.add_route("*", "/debug/{tail:.*}", guarded(_not_found))


def _not_found(request: web.Request) -> Any:
    raise web.HTTPNotFound(text=dumps({"error": f"no debug endpoint {request.path!r}; "
                                       "see /debug"}), content_type="application/json")
