"""Envoy readiness derived from its admin ``/stats`` (``docs/status.md``, case 30).

Upstream does not call Envoy's ``/ready``; it asks two stats queries and latches each
result once it succeeds (so a later admin outage does not flip readiness):

1. config received: ``cluster_manager.cds`` and ``listener_manager.lds`` ``update_success``
   both > 0 (messages name the counts and any rejection);
2. Envoy live: ``server.state`` is 0 (LIVE) and ``listener_manager.workers_started`` is 1.

Shutting down is checked between the two and is never latched.

What the readiness endpoints answer and log when not ready (``/healthz/ready`` on the
status port, ``/readyz`` on the health port; ``docs/status.md``): every part not ready
(:class:`NotReady`: a component by its name, ``envoy``, ``agent`` for shutting down,
``drain`` for draining, ``ztunnel`` for an ambient ADD that would block) with its last error,
each reason cleaned by :func:`clean_reason` (secrets redacted, control characters
escaped, at most :data:`MAX_REASON_CHARS`) and the whole by :func:`summary` (at most
:data:`MAX_BODY_CHARS`). :class:`ReadinessLog` logs the transitions: one line when a
part becomes not ready (with its reason) or ready again, none per probe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Iterable

import aiohttp

from agent.core.logsetup import redact

CONFIG_QUERY = (r"/stats?usedonly&filter=^(cluster_manager\.cds|listener_manager\.lds)"
                r"\.(update_success|update_rejected)$")
LIVE_QUERY = r"/stats?usedonly&filter=^(server\.state|listener_manager\.workers_started)"
SERVER_STATES = {0: "LIVE", 1: "DRAINING", 2: "PRE_INITIALIZING", 3: "INITIALIZING"}


def parse_stats(text: str) -> dict[str, float]:
    """``name: value`` lines → dict; the first occurrence of a name wins, bad lines skipped."""
    stats: dict[str, float] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            continue
        try:
            stats.setdefault(name.strip(), float(value.strip()))
        except ValueError:
            continue
    return stats


def config_error(stats: dict[str, float]) -> str | None:
    """None when both CDS and LDS have succeeded, else upstream's message (case 30)."""
    cds_ok = int(stats.get("cluster_manager.cds.update_success", 0))
    cds_rej = int(stats.get("cluster_manager.cds.update_rejected", 0))
    lds_ok = int(stats.get("listener_manager.lds.update_success", 0))
    lds_rej = int(stats.get("listener_manager.lds.update_rejected", 0))
    if cds_ok > 0 and lds_ok > 0:
        return None
    summary = (f"cds updates: {cds_ok} successful, {cds_rej} rejected; "
               f"lds updates: {lds_ok} successful, {lds_rej} rejected")
    if cds_ok == 0 and lds_ok == 0:
        return f"config not received from XDS server (is Istiod running?): {summary}"
    if cds_rej > 0 or lds_rej > 0:
        return f"config received from XDS server, but was rejected: {summary}"
    return f"config not fully received from XDS server: {summary}"


def live_error(text: str) -> str | None:
    """None when Envoy is LIVE with workers started, else the reason."""
    if "server.state" not in text or "listener_manager.workers_started" not in text:
        return "server.state or listener_manager.workers_started missing from Envoy stats"
    stats = parse_stats(text)
    state = int(stats.get("server.state", -1))
    if state != 0:
        return f"server is not live, current state is: {SERVER_STATES.get(state, state)}"
    if int(stats.get("listener_manager.workers_started", 0)) != 1:
        return "workers have not yet started"
    return None


class _NotStats(ValueError):
    """Envoy's admin answered with a non-200 status (the text names it)."""


class EnvoyReadiness:
    """Checks an Envoy admin endpoint; results latch once true.

    ``admin_url`` is ``http://127.0.0.1:<port>``; ``terminated`` returns the shutdown cause
    or "" while running; ``on_live(seconds)`` is called once, with the time since this
    object was created (``istio_agent_startup_duration_seconds``).
    """

    def __init__(self, admin_url: str, terminated: Callable[[], str],
                 on_live: Callable[[float], None] | None = None):
        self.admin_url = admin_url
        self.terminated = terminated
        self.on_live = on_live
        self.config_received = False
        self.live = False
        self.created = time.monotonic()

    async def _get(self, session: aiohttp.ClientSession, query: str, timeout: float) -> str:
        async with session.get(self.admin_url + query,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                raise _NotStats(f"HTTP status code {resp.status}")
            return await resp.text()

    async def check(self, session: aiohttp.ClientSession) -> str | None:
        """None when ready, else a short reason. Never raises for Envoy failures."""
        try:
            if not self.config_received:
                error = config_error(parse_stats(await self._get(session, CONFIG_QUERY, 1.0)))
                if error:
                    return error
                self.config_received = True
            cause = self.terminated()
            if cause:
                return f"server is terminated: {cause}"
            if not self.live:
                error = live_error(await self._get(session, LIVE_QUERY, 3.0))
                if error:
                    return error
                self.live = True
                if self.on_live:
                    self.on_live(time.monotonic() - self.created)
            return None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return f"Envoy admin not reachable: {e or type(e).__name__}"
        except _NotStats as e:
            return f"Envoy admin answered {e}"
        except ValueError as e:  # it answered, with something that is not its stats text
            return (f"Envoy admin answered something that is not Envoy's stats "
                    f"({type(e).__name__}: {str(e)[:120]})")


MAX_REASON_CHARS = 300   # one part's reason in a readiness body or log line
MAX_BODY_CHARS = 2000    # the whole reason line (kubelet keeps ~10 KiB of a probe's body)


@dataclasses.dataclass(frozen=True)
class NotReady:
    """One part that is not ready: ``name`` (a component's name, ``envoy``, ``agent``,
    ``drain``, ``ztunnel``) and ``reason`` (its last error, as the part reports it)."""

    name: str
    reason: str


def clean_reason(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` fit for a probe body and a log line: private keys and tokens replaced
    (:func:`agent.core.logsetup.redact`), every non-printable character (newlines, ANSI
    escapes, NUL, U+2028...) written as its ``\\xNN``/``\\uNNNN`` escape, then cut to
    ``limit`` characters with ``...`` and how many were left off."""
    text = redact(str(text))
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                  for c in text)
    if len(out) > limit:
        cut = out[:limit]
        out = f"{cut}... ({len(out) - len(cut)} more characters)"
    return out


def summary(parts: Iterable[NotReady], limit: int = MAX_BODY_CHARS) -> str:
    """``name: reason; name: reason`` for ``parts`` (each cleaned by
    :func:`clean_reason`), the reasons within ``limit`` characters: the parts that do
    not fit are still named, at the end (``; and N more not ready: a, b``)."""
    parts = list(parts)
    text = ""
    for i, p in enumerate(parts):
        item = f"{clean_reason(p.name, 60)}: {clean_reason(p.reason)}"
        if text and len(text) + 2 + len(item) > limit:
            rest = [clean_reason(q.name, 60) for q in parts[i:]]
            return f"{text}; and {len(rest)} more not ready: {', '.join(rest)}"
        text = f"{text}; {item}" if text else item
    return text


class ReadinessLog:
    """Logs readiness transitions, once per change and not per probe.

    Each evaluation calls :meth:`observe` with the names it checked (``scope``) and the
    parts of that scope not ready. The two endpoints check overlapping scopes (the status
    port's includes Envoy and ztunnel, the health port's does not), so the log keeps one
    state per part: a part that turns not ready is logged once (WARNING after the agent
    had been ready, INFO while it is still starting), with its reason; parts that turn
    ready again are logged at INFO, and ``agent is ready`` once every part is. A reason
    that changes while its part stays not ready is not a transition (the body of each
    probe has it). Returns the lines written (for tests)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self.failing: dict[str, str] = {}  # part -> its reason when it turned not ready
        self.was_ready = False             # the agent has been ready at least once
        self._ready_logged = False         # "agent is ready" is the last line written
        self._ready_once: set[str] = set()  # parts seen ready at least once

    def observe(self, scope: Iterable[str], parts: list[NotReady]) -> list[str]:
        lines: list[str] = []
        scope = set(scope)
        now_failing = {p.name: p for p in parts}
        new = [p for p in parts if p.name not in self.failing]
        back = sorted(name for name in self.failing
                      if name in scope and name not in now_failing)
        for name in back:
            del self.failing[name]
        for p in new:
            self.failing[p.name] = p.reason
        # a part that was ready and is not: WARNING once the agent had been ready; a part
        # never ready yet (a first look at ztunnel by the status port after the health
        # port said ready, or a component still starting): INFO
        regressed = [p for p in new if self.was_ready and p.name in self._ready_once]
        starting = [p for p in new if p not in regressed]
        for group, level in ((regressed, logging.WARNING), (starting, logging.INFO)):
            if group:
                line = "agent not ready: " + summary(group)
                self.log.log(level, "%s", line)
                lines.append(line)
                self._ready_logged = False
        again = [n for n in back if n in self._ready_once]
        first = [n for n in back if n not in self._ready_once]
        self._ready_once |= {n for n in scope if n not in now_failing}
        if back and self.failing:
            said = [f"ready again: {', '.join(again)}"] if again else []
            said += [f"ready: {', '.join(first)}"] if first else []
            line = f"{'; '.join(said)} (still not ready: {', '.join(sorted(self.failing))})"
            self.log.info("%s", line)
            lines.append(line)
        if not self.failing and not self._ready_logged and not parts:
            line = "agent is ready" + (f" ({', '.join(again)} ready again)" if again else "")
            self.log.info("%s", line)
            lines.append(line)
            self.was_ready = self._ready_logged = True
        return lines
