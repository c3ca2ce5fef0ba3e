"""argparse ``type=`` converters shared by the client subcommands (``status`` and ``xds
dump`` take their ``--timeout`` through one; ``log-level`` and ``ztunnel-config`` check
theirs in one line of their own): each raises ``argparse.ArgumentTypeError`` naming the
value, which argparse prints under the usage."""

from __future__ import annotations

import argparse
import math


def positive_seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds > 0 (``-5`` waited for nothing and then
    reported "no response within -5.0s")."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds > 0")
    return seconds
