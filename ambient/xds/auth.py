"""Who may call the workload xDS server's plaintext port: an optional shared bearer token
(``xds_token_file``); and the namespace check of a TLS caller's SPIFFE ID, as istiod
refuses a client whose identity namespace differs from its node's."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, Awaitable, Callable

import grpc

class AuthError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        self.code = code
        super().__init__(message)


def spiffe_namespace(spiffe_id: str) -> str | None:
    """``ns`` of ``spiffe://<td>/ns/<ns>/sa/<sa>``, else None."""
    parts = spiffe_id.removeprefix("spiffe://").split("/")
    if len(parts) >= 5 and parts[1] == "ns" and parts[3] == "sa":
        return parts[2]
    return None


# Worded so the log redaction (agent.core.logsetup: a word after "bearer ", a value after
# "authorization:") leaves it readable: it names no secret.
TOKEN_REFUSED = ("no valid token in the call's 'authorization' metadata (expected "
                 "'Bearer <the content of xds_token_file>')")


class PlaintextAuth:
    """The plaintext port's optional shared bearer token (``xds_token_file``): calls must
    send ``authorization: Bearer <the file's content>``. Raises :class:`AuthError`
    (UNAUTHENTICATED) on a missing or wrong token, UNAVAILABLE when the file is unreadable."""

    def __init__(self, token_file: str = "",
                 run_blocking: Callable[..., Awaitable[Any]] | None = None):
        self.token_file = token_file
        self._token: bytes | None = None
        self._read_at = 0.0
        self._run_blocking = run_blocking

    def _read_token(self) -> bytes:
        with open(self.token_file, "rb") as f:
            return f.read().strip()

    async def _expected(self) -> bytes | None:
        if not self.token_file:
            return None
        if self._token is None or time.monotonic() - self._read_at > 10.0:
            try:
                if self._run_blocking:
                    self._token = await self._run_blocking(self._read_token)
                else:
                    self._token = await asyncio.to_thread(self._read_token)
            except OSError as e:
                raise AuthError(grpc.StatusCode.UNAVAILABLE,
                                f"xds_token_file={self.token_file!r}: {e.strerror}") from None
            self._read_at = time.monotonic()
        return self._token

    async def authenticate(self, context: grpc.aio.ServicerContext) -> None:
        expected = await self._expected()
        if expected is not None:
            got = dict(context.invocation_metadata() or ()).get("authorization", "")
            token = got[7:].strip().encode() if got.lower().startswith("bearer ") else b""
            if not token or not hmac.compare_digest(token, expected):
                raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                                TOKEN_REFUSED)
