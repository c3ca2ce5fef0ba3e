"""How long this process has been running: the reference of the start timeline the
daemon, the Kubernetes source and the xDS server log (issue 28: an operator sees where a
slow start went: imports, LISTs, index, first push)."""

from __future__ import annotations

import os
import time


def start_time(pid: int | str = "self") -> float:
    """When process ``pid`` started, in CLOCK_BOOTTIME seconds: ``/proc/<pid>/stat``
    field 22 (clock ticks since boot). Resolution one clock tick (10 ms). Raises
    OSError (no such process) or ValueError (an unreadable stat line)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        # the command name (field 2) may hold spaces: fields are counted after ")"
        fields = f.read().rsplit(b")", 1)[-1].split()
    try:
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except IndexError:
        raise ValueError(f"/proc/{pid}/stat has {len(fields) + 2} fields") from None


def process_age() -> float:
    """Seconds since this process started (:func:`start_time` against CLOCK_BOOTTIME);
    NaN when ``/proc`` can't be read."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_time()
    except (OSError, ValueError):
        return float("nan")
