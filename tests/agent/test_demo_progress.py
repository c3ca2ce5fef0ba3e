"""The demo's progress lines and the agent's log on one terminal: a log line written
during a step starts on a line of its own, and the step's result follows on a line
naming the step (a newuser finding: "lacks status.podIP" WARNINGs were printed in the
middle of "  • starting pod ... " lines)."""

from __future__ import annotations

import asyncio
import io
import logging

from agent.demo.model import Progress


def test_log_line_during_a_step_starts_on_its_own_line():
    term = io.StringIO()  # one terminal: both writers, in order
    progress = Progress(term)
    handler = logging.StreamHandler(term)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.addFilter(progress.log_filter())
    log = logging.getLogger("tests.demo_progress")
    log.addHandler(handler)
    log.propagate = False
    try:
        async def run():
            async with progress.step("starting pod demo/client"):
                log.warning("pod demo/client lacks status.podIP")
            async with progress.step("quiet step"):
                pass
            log.warning("between steps")
        asyncio.run(run())
    finally:
        log.removeHandler(handler)
    lines = term.getvalue().splitlines()
    assert lines[0] == "  • starting pod demo/client ..."
    assert lines[1] == "WARNING pod demo/client lacks status.podIP"
    assert lines[2].startswith("  • starting pod demo/client: done (")
    assert lines[3].startswith("  • quiet step ... done (")
    assert lines[4] == "WARNING between steps"
