"""The embedded CA's signer process: workload certificates minted outside the agent's
interpreter, by a supervised child that alone needs the CA key for SDS issuance.

Why a process (``benchmarks/README.md`` "SDS and CA"): ``cryptography`` holds the GIL in
its OpenSSL calls, so in the agent's process the ~0.35 ms of key generation + CSR + CSR
verification + leaf signature per identity and grpcio's per-stream work (~0.4 ms of CPU
per SDS stream) run one after the other. In a child they run on another CPU, while the
agent's event loop serves the gRPC side; the agent's part per identity is one small
frame each way on a pipe.

Protocol (stdin/stdout of ``python -m agent.sds.signer <root-cert.pem> <root-key.pem>``):
frames of a 4-byte big-endian length + UTF-8 JSON. The child first sends
``{"ready": true}`` (or ``{"fatal": "<why>"}`` and exits 2 when the CA files do not
load); then, for each request ``{"id", "sans", "ttl", "now"}`` with ``"algorithm"``
(mint: key + CSR + verify + sign) or ``"csr"`` (sign that CSR), one answer
``{"id", "key", "chain", "not_before", "not_after", "serial"}`` or
``{"id", "code", "message"}`` (a :class:`~agent.sds.ca_embedded.CAError`). Answers may
come in any order; ``id`` matches them. Key material crosses the pipe only (never a log
line, never an argument).

Supervision (:class:`SignerProcess`): when the child exits, every request it held is
sent again to a fresh child (restarted at once, then with a backoff of 0.5 s doubling to
30 s while it keeps dying); a request whose second child also died, or that waited more
than ``timeout`` seconds, fails with :class:`~agent.sds.ca_istio.CAClientError`
(``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``) naming the cause; a child that holds a request
past the timeout is killed (it is stuck) and restarted. At most ``max_in_flight``
requests are sent to the child at a time; more wait (callers are bounded by the SDS
streams that asked). Nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import logging
import os
import struct
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, BinaryIO, Callable

from agent.core.backoff import Backoff
from agent.sds.ca_istio import CAClientError

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_ROOT = str(Path(__file__).resolve().parents[2])
MAX_FRAME = 1 << 20  # a leaf + root bundle is a few KiB; anything near this is a bug
Validity = tuple[dt.datetime, dt.datetime, int]


def _encode(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


class SignerProcess:
    """Parent side: one supervised signer child for the CA at ``cert_path``/``key_path``.

    ``clock`` (epoch seconds) dates what the child signs. ``timeout`` seconds per
    request; ``max_in_flight`` requests outstanding in the child; ``python`` the
    interpreter. :meth:`start` raises RuntimeError when the first child does not come up;
    :meth:`mint` / :meth:`sign` raise :class:`CAClientError`.
    """

    def __init__(self, cert_path: str, key_path: str, clock: Callable[[], float] = time.time,
                 timeout: float = 10.0, max_in_flight: int = 64,
                 python: str = sys.executable, restart: Backoff | None = None):
        self.cert_path, self.key_path = cert_path, key_path
        self.clock = clock
        self.timeout = timeout
        self.python = python
        self.restart = restart or Backoff(0.5, 30.0, jitter=(0.8, 1.2))
        self.restarts = 0       # children started after the first
        self.retried = 0        # requests sent again after their child died
        self._slots = asyncio.Semaphore(max_in_flight)
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[dict, asyncio.Future, int]] = {}  # id -> (req, fut, tries)
        self._proc: asyncio.subprocess.Process | None = None
        self._up = asyncio.Event()
        self._supervisor: asyncio.Task | None = None
        self._closed = False

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start the first child and wait until it has loaded the CA."""
        await self._spawn()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(),
                                                                  name="sds signer")

    async def _spawn(self) -> None:
        # The agent's own package root first: the child runs the same code as the parent.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
        proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "agent.sds.signer", self.cert_path, self.key_path,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
            limit=MAX_FRAME + 4)
        try:
            first = await asyncio.wait_for(self._read(proc), self.timeout + 20)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            await _kill(proc)
            raise RuntimeError(f"embedded CA signer process did not start: "
                               f"{type(e).__name__}") from None
        if not first.get("ready"):
            await _kill(proc)
            raise RuntimeError(f"embedded CA signer process: {first.get('fatal', first)}")
        self._proc = proc
        self._up.set()
        for rid, (req, _fut, _tries) in list(self._waiting.items()):
            self._send(rid, req)  # held by a child that died: to the new one

    async def _supervise(self) -> None:
        """Read answers; when the child exits, restart it and resend what it held."""
        while not self._closed:
            proc = self._proc
            assert proc is not None
            try:
                while True:
                    self._answer(await self._read(proc))
            except (asyncio.IncompleteReadError, ValueError, ConnectionError) as e:
                reason = "exited" if isinstance(e, asyncio.IncompleteReadError) else \
                    f"sent a bad frame ({e})"
            self._up.clear()
            code = await _kill(proc)
            if self._closed:
                return
            failed = 0
            for rid, (req, fut, tries) in list(self._waiting.items()):
                if tries >= 2:
                    failed += 1
                    del self._waiting[rid]
                    if not fut.done():
                        fut.set_exception(CAClientError(
                            "UNAVAILABLE", f"embedded CA signer process {reason} twice while "
                            f"signing for {', '.join(req['sans'])}"))
                else:
                    self._waiting[rid] = (req, fut, tries + 1)
                    self.retried += 1
            log.warning("embedded CA signer process %s (exit code %s); restarting it, "
                        "%d request(s) to resend, %d failed (their second child)", reason,
                        code, len(self._waiting), failed)
            while not self._closed:
                if self.restarts:
                    await self.restart.wait()
                try:
                    self.restarts += 1
                    await self._spawn()
                    break
                except (RuntimeError, OSError) as e:
                    log.error("embedded CA signer process restart failed: %s", e)
            if self._proc is not None and self._proc.returncode is None:
                # a child that stays up for a while resets the restart backoff
                asyncio.get_running_loop().call_later(30.0, self._healthy, self._proc)

    def _healthy(self, proc: asyncio.subprocess.Process) -> None:
        if proc is self._proc and proc.returncode is None:
            self.restart.reset()

    async def close(self) -> None:
        """Stop the child; requests still waiting fail with UNAVAILABLE."""
        self._closed = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._proc is not None:
            await _kill(self._proc)
        for _req, fut, _tries in self._waiting.values():
            if not fut.done():
                fut.set_exception(CAClientError("UNAVAILABLE", "SDS is stopping"))
        self._waiting.clear()

    # --- requests --------------------------------------------------------------------
    async def mint(self, sans: list[str], algorithm: str, ttl_seconds: int
                   ) -> tuple[bytes, list[str], Validity]:
        """A new ``algorithm`` key, its CSR, verified and signed for ``sans``:
        ``(key_pem, chain, (not_before, not_after, serial))``."""
        a = await self._call({"sans": sans, "ttl": int(ttl_seconds), "algorithm": algorithm})
        return a["key"].encode(), a["chain"], _validity(a)

    async def sign(self, csr_pem: bytes, sans: list[str], ttl_seconds: int
                   ) -> tuple[list[str], Validity]:
        """Sign ``csr_pem`` for ``sans`` (the CA's rules): ``(chain, validity)``."""
        a = await self._call({"sans": sans, "ttl": int(ttl_seconds), "csr": csr_pem.decode()})
        return a["chain"], _validity(a)

    async def _call(self, req: dict) -> dict:
        if self._closed:
            raise CAClientError("UNAVAILABLE", "SDS is stopping")
        async with self._slots:
            rid = next(self._ids)
            req["now"] = self.clock()
            fut = asyncio.get_running_loop().create_future()
            self._waiting[rid] = (req, fut, 1)
            if self._up.is_set():
                self._send(rid, req)
            try:
                answer = await asyncio.wait_for(asyncio.shield(fut), self.timeout)
            except asyncio.TimeoutError:
                self._stuck(rid, req)
                raise CAClientError("DEADLINE_EXCEEDED", f"embedded CA signer process did not "
                                    f"answer within {self.timeout:g}s (signing for "
                                    f"{', '.join(req['sans'])})") from None
            finally:
                self._waiting.pop(rid, None)
        if "code" in answer:
            raise CAClientError(answer["code"], answer["message"])
        return answer

    def _stuck(self, rid: int, req: dict) -> None:
        self._waiting.pop(rid, None)
        proc = self._proc
        if proc is not None and proc.returncode is None and self._up.is_set():
            log.error("embedded CA signer process held a request for %gs; killing it",
                      self.timeout)
            proc.kill()  # the supervisor sees EOF, restarts it and resends the others

    def _send(self, rid: int, req: dict) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.returncode is not None:
            return  # resent by the supervisor once a child is up
        try:
            proc.stdin.write(_encode({"id": rid, **req}))
        except (ConnectionError, RuntimeError):
            pass  # the child is gone: the supervisor resends

    def _answer(self, message: dict) -> None:
        entry = self._waiting.get(message.get("id", -1))
        if entry is not None and not entry[1].done():
            entry[1].set_result(message)

    @staticmethod
    async def _read(proc: asyncio.subprocess.Process) -> dict:
        assert proc.stdout is not None  # started with stdout=PIPE
        head = await proc.stdout.readexactly(_LEN.size)
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ValueError(f"frame of {n} bytes")
        message = json.loads(await proc.stdout.readexactly(n))
        if not isinstance(message, dict):
            raise ValueError("frame is not an object")
        return message

    def debug_state(self) -> dict:
        return {"pid": self._proc.pid if self._proc else None, "up": self._up.is_set(),
                "restarts": self.restarts, "retried": self.retried,
                "waiting": len(self._waiting)}


class SignerCAClient:
    """The embedded CA behind the CA-client interface (:class:`agent.sds.ca_istio.CAClient`)
    with signing in :class:`SignerProcess`; :meth:`issue` has the key and CSR made there
    too. ``identity`` is comma-separated SANs, as for the other clients."""

    def __init__(self, signer: SignerProcess):
        self.signer = signer

    async def issue(self, identity: str, algorithm: str, ttl_seconds: int,
                    run_blocking: Callable[..., Awaitable], on_csr: Callable[[], None]
                    ) -> tuple[bytes, list[str], Validity]:
        """Key, CSR and signature in the signer process (``run_blocking`` unused: no
        work here); ``on_csr`` is called as the request goes to it."""
        on_csr()
        return await self.signer.mint(identity.split(","), algorithm, ttl_seconds)

    async def sign(self, csr_pem: bytes, ttl_seconds: int, identity: str) -> list[str]:
        return (await self.signer.sign(csr_pem, identity.split(","), ttl_seconds))[0]

    async def close(self) -> None:
        await self.signer.close()


def _validity(a: dict) -> Validity:
    utc = dt.timezone.utc
    return (dt.datetime.fromtimestamp(a["not_before"], utc),
            dt.datetime.fromtimestamp(a["not_after"], utc), int(a["serial"]))


async def _kill(proc: asyncio.subprocess.Process) -> int | None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        return await asyncio.wait_for(proc.wait(), 5)
    except asyncio.TimeoutError:
        return None


# --- the child ---------------------------------------------------------------------------
def _serve(cert_path: str, key_path: str, inp: BinaryIO, out: BinaryIO) -> int:
    """The child's loop: load the CA, answer requests until stdin closes. Returns the
    exit code."""
    from agent.sds import keys
    from agent.sds.ca_embedded import CAError, EmbeddedCA

    # Ctrl-C reaches the whole process group: the parent decides when the child stops
    # (stdin closes when the parent exits or closes it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def send(message: dict) -> None:
        out.write(_encode(message))
        out.flush()

    try:
        ca = EmbeddedCA.load_or_create("", "", cert_path, key_path)
    except CAError as e:
        send({"fatal": str(e)})
        return 2
    send({"ready": True})
    utc = dt.timezone.utc
    while head := inp.read(_LEN.size):
        if len(head) < _LEN.size:
            return 1
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            return 1
        req: dict[str, Any] = json.loads(inp.read(n))
        answer: dict[str, Any] = {"id": req["id"]}
        try:
            now = dt.datetime.fromtimestamp(req["now"], utc)
            if "csr" in req:
                key_pem, csr_pem = b"", req["csr"].encode()
            else:
                key_pem, csr_pem = keys.new_key_and_csr(req["algorithm"], req["sans"])
            chain, leaf = ca.sign_leaf(csr_pem, req["sans"], req["ttl"], now)
            answer.update(key=key_pem.decode(), chain=chain,
                          not_before=leaf.not_valid_before_utc.timestamp(),
                          not_after=leaf.not_valid_after_utc.timestamp(),
                          serial=leaf.serial_number)
        except CAError as e:
            answer.update(code=e.code, message=str(e))
        except (ValueError, KeyError, TypeError) as e:  # a malformed request, or keygen
            answer.update(code="INVALID_ARGUMENT", message=f"signer request: {e}")
        send(answer)
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], sys.argv[2], sys.stdin.buffer, sys.stdout.buffer))
