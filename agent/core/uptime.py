"""How long this process has been running: the reference of the start timeline the
daemon, the Kubernetes source and the xDS server log (issue 28: an operator sees where a
slow start went: imports, LISTs, index, first push)."""

from __future__ import annotations

import os
import time


def process_age() -> float:
    """Seconds since this process started: the kernel's start time of the process
    (``/proc/self/stat`` field 22, clock ticks since boot) against CLOCK_BOOTTIME.
    Resolution one clock tick (10 ms); NaN when ``/proc`` can't be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # the command name (field 2) may hold spaces: fields are counted after ")"
            fields = f.read().rsplit(b")", 1)[1].split()
        return (time.clock_gettime(time.CLOCK_BOOTTIME)
                - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return float("nan")
