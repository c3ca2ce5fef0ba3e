"""argparse ``type=`` converters shared by the client subcommands (``status``,
``log-level``, ``xds dump``, ``ztunnel-config``): each raises
``argparse.ArgumentTypeError`` naming the value, which argparse prints as one usage line."""

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
