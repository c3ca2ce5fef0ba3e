"""argparse ``type=`` converters of the subcommands: :func:`checked` turns one of the
agent's setting parsers into one (``demo``'s port and log-level flags), and
:func:`positive_seconds` is ``status``'s and ``xds dump``'s ``--timeout`` (``log-level``
and ``ztunnel-config`` check theirs in one line of their own). Each raises
``argparse.ArgumentTypeError`` naming the value, which argparse prints under the usage."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable


def checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from one of the agent's setting parsers (a ValueError names
    the problem): a bad value is a usage error naming the flag and the value, before
    anything is set up, the same refusal ``run`` gives."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    convert.__name__ = parse.__name__  # argparse names the type in some messages
    return convert


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
