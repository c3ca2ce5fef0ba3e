"""Container labels from the runtime, for workload registration (:mod:`cni.registration`).

A CNI call carries no labels, and podman can't be asked during one: ``podman start``
holds the container's lock while it runs the CNI ADD, so ``podman container inspect`` of
that container blocks until the ADD is over (measured with podman 4.3: the inspect times
out). podman's event stream can: its ``create`` event is written when the container is
created, before any start, and carries the container's labels as ``Attributes`` (a podman
pod's infra container carries the pod's labels; ``io.buildah.version`` comes with the
pause image). :class:`PodmanLabels` follows ``podman events --format json --filter
type=container`` and keeps each container's labels by ID (bounded), so the ADD that
follows a create finds them; a ``remove`` event forgets them.

Containers created while the agent was down sent their ``create`` event to nobody: at
start :meth:`PodmanLabels.start` lists every container (``podman ps -a --format json``,
bounded by :data:`INSPECT_TIMEOUT`) and keeps their labels. A container still unknown at
its ADD is not guessed about: the registration refuses the ADD as "try again later" and
:meth:`PodmanLabels.inspect` asks ``podman container inspect`` once the ADD is answered (its
lock released), so the next ``podman start`` finds the labels.

The watcher restarts ``podman events`` with a backoff when it exits; its stderr is logged.
The ``podman events`` child dies with the agent (``PR_SET_PDEATHSIG`` SIGKILL, set
between fork and exec) and carries ``AMBIENT_AGENT_EVENTS_OWNER=<owner>`` in its
environment; at start, one left by an earlier agent of the same owner (state dir), from
before that was set or a kernel that lost it, is killed, so a SIGKILLed agent never leaves
a second event stream running.
``CONTAINERS_CONF`` is set to ``containers_conf`` when given, so it reads the same event
log the runtime writes (``events_logger`` and its path come from that file).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shutil
from typing import Any

from agent.core.backoff import Backoff

log = logging.getLogger(__name__)

OWNER_ENV = "AMBIENT_AGENT_EVENTS_OWNER"
PR_SET_PDEATHSIG = 1
MAX_CONTAINERS = 4096  # labels kept for this many containers (oldest dropped first)
INSPECT_TIMEOUT = 10.0
_IGNORED = frozenset({"io.buildah.version"})


def labels_of_event(event: Any) -> tuple[str, str, dict[str, str]] | None:
    """``(status, container id, labels)`` of one podman event line (a JSON object with
    ``Type`` ``container``, ``ID``, ``Status``, ``Attributes``), or None for any other
    line. Attributes that are not strings are dropped."""
    if not isinstance(event, dict) or event.get("Type") != "container":
        return None
    cid, status = event.get("ID"), event.get("Status")
    if not isinstance(cid, str) or not cid or not isinstance(status, str):
        return None
    attrs = event.get("Attributes") or {}
    labels = {k: v for k, v in attrs.items() if isinstance(k, str) and isinstance(v, str)
              and k not in _IGNORED} if isinstance(attrs, dict) else {}
    return status, cid, labels


class PodmanLabels:
    """Labels of podman containers by ID (see the module docstring).

    ``containers_conf``: the runtime's ``containers.conf`` path, or None for podman's
    default. ``command``: the podman binary.
    """

    def __init__(self, containers_conf: str | None, command: str = "podman",
                 owner: str = ""):
        self.containers_conf = containers_conf
        self.command = command
        self.owner = owner  # marks our podman events child (module docstring)
        self._labels: collections.OrderedDict[str, dict[str, str]] = collections.OrderedDict()
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._seed_task: asyncio.Task | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self.started = asyncio.Event()
        self.stats = {"events": 0, "restarts": 0, "inspects": 0, "listed": 0}
        # Why podman cannot tell labels now ("" = it can): its event stream failed (e.g.
        # "opening database ...: read-only file system" under a too strict sandbox) and
        # has not delivered a line since. The registration refuses unlabelled ADDs then.
        self.broken = ""

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.containers_conf:
            env["CONTAINERS_CONF"] = self.containers_conf
        return env

    async def start(self) -> None:
        if self.owner:
            await asyncio.get_running_loop().run_in_executor(None, kill_stale_followers,
                                                             self.owner)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._follow(), name="podman-events")
        # after the follower: a container created from now on is in its stream
        self._seed_task = loop.create_task(self.seed(), name="podman-ps")

    async def stop(self) -> None:
        proc = self._proc
        if self._seed_task is not None:
            self._seed_task.cancel()
            await asyncio.gather(self._seed_task, return_exceptions=True)
            self._seed_task = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None
        self._kill()
        if proc is not None:  # reaped here, not by a closed loop's transport later
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except (asyncio.TimeoutError, ProcessLookupError):
                pass

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass

    def note(self, status: str, cid: str, labels: dict[str, str]) -> None:
        """Record one event (also used by tests feeding events)."""
        if status == "remove":
            self._labels.pop(cid, None)
            return
        self._labels[cid] = labels
        self._labels.move_to_end(cid)
        while len(self._labels) > MAX_CONTAINERS:
            self._labels.popitem(last=False)
        self._changed.set()

    async def labels(self, container_id: str, wait: float) -> dict[str, str] | None:
        """The labels of ``container_id``; waits up to ``wait`` seconds for its create
        event (``podman run`` creates and starts back to back). None if none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while container_id not in self._labels:
            left = deadline - loop.time()
            if left <= 0:
                return None
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return None
        return dict(self._labels[container_id])

    async def _podman(self, *argv: str) -> bytes | None:
        """stdout of ``podman <argv>``, or None (logged) when it fails or takes longer
        than :data:`INSPECT_TIMEOUT` seconds (its child is killed then)."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.command, *argv, env=self._env(), stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            log.info("%s %s: %s", self.command, " ".join(argv[:2]), e)
            return None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), INSPECT_TIMEOUT)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            log.info("%s %s: no answer within %gs", self.command, " ".join(argv[:2]),
                     INSPECT_TIMEOUT)
            return None
        if proc.returncode != 0:
            log.info("%s %s: exit %s: %s", self.command, " ".join(argv[:2]), proc.returncode,
                     err.decode(errors="replace").strip()[:300])
            return None
        return out

    async def seed(self) -> int:
        """Learn the labels of every container podman has (``podman ps -a``), for those
        created while no agent followed the event stream; returns how many. A container
        whose event came meanwhile keeps the event's labels."""
        out = await self._podman("ps", "-a", "--no-trunc", "--format", "json")
        try:
            rows = json.loads(out or b"[]")
        except ValueError:
            log.info("podman ps: output is not JSON; labels come from events only")
            return 0
        count = 0
        for row in rows if isinstance(rows, list) else []:
            cid = row.get("Id") if isinstance(row, dict) else None
            if not isinstance(cid, str) or not cid or cid in self._labels:
                continue
            raw = row.get("Labels") or {}
            self.note("ps", cid, _clean(raw))
            count += 1
        self.stats["listed"] = count
        log.info("podman: labels of %d existing containers read", count)
        return count

    async def inspect(self, container_id: str) -> dict[str, str] | None:
        """``podman container inspect`` for the labels of a container whose create event
        was not seen; None when podman does not know it or does not answer in time."""
        self.stats["inspects"] += 1
        out = await self._podman("container", "inspect", "--format", "{{json .Config.Labels}}",
                                 container_id)
        if out is None:
            return None
        try:
            data = json.loads(out or b"null") or {}
        except ValueError:
            return None
        labels = _clean(data)
        self.note("inspect", container_id, labels)
        return labels

    async def _follow(self) -> None:
        backoff = Backoff(0.5, 30.0)
        while True:
            try:
                env = self._env()
                if self.owner:
                    env[OWNER_ENV] = self.owner
                argv, preexec = _dying_with_agent(
                    [self.command, "events", "--format", "json", "--filter", "type=container"])
                self._proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, limit=1 << 20, preexec_fn=preexec)
            except OSError as e:
                log.error("cannot run %s events: %s; container labels come from inspect only",
                          self.command, e)
                self.broken = f"cannot run {self.command} events: {e}"
                self.started.set()
                return
            self.started.set()
            assert self._proc.stdout is not None
            try:
                while True:
                    line = await self._proc.stdout.readline()
                    if not line:
                        break
                    self.broken = ""
                    try:
                        parsed = labels_of_event(json.loads(line))
                    except ValueError:
                        continue
                    if parsed is not None:
                        self.stats["events"] += 1
                        self.note(*parsed)
                    backoff.reset()
            except asyncio.CancelledError:
                self._kill()
                raise
            err = b""
            if self._proc.stderr is not None:
                try:
                    err = await asyncio.wait_for(self._proc.stderr.read(4096), 1)
                except asyncio.TimeoutError:
                    pass
            rc = await self._proc.wait()
            self.stats["restarts"] += 1
            text = " ".join(err.decode(errors="replace").split())[:300]
            self.broken = f"{self.command} events exited ({rc}): {text or 'no message'}"
            delay = backoff.next()
            log.warning("%s events exited (%s): %s; restarting in %.1fs", self.command, rc,
                        err.decode(errors="replace").strip(), delay)
            await asyncio.sleep(delay)

    def debug_state(self) -> Any:
        return {"containers": len(self._labels), "broken": self.broken, **self.stats}


def _clean(raw: Any) -> dict[str, str]:
    """String labels of a podman label map, without the image builder's own."""
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)
            and k not in _IGNORED}


def _dying_with_agent(argv: list[str]) -> tuple[list[str], Any]:
    """``(argv, preexec_fn)`` for a child that gets SIGKILL when the agent's thread that
    started it dies (``PR_SET_PDEATHSIG``). With util-linux's ``setpriv`` (Debian's, in
    the image) the argv is prefixed with ``setpriv --pdeathsig KILL --`` and there is no
    ``preexec_fn``: a ``preexec_fn`` makes Python fork() and run the at-fork handlers in
    the child, and gRPC's child handler then aborted it (SIGABRT, "epoll_wait error: Bad
    file descriptor" on its stderr; it failed a CI run under load). Without ``setpriv``,
    :func:`_die_with_parent` is the ``preexec_fn``."""
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, "--pdeathsig", "KILL", "--", *argv], None
    return argv, _die_with_parent(os.getpid())


def _die_with_parent(parent: int):
    """A ``preexec_fn``: the child gets SIGKILL when the agent's thread that forked it
    dies (``prctl(PR_SET_PDEATHSIG)``), and exits at once if the agent is already gone.
    libc and its ``prctl`` are looked up here, in the parent: the child of a process with
    other threads (gRPC's) may only do what needs no lock another thread could hold at the
    fork, and a ``dlopen`` or an import in the child can hang or abort it (a
    ``podman events`` that died of SIGABRT under load once)."""
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    args = (ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(int(signal.SIGKILL)),
            ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    getppid = os.getppid
    exit_now = os._exit

    def preexec() -> None:
        prctl(*args)
        if getppid() != parent:
            exit_now(1)
    return preexec


def kill_stale_followers(owner: str) -> int:
    """Kill ``podman events`` processes marked with ``owner`` that are not this process's
    children (left by an earlier agent of the same state dir); returns how many. Blocking
    (reads /proc)."""
    import psutil

    killed = 0
    me = os.getpid()
    for proc in psutil.process_iter(["name", "ppid"]):
        try:
            if proc.info["ppid"] == me or "podman" not in (proc.info["name"] or ""):
                continue
            if proc.environ().get(OWNER_ENV) != owner:
                continue
            log.warning("killing podman events pid %d left by an earlier agent", proc.pid)
            proc.kill()
            killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return killed
