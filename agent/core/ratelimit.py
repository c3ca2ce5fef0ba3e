"""Keep repeated identical log lines from flooding the log.

A peer that keeps doing the same wrong thing (connecting with garbage, hitting a listener
at its cap) or a resource that stays exhausted (``accept()`` failing with EMFILE, which
asyncio reports once per attempt with a traceback) must not turn into megabytes of
identical lines: 1,100 idle connections once grew the log by 112 MB in 40 s.

- :class:`RepeatLimiter` decides per text: the first occurrence in a window passes, the
  rest are held back and counted; the next one let through says how many were held.
- :class:`RepeatFilter` applies that to every WARNING-or-worse record of a logging handler
  (key: logger, level, rendered message), so any component is covered without knowing.
"""

from __future__ import annotations

import logging
import time

DEFAULT_WINDOW = 60.0  # seconds: an identical line is logged at most once per window


class RepeatLimiter:
    """One pass per identical text per ``window`` seconds; memory bounded (``max_keys``).

    ``check(text, now)`` returns ``(let it through, how many were held back since the
    previous one let through)``.
    """

    def __init__(self, window: float = DEFAULT_WINDOW, max_keys: int = 256):
        self.window = window
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}  # text -> (let through at, held back)

    def check(self, text: str, now: float) -> tuple[bool, int]:
        if len(self._last) > self.max_keys:  # forget entries whose window has passed
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.window}
            if len(self._last) > self.max_keys:  # a flood of distinct texts: start over
                self._last.clear()
        last = self._last.get(text)
        if last is not None and now - last[0] < self.window:
            self._last[text] = (last[0], last[1] + 1)
            return False, 0
        self._last[text] = (now, 0)
        return True, last[1] if last is not None else 0


class RepeatFilter(logging.Filter):
    """A handler filter: identical WARNING+ records within ``window`` pass once.

    Held-back records are dropped whole, tracebacks included (a repeated traceback says
    nothing new); the next one let through gets ``" (N identical lines held back in the
    last Ws)"`` appended. DEBUG/INFO records are not touched.
    """

    def __init__(self, window: float = DEFAULT_WINDOW, clock=time.monotonic):
        super().__init__()
        self.limiter = RepeatLimiter(window)
        self.clock = clock

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string is logging's to report
            return True
        key = f"{record.name}\0{record.levelno}\0{message}"
        allowed, held = self.limiter.check(key, self.clock())
        if allowed and held:
            record.msg = (f"{message} ({held} identical line{'s' if held != 1 else ''} "
                          f"held back in the last {self.limiter.window:g}s)")
            record.args = None
        return allowed


def source_of(peer: str) -> str:
    """The caller's host in a gRPC peer string, for rate-limiting per source:
    ``ipv4:10.0.0.1:5678`` -> ``10.0.0.1``, ``ipv6:[::1]:5678`` -> ``::1``; anything else
    (``unix:...``, ``unix-abstract:...``) as it is."""
    text = peer
    for prefix in ("ipv4:", "ipv6:"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            if text.startswith("[") and "]" in text:
                return text[1:text.index("]")]
            return text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    return text


class RefusalLog:
    """Refused calls (xDS, CA) logged at WARNING once per source (:func:`source_of`) per
    ``window`` seconds: a client retrying with a bad or missing token writes one line per
    window, the next one saying how many were held back. The caller's gRPC status carries
    the reason every time; only the log is limited. Memory bounded as
    :class:`RepeatLimiter`."""

    def __init__(self, logger: logging.Logger, what: str, window: float = DEFAULT_WINDOW,
                 clock=time.monotonic):
        self.logger = logger
        self.what = what
        self.limiter = RepeatLimiter(window)
        self.clock = clock

    def refused(self, peer: str, reason: object) -> None:
        source = source_of(peer)
        allowed, held = self.limiter.check(source, self.clock())
        if allowed:
            self.logger.warning(
                "%s: refused %s: %s%s", self.what, peer, reason,
                f" ({held} more refused from {source} in the last "
                f"{self.limiter.window:g}s, not logged)" if held else "")
