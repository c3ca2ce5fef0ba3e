"""The ``HOST:PORT`` form every command-line ``--addr`` takes (``ambient-agent status``,
``xds``, ...), shared by the application's CLI and the components' command-line modules."""

from __future__ import annotations

import argparse


def parse_addr(text: str, default_port: int) -> tuple[str, int]:
    """The form every ``--addr`` takes: ``HOST:PORT``, ``[IPv6]:PORT`` or ``HOST`` (then
    ``default_port``); a leading ``http://`` is accepted and ignored. Raises
    ``argparse.ArgumentTypeError`` naming the value."""
    raw = text
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    host, port = text, default_port
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise argparse.ArgumentTypeError(f"--addr {raw!r}: missing ']' after an IPv6 address")
        host, rest = text[1:close], text[close + 1:]
        if rest:
            if not rest.startswith(":"):
                raise argparse.ArgumentTypeError(f"--addr {raw!r}: expected :PORT after ']'")
            port = rest[1:]  # type: ignore[assignment]
    elif text.count(":") == 1:
        host, port = text.split(":")  # type: ignore[assignment]
    elif text.count(":") > 1:
        raise argparse.ArgumentTypeError(f"--addr {raw!r}: write an IPv6 address as [ADDR]:PORT")
    try:
        port = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--addr {raw!r}: port {port!r} is not a number") from None
    if not host:
        raise argparse.ArgumentTypeError(f"--addr {raw!r}: expected HOST:PORT")
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"--addr {raw!r}: port {port} is not between 1 and "
                                         "65535")
    return host, port


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
