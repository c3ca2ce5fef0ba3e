"""The agent's CNI event server (component ``cni-events``): where ``istio-cni`` asks.

HTTP/1.1 (aiohttp) on the Unix socket ``config.cni_event_socket`` (default
``<state dir>/pluginevent.sock``, mode 0600, parent 0700 when we create it). Istio's
listener is 0666 (``docs/enrollment.md``); ours is 0600 because only the runtime
(root) runs the plugin, and the socket triggers netns work.

Routes (the body is a :class:`cni.events.CniPodEvent` JSON):

- ``POST /cmdadd``: decide "is this pod ambient" (:mod:`cni.enablement`); if yes, await
  ``enrollment.enroll(event)`` and answer only when the pod is enrolled, so
  no pod starts outside the mesh by accident. 200 ``{"ambient": bool, "reason": str}``;
  400 malformed event (message names the field); 500 enrollment failed or impossible
  (the reason becomes the plugin's CNI error); 503 the agent is shutting down, the
  enrollment error is ``retryable``, or the pod is in an ambient namespace but its Pod
  object is not known yet after a short lookup (:attr:`cni.enablement.Decision.retry`;
  the plugin maps 503 to "try again later", code 11, and the runtime retries).
- ``POST /cmddel``: await ``enrollment.unenroll(event, is_delete=True)`` (best effort;
  the sandbox is being destroyed, so its in-pod rules go with its netns, as upstream's
  ``RemovePodFromMesh(pod, isDelete=true)``). 200 or 500.
- ``GET /healthz``: 200 while serving, 503 while draining (the plugin's STATUS).
- ``POST /log``: the plugin's own log lines (upstream's plugin tees its log to the node
  agent's log socket, ``cni/pkg/log/uds.go``): a JSON array of JSON-encoded objects
  ``{"level", "time", "msg", ...}``, logged under the scope ``cni.plugin`` at their level
  with the other fields (``command``, ``container_id``, ``pod``) and the plugin's time
  appended. At most :data:`LOG_BODY_MAX` bytes (413) and :data:`LOG_LINES_MAX` lines
  (the rest counted in one line); a line that does not parse is skipped (DEBUG); a body
  that is not such an array is 400. Always answered at once: the plugin does not wait.

Bounded like every listener (:mod:`agent.core.listeners`): a request body not received in full
within ``BODY_TIMEOUT`` (10 s) is answered 408 and the connection closed; a connection idle
(or stuck in its headers) for ``IDLE_TIMEOUT`` is closed; malformed HTTP is one DEBUG line.

ADD and DEL of one pod (:attr:`CniPodEvent.key`) are serialised, with one exception: a
DEL arriving while that pod's ADD still runs (e.g. enrollment waiting up to
``ztunnel_wait`` for a ztunnel) cancels the enrollment first
(``enrollment.abort_enroll``): it rolls back what it did and the ADD answers 500 "pod
deleted during enrollment"; then the DEL runs, so it answers within the plugin's 2 s
DEL timeout. An enrollment is not cancelled when only the plugin gives up (its 5 s ADD
timeout): a half-applied enrollment is worse than a complete one that the runtime's
following DEL undoes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import Counter, Histogram

from agent.core import listeners, unixsocket
from agent.core.lifecycle import AgentContext, Component
from cni import enablement
from cni.enrollment import metrics as enrollment_metrics
from cni.events import CniPodEvent, EnrollmentError, EventError
from cni.plugin import DRAINING_TEXT
from cni.registration import WorkloadRegistrar
from cni.sourceapi import PodSource, PodStore

log = logging.getLogger(__name__)

POD_LOOKUP_RETRIES = 10  # Istio: a just-created pod may be missing from a stale cache
POD_LOOKUP_INTERVAL = 0.01
IDLE_TIMEOUT = 30.0  # seconds a connection may stay open without a request in progress
#: seconds after an ADD before a hand-written Pod object is looked at for what the index
#: needs (a tool writing status.podIP right after the ADD, as a kubelet does and as the
#: demo does, is not warned about); at most UNSERVABLE_CHECKS_MAX wait at once (more are
#: looked at right away)
UNSERVABLE_GRACE = 5.0
UNSERVABLE_CHECKS_MAX = 1024
LOG_BODY_MAX = 128 * 1024  # bytes of one /log request
LOG_LINES_MAX = 64  # lines of one /log request logged; more are counted
LOG_MSG_MAX = 4096  # characters of one logged plugin message
PLUGIN_LOG = logging.getLogger("cni.plugin")  # the plugin's own scope, as upstream's "plugin"
_PLUGIN_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
                  "warning": logging.WARNING, "error": logging.ERROR}


class PodEnroller(Protocol):
    """What the event server asks of enrollment (``cni.enrollment.Enrollment`` has it)."""

    async def enroll(self, event: CniPodEvent) -> None:
        """Return once the pod is enrolled; raise ``EnrollmentError`` (or anything) if not."""

    async def unenroll(self, event: CniPodEvent, is_delete: bool = False) -> None: ...

    def note_sandbox(self, event: CniPodEvent) -> None:
        """Remember a non-ambient sandbox, found at once if it becomes ambient later."""

    def abort_enroll(self, uid: str) -> Any:
        """Cancel the ADD of ``uid`` in flight; truthy when there was one."""


class CniEventServer(Component):
    """The ``cni-events`` component. ``socket_path``: where to listen (str); ``store``:
    the config source's objects, where pods are looked up (None: every pod is decided
    by the network's ``ambient_default``); ``enrollment``: who enrolls ambient pods (None:
    an ambient ADD fails); ``registrar``: registers the pods of hosts without Kubernetes
    (``cni.registration``; None: off)."""

    name = "cni-events"

    def __init__(self, ctx: AgentContext, socket_path: str, *, store: PodStore | None,
                 enrollment: PodEnroller | None, registrar: WorkloadRegistrar | None = None):
        self.ctx = ctx
        self.socket_path = socket_path
        self.store = store
        self.enrollment = enrollment
        self.registrar = registrar
        self._runner: web.AppRunner | None = None
        self._locks: dict[str, list] = {}  # key -> [lock, users]
        self._inflight: dict[str, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._checks: set[asyncio.TimerHandle] = set()  # pending _warn_unservable calls
        self._stats = {"add": 0, "add_ambient": 0, "add_failed": 0, "add_held": 0, "del": 0,
                       "bad": 0}
        self.requests = Counter(
            "istio_cni_plugin_requests", "CNI plugin requests by command and HTTP response code",
            ["command", "response_code"], registry=ctx.registry)
        self.add_seconds = Histogram(
            "ambient_agent_cni_add_seconds", "time from CNI ADD request to answer, seconds",
            registry=ctx.registry, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.metrics = enrollment_metrics.of(ctx.registry)  # the ADD's "lookup" stage

    # --- lifecycle ---

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/cmdadd", self._handle_add)
        app.router.add_post("/cmddel", self._handle_del)
        app.router.add_get("/healthz", self._handle_healthz)
        app.router.add_post("/log", self._handle_log)
        parent = os.path.dirname(self.socket_path)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        try:
            os.unlink(self.socket_path)  # stale socket of a previous run
        except FileNotFoundError:
            pass
        self._runner = listeners.runner(app, "cni-events", IDLE_TIMEOUT)
        await self._runner.setup()
        await web.SockSite(self._runner, unixsocket.bind_unix(self.socket_path, 0o600)).start()
        log.info("CNI event server listening on %s", self.socket_path)

    async def stop(self, grace: float) -> None:
        for handle in self._checks:
            handle.cancel()
        self._checks.clear()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def ready(self) -> tuple[bool, str]:
        if self._runner is None:
            return False, "not listening"
        return True, ""

    def debug_state(self) -> Any:
        return {"socket": self.socket_path, "in_flight": dict(self._inflight), **self._stats}

    # --- handlers ---

    async def _read_event(self, request: web.Request, command: str) -> CniPodEvent:
        """Raises HTTPBadRequest naming the problem, HTTPRequestTimeout for a body that
        does not arrive."""
        body = await listeners.read_body(request)
        if not body:
            raise web.HTTPBadRequest(text="empty request body; expected a CNI pod event JSON")
        try:
            data = json.loads(body)
        except ValueError as e:
            raise web.HTTPBadRequest(text=f"malformed JSON in CNI pod event: {e}") from None
        except RecursionError:
            # the C scanner recurses per nesting level and stops at the interpreter's
            # limit: e.g. '[' * 100000; an event is two levels deep
            raise web.HTTPBadRequest(text="malformed JSON in CNI pod event: nested deeper "
                                          f"than {sys.getrecursionlimit()} levels") from None
        try:
            event = CniPodEvent.from_json(data)
        except EventError as e:
            raise web.HTTPBadRequest(text=f"invalid CNI pod event: {e}") from None
        if event.command != command:
            raise web.HTTPBadRequest(
                text=f"invalid CNI pod event: field 'command' is {event.command!r} "
                     f"on {request.path}; expected {command!r}")
        return event

    async def _handle_log(self, request: web.Request) -> web.Response:
        """The plugin's log lines (see the module docstring)."""
        if request.content_length is not None and request.content_length > LOG_BODY_MAX:
            return web.Response(status=413, text=f"plugin log body over {LOG_BODY_MAX} bytes\n")
        try:
            body = await listeners.read_body(request)
        except web.HTTPRequestTimeout as e:
            return e
        if len(body) > LOG_BODY_MAX:
            return web.Response(status=413, text=f"plugin log body over {LOG_BODY_MAX} bytes\n")
        try:
            lines = json.loads(body)
        except ValueError as e:
            return web.Response(status=400, text=f"malformed JSON in plugin log: {e}\n")
        except RecursionError:
            return web.Response(status=400, text="malformed JSON in plugin log: nested "
                                                 f"deeper than {sys.getrecursionlimit()} "
                                                 "levels\n")
        if not isinstance(lines, list):
            return web.Response(status=400, text="plugin log: expected a JSON array of log "
                                                 f"lines, got {type(lines).__name__}\n")
        for line in lines[:LOG_LINES_MAX]:
            _log_plugin_line(line)
        if len(lines) > LOG_LINES_MAX:
            PLUGIN_LOG.warning("%d more plugin log lines in one request not logged",
                               len(lines) - LOG_LINES_MAX)
        return web.Response(text="OK\n")

    def _respond(self, command: str, status: int, body: dict | str) -> web.Response:
        self.requests.labels(command, str(status)).inc()
        if isinstance(body, dict):
            return web.json_response(body, status=status)
        return web.Response(text=body, status=status)

    def _reject(self, command: str, e: web.HTTPException) -> web.Response:
        resp = self._respond(command, e.status, e.text or "bad request")
        if e.status == 408:
            resp.force_close()  # the rest of that body may still come: drop the connection
        return resp

    async def _handle_add(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        try:
            event = await self._read_event(request, "ADD")
        except (web.HTTPBadRequest, web.HTTPRequestTimeout) as e:
            self._stats["bad"] += 1
            log.warning("rejected CNI ADD: %s", (e.text or "").strip())
            return self._reject("ADD", e)
        self._stats["add"] += 1
        if self.ctx.draining:
            return self._respond("ADD", 503, f"{DRAINING_TEXT}; try again later")
        try:
            status, body = await self._run_serialised(event, self._add(event))
        finally:
            self.add_seconds.observe(time.monotonic() - started)
        return self._respond("ADD", status, body)

    async def _add(self, event: CniPodEvent) -> tuple[int, dict | str]:
        name = _pod_name(event)
        registrar = self.registrar
        registration = None
        if registrar is not None:
            # no kubelet writes a Pod for this sandbox: the agent registers it
            # (cni.registration); its labels decide enablement as a Pod's would
            try:
                registration = await registrar.prepare(event)
            except ValueError as e:
                self._stats["add_failed"] += 1
                # retryable (labels not read yet): the plugin answers code 11
                status = 503 if getattr(e, "retryable", False) else 500
                return status, f"cannot register pod {name}: {e}"
        started = time.monotonic()
        try:
            decision = await self._decide(event, registration)
        except ValueError as e:
            return 500, f"cannot decide whether pod {name} is ambient: {e}"
        if decision.ambient:
            self.metrics.stage("lookup", time.monotonic() - started)
        if registrar is not None and registration is not None:
            try:
                await registrar.commit(registration, decision.ambient)
            except Exception as e:  # noqa: BLE001
                self._stats["add_failed"] += 1
                log.warning("registering pod %s failed: %s", name, e)
                return 500, f"cannot register pod {name}: {e}"
            name = _pod_name(event, registration)
        result = await self._enroll(event, name, decision)
        if registrar is not None and registration is not None and result[0] != 200:
            try:  # the sandbox will not run: neither does its workload
                await registrar.remove(event.key)
            except Exception as e:  # noqa: BLE001
                log.warning("unregistering pod %s after its failed ADD: %s", name, e)
        return result

    async def _enroll(self, event: CniPodEvent, name: str,
                      decision: enablement.Decision) -> tuple[int, dict | str]:
        enrollment = self.enrollment
        if decision.retry:
            # fail closed, retryable (code 11): the runtime re-creates the sandbox and a
            # later ADD finds the Pod object; nothing was done to the netns
            self._stats["add_held"] += 1
            log.warning("pod %s held (try again later): %s", name, decision.reason)
            return 503, f"pod {name} not decided yet: {decision.reason}"
        if not decision.ambient:
            log.info("pod %s is not ambient (%s): not enrolled", name, decision.reason)
            if enrollment is not None:  # found at once if it becomes ambient while running
                enrollment.note_sandbox(event)
            return 200, {"ambient": False, "reason": decision.reason}
        if enrollment is None:
            self._stats["add_failed"] += 1
            return 500, (f"pod {name} should be enrolled in ambient mode ({decision.reason}) but "
                         f"this agent runs no enrollment component")
        try:
            await enrollment.enroll(event)
        except Exception as e:  # noqa: BLE001 - one bad pod never stops the server
            self._stats["add_failed"] += 1
            status = 500
            if isinstance(e, EnrollmentError):
                reason = str(e)
                # retryable (e.g. no ztunnel yet): the plugin reports "try again later"
                status = 503 if e.retryable else 500
            else:
                log.exception("enrollment of pod %s crashed", name)
                reason = f"internal error: {type(e).__name__}: {e}"
            log.warning("enrollment of pod %s failed: %s", name, reason)
            return status, f"enrollment of pod {name} failed: {reason}"
        self._stats["add_ambient"] += 1
        log.info("pod %s enrolled (%s)", name, decision.reason)
        self._check_servable_later(event, name)
        return 200, {"ambient": True, "reason": decision.reason}

    def _check_servable_later(self, event: CniPodEvent, name: str) -> None:
        """:meth:`_warn_unservable` :data:`UNSERVABLE_GRACE` seconds from now (at once
        when :data:`UNSERVABLE_CHECKS_MAX` checks are waiting already)."""
        if len(self._checks) >= UNSERVABLE_CHECKS_MAX:
            self._warn_unservable(event, name)
            return
        handle: asyncio.TimerHandle

        def due() -> None:
            self._checks.discard(handle)
            self._warn_unservable(event, name)

        handle = asyncio.get_running_loop().call_later(UNSERVABLE_GRACE, due)
        self._checks.add(handle)

    def _warn_unservable(self, event: CniPodEvent, name: str) -> None:
        """One WARN when the enrolled pod is a hand-written Pod of the config directory
        the ambient index can't serve as it is (looked at :data:`UNSERVABLE_GRACE`
        seconds after its ADD): without ``status.podIP`` it has no address (the index
        does not take the CNI's IPs), without a Ready condition True it is served
        Unhealthy. In Kubernetes the kubelet fills both after the ADD, so only objects
        from files are looked at."""
        store = self.store
        pod = enablement.find_pod(store, event)
        origin_of = getattr(store, "origin_of", None)
        if pod is None or not callable(origin_of):
            return
        meta = pod.get("metadata") or {}
        origin = origin_of(("Pod", meta.get("namespace", ""), meta.get("name", "")))
        if not isinstance(origin, str) or not origin.startswith("/"):
            return  # not from a config file (Kubernetes, a registration)
        status = pod.get("status") or {}
        missing = []
        if not status.get("podIP"):
            missing.append("status.podIP (without it the pod has no address in xDS; "
                           f"the CNI gave {','.join(event.ips) or 'none'})")
        if not any(isinstance(c, dict) and c.get("type") == "Ready"
                   and c.get("status") == "True" for c in status.get("conditions") or []):
            missing.append("a status.conditions entry {type: Ready, status: 'True'} "
                           "(without it the workload is served Unhealthy)")
        if missing:
            log.warning("pod %s is enrolled but its Pod object in %s lacks %s; see "
                        "docs/cni.md, \"Hand-written Pod objects\"", name, origin,
                        " and ".join(missing))

    async def _decide(self, event: CniPodEvent, registration=None) -> enablement.Decision:
        store = self.store
        exclude = self.ctx.config.exclude_namespaces
        pod = enablement.find_pod(store, event)
        if pod is None and registration is not None:
            return enablement.decide(event, store, exclude, pod=registration.pod())
        # a pod the runtime is creating right now may not have reached a watch cache yet
        if pod is None and store is not None and event.pod_namespace and event.pod_name:
            for _ in range(POD_LOOKUP_RETRIES):
                await asyncio.sleep(POD_LOOKUP_INTERVAL)
                pod = enablement.find_pod(store, event)
                if pod is not None:
                    break
        return enablement.decide(event, store, exclude, pod=pod)

    async def _handle_del(self, request: web.Request) -> web.Response:
        try:
            event = await self._read_event(request, "DEL")
        except (web.HTTPBadRequest, web.HTTPRequestTimeout) as e:
            self._stats["bad"] += 1
            return self._reject("DEL", e)
        self._stats["del"] += 1
        enrollment = self.enrollment
        if (enrollment is not None and self._inflight.get(event.key) == "ADD"
                and enrollment.abort_enroll(event.key)):
            log.info("CNI DEL of pod %s during its ADD: enrollment cancelled",
                     _pod_name(event))
        status, body = await self._run_serialised(event, self._del(event))
        return self._respond("DEL", status, body)

    async def _del(self, event: CniPodEvent) -> tuple[int, dict | str]:
        enrollment = self.enrollment
        if enrollment is None:
            await self._unregister(event)
            return 200, {"unenrolled": False, "reason": "no enrollment component"}
        try:
            await enrollment.unenroll(event, is_delete=True)
        except Exception as e:  # noqa: BLE001
            log.warning("unenrolling pod %s failed: %s", _pod_name(event), e)
            return 500, f"unenrolling pod {_pod_name(event)} failed: {e}"
        finally:
            await self._unregister(event)
        return 200, {"unenrolled": True}

    async def _unregister(self, event: CniPodEvent) -> None:
        """The DEL's workload goes away with its sandbox (best effort: a failure is logged;
        the kubernetes backend retries on its own)."""
        registrar = self.registrar
        if registrar is None:
            return
        try:
            await registrar.remove(event.key)
        except Exception as e:  # noqa: BLE001
            log.warning("unregistering pod %s failed: %s", _pod_name(event), e)

    async def _run_serialised(self, event: CniPodEvent, work) -> tuple[int, dict | str]:
        """Run ``work`` under the pod's lock in its own task, shielded from the plugin
        hanging up: the request may be cancelled, the enrollment is not."""
        entry = self._locks.setdefault(event.key, [asyncio.Lock(), 0])
        entry[1] += 1  # users of this pod's lock; dropped from the map at zero

        async def locked():
            try:
                async with entry[0]:
                    self._inflight[event.key] = event.command
                    try:
                        return await work
                    finally:
                        self._inflight.pop(event.key, None)
            finally:
                entry[1] -= 1
                if entry[1] == 0:
                    self._locks.pop(event.key, None)

        task = asyncio.get_running_loop().create_task(locked())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _handle_healthz(self, request: web.Request) -> web.Response:
        if self.ctx.draining:
            return self._respond("STATUS", 503, "draining")
        return self._respond("STATUS", 200, "ok")


def _log_plugin_line(line: Any) -> None:
    """Log one plugin line (a JSON text of ``{"level", "time", "msg", ...}``) under
    ``cni.plugin``; anything else is one DEBUG line."""
    try:
        entry = json.loads(line) if isinstance(line, str) else None
    except (ValueError, RecursionError):
        entry = None
    if not isinstance(entry, dict) or not isinstance(entry.get("msg"), str) \
            or entry.get("level") not in _PLUGIN_LEVELS:
        log.debug("plugin log line skipped: not {level, time, msg}: %.200r", line)
        return
    extra = " ".join(f"{k}={v}" for k, v in entry.items()
                     if k not in ("level", "time", "msg") and isinstance(v, (str, int, float))
                     and v != "")
    when = entry.get("time") if isinstance(entry.get("time"), str) else ""
    msg = entry["msg"].strip()[:LOG_MSG_MAX]
    PLUGIN_LOG.log(_PLUGIN_LEVELS[entry["level"]], "%s%s%s", msg,
                   f" ({extra})" if extra else "", f" [plugin time {when}]" if when else "")


def _pod_name(event: CniPodEvent, registration=None) -> str:
    if registration is not None:
        return f"{registration.namespace}/{registration.name} ({event.key})"
    if event.pod_namespace and event.pod_name:
        return f"{event.pod_namespace}/{event.pod_name} ({event.key})"
    return event.key


def build(ctx: AgentContext, source: PodSource, enrollment: PodEnroller,
          registrar: WorkloadRegistrar | None) -> CniEventServer:
    """The ``cni-events`` component (always on); ``agent.daemon`` builds it after
    everything it hands work to, so it is the last CNI part to start."""
    return CniEventServer(ctx, ctx.config.cni_event_socket, store=source.store,
                          enrollment=enrollment, registrar=registrar)
