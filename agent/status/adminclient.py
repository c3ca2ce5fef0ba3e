"""A client for the agent's root-only admin socket, shared by the operator commands.

:func:`request` sends one HTTP request over the Unix socket and returns ``(status,
body)``; every failure to reach the agent is a :class:`AdminUnreachable` (a
``RuntimeError``) whose message is one line naming the socket and the reason (no
permission, nothing listening, timed out), which the commands print as is.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp


class AdminUnreachable(RuntimeError):
    """No agent answered on the admin socket; the message is one line for the operator."""


async def request_async(path: str, method: str, url_path: str, timeout: float
                        ) -> tuple[int, bytes]:
    """``method url_path`` on the admin socket ``path`` → ``(HTTP status, body)``.
    Raises :class:`AdminUnreachable`."""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path),
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.request(method, f"http://localhost{url_path}") as resp:
                return resp.status, await resp.read()
    except PermissionError:
        raise AdminUnreachable(f"no permission to connect to {path} (the admin socket is "
                               "for root only)") from None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        cause = getattr(e, "os_error", None)
        if isinstance(cause, PermissionError):
            raise AdminUnreachable(f"no permission to connect to {path} (the admin socket "
                                   "is for root only)") from None
        reason = getattr(cause, "strerror", None) or str(cause or e) or "timed out"
        raise AdminUnreachable(f"no agent answering at {path}: {reason}") from None


def request(path: str, method: str, url_path: str, timeout: float) -> tuple[int, bytes]:
    """Blocking :func:`request_async` for the CLI."""
    return asyncio.run(request_async(path, method, url_path, timeout))


def get_json(path: str, url_path: str, timeout: float) -> Any:
    """``GET url_path`` → the JSON document. Raises :class:`AdminUnreachable`, or
    RuntimeError (one line) for a non-200 answer or a body that is not JSON."""
    status, body = request(path, "GET", url_path, timeout)
    if status != 200:
        raise RuntimeError(f"agent at {path} answered HTTP {status} for {url_path}: "
                           f"{body.decode('utf-8', 'replace').strip()[:200]}")
    try:
        return json.loads(body.decode("utf-8"))
    except ValueError as e:
        raise RuntimeError(f"agent at {path} sent invalid JSON for {url_path}: {e}") from None
