"""Repeated identical log lines are held back (agent.core.ratelimit), through the agent's own
log setup (agent.core.logsetup) writing to a real stream."""

from __future__ import annotations

import io
import logging

from agent.core import logsetup
from agent.core.ratelimit import RepeatFilter, RepeatLimiter


def test_limiter_counts_what_it_held_back_and_stays_bounded():
    lim = RepeatLimiter(window=10, max_keys=4)
    assert lim.check("a", 0) == (True, 0)
    assert lim.check("a", 1) == (False, 0) and lim.check("a", 2) == (False, 0)
    assert lim.check("b", 2) == (True, 0)  # another text is independent
    assert lim.check("a", 11) == (True, 2)  # next window: says how many were held
    for i in range(20):
        lim.check(f"x{i}", 12)
    assert len(lim._last) <= 5


def test_log_setup_holds_back_identical_warnings_and_tracebacks():
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    try:
        logsetup.setup("info", stream=stream)
        log = logging.getLogger("test.flood")
        for _ in range(10_000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                log.exception("socket.accept() out of system resource")
        log.warning("another line")
        log.info("info is never held back")
        log.info("info is never held back")
        text = stream.getvalue()
    finally:
        for h in list(root.handlers):
            if getattr(h, "_ambient_agent", False):
                root.removeHandler(h)
        root.setLevel(level)
    assert text.count("socket.accept() out of system resource") == 1
    assert text.count("Traceback") == 1 and len(text) < 2000
    assert "another line" in text and text.count("info is never held back") == 2


def test_filter_reports_the_held_back_count_when_the_window_passes():
    now = [0.0]
    f = RepeatFilter(window=60, clock=lambda: now[0])
    rec = lambda: logging.LogRecord("x", logging.ERROR, "", 0, "boom %s", ("1",), None)  # noqa
    assert f.filter(rec()) and not f.filter(rec()) and not f.filter(rec())
    now[0] = 61
    r = rec()
    assert f.filter(r) and r.getMessage() == "boom 1 (2 identical lines held back in the " \
        "last 60s)"
